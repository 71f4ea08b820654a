"""Quantized decode projections on an accelerator: bytes read per second against the measured read bandwidth.

For a Llama-3-8B layer's weight shapes (and its head) at 1, 8 and 32 rows: a bfloat16 weight by XLA's dot,
and int8 (per channel) and 4-bit (Q4_0: groups of 32, float16 scales) weights by XLA's dots (the reference,
quantized.py) and by the Pallas kernel (quantized_gpu.py). Each time is one call's share of a compiled
function that runs several copies of the weight (more bytes than the GPU's L2 holds, so each call reads
from memory); the fraction is the weight's stored bytes over that time over the bandwidth of a plain
jitted sum in the same run. Also: each kernel's largest error against the reference. Prints JSON lines.

    python bench/quantized_gpu_matmul.py [--rows 1,8,32] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_time

from pallas_kernels.matmul import quantized, quantized_gpu
from pallas_kernels.matmul.quantized import QuantizedWeight

SHAPES = {"q_o": (4096, 4096), "gate_up": (4096, 14336), "down": (14336, 4096)}
HEAD = {"head": (4096, 128256)}
QUICK_SHAPES = {"q_o": (512, 512), "down": (1024, 256)}


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def seconds_per_copy(fn, x, weights, repeats: int, **where):
    """Median seconds of `fn(x, weight)` a copy, all copies in one compiled call (None, and a line saying why,
    where it does not compile: a kernel configuration the GPU refuses is a result, not a crash)."""
    timed = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
    try:
        return median_time(timed, x, weights, repeats=repeats) / len(weights)
    except Exception as error:  # noqa: BLE001
        emit(**where, error=str(error)[:300])
        return None


def weight_copies(key, depth: int, columns: int, min_bytes: int) -> list:
    """Copies of random_weights (the first from `key`) whose int8 bytes reach min_bytes (at most 16): a timed call
    reads past the GPU's L2."""
    one = random_weights(key, depth, columns)
    copies = max(1, min(16, -(-min_bytes // one[1].nbytes)))
    return [one] + [random_weights(jax.random.fold_in(key, c), depth, columns) for c in range(1, copies)]


def read_bandwidth(num_bytes: int) -> dict[str, float]:
    """Bytes per second of a jitted sum (bytes read) and of a copy (bytes read and written: what the memory
    moves, near the datasheet's figure on a GPU, where one sum reads at about half of it)."""
    x = jnp.ones(num_bytes // 4, jnp.float32)
    return dict(
        sum=num_bytes / median_time(jax.jit(jnp.sum), x, repeats=20),
        copy=2 * num_bytes / median_time(jax.jit(lambda v: v + 1), x, repeats=20),
    )


def random_weights(rng, depth: int, columns: int):
    """The same random matrix as bfloat16, int8 per channel and Q4_0 (random integers: speed does not depend on
    the values, and building them on the device keeps the host out of it)."""
    k1, k2, k3, k4 = jax.random.split(rng, 4)
    dense = (jax.random.normal(k1, (depth, columns), jnp.float32) * 0.02).astype(jnp.bfloat16)
    int8 = QuantizedWeight(
        jax.random.randint(k2, (depth, columns), -127, 128, jnp.int8),
        jax.random.uniform(k3, (1, columns), jnp.float32, 1e-4, 2e-4),
        None,
        bits=8,
        group_size=depth,
        compute_dtype="bfloat16",
    )
    int4 = QuantizedWeight(
        jax.random.randint(k4, (depth // 2, columns), 0, 256, jnp.int32).astype(jnp.uint8),
        jax.random.uniform(k3, (depth // 32, columns), jnp.float32, 1e-3, 2e-3).astype(jnp.float16),
        None,
        bits=4,
        group_size=32,
        compute_dtype="bfloat16",
    )
    return dense, int8, int4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--quick", action="store_true", help="small shapes (a CPU, interpret mode)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--min-bytes", type=int, default=512 << 20, help="bytes of weight copies a timed call reads")
    parser.add_argument("--sweep", action="store_true", help="the Pallas kernel's column blocks and programs a core")
    args = parser.parse_args()
    shapes = QUICK_SHAPES if args.quick else {**SHAPES, **HEAD}
    min_bytes = (4 << 20) if args.quick else args.min_bytes
    bandwidths = read_bandwidth(4 * min_bytes)
    bandwidth = max(bandwidths.values())
    emit(
        bench="quantized_gpu_matmul",
        backend=jax.default_backend(),
        device=str(jax.devices()[0]),
        bandwidth_gb_s={name: round(b / 1e9, 1) for name, b in bandwidths.items()},
        jax=jax.__version__,
    )
    if args.sweep:
        return sweep(args, bandwidth, min_bytes)
    variants = {
        "bf16_xla": lambda x, w: jnp.dot(x, w[0], preferred_element_type=jnp.float32),
        "int8_xla": lambda x, w: quantized.matmul(x, w[1]),
        "int8_pallas": lambda x, w: quantized_gpu.quantized_matmul(x, w[1]),
        "q4_0_xla": lambda x, w: quantized.matmul(x, w[2]),
        "q4_0_pallas": lambda x, w: quantized_gpu.quantized_matmul(x, w[2]),
    }
    key = jax.random.PRNGKey(0)
    for name, (depth, columns) in shapes.items():
        weights = weight_copies(key, depth, columns, min_bytes)
        one, copies = weights[0], len(weights)
        bytes_of = {
            v: (one[0].nbytes if v.startswith("bf16") else one[1 if "int8" in v else 2].nbytes) for v in variants
        }
        for num_rows in (int(r) for r in args.rows.split(",")):
            x = (jax.random.normal(jax.random.fold_in(key, num_rows), (num_rows, depth)) * 1.0).astype(jnp.bfloat16)
            results = {}
            for variant, fn in variants.items():
                seconds = seconds_per_copy(fn, x, weights, args.repeats, shape=name, rows=num_rows, variant=variant)
                if seconds is None:
                    continue
                results[variant] = fn(x, one)
                emit(
                    shape=name,
                    rows=num_rows,
                    variant=variant,
                    us=round(seconds * 1e6, 2),
                    weight_mb=round(bytes_of[variant] / 1e6, 2),
                    gb_s=round(bytes_of[variant] / seconds / 1e9, 1),
                    fraction_of_bandwidth=round(bytes_of[variant] / seconds / bandwidth, 3),
                    copies=copies,
                )
            for bits in ("int8", "q4_0"):
                if f"{bits}_xla" in results and f"{bits}_pallas" in results:
                    want = np.asarray(results[f"{bits}_xla"], np.float64)
                    got = np.asarray(results[f"{bits}_pallas"], np.float64)
                    emit(
                        shape=name,
                        rows=num_rows,
                        check=bits,
                        max_error_relative=float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)),
                    )


def sweep(args, bandwidth: float, min_bytes: int) -> None:
    """The kernel's knobs (column block, programs a core) at a few shapes, one row and 32; each line a
    configuration's time and fraction of the bandwidth. (Session 23 also swept a vector product for one row
    and several groups a loop step: slower or no better, removed.)"""
    key = jax.random.PRNGKey(1)
    shapes = QUICK_SHAPES if args.quick else {"gate_up": SHAPES["gate_up"], "q_o": SHAPES["q_o"]}
    grid = [
        dict(block_columns=columns, programs_per_core=programs) for columns in (32, 64, 128) for programs in (2, 4, 16)
    ]
    for name, (depth, columns) in shapes.items():
        weights = weight_copies(key, depth, columns, min_bytes)
        for num_rows in (1, 32) if name != "q_o" else (1,):
            x = jax.random.normal(jax.random.fold_in(key, num_rows), (num_rows, depth)).astype(jnp.bfloat16)
            for fmt, index in (("int8", 1), ("q4_0", 2)):
                for config in grid:
                    kernel = functools.partial(quantized_gpu.quantized_matmul, **config)
                    fn = lambda x, w, kernel=kernel, index=index: kernel(x, w[index])  # noqa: E731
                    where = dict(shape=name, rows=num_rows, format=fmt, **config)
                    seconds = seconds_per_copy(fn, x, weights, 10, **where)
                    if seconds is not None:
                        fraction = weights[0][index].nbytes / seconds / bandwidth
                        emit(**where, us=round(seconds * 1e6, 2), fraction_of_bandwidth=round(fraction, 3))


if __name__ == "__main__":
    main()
