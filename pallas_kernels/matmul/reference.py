"""Projections with XLA's own dots: the specification every matmul kernel is tested against, on any
backend and for any dtype.

Written the way XLA:CPU computes them best, which the other backends do not mind: a 16-bit weight is
contracted where it lies, asking for float32 results, with at least two rows. XLA:CPU gives such a dot
its YNNPACK fusion, which reads the weight at its stored width; a one-row dot (a matrix-vector product)
or a dot of the weight's transpose would widen the whole weight to float32 first, every step (issue #16).
A float32 tied head keeps jnp.dot(x, embedding.T), as nnx's Embed.attend computes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.matmul import panels


def matmul(rows, weight, *, transposed: bool = False):
    """rows [M, K] @ weight [K, N] (weight [N, K] when transposed; or the [K, N] weight in ColumnPanels,
    panels.py) -> float32 [M, N]; rows in the weight's dtype."""
    if panels.is_panels(weight):
        if transposed:
            raise ValueError("a ColumnPanels weight is [K, N]: it cannot be contracted transposed")
        return panels.matmul(rows, weight)
    num_rows = rows.shape[0]
    if num_rows == 1 and weight.dtype != jnp.float32:
        rows = jnp.pad(rows, ((0, 1), (0, 0)))
    if transposed and weight.dtype == jnp.float32:
        y = jnp.dot(rows, weight.T)
    else:
        contracting = (1,) if transposed else (0,)
        y = jax.lax.dot_general(rows, weight, (((1,), contracting), ((), ())), preferred_element_type=jnp.float32)
    if y.shape[0] != num_rows:
        y = y[:num_rows]
    return y


def dot_operand_dtype(dtype):
    """The operands' dtype of a quantized weight's reference dot into float32 (quantized.py, kquant.py): XLA:CPU
    has no 16-bit dot into float32 for those (DotThunk: "BF16 x BF16 = F32" unimplemented: a tensor-parallel
    bfloat16 engine's int8 prefill raised), so on the CPU, where the C++ kernels serve one device and this is a
    mesh's path, float32; elsewhere the rows' own."""
    return jnp.float32 if jax.default_backend() == "cpu" else dtype
