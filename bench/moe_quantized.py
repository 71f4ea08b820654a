"""The grouped expert matmul with quantized experts against the float one, same process: rows sorted by expert
times [X, K, N] experts, as each MoE projection runs it (sharding/moe.py's grouped_expert_mlp).

    float      jax.lax.ragged_dot on float32 experts (the float path; XLA:CPU lowers it densely: every row
               masked against every expert, one dot over X * K)
    dequant    ragged_dot on the quantized experts dequantized in the step (the naive quantized path)
    int8/int4  pallas_kernels/matmul/quantized_experts.grouped_matmul: a loop over experts, one expert
               dequantized at a time, experts without rows skipped

Shapes: a Mixtral-like projection scaled down (X = 8, K = 1024, N = 2048, top 2), decode-sized (16 rows) and
prefill-sized (128 rows) groups, every expert routed to or only two. Prints JSON lines (median of 5).

    .venv/bin/python bench/moe_quantized.py [--experts 8 --depth 1024 --columns 2048]
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_time

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from jaxserve.loading.quantize import quantize_int4, quantize_int8, stack  # noqa: E402
from pallas_kernels.matmul.quantized import dequantize  # noqa: E402
from pallas_kernels.matmul.quantized_experts import grouped_matmul  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--depth", type=int, default=1024)
    parser.add_argument("--columns", type=int, default=2048)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    experts = rng.standard_normal((args.experts, args.depth, args.columns)).astype(np.float32) * 0.05
    weights = {
        "float": jnp.asarray(experts),
        "int8": jax.tree.map(jnp.asarray, stack([quantize_int8(w, "float32") for w in experts])),
        "int4": jax.tree.map(jnp.asarray, stack([quantize_int4(w, 32, "float32") for w in experts])),
    }
    paths = {
        "float": jax.jit(lambda rows, sizes, w: jax.lax.ragged_dot(rows, w, sizes)),
        "dequant": jax.jit(lambda rows, sizes, w: jax.lax.ragged_dot(rows, dequantize(w, rows.dtype), sizes)),
        "grouped": jax.jit(lambda rows, sizes, w: grouped_matmul(rows, w, sizes)),
    }
    for num_rows in (16, 128):
        rows = jnp.asarray(rng.standard_normal((num_rows, args.depth)), jnp.float32)
        for used in (args.experts, 2):
            sizes = jnp.asarray(np.bincount(rng.integers(0, used, num_rows), minlength=args.experts).astype(np.int32))
            record = dict(rows=num_rows, experts_routed_to=used, shape=[args.experts, args.depth, args.columns])
            record["float_ms"] = 1e3 * median_time(paths["float"], rows, sizes, weights["float"])
            for fmt in ("int8", "int4"):
                record[f"{fmt}_dequantize_then_ragged_dot_ms"] = 1e3 * median_time(
                    paths["dequant"], rows, sizes, weights[fmt]
                )
                record[f"{fmt}_grouped_ms"] = 1e3 * median_time(paths["grouped"], rows, sizes, weights[fmt])
            record = {k: round(v, 2) if isinstance(v, float) else v for k, v in record.items()}
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
