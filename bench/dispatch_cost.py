"""What dispatching one decode step costs the host thread, and which of its arguments the cost follows (issue #29).

A batch-1 decode step of the default model is dispatched back to back (overlapped, as the engine does:
step N+1 is called while step N runs). Between two steps, while one runs on the kernel's two workers, one
probe is dispatched: a trivial compiled function taking some of the real step's arguments (the params,
the KV pools donated and returned, the step's host inputs, ...). Each call's cost is the host thread's CPU
time (`time.thread_time`), which the load of other processes does not inflate the way wall time is; under
a running step the host's data is cold in cache and the memory bus is full, so these are the costs that
matter to the engine, several times those of the same calls on an idle core.

    .venv/bin/python bench/dispatch_cost.py [--dtype float32] [--seconds 40] [--idle]

With --idle the probes run back to back with no step running (warm caches, a free core): the contrast
shows how much of the cost is the running step's. Prints one JSON line: median and 10th-percentile ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from decode_step import decode_inputs


def first_scalar(arrays):
    """A float32 sum of one element of each array: a use of every argument that costs nothing to run."""
    return sum(x.ravel()[0].astype(jnp.float32) for x in jax.tree.leaves(arrays))


def rewritten(arrays):
    """Every array as a new output (what a step does to the KV pools it donates)."""
    return jax.tree.map(lambda x: x + 0, arrays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--idle", action="store_true", help="probes with no step running")
    args = parser.parse_args()

    from jaxserve import LLM
    from jaxserve.device.runner import ModelRunner
    from jaxserve.loading.default_model import resolve_model_path

    llm = LLM(
        resolve_model_path("default"),
        dtype=args.dtype,
        max_model_len=512,
        max_num_seqs=1,
        decode_seq_buckets=(1,),
        prefill_token_buckets=(64,),
        max_num_batched_tokens=64,
        show_progress=False,
    )
    runner = cast(ModelRunner, llm.engine.runner)
    shape = next(s for s in runner.executables if s.query_block == 1 and s.num_seqs == 1)
    inputs = decode_inputs(runner, 1, 100, shape, llm.engine.model_config.vocab_size)
    params = runner.param_leaves
    # The probes' own KV pools (two pages each, same count and dtypes as the real ones) and buffers.
    state = {
        "kv": jax.tree.map(lambda x: x[:2].copy(), runner.kv_pages),
        "buffers": jax.tree.map(lambda x: x.copy(), runner.buffers),
    }

    def compiled(fn, *example, donate=()):
        return jax.jit(fn, donate_argnums=donate).lower(*example).compile()

    whole = compiled(
        lambda p, kv, b, i: (first_scalar((p, i)), rewritten(kv), rewritten(b)),
        params,
        state["kv"],
        state["buffers"],
        inputs,
        donate=(1, 2),
    )
    only_params = compiled(first_scalar, params)
    kv_read = compiled(first_scalar, state["kv"])
    kv_returned = compiled(rewritten, state["kv"], donate=(0,))
    only_inputs = compiled(first_scalar, inputs)
    packed = np.zeros(sum(x.size for x in jax.tree.leaves(inputs)), np.int32)
    one_array = compiled(lambda x: x[0] + 1, packed)
    sixty_outputs = compiled(lambda x: [x + i for i in range(60)], np.zeros(8, np.float32))
    eight = np.zeros(8, np.float32)

    def whole_probe():
        outputs = whole(params, state["kv"], state["buffers"], inputs)
        state["kv"], state["buffers"] = outputs[1], outputs[2]
        return outputs

    def kv_returned_probe():
        state["kv"] = kv_returned(state["kv"])
        return state["kv"]

    n_params, n_kv, n_inputs = len(params), len(jax.tree.leaves(state["kv"])), len(jax.tree.leaves(inputs))
    probes = {
        f"same arguments as the step ({n_params} params, {n_kv} KV donated and returned, {n_inputs} numpy inputs)": (
            whole_probe
        ),
        f"{n_params} params": lambda: only_params(params),
        f"{n_kv} KV pools read": lambda: kv_read(state["kv"]),
        f"{n_kv} KV pools donated and returned": kv_returned_probe,
        f"{n_inputs} numpy step inputs": lambda: only_inputs(inputs),
        "one numpy array (the inputs packed)": lambda: one_array(packed),
        "one tiny array in, 60 out": lambda: sixty_outputs(eight),
    }
    kv, buffers = runner.kv_pages, runner.buffers

    def real_step():
        nonlocal kv, buffers
        sampled, _, _, kv, buffers = runner.executables[shape](params, kv, buffers, inputs)[:5]
        return sampled.token_ids

    seconds: dict[str, list[float]] = {name: [] for name in ["the real step", *probes]}
    previous = real_step()
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        for name, probe in probes.items():
            start = time.thread_time()
            running = real_step()
            seconds["the real step"].append(time.thread_time() - start)
            jax.block_until_ready(previous)
            previous = running
            if args.idle:
                jax.block_until_ready(previous)
                probe()  # warms the caches that the step evicted
            else:
                time.sleep(0.002)  # well inside the running step
            start = time.thread_time()
            result = probe()
            seconds[name].append(time.thread_time() - start)
            jax.block_until_ready(result)
    jax.block_until_ready(previous)
    report = {
        name: {"median_ms": round(1e3 * statistics.median(xs), 3), "p10_ms": round(1e3 * sorted(xs)[len(xs) // 10], 3)}
        for name, xs in seconds.items()
    }
    print(json.dumps({"dtype": args.dtype, "calls_each": len(seconds["the real step"]) // len(probes), **report}))


if __name__ == "__main__":
    main()
