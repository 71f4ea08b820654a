"""The CPU small matmul against XLA's dots on SmolLM2-135M's projections (session 16, docs/notes/cpu-kernels.md):
30 layers' calls as the engine joins them (q/k/v, o, gate/up, down) and the tied head read transposed, random
weights, at each number of rows: median ms of one jit each, the head alone too. Prints JSON lines.

    PYTHONPATH=. .venv/bin/python bench/small_matmul_vs_xla.py float32,bfloat16 16,32,64
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from timing import median_time  # noqa: E402

from pallas_kernels.matmul import cpu, reference  # noqa: E402

EMBED, KV, MLP, VOCAB, LAYERS = 576, 192, 1536, 49152, 30


def main(dtypes: str, row_counts: str) -> None:
    rng = np.random.default_rng(0)
    for name in dtypes.split(","):
        dtype = jnp.dtype(name)

        def weight(*shape, dtype=dtype):
            return jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, dtype)

        layers = [
            ((weight(EMBED, EMBED), weight(EMBED, KV), weight(EMBED, KV)), (weight(EMBED, EMBED),))
            + ((weight(EMBED, MLP), weight(EMBED, MLP)), (weight(MLP, EMBED),))
            for _ in range(LAYERS)
        ]
        head = weight(VOCAB, EMBED)

        def kernel(xs, layers, head):
            out = [cpu.small_matmuls(xs[ws[0].shape[0]], ws) for layer in layers for ws in layer]
            return out, cpu.small_matmuls(xs[EMBED], (head,), transposed=True)

        def xla(xs, layers, head):
            out = [[reference.matmul(xs[w.shape[0]], w) for w in ws] for layer in layers for ws in layer]
            return out, reference.matmul(xs[EMBED], head, transposed=True)

        def kernel_head(xs, head):
            return cpu.small_matmuls(xs[EMBED], (head,), transposed=True)

        def xla_head(xs, head):
            return reference.matmul(xs[EMBED], head, transposed=True)

        for rows in [int(r) for r in row_counts.split(",")]:
            xs = {d: jnp.asarray(rng.standard_normal((rows, d)), dtype) for d in (EMBED, MLP)}
            record: dict[str, str | int | float] = dict(dtype=name, rows=rows)
            record["kernel_all_ms"] = 1e3 * median_time(jax.jit(kernel), xs, layers, head, repeats=7)
            record["xla_all_ms"] = 1e3 * median_time(jax.jit(xla), xs, layers, head, repeats=7)
            record["kernel_head_ms"] = 1e3 * median_time(jax.jit(kernel_head), xs, head, repeats=7)
            record["xla_head_ms"] = 1e3 * median_time(jax.jit(xla_head), xs, head, repeats=7)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in record.items()}), flush=True)


if __name__ == "__main__":
    main(*(sys.argv[1:3] if len(sys.argv) > 2 else ("float32", "16,32,64")))
