"""The on-device sampler alone (device/sampler.py's `sample`, compiled): ms per call over [S, V] logits for
greedy, temperature-only and top-p / top-k / min-p rows, on peaked rows (a trained model's usual: the nucleus is a
few tokens) and flat rows (the nucleus passes the 256 candidates: whole-row thresholds). Three samplers in the
same run: the CPU kernel (pallas_kernels/sampling, what the CPU runs), the jax.numpy reference (what other
backends run), and the sampler they replaced (Gumbel noise over the whole row, a sort of the row for any filter).
First, each one's compile time for one shape (what it adds to every step executable at warm-up).

    .venv/bin/python bench/sampling.py [--vocab 49152] [--rows 1,8,64]

Prints JSON lines: ms for each (rows, case) and sampler, and the ratios to the kernel.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_time

from jaxserve.device.sampler import SamplingInputs, first_argmax, sample
from jaxserve.device.sampling_inputs import neutral_sampling_inputs
from jaxserve.models.layers import row_softmax
from jaxserve.step_allocator import restart_with_step_allocator
from pallas_kernels.sampling import cpu as cpu_sampler

CASES = {  # name: (temperature, top_k, top_p, min_p)
    "greedy": (0.0, 0, 1.0, 0.0),
    "temperature": (0.8, 0, 1.0, 0.0),
    "top_p_0.9": (0.8, 0, 0.9, 0.0),
    "top_k_40": (0.8, 40, 1.0, 0.0),
    "min_p_0.05": (0.8, 0, 1.0, 0.05),
}


def previous_sampler(logits, inputs: SamplingInputs):
    """The sampler before session 34: a full sort for any filter, Gumbel noise over the row (token ids only)."""
    greedy = first_argmax(logits)
    is_random = inputs.temperature > 0
    scaled = logits / jnp.where(is_random, inputs.temperature, 1.0)[:, None]

    def filtered(x):
        order = jnp.argsort(-x, axis=-1)
        sorted_logits = jnp.take_along_axis(x, order, axis=-1)
        rank = jnp.arange(x.shape[-1])[None, :]
        keep = (inputs.top_k[:, None] <= 0) | (rank < inputs.top_k[:, None])
        probs = row_softmax(jnp.where(keep, sorted_logits, -jnp.inf))
        keep &= (jnp.cumsum(probs, axis=-1) - probs) < inputs.top_p[:, None]
        keep &= probs >= inputs.min_p[:, None] * probs[:, :1]
        keep |= rank == 0
        rows = jnp.arange(x.shape[0])[:, None]
        return jnp.full_like(x, -jnp.inf).at[rows, order].set(jnp.where(keep, sorted_logits, -jnp.inf))

    needs_filter = jnp.any(is_random & ((inputs.top_k > 0) | (inputs.top_p < 1) | (inputs.min_p > 0)))
    scaled = jax.lax.cond(needs_filter, filtered, lambda x: x, scaled)

    keys = jax.vmap(lambda seed, index: jax.random.fold_in(jax.random.wrap_key_data(seed), index))(
        inputs.seeds, inputs.token_indices
    )

    def draw():
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(keys)
        return jnp.where(is_random, first_argmax(scaled + gumbel), greedy)

    return jax.lax.cond(jnp.any(is_random), draw, lambda: greedy)


def inputs_for(rows: int, case: tuple) -> SamplingInputs:
    temperature, top_k, top_p, min_p = case
    seeds = np.stack([np.zeros(rows, np.uint32), np.arange(rows, dtype=np.uint32)], axis=1)
    return neutral_sampling_inputs(rows, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    samplers = {
        "kernel": lambda logits, inputs: sample(logits, inputs, 0, cpu_kernel=True).token_ids,
        "reference": lambda logits, inputs: sample(logits, inputs, 0, cpu_kernel=False).token_ids,
        "previous": previous_sampler,
    }
    example = (jnp.zeros((8, args.vocab)), jax.device_put(inputs_for(8, CASES["top_p_0.9"])))
    compile_seconds = {}
    if not cpu_sampler.available():  # built (or loaded) before any timing
        raise SystemExit("the CPU sampler kernel does not build here")
    for name, sampler in samplers.items():  # a fresh function each: nothing cached in this process
        start = time.perf_counter()
        jax.jit(lambda *a, sampler=sampler: sampler(*a)).lower(*example).compile()
        compile_seconds[name] = round(time.perf_counter() - start, 3)
    print(json.dumps(dict(compile_seconds_8_rows=compile_seconds, vocab=args.vocab)), flush=True)
    compiled = {name: jax.jit(sampler) for name, sampler in samplers.items()}
    for rows in (int(r) for r in args.rows.split(",")):
        noise = rng.standard_normal((rows, args.vocab)).astype(np.float32)
        shapes = {"peaked": noise * 3.0, "flat": noise * 0.3}  # nucleus at 0.9: ~10 tokens / ~30 K tokens
        for shape, logits in shapes.items():
            logits = jnp.asarray(logits)
            for case_name, case in CASES.items():
                if shape == "flat" and case_name == "greedy":
                    continue
                inputs = jax.device_put(inputs_for(rows, case))
                ms = {
                    name: median_time(run, logits, inputs, repeats=args.repeats) * 1e3 for name, run in compiled.items()
                }
                record = dict(rows=rows, logits=shape, case=case_name) | {f"{n}_ms": round(t, 3) for n, t in ms.items()}
                ratios = {f"{n}_over_kernel": round(t / ms["kernel"], 2) for n, t in ms.items() if n != "kernel"}
                print(json.dumps(record | ratios), flush=True)


if __name__ == "__main__":
    restart_with_step_allocator()  # as `python -m jaxserve.serve` runs (jaxserve/step_allocator.py)
    main()
