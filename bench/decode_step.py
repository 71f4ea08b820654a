"""Where a decode step's time goes, against the memory roofline (issue #16 item 3).

For each dtype: the compiled decode step alone (device time, batch 1 and 8, fixed context), the engine's
single-stream decode end to end (tokens/s, from two generate calls that differ only in output length), the
host's share of an engine step (schedule, input building, dispatch, fetch, postprocess), and the roofline:
bytes a decode token must read (weights + the context's KV) over a read bandwidth measured in the same run.
Prints JSON lines.

    .venv/bin/python bench/decode_step.py [--model default] [--dtypes float32,bfloat16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_time


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def read_bandwidth(num_bytes: int = 512 * 2**20, repeats: int = 10) -> float:
    """Bytes read per second over a large float32 array, the best of a whole-array sum and a per-row sum
    (XLA:CPU may run the first on one thread, the second spreads rows over its threads): what a decode
    step does to its weights. The array lives in huge pages where the engine puts its weights there
    (jaxserve/device/huge_pages.py): over 4 KiB pages reads run at about half the speed."""
    from jaxserve.device.huge_pages import huge_page_arena

    shape = (num_bytes // 4 // 4096, 4096)
    arena = huge_page_arena(num_bytes) if jax.default_backend() == "cpu" else None
    if arena is not None:
        host = arena.view(np.float32).reshape(shape)
        host[:] = 1.0
        x = jax.device_put(host)
    else:
        x = jnp.ones(shape, jnp.float32)
    whole = median_time(jax.jit(jnp.sum), x, repeats=repeats)
    rows = median_time(jax.jit(lambda a: a.sum(axis=1)), x, repeats=repeats)
    return x.nbytes / min(whole, rows)


def decode_inputs(runner, batch: int, context: int, shape, vocab_size: int):
    """The runner's empty step inputs for `shape`, filled in for `batch` sequences each at `context`
    tokens on disjoint pages after the reserved one."""
    page_size = runner.page_size
    inputs = runner.build_inputs([[]], shape)
    attention = inputs.attention
    pages_each = -(-(context + 1) // page_size)
    for row in range(batch):
        attention.page_table[row, :pages_each] = 1 + row * pages_each + np.arange(pages_each)
    attention.positions[:batch] = context
    attention.kv_indices[:batch] = attention.page_table[:batch, context // page_size] * page_size + context % page_size
    attention.token_seq_ids[:] = np.arange(len(attention.token_seq_ids))
    inputs.token_ids[:] = np.arange(len(inputs.token_ids)) % vocab_size
    inputs.logits_indices[:] = np.arange(len(inputs.logits_indices))
    return inputs


def device_step_ms(llm, batch: int, context: int, repeats: int) -> float:
    """Median ms of the compiled decode step alone (dispatch to sampled tokens ready), inputs built once."""
    runner = llm.engine.runner
    shape = next(s for s in runner.executables if s.query_block == 1 and s.num_seqs == batch)
    inputs = decode_inputs(runner, batch, context, shape, llm.engine.model_config.vocab_size)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        jax.block_until_ready(runner.execute(shape, inputs).sampled.token_ids)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[2:])


class HostClock:
    """Wraps engine methods with timers: seconds spent in each over a run."""

    def __init__(self, engine):
        self.seconds: dict[str, float] = {}
        scheduler, runner, outputs = engine.schedulers[0], engine.runner, engine.outputs
        self._wrap(scheduler, "schedule", "schedule")
        self._wrap(engine, "_dispatch", "build_inputs+dispatch")
        self._wrap(runner, "execute", "dispatch")
        self._wrap(outputs, "process", "postprocess")
        self._wrap(engine, "_end_step", "end_step")
        self._wrap(engine, "step", "step")

    def _wrap(self, owner, name: str, label: str) -> None:
        inner = getattr(owner, name, None)
        if inner is None:  # the engine loop is being rewritten: time what exists
            return

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)


def single_stream(llm, clock: HostClock, prompt: list[int], new_tokens: int, device_ms: float):
    """Decode tokens/s of one request (generate N tokens minus generate 1 token), and the host's share."""
    from jaxserve import SamplingParams

    def run(n):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        clock.seconds.clear()
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start, out[0].outputs[0].token_ids

    run(new_tokens)  # warm caches
    first, _ = run(1)
    whole, tokens = run(new_tokens)
    steps = new_tokens - 1
    per_step = {k: round(1e3 * v / steps, 3) for k, v in clock.seconds.items()}
    per_step["device(step alone)"] = round(device_ms, 3)
    engine_stats = llm.stats()
    for key in ("host_seconds_per_step", "device_idle_seconds_per_step"):
        if key in engine_stats:
            per_step["engine_" + key.replace("seconds", "ms")] = round(1e3 * engine_stats[key], 3)
    return steps / (whole - first), per_step, tokens


def weight_bytes(llm) -> int:
    return sum(x.nbytes for x in llm.engine.runner.param_leaves)


def kv_bytes_per_token(llm, context: int) -> int:
    config = llm.engine.model_config
    itemsize = jnp.dtype(llm.engine.runner.kv_pages.keys[0].dtype).itemsize
    return 2 * config.num_layers * context * config.num_kv_heads * config.head_dim * itemsize


def bench_dtype(args, dtype: str, bandwidth: float, prompt: list[int]) -> None:
    from jaxserve import LLM
    from jaxserve.loading.default_model import resolve_model_path

    llm = LLM(
        resolve_model_path(args.model),
        dtype=dtype,
        max_model_len=512,
        max_num_seqs=8,
        decode_seq_buckets=(1, 8),
        prefill_token_buckets=(64, 256),
        max_num_batched_tokens=256,
        show_progress=False,
    )
    context = len(prompt) + args.new_tokens // 2
    roof_bytes = weight_bytes(llm) + kv_bytes_per_token(llm, context)
    roofline_tok_s = bandwidth / roof_bytes
    clock = HostClock(llm.engine)
    for round_ in range(args.rounds):
        step_ms = {b: device_step_ms(llm, b, context, args.repeats) for b in (1, 8)}
        tok_s, host, tokens = single_stream(llm, clock, prompt, args.new_tokens, step_ms[1])
        emit(
            dtype=dtype,
            round=round_,
            step_ms_batch1=round(step_ms[1], 3),
            step_ms_batch8=round(step_ms[8], 3),
            device_roofline_fraction=round(1e3 / step_ms[1] / roofline_tok_s, 3),
            single_stream_tok_s=round(tok_s, 2),
            roofline_tok_s=round(roofline_tok_s, 2),
            e2e_roofline_fraction=round(tok_s / roofline_tok_s, 3),
            host_ms_per_step=host,
            weight_mb=round(weight_bytes(llm) / 1e6, 1),
            first_tokens=tokens[:8],
        )
    assert llm.stats()["num_compiles_after_warmup"] == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="a path, 'default' or 'tiny-random'")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    bandwidth = read_bandwidth()
    emit(
        bench="decode_step",
        model=args.model,
        read_bandwidth_gb_s=round(bandwidth / 1e9, 2),
        jax=jax.__version__,
        python=sys.version.split()[0],
    )
    prompt = np.random.default_rng(0).integers(100, 10000, size=args.prompt_tokens).tolist()
    for dtype in args.dtypes.split(","):
        bench_dtype(args, dtype, bandwidth, prompt)


if __name__ == "__main__":
    main()
