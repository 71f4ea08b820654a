"""Decode latency under long-prompt interference: colocated (one engine, both cores) vs disaggregated
(a prefill worker pinned to core 0, the decode engine to core 1, pages via JAX's transfer server).

    python bench/disagg.py [--model DIR] [--num-short 8] [--num-long 4]

Each mode runs in its own process (pinning must precede JAX's thread pools). Prints one JSON line per
mode (p50/p99 inter-token latency of the short requests, p50/p99 TTFT, tokens/s, bytes and pages moved
per handover, transfer bandwidth) and a last line with the ratios disaggregated / colocated.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=16, max_num_batched_tokens=128, show_progress=False)


def workload(args):
    rng = np.random.default_rng(0)
    short = [[1] + rng.integers(3, 384, size=8).tolist() for _ in range(args.num_short)]
    long = [[1] + rng.integers(3, 384, size=args.long_tokens).tolist() for _ in range(args.num_long)]
    return short, long


def drive(add, step, args):
    """Short requests start at once; a long prompt arrives every few steps while they decode."""
    short, long = workload(args)
    decode = dict(max_tokens=args.short_tokens, temperature=0.0, ignore_eos=True)
    from jaxserve import SamplingParams
    arrivals, last_token, gaps, ttfts, tokens = {}, {}, [], [], 0
    for index, prompt in enumerate(short):
        arrivals[f"s{index}"] = time.perf_counter()
        add(f"s{index}", prompt, SamplingParams(**decode))
    pending, steps, started = list(enumerate(long)), 0, time.perf_counter()
    done = set()
    while len(done) < len(short) + len(long):
        if pending and steps % args.long_every == 0:
            index, prompt = pending.pop(0)
            arrivals[f"l{index}"] = time.perf_counter()
            add(f"l{index}", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        steps += 1
        now_outputs = step()
        now = time.perf_counter()
        for output in now_outputs:
            request_id = output.request_id
            count = len(output.outputs[0].token_ids)
            if request_id not in last_token:
                ttfts.append(now - arrivals[request_id])
            elif request_id.startswith("s"):
                gaps.append(now - last_token[request_id])
            last_token[request_id] = now
            tokens += 1
            if output.finished:
                done.add(request_id)
    elapsed = time.perf_counter() - started
    return {"itl_p50_ms": 1e3 * np.percentile(gaps, 50), "itl_p99_ms": 1e3 * np.percentile(gaps, 99),
            "ttft_p50_ms": 1e3 * np.percentile(ttfts, 50), "ttft_p99_ms": 1e3 * np.percentile(ttfts, 99),
            "tokens_per_s": tokens / elapsed}


def run_mode(args):
    from jaxserve import LLM
    if args.mode == "colocated":
        engine = LLM(args.model, **ENGINE).engine
        result = drive(engine.add_request, engine.step, args)
    else:
        from jaxserve.disagg.remote import RemotePrefill, start_prefill_worker
        process, port = start_prefill_worker(args.model, ENGINE, cpus={0})
        try:
            client = RemotePrefill(LLM(args.model, role="decode", **ENGINE).engine, port)
            result = drive(client.add_request, lambda: [o for o in client.step() if not isinstance(o, dict)], args)
            stats = client.stats
            result.update(bytes_per_handover=stats.bytes_moved / max(stats.num_handovers, 1),
                          pages_per_handover=stats.num_pages_moved / max(stats.num_handovers, 1),
                          handover_mb_per_s=stats.bytes_moved / max(stats.seconds_moving, 1e-9) / 1e6,
                          num_handovers=stats.num_handovers, num_recomputed=stats.num_recomputed)
        finally:
            process.kill()
    print(json.dumps({"mode": args.mode, **{k: round(v, 3) for k, v in result.items()}}), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=os.path.join(ROOT, "tests", "fixtures", "llama_gqa"))
    parser.add_argument("--mode", choices=["colocated", "disaggregated"])
    parser.add_argument("--num-short", type=int, default=8)
    parser.add_argument("--short-tokens", type=int, default=48)
    parser.add_argument("--num-long", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=200)
    parser.add_argument("--long-every", type=int, default=8)
    args = parser.parse_args()
    if args.mode:
        return run_mode(args)
    results = {}
    for mode, pin in (("colocated", None), ("disaggregated", ["taskset", "-c", "1"])):
        command = (pin or []) + [sys.executable, __file__, "--mode", mode] + sys.argv[1:]
        line = subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        print(line, flush=True)
        results[mode] = json.loads(line)
    ratio = {f"{k}_disagg_over_colocated": round(results["disaggregated"][k] / results["colocated"][k], 3)
             for k in ("itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "tokens_per_s")}
    print(json.dumps(ratio))


if __name__ == "__main__":
    main()
