"""The CPU quantized matmul's two kernels A/B in one process: float activations (cpu_quantized_matmul.cc: weights
widened to float32, FMAs) vs int8 activations (cpu_quantized_int8_dot.cc: x quantized per 32 k, integer dots),
on one SmolLM2-135M decode step's projections (30 layers: q/k/v joined, o, gate/up joined, down; the tied
49152-column head), random weights in the Q8_0 layout (int8, groups of 32, float16 scales) and the Q4_0 layout
(4-bit, offset 8). The kernels take turns within each repeat, so load drift on a shared machine hits both.
Prints one JSON line per (layout, rows): medians of `--repeats` in ms and the ratio.

`--prefill-rows 64,256,512` instead: prefill chunks, one weight of each SmolLM2-135M shape at a time, the int8
kernel in one call vs in 64-row calls (session 11's limit) vs XLA's reference with the same int8 rounding of x
(quantized.py + int8_activations.py: what the plan used past 64 rows); best of `--repeats` in ms.

    .venv/bin/python bench/quantized_activations.py [--rows 1,8,48] [--repeats 9] [--prefill-rows 64,512]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from pallas_kernels.matmul import quantized, quantized_cpu  # noqa: E402
from pallas_kernels.matmul.quantized import QuantizedWeight  # noqa: E402

HIDDEN, INTERMEDIATE, VOCAB, LAYERS, KV_COLUMNS = 576, 1536, 49152, 30, 192  # SmolLM2-135M


def random_weight(rng, depth: int, columns: int, bits: int) -> QuantizedWeight:
    if bits == 8:
        values = rng.integers(-127, 128, (depth, columns)).astype(np.int8)
    else:
        values = rng.integers(0, 256, (depth // 2, columns)).astype(np.uint8)
    scales = jnp.asarray(rng.uniform(1e-3, 2e-2, (depth // 32, columns)), jnp.float16)
    return QuantizedWeight(jnp.asarray(values), scales, None, bits=bits, group_size=32)


def step_weights(rng, bits: int):
    def layer():
        return [
            tuple(random_weight(rng, HIDDEN, n, bits) for n in (HIDDEN, KV_COLUMNS, KV_COLUMNS)),
            (random_weight(rng, HIDDEN, HIDDEN, bits),),
            tuple(random_weight(rng, HIDDEN, INTERMEDIATE, bits) for _ in range(2)),
            (random_weight(rng, INTERMEDIATE, HIDDEN, bits),),
        ]

    return [layer() for _ in range(LAYERS)], (random_weight(rng, HIDDEN, VOCAB, bits),)


def step_function(activations: str):
    @jax.jit
    def step(x, layers, head):
        carry = jnp.zeros((), jnp.float32)  # a data dependence between the calls, as a real step has
        for layer in layers:
            for weights in layer:
                rows = x if weights[0].shape[0] == HIDDEN else jnp.tile(x, (1, 3))[:, :INTERMEDIATE]
                outs = quantized_cpu.quantized_matmuls(rows + carry, weights, activations=activations)
                carry = carry + outs[0][0, 0] * 1e-9
        return quantized_cpu.quantized_matmuls(x + carry, head, activations=activations)[0]

    return step


def in_64_row_calls(x, weight):
    calls = [quantized_cpu.quantized_matmul(x[r0 : r0 + 64], weight) for r0 in range(0, x.shape[0], 64)]
    return jnp.concatenate(calls, axis=0)


def prefill(rng, rows: list[int], repeats: int) -> None:
    kernels = {
        "kernel": jax.jit(quantized_cpu.quantized_matmul),
        "kernel_64_row_calls": jax.jit(in_64_row_calls),
        "reference": jax.jit(lambda x, w: quantized.matmul(x, w, activations="int8")),
    }
    for layout, bits in (("Q8_0", 8), ("Q4_0", 4)):
        for depth, columns in ((HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, KV_COLUMNS)):
            weight = random_weight(rng, depth, columns, bits)
            for num_rows in rows:
                x = jnp.asarray(rng.standard_normal((num_rows, depth)), jnp.float32)
                for kernel in kernels.values():
                    kernel(x, weight).block_until_ready()
                times = {name: [] for name in kernels}
                for _ in range(repeats):
                    for name, kernel in kernels.items():  # taking turns: load drift hits all three
                        start = time.perf_counter()
                        kernel(x, weight).block_until_ready()
                        times[name].append(1e3 * (time.perf_counter() - start))
                best = {f"{name}_ms": round(min(values), 3) for name, values in times.items()}
                record = dict(layout=layout, K=depth, N=columns, rows=num_rows, **best)
                record["reference_over_kernel"] = round(best["reference_ms"] / best["kernel_ms"], 2)
                print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,48")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--prefill-rows", default=None, help="e.g. 64,256,512: prefill chunks instead")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    if args.prefill_rows:
        prefill(rng, [int(r) for r in args.prefill_rows.split(",")], args.repeats)
        return
    kernels = {name: step_function(name) for name in ("float", "int8")}
    for layout, bits in (("Q8_0", 8), ("Q4_0", 4)):
        layers, head = step_weights(rng, bits)
        for num_rows in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((num_rows, HIDDEN)), jnp.float32)
            for kernel in kernels.values():
                kernel(x, layers, head).block_until_ready()
            times = {name: [] for name in kernels}
            for _ in range(args.repeats):
                for name, kernel in kernels.items():
                    start = time.perf_counter()
                    kernel(x, layers, head).block_until_ready()
                    times[name].append(1e3 * (time.perf_counter() - start))
            medians = {name: float(np.median(values)) for name, values in times.items()}
            record = dict(layout=layout, rows=num_rows, float_ms=round(medians["float"], 2))
            record |= dict(int8_ms=round(medians["int8"], 2), speedup=round(medians["float"] / medians["int8"], 3))
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
