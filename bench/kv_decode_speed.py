"""Single-stream decode speed per KV cache format (cache.kv_dtype) at a long context: what a 16-bit or one-byte
cache buys in attention time, where attention reads most of a step's bytes.

    .venv/bin/python bench/kv_decode_speed.py [--model default|PATH] [--quantization auto]
        [--kv-dtypes auto,bfloat16,float16,int8] [--context 1800] [--new-tokens 128] [--rounds 6]

One engine per format, all loaded at once; each round generates --new-tokens greedy tokens after a prompt of
--context tokens in every engine, the order reversed every other round, so that the machine's drift lands on all
formats alike. The prompt's full pages come from the prefix cache after the warm-up round (each round then
prefills only the last partial page) and a 1-token request's time is taken off, so the rates are the decode's.
Prints one JSON line per format: median and best tokens/s of the decode, its
median ratio to the first format's round by round, greedy tokens equal to the first format's, and compiles
after warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct) or a model path")
    parser.add_argument("--quantization", default="auto", help="model.quantization (auto: a GGUF file's blocks)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-dtypes", default="auto,bfloat16,float16,int8", help="the first is the baseline")
    parser.add_argument("--context", type=int, default=1800, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()

    from jaxserve import LLM, SamplingParams
    from jaxserve.loading.default_model import resolve_model_path

    path = resolve_model_path(args.model) if args.model == "default" else args.model
    max_model_len = args.context + args.new_tokens + 16
    kv_dtypes = args.kv_dtypes.split(",")
    engines = {
        kv_dtype: LLM(
            path,
            dtype=args.dtype,
            quantization=args.quantization,
            kv_dtype=kv_dtype,
            max_model_len=max_model_len,
            max_num_seqs=4,
            show_progress=False,
        )
        for kv_dtype in kv_dtypes
    }
    vocab = engines[kv_dtypes[0]].engine.model_config.vocab_size
    prompt = [100 + (i * 7919) % min(vocab - 100, 4000) for i in range(args.context)]
    decode = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    first_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def timed(llm, params) -> tuple[float, list[int]]:
        start = time.perf_counter()
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        return time.perf_counter() - start, list(output.outputs[0].token_ids)

    tokens = {kv_dtype: timed(llm, decode)[1] for kv_dtype, llm in engines.items()}  # warm, and the greedy tokens
    rates: dict[str, list[float]] = {kv_dtype: [] for kv_dtype in kv_dtypes}
    for index in range(args.rounds):
        for kv_dtype in kv_dtypes if index % 2 == 0 else kv_dtypes[::-1]:
            prefill_seconds, _ = timed(engines[kv_dtype], first_token)
            seconds, _ = timed(engines[kv_dtype], decode)
            rates[kv_dtype].append((args.new_tokens - 1) / max(seconds - prefill_seconds, 1e-9))
    baseline = kv_dtypes[0]
    for kv_dtype, llm in engines.items():
        stats = llm.stats()
        emit(
            bench="kv_decode_speed",
            model=args.model,
            quantization=args.quantization,
            dtype=args.dtype,
            kv_dtype=kv_dtype,
            context=args.context,
            new_tokens=args.new_tokens,
            decode_tokens_per_s=round(statistics.median(rates[kv_dtype]), 1),
            best_tokens_per_s=round(max(rates[kv_dtype]), 1),
            vs_baseline=round(statistics.median(a / b for a, b in zip(rates[kv_dtype], rates[baseline])), 3),
            greedy_tokens_equal=f"{sum(a == b for a, b in zip(tokens[kv_dtype], tokens[baseline]))}/{args.new_tokens}",
            kv_cache_bytes_per_token=stats["kv_cache_bytes_per_token"],
            num_compiles_after_warmup=stats["num_compiles_after_warmup"],
        )


if __name__ == "__main__":
    main()
