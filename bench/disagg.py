"""Decode latency under long-prompt interference: colocated (one replica on both cores) vs disaggregated
(a prefill replica pinned to core 0, a decode replica pinned to core 1, KV pages through JAX's transfer
server, metadata over gRPC: jaxserve/disagg).

    python bench/disagg.py [--model tiny-random] [--num-short 8] [--short-tokens 64] [--num-long 4]
                           [--long-tokens 1000] [--long-every 0.15] [--cores 0,1]

Short requests start together and decode; long prompts arrive every --long-every seconds meanwhile.
The replicas are real `python -m jaxserve.serve` processes on loopback; this process streams every
request (a thread each) and times the messages: a message of k tokens counts k gaps of its delay / k.
--decode-full instead compares the two answers to a request that finds the decode side full: queue for
the handover, or prefill there (bench/disagg_decode_full.py; in one process, or with --replicas over
a prefill and a decode replica process).
Prints one JSON line per mode (p50/p99 inter-token latency of the short requests, p50/p99 TTFT of short
and long requests, output tokens/s, and, disaggregated, bytes and pages per handover and the transfer
bandwidth from the decode replica's Status) and a last line with the ratios disaggregated / colocated.
"""

import argparse
import json
import os
import sys
import tempfile
import threading
import time

import grpc
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxserve.proto import disagg_pb2 as dpb  # noqa: E402
from jaxserve.proto import disagg_pb2_grpc, jaxserve_pb2_grpc  # noqa: E402
from jaxserve.proto import jaxserve_pb2 as pb  # noqa: E402
from jaxserve.router.launcher import LaunchedReplica, is_serving  # noqa: E402


def engine_settings(args) -> list[str]:
    max_model_len = max(args.long_tokens, 16 + args.short_tokens) + 16
    num_tokens = args.num_short * (16 + args.short_tokens) + args.num_long * max_model_len
    return [
        "model.dtype=float32",
        f"engine.max_model_len={max_model_len}",
        "engine.max_num_seqs=16",
        f"engine.max_num_batched_tokens={args.batched_tokens}",
        "engine.page_size=16",
        f"engine.num_pages={num_tokens // 16 + 64}",
        "engine.show_progress=false",
        "server.http_port=0",
        *getattr(args, "extra_settings", ()),  # --decode-full --replicas: later keys win
    ]


def start_replicas(args, roles_and_cores, log_dir) -> list[LaunchedReplica]:
    replicas = []
    for index, (role, cores) in enumerate(roles_and_cores):
        replica = LaunchedReplica(
            index, args.model, None, tuple(engine_settings(args) + [f"engine.role={role}"]), log_dir
        )
        if cores:
            replica.command = ["taskset", "-c", cores] + replica.command
        replica.start()
        replicas.append(replica)
    deadline = time.monotonic() + args.startup_timeout
    for replica in replicas:
        while not is_serving(replica.address):
            if replica.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"replica {replica.index} did not start:\n{replica.log_tail()}")
            time.sleep(0.5)
    return replicas


def workload(args, seed: int):
    """Fresh prompts per pass (seed): nothing is cached from the warm-up pass."""
    rng = np.random.default_rng(seed)
    short = [[1] + rng.integers(3, 384, size=8).tolist() for _ in range(args.num_short)]
    long = [[1] + rng.integers(3, 384, size=args.long_tokens - 1).tolist() for _ in range(args.num_long)]
    return short, long


class Timings:
    def __init__(self):
        self.lock = threading.Lock()
        self.gaps, self.ttft_short, self.ttft_long, self.num_tokens, self.errors = [], [], [], 0, []


def stream(generate, prompt, max_tokens, kind, timings: Timings, start_at: float):
    time.sleep(max(0.0, start_at - time.perf_counter()))
    sent = last = time.perf_counter()
    first, gaps, num_tokens = None, [], 0
    try:
        for message in generate(
            pb.GenerateRequest(
                token_ids=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            )
        ):
            now = time.perf_counter()
            count = len(message.token_ids)
            if not count:
                continue
            if first is None:
                first = now - sent
            else:
                gaps += [(now - last) / count] * count
            last, num_tokens = now, num_tokens + count
    except grpc.RpcError as error:
        timings.errors.append(f"{error.code().name}: {error.details()}")
        return
    with timings.lock:
        (timings.ttft_short if kind == "short" else timings.ttft_long).append(first)
        if kind == "short":
            timings.gaps += gaps
        timings.num_tokens += num_tokens


def drive(generate, args, seed: int) -> dict:
    short, long = workload(args, seed)
    timings, started = Timings(), time.perf_counter() + 0.2
    threads = [
        threading.Thread(target=stream, args=(generate, prompt, args.short_tokens, "short", timings, started))
        for prompt in short
    ]
    threads += [
        threading.Thread(
            target=stream,
            args=(generate, prompt, 4, "long", timings, started + args.long_start + index * args.long_every),
        )
        for index, prompt in enumerate(long)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    elapsed = time.perf_counter() - started
    if timings.errors:
        raise RuntimeError(f"requests failed: {timings.errors[:3]}")
    result = {}
    for name, values in (("itl", timings.gaps), ("ttft_short", timings.ttft_short), ("ttft_long", timings.ttft_long)):
        for q in (50, 99):
            result[f"{name}_p{q}_ms"] = round(1e3 * float(np.percentile(values, q)), 2)
    return {**result, "tokens_per_s": round(timings.num_tokens / elapsed, 1)}


def run_colocated(args, log_dir) -> dict:
    [replica] = start_replicas(args, [("both", args.colocated_cores)], log_dir)
    try:
        with grpc.insecure_channel(replica.address) as channel:
            stub = jaxserve_pb2_grpc.GenerationStub(channel)
            drive(lambda request: stub.Generate(request, timeout=600), args, seed=1)  # warms the process up
            return drive(lambda request: stub.Generate(request, timeout=600), args, seed=2)
    finally:
        replica.stop()


def run_disaggregated(args, log_dir) -> dict:
    prefill_cores, decode_cores = args.cores.split(",")
    prefill, decode = start_replicas(args, [("prefill", prefill_cores), ("decode", decode_cores)], log_dir)
    try:
        with grpc.insecure_channel(decode.address) as channel:
            stub = disagg_pb2_grpc.DecodeStub(channel)
            generate = lambda request: stub.Generate(  # noqa: E731
                dpb.DecodeRequest(request=request, prefill_address=prefill.address), timeout=600
            )
            drive(generate, args, seed=1)
            before = stub.Status(dpb.StatusRequest(), timeout=30)
            result = drive(generate, args, seed=2)
            after = stub.Status(dpb.StatusRequest(), timeout=30)
        num = max(after.num_handovers - before.num_handovers, 1)
        moved = after.bytes_moved - before.bytes_moved
        result.update(
            bytes_per_handover=moved // num,
            pages_per_handover=round((after.num_pages_moved - before.num_pages_moved) / num, 1),
            num_handovers=num,
            handover_ms=round(1e3 * (after.seconds_moving - before.seconds_moving) / num, 2),
            prefill_wait_ms=round(1e3 * (after.seconds_prefilling - before.seconds_prefilling) / num, 2),
            transfer_mb_per_s=round(moved / max(after.seconds_moving - before.seconds_moving, 1e-9) / 1e6, 1),
            num_recomputed=after.num_recomputed - before.num_recomputed,
            compiles_after_warmup=after.num_compiles_after_warmup,
        )
        return result
    finally:
        prefill.stop()
        decode.stop()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--num-short", type=int, default=8)
    parser.add_argument("--short-tokens", type=int, default=256)
    parser.add_argument("--num-long", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=1000)
    parser.add_argument("--long-start", type=float, default=0.1, help="seconds before the first long prompt")
    parser.add_argument("--long-every", type=float, default=0.15, help="seconds between long prompts")
    parser.add_argument("--batched-tokens", type=int, default=256, help="engine.max_num_batched_tokens")
    parser.add_argument("--cores", default="0,1", help="prefill core(s),decode core(s) when disaggregated")
    parser.add_argument("--colocated-cores", default="", help="taskset for the colocated replica; default: all")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument(
        "--decode-full", action="store_true", help="compare queueing with prefilling on a full decode side"
    )
    parser.add_argument("--decode-slots", type=int, default=2, help="--decode-full: the decode side's max_num_seqs")
    parser.add_argument(
        "--replicas",
        action="store_true",
        help="--decode-full: over a prefill and a decode replica process (pinned by --cores), not one process",
    )
    args = parser.parse_args()
    if args.decode_full:
        from bench.disagg_decode_full import run_decode_full, run_decode_full_replicas

        return run_decode_full_replicas(args) if args.replicas else run_decode_full(args)
    log_dir = tempfile.mkdtemp(prefix="bench-disagg-")
    results = {}
    for mode, run in (("colocated", run_colocated), ("disaggregated", run_disaggregated)):
        results[mode] = run(args, log_dir)
        print(json.dumps({"mode": mode, "model": args.model, **results[mode]}), flush=True)
    ratio = {
        f"{k}_disagg_over_colocated": round(results["disaggregated"][k] / results["colocated"][k], 3)
        for k in results["colocated"]
    }
    print(json.dumps(ratio), flush=True)


if __name__ == "__main__":
    main()
