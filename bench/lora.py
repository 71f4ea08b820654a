"""Multi-LoRA throughput: a batch of requests spread over 1, 4 or 16 distinct adapters vs the base model alone,
in one run.

    .venv/bin/python bench/lora.py [--model default] [--num-requests 32] [--rank 16] [--dtype float32]

The peer is the base model on an engine without LoRA slots (what serving no adapters costs); the same
engine with slots serving base-only requests is reported too (what the slots cost a request that uses
none). Adapters are random PEFT-format adapters (every q/k/v/o and MLP projection of every layer, rank
--rank, nonzero A and B) written to a temporary directory; speed does not depend on their values. Request i
uses adapter i % k. Prompts are random token ids (--prompt-tokens each, the same in every mode), outputs
--max-tokens long with EOS ignored, greedy; prefix caching is off so that every mode computes every prompt.
Rates are generated tokens over wall time, prompt processing included, the best of --repeats runs. Both
engines stay up and the modes take turns within each repeat, so that a machine whose load drifts during the
run (a shared one) skews every mode alike rather than the later ones.

Prints one JSON line per (engine, adapters) and a last line with each mode's ratio to the peer (goal: >= 0.8
with 16 adapters).

On one CPU device the adapters go through the C++ segmented kernel (pallas_kernels/matmul/cpu_lora.py);
--compare-masked adds a third engine whose adapters take lora.py's masked XLA product (what every other
backend runs), its modes suffixed "_masked", taking turns with the others.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.config import LORA_TARGET_MODULES  # noqa: E402


def write_adapters(directory: str, llm: LLM, count: int, rank: int, seed: int = 0) -> dict[str, str]:
    """count random adapters over every projection the engine gives slots, in PEFT's file layout."""
    rng = np.random.default_rng(seed)
    shapes = llm.engine.parts.lora.shapes  # our module path -> (in, out)
    paths = {}
    for index in range(count):
        tensors = {}
        for module, (size_in, size_out) in shapes.items():
            prefix = f"base_model.model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, size_in)) / np.sqrt(size_in)).astype(
                np.float32
            )
            tensors[f"{prefix}.lora_B.weight"] = (0.01 * rng.standard_normal((size_out, rank))).astype(np.float32)
        path = os.path.join(directory, f"adapter{index}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        config = dict(peft_type="LORA", r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGET_MODULES))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        paths[f"adapter{index}"] = path
    return paths


def run_once(llm: LLM, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> tuple[float, int]:
    """(seconds, generated tokens) of one batch."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora=a) for a in adapters]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def masked_engine(model: str, engine: dict, lora: dict) -> LLM:
    """An engine whose adapters take the masked XLA product, the segmented kernel reported unavailable
    while its plan is built."""
    from pallas_kernels.matmul import cpu_lora

    available = cpu_lora.available
    cpu_lora.available = lambda: False
    try:
        return LLM(model, **engine, lora=lora)
    finally:
        cpu_lora.available = available


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", default="1,4,16", help="distinct adapters per batch, comma separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compare-masked", action="store_true", help="also the masked XLA product's engine")
    args = parser.parse_args()
    counts = [int(c) for c in args.adapters.split(",")]
    max_len = args.prompt_tokens + args.max_tokens
    engine = dict(
        dtype=args.dtype,
        max_model_len=max(128, max_len),
        max_num_seqs=args.num_requests,
        max_num_batched_tokens=512,
        decode_seq_buckets=(args.num_requests,),
        prefill_token_buckets=(512,),
        enable_prefix_caching=False,
        show_progress=False,
    )
    peer = LLM(args.model, **engine)
    vocab_size = peer.engine.model_config.vocab_size
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, vocab_size, args.prompt_tokens).tolist() for _ in range(args.num_requests)]
    lora = dict(max_adapters=max(counts), max_rank=args.rank)
    llm = LLM(args.model, **engine, lora=lora)
    masked = masked_engine(args.model, engine, lora) if args.compare_masked else None
    with tempfile.TemporaryDirectory() as directory:
        for name, path in write_adapters(directory, llm, max(counts), args.rank).items():
            for slotted in (llm, masked) if masked is not None else (llm,):
                slotted.load_lora(name, path)
        # mode -> (engine, its name in the output, adapters, each request's adapter)
        modes = {"base": (peer, "no_lora_slots", 0, [None] * args.num_requests)}
        modes["base_with_slots"] = (llm, "lora_slots", 0, [None] * args.num_requests)
        for count in counts:
            modes[f"{count}_adapters"] = (
                llm,
                "lora_slots",
                count,
                [f"adapter{i % count}" for i in range(args.num_requests)],
            )
            if masked is not None:
                modes[f"{count}_adapters_masked"] = (masked, "lora_slots_masked", *modes[f"{count}_adapters"][2:])
        for engine_llm, _, _, adapters in modes.values():  # warm: each adapter's first use
            run_once(engine_llm, prompts[:2], adapters[:2], args.max_tokens)
        best = {mode: float("inf") for mode in modes}
        generated = {}
        for _ in range(args.repeats):  # the modes take turns, so load drift hits them alike
            for mode, (engine_llm, _, _, adapters) in modes.items():
                seconds, generated[mode] = run_once(engine_llm, prompts, adapters, args.max_tokens)
                best[mode] = min(best[mode], seconds)
    results = {}
    for mode, (_, name, count, _) in modes.items():
        results[mode] = dict(
            seconds=round(best[mode], 3),
            generated_tokens=generated[mode],
            tokens_per_second=round(generated[mode] / best[mode], 2),
        )
        print(json.dumps(dict(engine=name, adapters=count, **results[mode])), flush=True)
    stats = llm.stats()
    base_rate = results["base"]["tokens_per_second"]
    ratios = {name: round(result["tokens_per_second"] / base_rate, 3) for name, result in results.items()}
    summary = dict(
        model=args.model,
        dtype=args.dtype,
        rank=args.rank,
        num_requests=args.num_requests,
        ratio_to_base=ratios,
        num_compiles_after_warmup=stats["num_compiles_after_warmup"],
    )
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
