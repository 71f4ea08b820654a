"""What a quantized KV cache (cache.kv_dtype) costs in quality and buys in pages: perplexity on a fixed
public-domain text, teacher-forced top-1 agreement and greedy agreement with the model-dtype cache, and the
pages a fixed KV budget holds, per kv_dtype, on the default model (or --model).

    .venv/bin/python bench/kv_quality.py [--model default] [--kv-dtypes auto,int8,float8_e4m3]
                                         [--max-tokens 2048] [--window 512] [--prompts 8] [--generate 32]
                                         [--budget-gib 1]

The text: bench/data/kjv_genesis_1-9.txt (--text to use another). Perplexity: the text's first max-tokens
tokens in windows of `window` tokens scored teacher-forced (prompt_logprobs), so every score after a window's
first few tokens reads quantized keys and values. Teacher-forced agreement: the share of those positions where
a format's top token equals the first format's (the baseline, auto). Greedy agreement: `prompts` prompts of 48
tokens from the text, `generate` greedy tokens each (decode steps reading the cache), the share of equal
positions and the mean common prefix. Pages: KVPages.bytes_per_page of this model's cache geometry against
--budget-gib. Each format prints a JSON line; the last line compares them.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "data", "kjv_genesis_1-9.txt")


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def scored_windows(llm, token_ids: list[int], window: int, bos: int | None) -> list[tuple[int, dict]]:
    """(the text's token, its prompt_logprobs entry) for every scored position of every window."""
    from jaxserve import SamplingParams

    step = window - (1 if bos is not None else 0)
    windows = [token_ids[i : i + step] for i in range(0, len(token_ids), step)]
    windows = [([bos] if bos is not None else []) + w for w in windows if len(w) > 1]
    outputs = llm.generate(windows, SamplingParams(max_tokens=0, prompt_logprobs=1))
    first_scored = 2 if bos is not None else 1  # the BOS predicts the window's first token: not text
    return [
        (token, scores)
        for prompt, output in zip(windows, outputs)
        for token, scores in zip(prompt[first_scored:], output.prompt_logprobs[first_scored:])
    ]


def greedy(llm, prompts, num_tokens: int) -> list[list[int]]:
    from jaxserve import SamplingParams

    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params)]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--kv-dtypes", default="auto,int8,float8_e4m3", help="cache.kv_dtype values; first: baseline")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--max-tokens", type=int, default=2048, help="of the text, for perplexity")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generate", type=int, default=32)
    parser.add_argument("--budget-gib", type=float, default=1.0, help="KV memory to count pages for")
    args = parser.parse_args()

    from jaxserve import LLM
    from jaxserve.models.kv_pages import KVPages

    with open(args.text) as f:
        text = f.read()
    baseline, results = None, {}
    for kv_dtype in args.kv_dtypes.split(","):
        llm = LLM(
            args.model,
            dtype=args.dtype,
            kv_dtype=kv_dtype,
            max_model_len=args.window + args.generate + 64,
            max_num_seqs=max(8, args.prompts),
            max_num_batched_tokens=args.window,
            show_progress=False,
        )
        tokenizer = llm.engine.parts.source.tokenizer
        token_ids = tokenizer.encode(text, add_special_tokens=False)[: args.max_tokens]
        stride = max(1, (len(token_ids) - 48) // args.prompts)
        prompts = [token_ids[i * stride : i * stride + 48] for i in range(args.prompts)]
        scored = scored_windows(llm, token_ids, args.window, getattr(tokenizer, "bos_token_id", None))
        top = [max(scores, key=scores.get) for _, scores in scored]
        tokens = greedy(llm, prompts, args.generate)
        baseline = baseline or (top, tokens)
        model, pool = llm.engine.model_config, llm.engine.runner.kv_pages.keys[0]
        page_bytes = KVPages.bytes_per_page(
            model.num_layers, pool.shape[1], pool.shape[2], pool.shape[3], args.dtype, kv_dtype
        )
        stats = llm.stats()
        record = dict(
            model=args.model,
            kv_dtype=kv_dtype,
            dtype=args.dtype,
            text_tokens=len(token_ids),
            perplexity=math.exp(-sum(scores[token] for token, scores in scored) / len(scored)),
            teacher_forced_top1_agreement=sum(a == b for a, b in zip(baseline[0], top)) / len(top),
            greedy_token_agreement=sum(a == b for x, y in zip(baseline[1], tokens) for a, b in zip(x, y))
            / sum(len(x) for x in tokens),
            mean_common_prefix=sum(map(common_prefix, baseline[1], tokens)) / len(tokens),
            kv_cache_bytes_per_token=stats["kv_cache_bytes_per_token"],
            pages_per_budget=int(args.budget_gib * 2**30) // page_bytes,
            budget_gib=args.budget_gib,
            num_compiles_after_warmup=stats["num_compiles_after_warmup"],
        )
        emit(**record)
        results[kv_dtype] = record
        del llm
        gc.collect()
    first = next(iter(results.values()))
    emit(
        summary={
            name: dict(
                perplexity_ratio=r["perplexity"] / first["perplexity"],
                pages_ratio=r["pages_per_budget"] / first["pages_per_budget"],
                teacher_forced_top1_agreement=r["teacher_forced_top1_agreement"],
                greedy_token_agreement=r["greedy_token_agreement"],
            )
            for name, r in results.items()
        }
    )


if __name__ == "__main__":
    main()
