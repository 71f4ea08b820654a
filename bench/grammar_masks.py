"""Constrained decoding's host cost: the time to compute a JSON schema's token bitmask, per token and row,
on the default model's tokenizer (SmolLM2-135M-Instruct, 49152 tokens).

Each sequence replays the tokenization of a valid document (random values, fixed seed), as a model's
output would be accepted: fill the mask row, accept the token. Batch 1 fills one row at a time; batch 32
fills all rows at once with llguidance's parallel executor (GrammarCompiler.fill_bitmasks), and its peer,
the same 32 rows filled one after another, runs in the same process. Prints JSON lines; absolute times
on a shared machine are noise, the ratio less so.

    .venv/bin/python bench/grammar_masks.py [--steps 200 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from jaxserve.host.grammar import GrammarCompiler
from jaxserve.host.request import GuidedDecodingParams
from jaxserve.loading.default_model import resolve_model_path
from jaxserve.loading.model_source import open_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 6},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "bio": {"type": "string"},
    },
    "required": ["name", "email", "age", "score", "member", "tags", "address", "bio"],
    "additionalProperties": False,
}
WORDS = "the quick brown fox jumps over lazy dog river stone garden music winter light paper city north".split()


def documents(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS, n))

    return [
        json.dumps(
            {
                "name": words(2).title(),
                "email": f"{rng.choice(WORDS)}@{rng.choice(WORDS)}.com",
                "age": int(rng.integers(0, 100)),
                "score": round(float(rng.normal(50, 20)), 3),
                "member": bool(rng.integers(2)),
                "tags": [str(w) for w in rng.choice(WORDS, int(rng.integers(0, 5)))],
                "address": {"street": f"{rng.integers(1, 999)} {words(2)}", "city": words(1), "zip": "12345"},
                "bio": words(int(rng.integers(8, 40))) + ".",
            },
        )
        for _ in range(count)
    ]


def replay(compiler, compiled, token_lists, steps, parallel):
    """Seconds spent filling masks and accepting tokens, over `steps` steps of len(token_lists) rows.
    A row whose document ends starts the next one over (a new matcher), as a new request would."""
    rows = len(token_lists)
    bitmask = compiler.allocate_bitmask(rows)
    matchers = [compiled.new_matcher() for _ in range(rows)]
    positions = [0] * rows
    fill_seconds = accept_seconds = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        if parallel:
            compiler.fill_bitmasks(list(zip(matchers, range(rows), strict=True)), bitmask)
        else:
            for row, matcher in enumerate(matchers):
                matcher.fill_bitmask(bitmask, row)
        middle = time.perf_counter()
        for row, matcher in enumerate(matchers):
            token_ids = token_lists[row]
            token_id = token_ids[positions[row]] if positions[row] < len(token_ids) else None
            if token_id is None:
                token_id = min(compiler.layout.eos_token_ids)
            word = int(bitmask[row, token_id // 32]) & (1 << (token_id % 32))
            assert word, f"row {row}: token {token_id} refused at {positions[row]}"
            assert matcher.accept_token(token_id)
            positions[row] += 1
        accept_seconds += time.perf_counter() - middle
        fill_seconds += middle - start
        for row, matcher in enumerate(matchers):
            if matcher.is_finished:
                matchers[row], positions[row] = compiled.new_matcher(), 0
    return fill_seconds, accept_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    tokenizer = open_model(resolve_model_path("default")).tokenizer
    assert tokenizer is not None
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    setup_ms = (time.perf_counter() - start) * 1e3
    guided = GuidedDecodingParams(json=json.dumps(SCHEMA))  # as text: properties keep their order
    start = time.perf_counter()
    compiled = compiler.compile_async(guided).result()
    compile_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    compiler.compile_async(guided).result()
    cached_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    for _ in range(1000):
        compiled.new_matcher()
    new_matcher_us = (time.perf_counter() - start) * 1e3
    print(
        json.dumps(
            dict(
                bench="grammar_setup",
                vocab_size=tokenizer.vocab_size,
                cpu_count=os.cpu_count(),
                tokenizer_setup_ms=round(setup_ms, 1),
                schema_compile_ms=round(compile_ms, 2),
                cached_compile_ms=round(cached_ms, 3),
                new_matcher_us=round(new_matcher_us, 1),
            )
        ),
        flush=True,
    )

    token_lists = [tokenizer.encode(text, add_special_tokens=False) for text in documents(32, seed=0)]
    results = {}
    for batch, parallel in ((1, False), (1, True), (32, False), (32, True)):
        best = None
        for _ in range(args.repeats):  # the best of a few: other processes share these cores
            fill, accept = replay(compiler, compiled, token_lists[:batch], args.steps, parallel)
            best = (fill, accept) if best is None or fill < best[0] else best
        assert best is not None
        per_token_row_us = best[0] / (args.steps * batch) * 1e6
        results[(batch, parallel)] = per_token_row_us
        print(
            json.dumps(
                dict(
                    bench="grammar_masks",
                    batch=batch,
                    fill="parallel (LLExecutor)" if parallel else "one row after another",
                    mask_us_per_token_per_row=round(per_token_row_us, 1),
                    mask_ms_per_step=round(best[0] / args.steps * 1e3, 3),
                    accept_us_per_token=round(best[1] / (args.steps * batch) * 1e6, 1),
                    steps=args.steps,
                )
            ),
            flush=True,
        )
    print(
        json.dumps(
            dict(
                bench="grammar_masks_ratio",
                batch=32,
                parallel_over_sequential_step_time=round(results[(32, True)] / results[(32, False)], 3),
            )
        ),
        flush=True,
    )
    compiler.close()


if __name__ == "__main__":
    main()
