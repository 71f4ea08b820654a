"""Layers shared by the Llama-family models, numerically matched to Hugging Face transformers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.models.kv_pages import AttentionMetadata
from pallas_kernels import ragged_paged_attention, write_kv_pages
from sharding.attention import sharded_write_and_attend

# Legend: T = tokens in the step, E = embed (hidden), H = query heads, K = kv heads, D = head dim, F = mlp.

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((size,), dtype))  # [E]
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
            scaling.high_freq_factor - scaling.low_freq_factor)
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


def linear(in_features: int, out_features: int, *, bias: bool, dtype, rngs: nnx.Rngs):
    return nnx.Linear(in_features, out_features, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, dtype, attention_impl: str, rngs: nnx.Rngs, attention_mesh=None):
        e, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = linear(e, config.num_heads * d, bias=config.attention_bias, dtype=dtype, rngs=rngs)
        self.k_proj = linear(e, config.num_kv_heads * d, bias=config.attention_bias, dtype=dtype, rngs=rngs)
        self.v_proj = linear(e, config.num_kv_heads * d, bias=config.attention_bias, dtype=dtype, rngs=rngs)
        self.o_proj = linear(config.num_heads * d, e, bias=config.attention_bias, dtype=dtype, rngs=rngs)
        self.sliding_window = config.sliding_window
        self.attention_impl = attention_impl
        self.attention_mesh = attention_mesh  # set: attention runs per shard (sharding/attention.py)
        # A tuple, not an array: module attributes that are not params must be static and hashable.
        self.inverse_frequencies = tuple(rope_inverse_frequencies(d, config.rope_theta, config.rope_scaling).tolist())

    def __call__(self, x, key_pages, value_pages, metadata: AttentionMetadata):
        num_tokens = x.shape[0]
        q = self.q_proj(x).reshape(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(num_tokens, self.num_kv_heads, self.head_dim)
        inverse_frequencies = jnp.asarray(self.inverse_frequencies, jnp.float32)
        q = apply_rope(q, metadata.positions, inverse_frequencies)
        k = apply_rope(k, metadata.positions, inverse_frequencies)
        if self.attention_mesh is not None:
            out, key_pages, value_pages = sharded_write_and_attend(
                self.attention_mesh, q, k, v, key_pages, value_pages, metadata,
                sliding_window=self.sliding_window, impl=self.attention_impl)
        else:
            key_pages, value_pages = write_kv_pages(key_pages, value_pages, k, v, metadata.slot_ids,
                                                    impl=self.attention_impl)
            out = ragged_paged_attention(
                q, key_pages, value_pages, metadata.page_table, metadata.token_seq_ids, metadata.positions,
                query_block=metadata.query_block, sliding_window=self.sliding_window, impl=self.attention_impl)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim)), key_pages, value_pages


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        e, f = config.hidden_size, config.intermediate_size
        self.gate_proj = linear(e, f, bias=config.mlp_bias, dtype=dtype, rngs=rngs)
        self.up_proj = linear(e, f, bias=config.mlp_bias, dtype=dtype, rngs=rngs)
        self.down_proj = linear(f, e, bias=config.mlp_bias, dtype=dtype, rngs=rngs)
        self.activation = config.hidden_act

    def __call__(self, x):
        return self.down_proj(ACTIVATIONS[self.activation](self.gate_proj(x)) * self.up_proj(x))
