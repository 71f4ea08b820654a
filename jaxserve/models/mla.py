"""DeepSeek's multi-head latent attention (MLA), numerically matched to transformers' DeepseekV2Attention /
DeepseekV3Attention, served from a compressed cache.

transformers expands the cached latent into per-head keys and values (kv_b_proj) at every step. Here the
cache holds only what MLA compresses to, per token: the normalized latent c (kv_lora_rank lanes) and the
rope key (qk_rope_head_dim lanes), one entry every head reads (pallas_kernels/paged_attention/latent.py).
Attention runs in the latent space with the projections absorbed, at prefill and decode alike: each
head's q_nope goes through its key projection W_UK (q_nope . (W_UK c) = (q_nope W_UK) . c), the
scores are taken against [c | rope key], the weighted sum of c comes out, and each head's value
projection W_UV applies after the sum (sum p (W_UV c) = W_UV (sum p c)). Both W_UK and W_UV are
kv_b_proj's kernel, read in place: no second copy of the weights.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.config import ModelConfig, yarn_mscale
from jaxserve.models.kv_pages import AttentionMetadata
from jaxserve.models.layers import (
    Matmul,
    RMSNorm,
    WriteAndAttend,
    apply_rope,
    linear,
    rope_attention_factor,
    rope_inverse_frequencies,
)

# Legend: T = tokens, E = embed, H = heads, N = qk_nope_head_dim, Q = qk_rope_head_dim, R = kv_lora_rank,
# V = v_head_dim, A = q_lora_rank, C = lanes per cache pool (an entry [R + Q, padded] is 2C).

LORA_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with the default eps


def softmax_scale(config: ModelConfig) -> float:
    """As transformers' yarn_apply_mscale: qk_head_dim ** -0.5, times mscale_all_dim's YaRN correction squared."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling
    if scaling.rope_type != "default" and scaling.mscale_all_dim:
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale


def deinterleave(x):
    """[..., Q] lanes (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): DeepSeek's rope turns adjacent lane
    pairs; reordered so, rotate-half rope turns the same pairs. Queries and keys are reordered alike, so their
    dot products, all attention reads of them, are unchanged."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class LatentAttention(nnx.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        dtype,
        write_and_attend: WriteAndAttend,
        matmul: Matmul,
        rngs: nnx.Rngs,
    ):
        del layer  # every DeepSeek layer attends alike
        e, h = config.hidden_size, config.num_heads
        self.num_heads, self.nope, self.rope = h, config.qk_nope_head_dim, config.qk_rope_head_dim
        self.rank, self.value_dim = config.kv_lora_rank, config.v_head_dim
        qk = self.nope + self.rope
        bias = config.attention_bias

        def make(in_features: int, out_features: int, axes: tuple[str, str], bias: bool):
            return linear(in_features, out_features, axes, bias=bias, dtype=dtype, matmul=matmul, rngs=rngs)

        if config.q_lora_rank:
            a = config.q_lora_rank
            self.q_proj = None
            self.q_a_proj = make(e, a, ("embed", "latent"), bias)
            self.q_a_layernorm = RMSNorm(a, LORA_NORM_EPS, dtype, axis="latent")
            self.q_b_proj = make(a, h * qk, ("latent", "heads"), False)
        else:  # V2-Lite
            self.q_proj = make(e, h * qk, ("embed", "heads"), False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        self.kv_a_proj_with_mqa = make(e, self.rank + self.rope, ("embed", "latent"), bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LORA_NORM_EPS, dtype, axis="latent")
        self.kv_b_proj = make(self.rank, h * (self.nope + self.value_dim), ("latent", "heads"), False)
        self.kv_b_proj.reads_kernel_whole = True  # read as a matrix below: kept [K, N] (device/panel_weights.py)
        self.o_proj = make(h * self.value_dim, e, ("heads", "embed"), config.attention_output_bias)
        self.entry_width = 2 * config.kv_cache_head_dim
        self.scale = softmax_scale(config)
        self.rope_interleave = config.rope_interleave
        # A tuple, not an array: module attributes that are not params must be static and hashable.
        self.inverse_frequencies = tuple(
            rope_inverse_frequencies(self.rope, config.rope_theta, config.rope_scaling, config.context_length).tolist()
        )
        self.rope_attention_factor = rope_attention_factor(config.rope_scaling)
        self.write_and_attend = write_and_attend

    def _queries(self, x):
        """x [T, E] -> q [T, H, N + Q]."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.reshape(x.shape[0], self.num_heads, self.nope + self.rope)

    def _rotate(self, x, positions):
        """x [T, heads, Q] -> rope applied (DeepSeek's lane pairs reordered first where it turns them)."""
        if self.rope_interleave:
            x = deinterleave(x)
        inverse_frequencies = jnp.asarray(np.asarray(self.inverse_frequencies, np.float32))
        return apply_rope(x, positions, inverse_frequencies, self.rope_attention_factor)

    def __call__(self, x, key_pages, value_pages, metadata: AttentionMetadata):
        num_tokens, dtype = x.shape[0], x.dtype
        q = self._queries(x)
        q_nope, q_rope = q[..., : self.nope], self._rotate(q[..., self.nope :], metadata.positions)
        compressed = self.kv_a_proj_with_mqa(x)  # [T, R + Q]
        latent = self.kv_a_layernorm(compressed[:, : self.rank])  # [T, R]
        key_rope = self._rotate(compressed[:, None, self.rank :], metadata.positions)  # [T, 1, Q]
        kv_b = self.kv_b_proj.kernel[...].reshape(self.rank, self.num_heads, self.nope + self.value_dim)
        key_up, value_up = kv_b[..., : self.nope], kv_b[..., self.nope :]  # [R, H, N], [R, H, V]
        absorbed = jnp.einsum("thn,rhn->thr", q_nope, key_up, preferred_element_type=jnp.float32).astype(dtype)
        padding = jnp.zeros((num_tokens, self.num_heads, self.entry_width - self.rank - self.rope), dtype)
        query = jnp.concatenate([absorbed, q_rope.astype(dtype), padding], axis=-1)  # [T, H, 2C]
        entries = jnp.concatenate([latent, key_rope[:, 0].astype(dtype)], axis=-1)[:, None, :]  # [T, 1, R + Q]
        out, key_pages, value_pages = self.write_and_attend.latent(
            query, entries, key_pages, value_pages, metadata, scale=self.scale
        )
        heads = jnp.einsum("thr,rhv->thv", out[..., : self.rank], value_up, preferred_element_type=jnp.float32)
        heads = heads.astype(dtype).reshape(num_tokens, self.num_heads * self.value_dim)
        return self.o_proj(heads), key_pages, value_pages
