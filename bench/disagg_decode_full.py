"""bench/disagg.py --decode-full: a decode side with --decode-slots slots and twice as many requests of
--long-tokens prompt tokens and --short-tokens greedy tokens each, once per `when_decode_full` policy: wait
for a slot and take the handover ("queue", the default), or prefill on the decode side ("prefill_here").
Prints a line per policy (mean time to the first token, total time, local prefills) and the ratios
prefill_here / queue. Each policy runs twice; the second is timed.

    run_decode_full: in one process (a prefill engine and a decode engine stepped in turn: they share
                     the cores, jaxserve/disagg/handover.py)
    run_decode_full_replicas (--replicas): a prefill replica and, per policy, a decode replica started
                     with engine.when_decode_full, each a `jaxserve.serve` process pinned by --cores;
                     requests through Decode.Generate, first tokens timed as the client sees them
"""

import json
import tempfile
import threading
import time

import grpc
import numpy as np

from bench.disagg import start_replicas
from jaxserve.proto import disagg_pb2 as dpb
from jaxserve.proto import disagg_pb2_grpc
from jaxserve.proto import jaxserve_pb2 as pb


def prompts_for(args, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1] + rng.integers(3, 384, size=args.long_tokens - 1).tolist() for _ in range(2 * args.decode_slots)]


def report(args, results: dict, where: str) -> None:
    for policy in ("queue", "prefill_here"):
        print(json.dumps({"mode": "decode_full", "where": where, "model": args.model, **results[policy]}), flush=True)
    print(
        json.dumps(
            {
                f"{k}_prefill_here_over_queue": round(results["prefill_here"][k] / results["queue"][k], 3)
                for k in ("ttft_mean_ms", "total_s")
            }
        ),
        flush=True,
    )


def run_decode_full(args) -> None:
    """In one process; a first token's time is the step it is out in."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.disagg.handover import DisaggregatedPair

    engine = dict(
        dtype="float32",
        max_model_len=args.long_tokens + args.short_tokens + 16,
        max_num_batched_tokens=args.batched_tokens,
        show_progress=False,
    )
    prefill = LLM(args.model, role="prefill", **engine).engine
    decode = LLM(args.model, role="decode", max_num_seqs=args.decode_slots, **engine).engine
    params = SamplingParams(max_tokens=args.short_tokens, temperature=0.0, ignore_eos=True)
    results = {}
    for policy in ("queue", "prefill_here", "queue", "prefill_here"):
        prompts = prompts_for(args, len(results))
        pair = DisaggregatedPair(prefill, decode, when_decode_full=policy)
        local_before = decode.handovers.num_local_prefills
        first_token, started = {}, time.perf_counter()
        for index, prompt in enumerate(prompts):
            pair.add_request(f"{policy}-{index}", prompt, params)
        while pair.has_unfinished_requests():
            for output in pair.step():
                first_token.setdefault(output.request_id, time.perf_counter() - started)
        total = time.perf_counter() - started
        results[policy] = {
            "policy": policy,
            "ttft_mean_ms": round(1e3 * float(np.mean(list(first_token.values()))), 1),
            "total_s": round(total, 3),
            "tokens_per_s": round(len(prompts) * args.short_tokens / total, 1),
            "num_local_prefills": decode.handovers.num_local_prefills - local_before,
            "num_requests": len(prompts),
        }
    report(args, results, "one process")


def run_decode_full_replicas(args) -> None:
    """Over processes: one prefill replica for both policies, a decode replica per policy."""
    log_dir = tempfile.mkdtemp(prefix="bench-disagg-full-")
    prefill_cores, decode_cores = args.cores.split(",")
    max_model_len = f"engine.max_model_len={args.long_tokens + args.short_tokens + 16}"
    args.extra_settings = (max_model_len,)
    [prefill] = start_replicas(args, [("prefill", prefill_cores)], log_dir)
    results = {}
    try:
        for policy in ("queue", "prefill_here"):
            args.extra_settings = (
                max_model_len,
                f"engine.max_num_seqs={args.decode_slots}",
                f"disagg.when_decode_full={policy}",
            )
            [decode] = start_replicas(args, [("decode", decode_cores)], log_dir)
            try:
                drive_decode_full(args, prefill, decode, seed=10)  # warms the processes up
                before = status(decode)
                started = time.perf_counter()
                first_tokens = drive_decode_full(args, prefill, decode, seed=11)
                total = time.perf_counter() - started
                after = status(decode)
            finally:
                decode.stop()
            results[policy] = {
                "policy": policy,
                "ttft_mean_ms": round(1e3 * float(np.mean(first_tokens)), 1),
                "total_s": round(total, 3),
                "tokens_per_s": round(len(first_tokens) * args.short_tokens / total, 1),
                "num_local_prefills": after.num_local_prefills - before.num_local_prefills,
                "num_handovers": after.num_handovers - before.num_handovers,
                "num_requests": len(first_tokens),
            }
    finally:
        prefill.stop()
    report(args, results, "replicas")


def status(replica) -> dpb.StatusResponse:
    with grpc.insecure_channel(replica.address) as channel:
        return disagg_pb2_grpc.DecodeStub(channel).Status(dpb.StatusRequest(), timeout=30)


def drive_decode_full(args, prefill, decode, seed: int) -> list[float]:
    """Every prompt at once through Decode.Generate; each one's seconds to its first token."""
    first_tokens: list[float] = []
    errors: list[str] = []
    params = pb.SamplingParams(max_tokens=args.short_tokens, temperature=0.0, ignore_eos=True)

    def generate(stub, prompt: list[int]) -> None:
        sent = time.perf_counter()
        request = dpb.DecodeRequest(
            prefill_address=prefill.address, request=pb.GenerateRequest(token_ids=prompt, sampling=params)
        )
        try:
            first = None
            for message in stub.Generate(request, timeout=600):
                if first is None and message.token_ids:
                    first = time.perf_counter() - sent
            first_tokens.append(first)
        except grpc.RpcError as error:
            errors.append(f"{error.code().name}: {error.details()}")

    with grpc.insecure_channel(decode.address) as channel:
        stub = disagg_pb2_grpc.DecodeStub(channel)
        threads = [threading.Thread(target=generate, args=(stub, p)) for p in prompts_for(args, seed)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
    if errors:
        raise RuntimeError(f"requests failed: {errors[:3]}")
    return first_tokens
