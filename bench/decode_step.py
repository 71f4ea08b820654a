"""Where a decode step's time goes, against the memory roofline (issue #16 item 3).

For each dtype: the compiled decode step alone (device time at each of --batches, fixed context), the
engine's single-stream decode end to end (tokens/s, from two generate calls that differ only in output
length), the host's share of an engine step (schedule, input building, dispatch, fetch, postprocess), and
the roofline: bytes a decode token must read (weights + the context's KV) over a read bandwidth measured
in the same run (`--alternate N`: N more single streams, each beside its own read, since this VM's bandwidth
drifts within a run). `--profile` splits each step (issue #29): the model's projections alone, those the C++
small matmul serves and those XLA's dots serve (each group timed on its own with the step's rows), every
layer's attention alone (the CPU kernel at the step's context), and the rest of the step; with `--paths`, all projections through each kernel path this CPU runs and through
XLA's dots; with `--trace`, the step itself op by op from XLA's trace (bench/step_trace.py: each kernel's
calls, XLA's fusions, the executor's gaps). The CPU (model, vector flags) and the kernel's instruction path head the output
(JAXSERVE_CPU_KERNEL_PATH=avx2 measures what an AVX2-only CPU's kernel does). Prints JSON lines.

    .venv/bin/python bench/decode_step.py [--model default] [--dtypes float32,bfloat16] [--rounds 3]
        [--batches 1,8,32] [--alternate N] [--profile [--paths] [--trace]] [--quantization none|int8|int4|auto]
        [--quantized-activations int8|float]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_time

from jaxserve.step_allocator import restart_with_step_allocator


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


class BandwidthReader:
    """Bytes read per second over a large float32 array by each way of reading it: XLA's whole-array sum
    and per-row sum (XLA:CPU may run the first on one thread, the second spreads rows over its threads)
    and, on the CPU, two threads each summing one half at once (numpy, outside the GIL). What a decode
    step does to its weights; the roofline takes the best. The two-thread read matters where one thread
    cannot read at the memory's bandwidth (an Intel Xeon here: ~16 GB/s one thread, ~27 two), since a step's
    kernels read with two workers. The array lives in huge pages where the engine puts its weights there
    (jaxserve/device/huge_pages.py): over 4 KiB pages reads run at about half the speed. Built once, read
    as often as a run needs (--alternate reads it between single streams)."""

    def __init__(self, num_bytes: int = 512 * 2**20):
        from jaxserve.device.huge_pages import huge_page_arena

        shape = (num_bytes // 4 // 4096, 4096)
        arena = huge_page_arena(num_bytes) if jax.default_backend() == "cpu" else None
        if arena is not None:
            self.host = arena.view(np.float32).reshape(shape)
            self.host[:] = 1.0
            self.device = jax.device_put(self.host)
        else:
            self.host = None
            self.device = jnp.ones(shape, jnp.float32)
        self.whole_sum, self.row_sums = jax.jit(jnp.sum), jax.jit(lambda a: a.sum(axis=1))

    def read(self, repeats: int = 10) -> dict[str, float]:
        seconds = {
            "xla_whole": median_time(self.whole_sum, self.device, repeats=repeats),
            "xla_rows": median_time(self.row_sums, self.device, repeats=repeats),
        }
        if self.host is not None:
            seconds["two_threads"] = two_thread_read_seconds(self.host, repeats)
        return {name: self.device.nbytes / s for name, s in seconds.items()}


def two_thread_read_seconds(host: np.ndarray, repeats: int) -> float:
    """Median seconds for two threads to sum the two halves of `host` at the same time."""
    halves = np.array_split(host, 2)
    times = []
    with ThreadPoolExecutor(2) as pool:
        for _ in range(repeats + 1):
            start = time.perf_counter()
            list(pool.map(np.sum, halves))
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


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


def traced_step_ms(llm, batch: int, context: int) -> dict:
    """The compiled decode step's ms by kind of op, from XLA's trace (step_trace.py): the kernels' calls, XLA's
    fusions between them, the executor's gaps between thunks."""
    from step_trace import step_breakdown

    runner = llm.engine.runner
    shape = next(s for s in runner.executables if s.query_block == 1 and s.num_seqs == batch)
    inputs = decode_inputs(runner, batch, context, shape, llm.engine.model_config.vocab_size)

    def run_step():
        jax.block_until_ready(runner.execute(shape, inputs).sampled.token_ids)

    return step_breakdown(run_step, runner.executables[shape].as_text())


def step_timings(llm, batch: int, context: int, repeats: int) -> dict[str, float]:
    """The compiled decode step alone, inputs built once, three ways (median ms): from dispatch to sampled tokens
    ready (`step_ms`); the same with the inputs already on the device (`step_ms_inputs_on_device`: what moving a
    step's host arrays costs); and the host's time in the dispatch call itself (`dispatch_ms`: until the
    executable returns, the device's work still queued). On a GPU the first exceeded the weights' read time
    several times over (bench/results/gpu-h200/README.md); these split where it goes."""
    runner = llm.engine.runner
    shape = next(s for s in runner.executables if s.query_block == 1 and s.num_seqs == batch)
    inputs = decode_inputs(runner, batch, context, shape, llm.engine.model_config.vocab_size)
    placed = jax.block_until_ready(jax.device_put(inputs))
    step, on_device, dispatch = [], [], []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        pending = runner.execute(shape, inputs)
        dispatched = time.perf_counter()
        jax.block_until_ready(pending.sampled.token_ids)
        step.append(time.perf_counter() - start)
        dispatch.append(dispatched - start)
        start = time.perf_counter()
        jax.block_until_ready(runner.execute(shape, placed).sampled.token_ids)
        on_device.append(time.perf_counter() - start)
    median = lambda times: round(1e3 * statistics.median(times[2:]), 3)  # noqa: E731
    return dict(step_ms=median(step), step_ms_inputs_on_device=median(on_device), dispatch_ms=median(dispatch))


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


def cpu_description() -> dict:
    """The CPU model, its vector flags and the kernel's instruction path: which machine a figure came from."""
    from pallas_kernels import cpu_library
    from pallas_kernels.matmul import SMALL_MATMUL_MAX_ROWS, cpu, small_matmul_entry

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    vector = sorted(f for f in cpu_library.cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
    # an accelerator's run builds no CPU kernel (the build takes a minute of a lent machine's time)
    kernel = jax.default_backend() == "cpu" and cpu.available()
    max_rows = dict(small_matmul_entry().max_rows) if kernel else {str(d): r for d, r in SMALL_MATMUL_MAX_ROWS.items()}
    return dict(
        cpu_model=model,
        cpu_vector_flags=vector,
        kernel_path=cpu.kernel_path() if kernel else None,
        small_matmul_max_rows=max_rows,
        amx_tiles=kernel and cpu.amx_tiles(),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
    )


def projection_groups(llm, batch: int):
    """The engine's matmul plan, and the model's projections by who serves `batch` rows: "kernel" (the C++
    small matmul) or "xla" (the reference's dots). Each entry is one call as the model makes it: (weights,
    transposed), a layer's q/k/v and gate/up joined where the plan joins them (models/layers.py's
    project_many), every other weight alone (timing each weight alone made 211 kernel calls of a SmolLM2 step's
    121: 90 calls' fixed costs and short items the step does not have, which weigh most in bfloat16)."""
    from flax import nnx

    from jaxserve.models.layers import Linear
    from pallas_kernels.matmul import MatmulPlan, SmallMatmul, kquant_cpu, quantized_cpu

    runner = llm.engine.runner
    model = nnx.merge(runner.graphdef, jax.tree.unflatten(runner.params_treedef, runner.param_leaves))
    linears = [(path, node) for path, node in nnx.iter_graph(model) if isinstance(node, Linear)]
    plan = linears[0][1].matmul
    assert isinstance(plan, MatmulPlan)
    calls: dict[tuple, list] = {}
    for path, linear in linears:
        name = str(path[-1])
        joined = (
            "qkv" if name in ("q_proj", "k_proj", "v_proj") else "gate_up" if name in ("gate_proj", "up_proj") else name
        )
        calls.setdefault((*path[:-1], joined), []).append(linear.kernel[...])
    entries = []
    for weights in calls.values():
        joins = len(weights) > 1 and plan._entry(batch, tuple(weights)).joins_weights
        entries += [(tuple(weights), False)] if joins else [((w,), False) for w in weights]
    config = llm.engine.model_config
    if getattr(config, "tie_word_embeddings", False):  # the embedding serves as the head, transposed
        embedding = next(node for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Embed)).embedding[...]
        # a quantized embedding is stored [E, V], as the head it also is
        entries.append(((embedding,), not hasattr(embedding, "embedding_rows")))
    groups: dict[str, list] = {"kernel": [], "xla": []}
    kernels = (SmallMatmul, quantized_cpu.QuantizedSmallMatmul, kquant_cpu.KQuantSmallMatmul)  # K-quants: theirs
    for weights, transposed in entries:
        served = isinstance(plan._entry(batch, weights), kernels)
        groups["kernel" if served else "xla"].append((weights, transposed))
    return plan, {name: group for name, group in groups.items() if group}


def projections_ms(llm, batch: int, repeats: int) -> dict[str, float]:
    """Median ms of each group of projections (projection_groups) at `batch` rows, every result kept."""
    plan, groups = projection_groups(llm, batch)
    times = {}
    for name, group in groups.items():
        weight_sets = [ws for ws, _ in group]
        flags = tuple(t for _, t in group)
        depth_of = tuple(ws[0].shape[1] if t else ws[0].shape[0] for ws, t in group)
        xs = {d: jnp.ones((batch, d), weight_sets[0][0].dtype) for d in set(depth_of)}

        def run(xs, weight_sets, flags=flags, depth_of=depth_of):
            out = []
            for ws, t, d in zip(weight_sets, flags, depth_of):
                joined = plan.together(xs[d], ws) if len(ws) > 1 else None
                out += list(joined) if joined is not None else [plan(xs[d], w, transposed=t) for w in ws]
            return out

        times[name] = round(1e3 * median_time(jax.jit(run), xs, weight_sets, repeats=repeats), 3)
    return times


def attention_ms(llm, batch: int, context: int, repeats: int) -> float | None:
    """Median ms of the step's attention alone: every layer's paged attention through the CPU kernel over that
    layer's own pages, `batch` rows at `context` keys each (decode_inputs' tables). None where the kernel does
    not serve this engine (not a CPU, quantized pages)."""
    from pallas_kernels.paged_attention import cpu as cpu_attention

    runner = llm.engine.runner
    keys, values = runner.kv_pages.keys, runner.kv_pages.values
    if jax.default_backend() != "cpu" or not cpu_attention.available() or not isinstance(keys[0], jax.Array):
        return None
    config = llm.engine.model_config
    shape = next(s for s in runner.executables if s.query_block == 1 and s.num_seqs == batch)
    attention = decode_inputs(runner, batch, context, shape, config.vocab_size).attention
    tables = [jnp.asarray(a) for a in (attention.page_table, attention.token_seq_ids, attention.positions)]
    q = jnp.ones((len(attention.positions), config.num_heads, config.head_dim), keys[0].dtype)

    def run(q, keys, values, tables):
        return [cpu_attention.ragged_paged_attention(q, k, v, *tables, query_block=1) for k, v in zip(keys, values)]

    return round(1e3 * median_time(jax.jit(run), q, keys, values, tables, repeats=repeats), 3)


def paths_ms(llm, batch: int, repeats: int, activations: str) -> dict[str, float]:
    """Median ms of all the model's projections at `batch` rows through each kernel path this CPU runs and
    through XLA's dots (every result kept): where each should serve, per machine and dtype."""
    from pallas_kernels import cpu_library
    from pallas_kernels.matmul import cpu

    _, groups = projection_groups(llm, batch)
    group = [(w, t) for entries in groups.values() for ws, t in entries for w in ws]
    weights = [w for w, _ in group]
    flags = tuple(t for _, t in group)
    depth_of = tuple(w.shape[1] if t else w.shape[0] for w, t in group)
    xs = {d: jnp.ones((batch, d), weights[0].dtype) for d in set(depth_of)}
    times = {}
    from pallas_kernels.matmul.quantized import untiled

    for path in (*cpu_library.runnable_paths(), "xla"):
        if path != "xla" and batch > cpu.MATMUL_MAX_ROWS:
            continue

        def run(xs, weights, path=path):
            if path == "xla":
                return [project_xla(xs[d], w, t) for w, t, d in zip(weights, flags, depth_of)]
            return [project_path(xs[d], w, t, path, activations) for w, t, d in zip(weights, flags, depth_of)]

        # XLA's dots read the [K, N] form: untiled here, not inside the timed step (quantized_tiles.py)
        path_weights = [untiled(w) for w in weights] if path == "xla" else weights
        times[path] = round(1e3 * median_time(jax.jit(run), xs, path_weights, repeats=repeats), 3)
    return times


def project_xla(x, w, transposed: bool):
    """XLA's dots for a float or a quantized weight (--quantization)."""
    from pallas_kernels.matmul import quantized, reference

    if quantized.is_quantized(w):
        return quantized.matmul(x, w)
    return reference.matmul(x, w, transposed=transposed)


def project_path(x, w, transposed: bool, path: str, activations: str):
    """A kernel path's build for a float or a quantized weight (--quantization, --quantized-activations)."""
    from pallas_kernels.matmul import cpu, kquant, kquant_cpu, quantized, quantized_cpu

    if kquant.is_kquant(w):  # a K-quant file's weights (Q4_K_M): their own kernel
        return kquant_cpu.kquant_matmuls(x, [w], path=path)[0]
    if quantized.is_quantized(w):
        return quantized_cpu.quantized_matmul(x, w, path=path, activations=activations)
    return cpu.small_matmul(x, w, transposed=transposed, path=path)


def weight_bytes(llm) -> int:
    return sum(x.nbytes for x in llm.engine.runner.param_leaves)


def ops_making_pool_arrays(llm, batch: int) -> dict[str, int]:
    """In the compiled decode step, the instructions whose result has a KV layer pool's shape, by opcode (custom
    calls by target): in-place kernels only, or a copy / fusion over the whole pool each step (whose cost follows
    the pool's size, not the context: what a GPU step's extra milliseconds could be)."""
    runner = llm.engine.runner
    shape = next(s for s in runner.executables if s.query_block == 1 and s.num_seqs == batch)
    pool = runner.kv_pages.keys[0]
    pool = getattr(pool, "data", pool)  # a quantized pool's values
    dims = ",".join(str(d) for d in pool.shape)
    found: dict[str, int] = collections.Counter()
    # an instruction's result type (an array, or a tuple of them: a kernel's outputs) and opcode
    pattern = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (\([^=]*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?) ([a-z][\w\-]*)\(")
    for line in runner.executables[shape].as_text().splitlines():
        match = pattern.search(line)
        if match and f"[{dims}]" in match[1]:
            if match[2] in ("parameter", "get-tuple-element", "tuple", "bitcast"):
                continue
            target = re.search(r'custom_call_target="([^"]+)"', line)
            found[f"{match[2]}:{target[1]}" if target else match[2]] += 1
    return dict(found)


def kv_bytes_per_token(llm, context: int) -> int:
    config = llm.engine.model_config
    itemsize = jnp.dtype(llm.engine.runner.kv_pages.keys[0].dtype).itemsize
    return 2 * config.num_layers * context * config.num_kv_heads * config.head_dim * itemsize


def bench_dtype(args, dtype: str, bandwidth: float, prompt: list[int], reader: BandwidthReader) -> None:
    from jaxserve import LLM
    from jaxserve.loading.default_model import resolve_model_path

    llm = LLM(
        resolve_model_path(args.model),
        dtype=dtype,
        max_model_len=512,
        max_num_seqs=max(args.batches),
        decode_seq_buckets=tuple(args.batches),
        prefill_token_buckets=(64, 256),
        max_num_batched_tokens=256,
        show_progress=False,
        quantization=args.quantization,
        quantized_activations=args.quantized_activations,
    )
    prompt = [token % llm.engine.model_config.vocab_size for token in prompt]  # tiny models' small vocabularies
    context = len(prompt) + args.new_tokens // 2
    roof_bytes = weight_bytes(llm) + kv_bytes_per_token(llm, context)
    roofline_tok_s = bandwidth / roof_bytes
    clock = HostClock(llm.engine)
    for round_ in range(args.rounds):
        timings = {b: step_timings(llm, b, context, args.repeats) for b in args.batches}
        step_ms = {b: timings[b]["step_ms"] for b in args.batches}
        tok_s, host, tokens = single_stream(llm, clock, prompt, args.new_tokens, step_ms[1])
        if args.profile:
            for b in args.batches:
                parts = projections_ms(llm, b, args.repeats)
                attention = attention_ms(llm, b, context, args.repeats)
                emit(
                    dtype=dtype,
                    round=round_,
                    batch=b,
                    step_ms=round(step_ms[b], 3),
                    step_ms_per_row=round(step_ms[b] / b, 3),
                    projections_ms=parts,
                    attention_ms=attention,
                    rest_ms=round(step_ms[b] - sum(parts.values()) - (attention or 0.0), 3),
                    **(
                        {"projections_ms_by_path": paths_ms(llm, b, args.repeats, args.quantized_activations)}
                        if args.paths
                        else {}
                    ),
                    **({"traced_step_ms": traced_step_ms(llm, b, context)} if args.trace else {}),
                )
        emit(
            dtype=dtype,
            round=round_,
            **{f"step_ms_batch{b}": round(step_ms[b], 3) for b in args.batches},
            **{f"step_ms_per_row_batch{b}": round(step_ms[b] / b, 3) for b in args.batches},
            step_ms_inputs_on_device_batch1=timings[1]["step_ms_inputs_on_device"],
            dispatch_ms_batch1=timings[1]["dispatch_ms"],
            device_roofline_fraction=round(1e3 / step_ms[1] / roofline_tok_s, 3),
            single_stream_tok_s=round(tok_s, 2),
            roofline_tok_s=round(roofline_tok_s, 2),
            e2e_roofline_fraction=round(tok_s / roofline_tok_s, 3),
            host_ms_per_step=host,
            weight_mb=round(weight_bytes(llm) / 1e6, 1),
            pool_shaped_ops_batch1=ops_making_pool_arrays(llm, 1),
            first_tokens=tokens[:8],
        )
    if args.alternate:
        emit(dtype=dtype, **alternating_roofline(llm, clock, reader, prompt, args, roof_bytes))
    if args.save_trace:
        save_step_trace(llm, context, args.save_trace)
    assert llm.stats()["num_compiles_after_warmup"] == 0


def alternating_roofline(llm, clock, reader, prompt, args, roof_bytes: int) -> dict:
    """Single streams and reads of the memory taking turns (who goes first alternates), each stream's tokens/s
    over the roofline of the read beside it. This VM's bandwidth drifts by a fifth within a minute, so a
    roofline read once at the start misjudges a stream run a minute later, either way."""
    fractions, turns = [], []
    for turn in range(args.alternate):
        if turn % 2:
            tok_s = single_stream(llm, clock, prompt, args.new_tokens, 0.0)[0]
            bandwidth = max(reader.read(5).values())
        else:
            bandwidth = max(reader.read(5).values())
            tok_s = single_stream(llm, clock, prompt, args.new_tokens, 0.0)[0]
        fractions.append(tok_s * roof_bytes / bandwidth)
        turns.append({"single_stream_tok_s": round(tok_s, 2), "read_bandwidth_gb_s": round(bandwidth / 1e9, 2)})
    return dict(
        alternating_turns=len(turns),
        e2e_roofline_fraction_alternating_median=round(statistics.median(fractions), 3),
        e2e_roofline_fraction_alternating_min=round(min(fractions), 3),
        e2e_roofline_fraction_alternating_max=round(max(fractions), 3),
        turns=turns,
    )


def save_step_trace(llm, context: int, path: str) -> None:
    """Five batch-1 decode steps (host inputs, as the engine dispatches them) under the profiler, to `path`."""
    from step_trace import save_trace

    runner = llm.engine.runner
    shape = next(s for s in runner.executables if s.query_block == 1 and s.num_seqs == 1)
    inputs = decode_inputs(runner, 1, context, shape, llm.engine.model_config.vocab_size)
    save_trace(lambda: jax.block_until_ready(runner.execute(shape, inputs).sampled.token_ids), path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="a path, 'default' or 'tiny-random'")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--batches", default="1,8,32", help="decode batch sizes (the engine's decode buckets)")
    parser.add_argument(
        "--alternate",
        type=int,
        default=0,
        help="then N single streams each beside its own read of the memory: the median end-to-end roofline fraction",
    )
    parser.add_argument("--profile", action="store_true", help="split each step: kernel / XLA projections, rest")
    parser.add_argument(
        "--quantization", default="none", help="model.quantization: none, int8, int4, auto (a GGUF file's blocks)"
    )
    parser.add_argument(
        "--quantized-activations",
        default="int8",
        choices=("int8", "float"),
        help="the engine option quantized_activations: the CPU quantized kernel's x as int8 per 32 or float",
    )
    parser.add_argument(
        "--save-trace", default=None, help="write a perfetto trace (.json.gz) of five batch-1 decode steps here"
    )
    parser.add_argument("--paths", action="store_true", help="with --profile: projections through every kernel path")
    parser.add_argument(
        "--trace", action="store_true", help="with --profile: the step's ms by kind of op from XLA's trace"
    )
    args = parser.parse_args()
    args.batches = sorted({1, *(int(b) for b in args.batches.split(","))})
    reader = BandwidthReader()
    bandwidths = reader.read()
    bandwidth = max(bandwidths.values())
    emit(
        bench="decode_step",
        model=args.model,
        read_bandwidth_gb_s=round(bandwidth / 1e9, 2),
        read_bandwidth_gb_s_by_reader={name: round(b / 1e9, 2) for name, b in bandwidths.items()},
        jax=jax.__version__,
        python=sys.version.split()[0],
        **cpu_description(),
    )
    prompt = np.random.default_rng(0).integers(100, 10000, size=args.prompt_tokens).tolist()
    for dtype in args.dtypes.split(","):
        bench_dtype(args, dtype, bandwidth, prompt, reader)


if __name__ == "__main__":
    restart_with_step_allocator()  # as `python -m jaxserve.serve` runs (jaxserve/step_allocator.py)
    main()
