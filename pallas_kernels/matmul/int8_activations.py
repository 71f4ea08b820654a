"""x rounded to int8 per 32 k as the CPU int8-activation kernels round it (llama.cpp's quantize_row_q8_0), in
XLA ops: what the quantized references (quantized.py, kquant.py) project when the engine runs with
`quantized_activations: int8`, so a prefill chunk over the kernels' 64 rows computes what the kernels compute
for decode rows (and llama.cpp for every row) rather than the float product.

Why it matters: rounding x to a grid makes the result a step function of x. A perturbation far below float
rounding noise (an attention computed in another order) moves some values across a rounding boundary, each
such move a whole step (1/254 of the block's largest |x|). So two engines agree on quantized models only as
far as they round the same x the same way; mixing float x (prefill) and int8 x (decode) in one request is a
difference of the size of the quantization itself. docs/notes/quantization.md, "Session 11", has the figures.

Per chunk of up to 32 k within a weight group (a group of 16 gives chunks of 16; a per-channel group of K,
chunks of 32 and a shorter last one): d = max|x| / 127, q = x * (1 / d) rounded half away from zero (C's
roundf), and the fake-quantized x = q * d, with d rounded to float16 as ggml's q8_0 / q8_1 blocks hold it
(`half_d`, cpu_quantized_int8_dot.cc) or kept in float32 (`half_d=False`, cpu_kquant_matmul.cc's
QuantizedRows). Products of these values with the weights are exact-integer-times-scale in float32 up to
the order of additions.
"""

from __future__ import annotations

import jax.numpy as jnp

CHUNK = 32  # k per activation block (ggml's QK8_0)
FLOAT16_MAX = 65504.0


def round_half_away(v):
    """C's roundf: to the nearest integer, halves away from zero (jnp.round rounds halves to even). Exact:
    v - trunc(v) has no rounding error."""
    whole = jnp.trunc(v)
    return whole + jnp.where(jnp.abs(v - whole) >= 0.5, jnp.sign(v), 0.0)


def as_half(v):
    """v rounded to float16 where float16 holds it (the kernels keep the float32 value beyond its range)."""
    return jnp.where(jnp.abs(v) <= FLOAT16_MAX, v.astype(jnp.float16).astype(jnp.float32), v)


def fake_quantize(rows, group: int, *, half_d: bool = True):
    """rows [M, K] -> (x float32 [M, K]: q * d per chunk; chunk_sums float32 [M, K / group]: per weight group,
    the sum over its chunks of d * sum(q), each rounded as `half_d` says: q8_1's s, what a weight with mins
    multiplies). K must be a multiple of `group`."""
    num_rows, depth = rows.shape
    if depth % group:
        raise ValueError(f"K ({depth}) is not a multiple of the weight's group ({group})")
    groups = depth // group
    per_group = -(-group // CHUNK)  # chunks per group; the last may be shorter
    padded = per_group * CHUNK
    x = rows.astype(jnp.float32).reshape(num_rows, groups, group)
    if padded != group:  # zeros change no chunk's max and quantize to 0
        x = jnp.pad(x, ((0, 0), (0, 0), (0, padded - group)))
    x = x.reshape(num_rows, groups, per_group, CHUNK)
    d = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
    inverse = jnp.where(d != 0.0, 1.0 / jnp.where(d != 0.0, d, 1.0), 0.0)
    q = round_half_away(x * inverse)
    rounded_d = as_half(d) if half_d else d
    fake = (q * rounded_d).reshape(num_rows, groups, padded)[..., :group].reshape(num_rows, depth)
    sums = d[..., 0] * jnp.sum(q, axis=-1)  # [M, groups, per_group]: d * sum q, d in float32 as ggml forms s
    chunk_sums = jnp.sum(as_half(sums) if half_d else sums, axis=-1)
    return fake, chunk_sums


__all__ = ["CHUNK", "as_half", "fake_quantize", "round_half_away"]
