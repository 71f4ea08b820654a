"""Prefill chunks of quantized GGUF weights through the int8 CPU kernel vs XLA's reference, end to end, A/B in one
process: two engines on the same file, one whose plan sends the int8 kernel up to 64 rows (session 11's:
prefill chunks of more than 64 rows went to the reference, which dequantizes every weight per chunk) and one
with the current plan (quantized_cpu.PLAN_MAX_ROWS: the kernel up to the largest prefill bucket). They take
turns on vs_llamacpp.py's batched workload (48 requests, prompts 16-384 random tokens, all at once): once with
one output token each (prefill alone), once with its outputs (8-128 tokens: the batched row). Prints one JSON
line per (file, round), then the best of the rounds and the ratio new / old (> 1: the kernel's prefill faster).

    .venv/bin/python bench/quantized_prefill.py [--files Q8_0,Q4_0] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vs_llamacpp import CACHE_DIR, make_workload  # noqa: E402

from pallas_kernels.matmul import quantized_cpu  # noqa: E402

GGUF_DIR = os.path.join(CACHE_DIR, "vs_llamacpp", "SmolLM2-135M-Instruct.Q4_1")  # written by vs_llamacpp.py
PREVIOUS_MAX_ROWS = 64  # session 11's plan: the int8 kernel for decode-sized rows only


def engine(path: str, max_rows: int):
    """An engine whose plan sends the int8 kernel up to `max_rows` rows (the plan is chosen at build)."""
    from jaxserve import LLM

    current = quantized_cpu.PLAN_MAX_ROWS["int8"]
    quantized_cpu.PLAN_MAX_ROWS["int8"] = max_rows
    try:
        return LLM(
            path,
            dtype="float32",
            max_model_len=512,
            max_num_seqs=48,
            max_num_batched_tokens=512,
            show_progress=False,
            quantization="auto",
        )
    finally:
        quantized_cpu.PLAN_MAX_ROWS["int8"] = current


def timed(llm, prompts, lengths) -> float:
    from jaxserve import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", default="Q8_0,Q4_0", help="GGUF files in " + GGUF_DIR)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=48)
    args = parser.parse_args()
    for name in args.files.split(","):
        path = os.path.join(GGUF_DIR, f"{name}.gguf")
        if not os.path.isfile(path):
            raise SystemExit(f"{path} is missing: bench/vs_llamacpp.py --precisions {name.lower()} writes it")
        engines = {"old": engine(path, PREVIOUS_MAX_ROWS), "new": engine(path, quantized_cpu.PLAN_MAX_ROWS["int8"])}
        prompts, lengths = make_workload(args.num_requests, engines["new"].engine.model_config.vocab_size, 0)
        for llm in engines.values():
            timed(llm, [[101, 102, 103, 104] * 8], [4])  # warm-up
        best = {}
        for round_ in range(args.rounds):
            for label, llm in engines.items():  # alternating, so load drift hits both
                prefill_s = timed(llm, prompts, [1] * len(prompts))
                batched_s = timed(llm, prompts, lengths)
                record = dict(file=name, round=round_, plan=label, prefill_s=round(prefill_s, 2))
                record |= dict(batched_s=round(batched_s, 2), batched_tokens_per_s=round(sum(lengths) / batched_s, 1))
                print(json.dumps(record), flush=True)
                previous = best.get(label, (prefill_s, batched_s))
                best[label] = (min(previous[0], prefill_s), min(previous[1], batched_s))
        summary = dict(file=name, best_prefill_s={k: round(v[0], 2) for k, v in best.items()})
        summary |= dict(best_batched_s={k: round(v[1], 2) for k, v in best.items()})
        summary |= dict(prefill_speedup=round(best["old"][0] / best["new"][0], 2))
        summary |= dict(batched_speedup=round(best["old"][1] / best["new"][1], 2))
        print(json.dumps(summary), flush=True)
        del engines


if __name__ == "__main__":
    main()
