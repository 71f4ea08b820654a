"""Layers shared by the decoder models, numerically matched to Hugging Face transformers.

Every param names its logical axes where it is created (`logical_axes` metadata); sharding/placement.py
reads them back to place each param by the rules table. Attention takes the kernel dispatch
(`write_and_attend`) as a function, so the same module runs on one device or per shard.
"""

from __future__ import annotations

import math
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.config import ModelConfig, RopeScaling
from jaxserve.models.kv_pages import AttentionMetadata

# Legend: T = tokens in the step, E = embed (hidden), H = query heads, K = kv heads, D = head dim, F = mlp.

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


class WriteAndAttend(Protocol):
    """Writes this step's keys and values into their pages, then attends over the pages: on one
    device or per shard (sharding/attention.py provides both)."""

    def __call__(self, q, k, v, key_pages, value_pages, metadata: AttentionMetadata, *, sliding_window: int | None):
        """q [T, H, D], k / v [T, K, D] -> (out [T, H, D], key_pages, value_pages)."""


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, dtype, axis: str = "embed"):
        self.weight = nnx.Param(jnp.ones((size,), dtype), logical_axes=(axis,))  # [E] (or [D] per head)
        self.eps = eps

    def __call__(self, x):
        # As HF: normalize in float32, cast back, then scale in the input dtype.
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """[D/2] float32 inverse frequencies, with HF's linear and llama3 scaling rules."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = (1.0 / (theta ** exponents.astype(np.float64))).astype(np.float32)
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(x, positions, inverse_frequencies):
    """x [T, heads, D], rotate-half convention as HF Llama; angles in float32, applied in x's dtype."""
    angles = positions.astype(jnp.float32)[:, None] * inverse_frequencies[None, :]  # [T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]  # [T, 1, D]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


# Rows up to which the CPU kernel serves a dot (it reads the weights once for up to eight rows). Measured
# on SmolLM2-135M decode steps (issue #16): bfloat16 beats XLA:CPU's YNNPACK dot up to 8 rows (at 16,
# YNNPACK is faster); float16 has no XLA dot that reads the weight as stored, so the kernel goes as far
# as it can; float32 beats XLA's dots up to 8 rows (batch 4: 64 -> 41 ms a step, batch 8: 75 -> 57).
SMALL_MATMUL_MAX_ROWS = {jnp.dtype(jnp.bfloat16): 8, jnp.dtype(jnp.float16): 64, jnp.dtype(jnp.float32): 8}


def _use_small_matmul(num_rows: int, weight) -> bool:
    """The C++ kernel (pallas_kernels/paged_attention/cpu_matmul.cc) for decode-sized 16-bit dots, on a
    process with one CPU device: it is a custom call XLA's partitioner cannot split, so it must never
    see a weight sharded over devices."""
    if num_rows > SMALL_MATMUL_MAX_ROWS.get(jnp.dtype(weight.dtype), 0):
        return False
    if jax.default_backend() != "cpu" or jax.device_count() != 1:
        return False
    from pallas_kernels.paged_attention import cpu  # the kernel is built at first use

    return cpu.available()


def project(x, weight, bias=None, *, transposed: bool = False):
    """x [..., in] times weight [in, out] ([out, in] when transposed), plus bias: accumulated in float32,
    returned in the weight's dtype (x is cast to it first, as nnx.Linear does).

    On XLA:CPU a dot with 16-bit weights and few rows (a decode step) converts the whole weight to
    float32 first, every step: five times the weight bytes (issue #16). So: up to SMALL_MATMUL_MAX_ROWS
    rows, the C++ kernel that widens each element in registers; otherwise a dot asking for float32
    results with at least two rows, which XLA:CPU gives its YNNPACK fusion (it reads 16-bit weights as
    they are; a one-row dot becomes a matrix-vector product without it, so one row is padded to two).
    Float32 weights use the kernel up to SMALL_MATMUL_MAX_ROWS and XLA's plain dot beyond. Float16 beyond the kernel's
    rows (prefill) is still widened by XLA, once per step for many tokens.
    """
    *lead, size = x.shape
    rows = x.reshape(-1, size).astype(weight.dtype)  # as nnx.Linear, computing in the params' dtype
    num_rows = rows.shape[0]
    if _use_small_matmul(num_rows, weight):
        from pallas_kernels.paged_attention import cpu

        y = cpu.small_matmul(rows, weight, transposed=transposed)
    else:
        if num_rows == 1 and weight.dtype != jnp.float32:
            rows = jnp.pad(rows, ((0, 1), (0, 0)))
        if transposed and weight.dtype == jnp.float32:  # as nnx's Embed.attend: the same HLO as before (#16)
            y = jnp.dot(rows, weight.T)
        else:  # a 16-bit weight.T would be widened: contract its second axis where it lies
            contracting = (1,) if transposed else (0,)
            y = jax.lax.dot_general(rows, weight, (((1,), contracting), ((), ())), preferred_element_type=jnp.float32)
        if y.shape[0] != num_rows:
            y = y[:num_rows]
    return _finish(y, bias, rows.dtype, lead)


def _finish(y, bias, dtype, lead):
    """A float32 projection [rows, out] plus bias, in `dtype`, with x's leading axes back."""
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(dtype).reshape(*lead, y.shape[-1])


def project_many(x, linears):
    """The same x through several Linears (a layer's q, k and v; gate and up): on the CPU kernel's path
    one call for all of them, so that its threads share their work and a decode step makes fewer calls;
    otherwise each Linear on its own. Same results as [linear(x) for linear in linears]."""
    weights = [linear.kernel[...] for linear in linears]
    *lead, size = x.shape
    dtype = weights[0].dtype
    rows = x.reshape(-1, size).astype(dtype)
    if (
        all(isinstance(linear, Linear) and linear.dtype in (None, dtype) for linear in linears)
        and all(w.dtype == dtype for w in weights)
        and _use_small_matmul(rows.shape[0], weights[0])
    ):
        from pallas_kernels.paged_attention import cpu

        ys = cpu.small_matmuls(rows, weights)
        return [
            _finish(y, None if linear.bias is None else linear.bias[...], dtype, lead) for y, linear in zip(ys, linears)
        ]
    return [linear(x) for linear in linears]


class Linear(nnx.Linear):
    """nnx.Linear's params and names (checkpoints, sharding rules and the HF names see no difference),
    computed by `project`."""

    def __call__(self, inputs, out_sharding=None):
        if out_sharding is not None or self.dtype not in (None, self.kernel.dtype):
            return super().__call__(inputs, out_sharding)
        return project(inputs, self.kernel[...], None if self.bias is None else self.bias[...])


def linear(
    in_features: int, out_features: int, axes: tuple[str | None, str | None], *, bias: bool, dtype, rngs: nnx.Rngs
):
    """A Linear (kernel [in, out]) whose kernel and bias carry their logical axes."""
    return Linear(
        in_features,
        out_features,
        use_bias=bias,
        dtype=dtype,
        param_dtype=dtype,
        rngs=rngs,
        kernel_metadata={"logical_axes": axes},
        bias_metadata={"logical_axes": axes[1:]},
    )


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype, write_and_attend: WriteAndAttend, rngs: nnx.Rngs):
        e, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        qkv_bias = config.attention_bias
        self.q_proj = linear(e, config.num_heads * d, ("embed", "heads"), bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.k_proj = linear(e, config.num_kv_heads * d, ("embed", "kv_heads"), bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.v_proj = linear(e, config.num_kv_heads * d, ("embed", "kv_heads"), bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = linear(
            config.num_heads * d, e, ("heads", "embed"), bias=config.attention_output_bias, dtype=dtype, rngs=rngs
        )
        # Qwen3 normalizes each query and key head on its own
        self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype, axis="head_dim") if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype, axis="head_dim") if config.qk_norm else None
        self.sliding_window = config.layer_sliding_window(layer)
        self.write_and_attend = write_and_attend
        # A tuple, not an array: module attributes that are not params must be static and hashable.
        self.inverse_frequencies = tuple(rope_inverse_frequencies(d, config.rope_theta, config.rope_scaling).tolist())

    def __call__(self, x, key_pages, value_pages, metadata: AttentionMetadata):
        num_tokens = x.shape[0]
        q, k, v = project_many(x, (self.q_proj, self.k_proj, self.v_proj))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inverse_frequencies = jnp.asarray(self.inverse_frequencies, jnp.float32)
        q = apply_rope(q, metadata.positions, inverse_frequencies)
        k = apply_rope(k, metadata.positions, inverse_frequencies)
        out, key_pages, value_pages = self.write_and_attend(
            q, k, v, key_pages, value_pages, metadata, sliding_window=self.sliding_window
        )
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim)), key_pages, value_pages


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        e, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = linear(e, f, ("embed", "mlp"), bias=bias, dtype=dtype, rngs=rngs)
        self.up_proj = linear(e, f, ("embed", "mlp"), bias=bias, dtype=dtype, rngs=rngs)
        self.down_proj = linear(f, e, ("mlp", "embed"), bias=bias, dtype=dtype, rngs=rngs)
        self.activation = config.hidden_act

    def __call__(self, x):
        gate, up = project_many(x, (self.gate_proj, self.up_proj))
        return self.down_proj(ACTIVATIONS[self.activation](gate) * up)
