"""Prefill speed against llama.cpp's prompt processing, same GGUF file, same run: jaxserve's time to the first
token of one prompt of N tokens (one chunk, prefix cache off: the whole prompt computed, the first token sampled)
as prompt tokens per second, beside llama-bench's pp N on the same file and threads. Prints JSON lines, one per
engine x precision x length, and the ratio jaxserve / llama.cpp.

    .venv/bin/python bench/prefill.py [--precisions f32,bf16] [--lengths 64,192,512] [--repeats 5] [--threads 2]

Why a bench of its own: bench/vs_llamacpp.py and bench/speculative.py time whole requests, where a prompt's
prefill is the part speculation cannot shorten (a third of a code-edit request's time on the default model,
docs/notes/speculative.md) and what a chat user waits for first. Median of --repeats runs each, both engines
on the same cores (pin_threads); ratios only on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llamacpp_peer as peer  # noqa: E402
from vs_llamacpp import CACHE_DIR, DTYPES, emit, model_files, pin_threads, quantized_gguf  # noqa: E402

from jaxserve.step_allocator import restart_with_step_allocator


def prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> dict[int, list[int]]:
    """A prompt of random ids per length (clear of the special ids at both ends, as llama-bench's)."""
    rng = np.random.default_rng(seed)
    return {n: rng.integers(100, vocab_size - 100, size=n).tolist() for n in lengths}


def jaxserve_rates(
    path: str, dtype: str, quantization: str, by_length: dict[int, list[int]], repeats: int
) -> dict[int, float]:
    """Prompt tokens per second: length / the median time of a max_tokens=1 request, each length warmed once."""
    from jaxserve import LLM, SamplingParams

    longest = max(by_length)
    llm = LLM(
        path,
        dtype=dtype,
        quantization=quantization,
        max_model_len=longest + 8,
        max_num_seqs=1,
        max_num_batched_tokens=max(longest, 64),  # every prompt one chunk
        enable_prefix_caching=False,
        show_progress=False,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rates = {}
    for length, prompt in by_length.items():
        llm.generate([prompt], params, use_tqdm=False)  # its buckets' first run
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            seconds.append(time.perf_counter() - start)
        rates[length] = round(length / statistics.median(seconds), 1)
    compiles = llm.stats()["num_compiles_after_warmup"]
    emit(engine="jaxserve", dtype=dtype, compiles_after_warmup=compiles)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a Hugging Face dir")
    parser.add_argument("--precisions", default="f32,bf16", help=f"of {', '.join(DTYPES)}")
    parser.add_argument("--lengths", default="64,192,512", help="prompt tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--build", default="auto", help="llama.cpp build (llamacpp_peer.BUILDS), auto: the native one")
    args = parser.parse_args()
    pin_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    jax_path, ggufs, name = model_files(args)
    from jaxserve.loading.model_source import open_model

    by_length = prompts(open_model(jax_path).config.vocab_size, lengths)
    emit(bench="prefill", model=name, lengths=lengths, threads=args.threads, repeats=args.repeats)
    for precision in args.precisions.split(","):
        dtype, gguf_type = DTYPES[precision]
        gguf = quantized_gguf(ggufs, gguf_type)  # Q4_0, Q4_K_M, ... written from the F32 file where missing
        quantized = precision not in ("f32", "bf16")
        build = peer.build_for(args.build, quantized)
        peer.ensure_built(CACHE_DIR, build)
        # jaxserve reads the same file llama.cpp does (a quantized one with its blocks kept as stored)
        ours = jaxserve_rates(gguf, dtype, "auto" if quantized else "none", by_length, args.repeats)
        for length in lengths:
            theirs = peer.llama_bench(CACHE_DIR, gguf, args.threads, length, 0, args.repeats, build=build)
            rate = theirs["prompt_tokens_per_s"]
            emit(precision=precision, prompt_tokens=length, jaxserve_tokens_per_s=ours[length],
                 llamacpp_tokens_per_s=rate, ratio=round(ours[length] / rate, 2))  # fmt: skip


if __name__ == "__main__":
    restart_with_step_allocator()  # as `python -m jaxserve.serve` runs (jaxserve/step_allocator.py)
    main()
