"""Offline throughput: jaxserve against Hugging Face transformers on the same checkpoint, in one run.

Default: N requests with random prompt lengths (16-384) and output lengths (8-128, EOS ignored),
through jaxserve's LLM.generate and through transformers' own continuous batching (its
ContinuousBatchingManager, each request with its own max_new_tokens). `--single` compares
one-request decode against `model.generate` and reports jaxserve's decode rate (tokens/s after the
first) as a fraction of the memory roofline: the memory bandwidth measured in the same run over the
bytes one decode step reads (weights, and the KV cache at the mean context). Prints JSON lines; the
last one holds the ratios.

    .venv/bin/python bench/throughput.py [--num-requests 128] [--single]

Needs the bench extras (torch, transformers). The checkpoint is a randomly initialized ~32M-parameter
Llama written to a temporary directory; speed does not depend on the weights' values.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

import numpy as np

from jaxserve.step_allocator import restart_with_step_allocator

MODEL_PRESETS = {
    # vocab 32000, tied embeddings: 16.4M embedding + 6 x 2.9M layers = 33.8M parameters
    "llama-32m": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
    ),
    "llama-8m": dict(
        vocab_size=8000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    ),
    # Qwen2.5-0.5B's shape as a Llama (no q/k/v biases), 494M parameters: the GPU check (bench/gpu_checks.sh)
    "qwen2.5-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        max_position_embeddings=4096,
    ),
}


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def build_checkpoint(args, directory: str):
    """The preset's random-weight model in args.dtype on args.device, saved to directory (loaded from there
    when it already holds one: runs with the same --checkpoint-dir share it)."""
    import torch
    import transformers

    dtype = getattr(torch, args.dtype)
    if os.path.isfile(os.path.join(directory, "config.json")):
        model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=dtype)
    else:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**MODEL_PRESETS[args.model], bos_token_id=1, eos_token_id=2)
        model = transformers.LlamaForCausalLM(config).to(dtype)
        model.save_pretrained(directory)
    model = model.eval().to(args.device)
    return model, sum(p.numel() for p in model.parameters())


def checkpoint_dir(args):
    """args.checkpoint_dir, or a temporary directory removed afterwards."""
    if args.checkpoint_dir:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        return contextlib.nullcontext(args.checkpoint_dir)
    return tempfile.TemporaryDirectory()


def make_workload(num_requests: int, vocab_size: int, seed: int, output_len: int | None = None):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab_size, size=int(n)).tolist() for n in rng.integers(16, 385, size=num_requests)]
    output_lengths = rng.integers(8, 129, size=num_requests).tolist()
    return prompts, [output_len] * num_requests if output_len else output_lengths


def run_jaxserve(directory: str, prompts, output_lengths, args):
    from jaxserve import LLM, SamplingParams

    start = time.perf_counter()
    # --cold-compile: no persistent compilation cache, so startup_seconds is the whole warm-up compile
    llm = LLM(
        directory,
        dtype=args.dtype,
        max_model_len=512,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=512,
        show_progress=False,
        **(dict(compilation_cache_dir=None) if args.cold_compile else {}),
    )
    startup = time.perf_counter() - start
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lengths]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.stats()
    assert stats["num_compiles_after_warmup"] == 0, stats
    return [o.outputs[0].token_ids for o in outputs], elapsed, startup, stats


def run_transformers_continuous_batching(model, prompts, output_lengths):
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=max(output_lengths))
    results = {}
    with torch.inference_mode():
        with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
            start = time.perf_counter()
            ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in zip(prompts, output_lengths)]
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped")
            elapsed = time.perf_counter() - start
    return [list(results[i].generated_tokens) for i in ids], elapsed


def run_transformers_generate_batch(model, prompts, num_tokens: int):
    """transformers' own batch API (CUDA graphs on a GPU), every request num_tokens long: one untimed run
    to capture its graphs and warm up, then the timed one."""
    import inspect

    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=num_tokens)
    options = {"warmup": True} if "warmup" in inspect.signature(model.generate_batch).parameters else {}
    with torch.inference_mode():
        model.generate_batch(prompts, generation_config=config, **options)
        start = time.perf_counter()
        outputs = model.generate_batch(prompts, generation_config=config, **options)
        elapsed = time.perf_counter() - start
    return [list(output.generated_tokens) for output in outputs.values()], elapsed


def throughput(args) -> None:
    with checkpoint_dir(args) as directory:
        model, num_params = build_checkpoint(args, directory)
        prompts, output_lengths = make_workload(
            args.num_requests, MODEL_PRESETS[args.model]["vocab_size"], args.seed, args.output_len
        )
        num_output = sum(output_lengths)
        emit(
            bench="throughput",
            model=args.model,
            num_params=num_params,
            dtype=args.dtype,
            num_requests=len(prompts),
            prompt_tokens=sum(map(len, prompts)),
            output_tokens=num_output,
            cpu_count=os.cpu_count(),
        )
        ours, elapsed, startup, stats = run_jaxserve(directory, prompts, output_lengths, args)
        emit(
            engine="jaxserve",
            seconds=round(elapsed, 3),
            output_tokens_per_s=round(num_output / elapsed, 1),
            startup_seconds=round(startup, 2),
            cold_compile=args.cold_compile,
            num_executables=stats["num_executables"],
            num_compiles_after_warmup=stats["num_compiles_after_warmup"],
        )
        if args.output_len:
            theirs, their_elapsed = run_transformers_generate_batch(model, prompts, args.output_len)
            their_name = "transformers-generate_batch"
        else:
            theirs, their_elapsed = run_transformers_continuous_batching(model, prompts, output_lengths)
            their_name = "transformers-continuous-batching"
        their_output = sum(map(len, theirs))
        emit(
            engine=their_name,
            seconds=round(their_elapsed, 3),
            output_tokens=their_output,
            output_tokens_per_s=round(their_output / their_elapsed, 1),
        )
        agree = sum(a == b for a, b in zip(ours, theirs))
        emit(
            result="throughput",
            ratio=round((num_output / elapsed) / (their_output / their_elapsed), 2),
            identical_greedy_outputs=f"{agree}/{len(prompts)}",
        )


def memory_bandwidth(num_bytes: int = 512 << 20, repeats: int = 5) -> dict:
    """This machine's read bandwidth (bytes/s) over a buffer far larger than any cache, two ways, best of
    `repeats`: a float32 matrix-vector product (decode's access pattern, BLAS on all cores) and a
    threaded sum (one slice per core). The faster is the roofline's bandwidth."""
    from concurrent.futures import ThreadPoolExecutor

    import jax

    if jax.default_backend() != "cpu":
        return device_bandwidth(4 * num_bytes, repeats)
    cols = 8192
    matrix = np.ones((num_bytes // 4 // cols, cols), np.float32)
    vector = np.ones(cols, np.float32)
    threads = os.cpu_count() or 1
    slices = np.array_split(matrix.reshape(-1), threads)

    def best(run) -> float:
        run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return matrix.nbytes / min(times)

    with ThreadPoolExecutor(threads) as pool:
        rates = dict(matvec=best(lambda: matrix @ vector), threaded_sum=best(lambda: list(pool.map(np.sum, slices))))
    return dict(rates, best=max(rates.values()))


def device_bandwidth(num_bytes: int, repeats: int) -> dict:
    """An accelerator's read bandwidth: a jitted sum over num_bytes (and a copy, counting bytes read and
    written, for reference); the sum's is the roofline's."""
    import jax
    import jax.numpy as jnp

    def best_time(fn, x, repeats):
        jax.block_until_ready(fn(x))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - start)
        return min(times)

    x = jnp.ones(num_bytes // 4, jnp.float32)
    rates = dict(
        sum=num_bytes / best_time(jax.jit(jnp.sum), x, repeats=repeats),
        copy_read_write=2 * num_bytes / best_time(jax.jit(lambda v: v + 1), x, repeats=repeats),
    )
    return dict(rates, best=rates["sum"])


def decode_bytes_per_token(llm, context: float) -> dict:
    """What one decode step of one sequence reads: every weight matrix (the input embedding only a row of
    it, unless tied to the output) and the KV cache of `context` tokens, in the served dtype."""
    config = llm.engine.model_config
    stats = llm.stats()
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[llm.engine.dtype]
    weights = stats["weights_device_bytes"]
    if not config.tie_word_embeddings:
        weights -= config.vocab_size * config.hidden_size * itemsize
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize * context
    return dict(weights=int(weights), kv=int(kv), total=int(weights + kv))


def single(args) -> None:
    import torch

    from jaxserve import LLM, SamplingParams

    with checkpoint_dir(args) as directory:
        model, num_params = build_checkpoint(args, directory)
        prompts, _ = make_workload(1, MODEL_PRESETS[args.model]["vocab_size"], args.seed)
        prompt, num_tokens = prompts[0][:128], args.single_tokens
        emit(
            bench="single",
            model=args.model,
            num_params=num_params,
            prompt_tokens=len(prompt),
            output_tokens=num_tokens,
            dtype=args.dtype,
        )
        start = time.perf_counter()
        # Without prefix caching each run prefills afresh, as transformers' generate does.
        llm = LLM(
            directory,
            dtype=args.dtype,
            max_model_len=512,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=512,
            enable_prefix_caching=False,
            show_progress=False,
            **(dict(compilation_cache_dir=None) if args.cold_compile else {}),
        )
        startup = time.perf_counter() - start

        def generate(n: int):
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            start = time.perf_counter()
            output = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            return list(output), time.perf_counter() - start

        generate(num_tokens)  # warm-up
        ours, elapsed = min((generate(num_tokens) for _ in range(args.repeats)), key=lambda r: r[1])
        first = min(generate(1)[1] for _ in range(args.repeats))  # prefill and one step
        decode_rate = (num_tokens - 1) / (elapsed - first)
        emit(
            engine="jaxserve",
            seconds=round(elapsed, 3),
            output_tokens_per_s=round(num_tokens / elapsed, 1),
            decode_tokens_per_s=round(decode_rate, 1),
            startup_seconds=round(startup, 2),
        )
        read = decode_bytes_per_token(llm, context=len(prompt) + num_tokens / 2)
        bandwidth = memory_bandwidth()
        roofline = bandwidth["best"] / read["total"]
        emit(
            result="roofline",
            bytes_per_token=read,
            bandwidth_gb_s={k: round(v / 1e9, 1) for k, v in bandwidth.items()},
            roofline_tokens_per_s=round(roofline, 1),
            decode_tokens_per_s=round(decode_rate, 1),
            fraction_of_roofline=round(decode_rate / roofline, 2),
        )
        llm = None  # its memory goes before transformers runs
        input_ids = torch.tensor([prompt], device=args.device)
        with torch.inference_mode():
            model.generate(input_ids, max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm up
            start = time.perf_counter()
            generated = model.generate(
                input_ids, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False, pad_token_id=0
            )
            if args.device != "cpu":
                torch.cuda.synchronize()
            their_elapsed = time.perf_counter() - start
        theirs = generated[0, len(prompt) :].tolist()
        emit(
            engine="transformers-generate",
            seconds=round(their_elapsed, 3),
            output_tokens_per_s=round(num_tokens / their_elapsed, 1),
        )
        emit(result="single", ratio=round(their_elapsed / elapsed, 2), identical_greedy_output=ours == theirs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODEL_PRESETS), default="llama-32m")
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--single", action="store_true", help="one-request decode against model.generate")
    parser.add_argument("--single-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="--single runs; the fastest counts")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both engines'")
    parser.add_argument("--device", default="cpu", help="transformers' torch device (cuda on a GPU)")
    parser.add_argument("--output-len", type=int, help="every request this long; transformers runs generate_batch")
    parser.add_argument("--checkpoint-dir", help="write the random checkpoint here once (default: a temporary dir)")
    parser.add_argument("--cold-compile", action="store_true", help="no compilation cache: startup = compile time")
    args = parser.parse_args()
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        sys.exit("bench/throughput.py needs the bench extras: pip install -e '.[bench]'")
    (single if args.single else throughput)(args)


if __name__ == "__main__":
    restart_with_step_allocator()  # as `python -m jaxserve.serve` runs (jaxserve/step_allocator.py)
    main()
