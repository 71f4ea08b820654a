"""Prefix caching: the same workloads with enable_prefix_caching on and off, in one run.

(a) shared prefix: groups of requests that share a long system prompt, each with its own question
    (like SGLang's generated-shared-prefix workload);
(b) multi-turn: conversations of 4-8 turns, every turn resending the whole conversation so far.

Prints JSON lines: per workload and setting, output tokens/s, mean time to first token and the
prefix-cache hit rate; then the on/off ratios. Greedy, EOS ignored; the checkpoint is a random
~32M-parameter Llama (speed does not depend on the weights' values). No torch needed.

    .venv/bin/python bench/prefix.py [--groups 8 --per-group 16 --system-len 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np
from safetensors.numpy import save_file

from jaxserve import LLM, SamplingParams
from jaxserve.loading.default_model import random_llama_weights

CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def write_checkpoint(directory: str) -> None:
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    save_file(random_llama_weights(CONFIG, seed=0), os.path.join(directory, "model.safetensors"))


def run_batch(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    """Runs one batch through the engine; returns outputs in order and each request's time to first token."""
    engine = llm.engine
    start = time.perf_counter()
    ids = [f"bench-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    first_token, finished = {}, {}
    while len(finished) < len(ids):
        for output in engine.step():
            first_token.setdefault(output.request_id, time.perf_counter() - start)
            if output.finished:
                finished[output.request_id] = output
    return [finished[i] for i in ids], [first_token[i] for i in ids]


def shared_prefix_workload(args, rng):
    prompts = []
    for _ in range(args.groups):
        system = [1] + rng.integers(3, CONFIG["vocab_size"], size=args.system_len - 1).tolist()
        for _ in range(args.per_group):
            question = rng.integers(3, CONFIG["vocab_size"], size=int(rng.integers(16, 65))).tolist()
            prompts.append(system + question)
    order = rng.permutation(len(prompts))  # requests of a group do not arrive together
    return [prompts[i] for i in order]


def run_shared_prefix(llm: LLM, prompts, args):
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs, ttft = run_batch(llm, prompts, params)
    elapsed = time.perf_counter() - start
    return [o.outputs[0].token_ids for o in outputs], elapsed, ttft, len(prompts) * args.output_len


def run_multi_turn(llm: LLM, args, seed: int):
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    turns = rng.integers(4, 9, size=args.conversations)
    conversations = [
        [1] + rng.integers(3, CONFIG["vocab_size"], size=args.turn_len).tolist() for _ in range(args.conversations)
    ]
    all_tokens, ttft, num_output, elapsed = [], [], 0, 0.0
    for turn in range(int(turns.max())):
        active = [i for i in range(args.conversations) if turns[i] > turn]
        start = time.perf_counter()
        outputs, batch_ttft = run_batch(llm, [conversations[i] for i in active], params)
        elapsed += time.perf_counter() - start
        ttft += batch_ttft
        for i, output in zip(active, outputs):
            answer = output.outputs[0].token_ids
            all_tokens.append(answer)
            num_output += len(answer)
            conversations[i] = (
                conversations[i] + answer + rng.integers(3, CONFIG["vocab_size"], size=args.turn_len).tolist()
            )
    return all_tokens, elapsed, ttft, num_output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turn-len", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    directory = tempfile.mkdtemp()
    try:
        write_checkpoint(directory)
        engines = {
            caching: LLM(
                directory,
                dtype="float32",
                max_model_len=2048,
                max_num_seqs=64,
                max_num_batched_tokens=512,
                enable_prefix_caching=caching,
                kv_cache_memory_gib=2.0,
                show_progress=False,
            )
            for caching in (True, False)
        }
        prompts = shared_prefix_workload(args, np.random.default_rng(args.seed))
        workloads = {
            "shared_prefix": lambda llm: run_shared_prefix(llm, prompts, args),
            "multi_turn": lambda llm: run_multi_turn(llm, args, args.seed),
        }
        for name, run in workloads.items():
            results = {}
            for caching, llm in engines.items():
                before = llm.stats()
                tokens, elapsed, ttft, num_output = run(llm)
                after = llm.stats()
                queried = after["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"]
                hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
                results[caching] = (tokens, num_output / elapsed, float(np.mean(ttft)))
                emit(
                    workload=name,
                    prefix_caching=caching,
                    requests=len(ttft),
                    seconds=round(elapsed, 3),
                    output_tokens_per_s=round(num_output / elapsed, 1),
                    mean_ttft_s=round(float(np.mean(ttft)), 3),
                    hit_rate=round(hits / queried, 3) if queried else 0.0,
                )
            emit(
                workload=name,
                result="on/off",
                throughput_ratio=round(results[True][1] / results[False][1], 2),
                ttft_ratio=round(results[False][2] / results[True][2], 2),
                identical_outputs=results[True][0] == results[False][0],
            )
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
