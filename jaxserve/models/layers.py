"""Layers shared by the decoder models, numerically matched to Hugging Face transformers.

Every param names its logical axes where it is created (`logical_axes` metadata); sharding/placement.py
reads them back to place each param by the rules table. Kernels come in from outside, chosen when the
engine is built: attention takes its dispatch (`write_and_attend`) as a function, so the same module runs
on one device or per shard; projections take the matmul plan (`Matmul`, pallas_kernels/matmul), so the
model names no kernel.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.core import Tracer

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


def gated_activation(activation, gate, up):
    """activation(gate) * up as transformers computes it in the model's dtype: the activation in float32 of the
    stored gate, rounded once to that dtype, times up in float32, rounded (torch's bfloat16 ops compute in float32
    and round their result). The same in float32; in bfloat16 XLA's own fusion of silu rounded the sigmoid before
    the product (another rounding) and ran 1.2x slower over a batch-8 step's [8, 1536] (XLA:CPU)."""
    dtype = gate.dtype
    wide = activation(gate.astype(jnp.float32)).astype(dtype).astype(jnp.float32)
    return (wide * up.astype(jnp.float32)).astype(dtype)


class WriteAndAttend(Protocol):
    """Writes this step's keys and values into their pages, then attends over the pages: on one
    device or per shard (sharding/attention.py provides both)."""

    def __call__(
        self,
        q,
        k,
        v,
        key_pages,
        value_pages,
        metadata: AttentionMetadata,
        *,
        sliding_window: int | None,
        logits_soft_cap: float | None,
        sinks: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [T, H, D], k / v [T, K, D] -> (out [T, H, D], key_pages, value_pages); per layer, the window,
        the scores' soft-cap and the attention sinks [H] (None: none)."""
        ...

    def latent(
        self, q, entries, key_pages, value_pages, metadata: AttentionMetadata, *, scale: float
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Multi-head latent attention (DeepSeek, mla.py; pallas_kernels/paged_attention/latent.py): entries
        [T, 1, <= 2C] (each token's latent and rope key) are written half into each pool; every head of q
        [T, H, 2C] scores scale * q . entry and reads the entries back -> (out [T, H, 2C], pools)."""
        ...


class Matmul(Protocol):
    """A step's rows times a layer's weights, with the kernels the engine chose at build time
    (pallas_kernels/matmul provides the plan), so the model names no kernel."""

    def __call__(self, rows, weight, *, transposed: bool = False) -> jax.Array:
        """rows [M, K] in the weight's dtype, weight [K, N] ([N, K] when transposed) -> float32 [M, N]."""
        ...

    def together(self, rows, weights) -> tuple | None:
        """Several weights [K, N_i] by the same rows in one call where a kernel joins them -> float32
        [M, N_i] each; None where each is better projected on its own."""
        ...

    def together_normed(self, rows, scale, eps: float, weights) -> tuple | None:
        """RMSNorm(rows; scale, eps) by several weights in one call where a kernel takes the norm into it ->
        float32 [M, N_i] each; None where the caller normalizes first."""
        ...

    def gated(self, activation: str, gate, up, weight) -> jax.Array | None:
        """activation(gate) * up (float32 [M, F] each, rounded to the weight's dtype as gated_activation rounds
        them) by weight [F, N] in one call where a kernel takes the activation into it -> float32 [M, N]; None
        where the caller computes the activation first."""
        ...


def tree_sum(x):
    """x [..., n] -> [..., 1]: the sum over the last axis in a fixed tree of halves (zero-padded to a power of two).
    XLA:CPU's own reduction sums a float32 row in another order in a call of 8 rows or more than in one of fewer,
    so a norm's row (and everything after it) depended on the step's rows: a verify step's row then rounded
    differently from a decode step's (issue 26: greedy outputs identical with speculation on and off). Each add
    here is elementwise, so every row is summed alike whatever the rows."""
    width = 1 << (x.shape[-1] - 1).bit_length()
    if width != x.shape[-1]:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x


ROW_SUM_CHUNK = 4096  # long_row_sum: lanes a long row is first folded into


def long_row_sum(x):
    """x [..., n] -> [..., 1], as row-invariant as tree_sum for rows of any length: a row longer than ROW_SUM_CHUNK
    is first folded into ROW_SUM_CHUNK lanes by adding its chunks in order (the last zero-padded), then the lanes by
    tree_sum. Every add is elementwise. Why not tree_sum alone: over a vocabulary padded to a power of two it cost
    2-10x XLA's own reduction (151936 entries, 8 rows: 14 ms), folded first 1.1-1.3x."""
    width = x.shape[-1]
    if width <= ROW_SUM_CHUNK:
        return tree_sum(x)
    whole = width // ROW_SUM_CHUNK
    lanes = x[..., :ROW_SUM_CHUNK]
    for i in range(1, whole):
        lanes = lanes + x[..., i * ROW_SUM_CHUNK : (i + 1) * ROW_SUM_CHUNK]
    if whole * ROW_SUM_CHUNK < width:
        tail = x[..., whole * ROW_SUM_CHUNK :]
        lanes = lanes + jnp.pad(tail, [(0, 0)] * (x.ndim - 1) + [(0, ROW_SUM_CHUNK - tail.shape[-1])])
    return tree_sum(lanes)


def row_log_softmax(x):
    """log_softmax over the last axis with the sum taken by long_row_sum. XLA's own sums a row of a few thousand
    logits in another order in a call of 2+ rows than of one (a 2048-entry row: 1061 of 2048 log-probabilities off
    by an ulp), so a verify step's logprobs differed from a decode step's, and a prompt's from one chunking to
    another; vocabularies of 16k and more happened to agree."""
    shifted = x - jnp.max(x, axis=-1, keepdims=True)
    return shifted - jnp.log(long_row_sum(jnp.exp(shifted)))


def row_softmax(x):
    """softmax over the last axis with the sum taken by long_row_sum (tree_sum up to ROW_SUM_CHUNK entries): XLA's
    own softmax sums a row of 60-128 experts in another order in a call of 40+ rows than of fewer (a router's
    weights then depended on the step's rows), and a vocabulary's row in another in a call of 8+ rows (top-p)."""
    exps = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    return exps / long_row_sum(exps)


class RMSNorm(nnx.Module):
    def __init__(self, size: int, eps: float, dtype, axis: str = "embed", unit_offset: bool = False):
        # unit_offset (Gemma): the weight is stored as an offset from 1
        initial = jnp.zeros((size,), dtype) if unit_offset else jnp.ones((size,), dtype)
        self.weight = nnx.Param(initial, logical_axes=(axis,))  # [E] (or [D] per head)
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(tree_sum(x32 * x32) / x.shape[-1] + self.eps)
        if self.unit_offset:  # as HF's Gemma: scaled in float32, then cast
            return (normed * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        # As HF's Llama: normalize in float32, cast back, then scale in the input dtype.
        return self.weight[...] * normed.astype(x.dtype)


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling, context_length: int | None = None
) -> np.ndarray:
    """[D/2] float32 inverse frequencies (D: the rotated lanes), with HF's linear, llama3, LongRoPE and YaRN
    scaling rules. LongRoPE takes its long factors when context_length exceeds the pretraining length."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    if scaling.rope_type == "longrope":
        long = context_length is not None and context_length > scaling.original_max_position_embeddings
        factors = np.asarray(scaling.long_factor if long else scaling.short_factor, np.float32)
        powers = (np.float32(theta) ** exponents).astype(np.float32)  # as torch: float32 base ** float32 exponent
        return (1.0 / (factors * powers)).astype(np.float32)
    if scaling.rope_type == "yarn":
        return _yarn_inverse_frequencies(head_dim, theta, scaling)
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


def _yarn_inverse_frequencies(dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """HF's _compute_yarn_parameters in float32 as torch computes it: lanes that turn more than beta_fast times
    over the pretraining length keep their frequency, lanes that turn fewer than beta_slow times are divided
    by the factor, and a linear ramp blends the ones between."""
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    powers = (np.float32(theta) ** exponents).astype(np.float32)
    extrapolated = (np.float32(1.0) / powers).astype(np.float32)
    interpolated = (np.float32(1.0) / (np.float32(scaling.factor) * powers)).astype(np.float32)

    def correction_dim(num_rotations: float) -> float:  # the lane that turns num_rotations times
        original = scaling.original_max_position_embeddings
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_weight = (np.float32(1.0) - ramp.astype(np.float32)).astype(np.float32)
    inv_freq = interpolated * (np.float32(1.0) - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq.astype(np.float32)


def rope_attention_factor(scaling: RopeScaling) -> float:
    """The factor cos and sin are scaled by: LongRoPE's and YaRN's magnitude correction, 1 otherwise."""
    return scaling.attention_factor if scaling.rope_type in ("longrope", "yarn") else 1.0


def rope_cos_sin(positions, inverse_frequencies, attention_factor: float = 1.0):
    """cos and sin [T, 1, R] in float32 of positions [T] times the inverse frequencies [R/2] (R: the rotated
    lanes, the angles repeated for the rotate-half convention), scaled by attention_factor (LongRoPE)."""
    angles = positions.astype(jnp.float32)[:, None] * inverse_frequencies[None, :]  # [T, R/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None, :]  # [T, 1, R]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def step_rope_cos_sin(metadata: AttentionMetadata, inverse_frequencies: tuple, attention_factor: float = 1.0):
    """rope_cos_sin of the step's positions, computed once per traced step for all the layers with the same
    frequencies and factor. XLA:CPU computes each sin and cos with a scalar libm call, and fused a copy of them
    into every layer's q and k rotation, per head: 8% of a float32 prefill of the default model, 60 copies. The
    tables live on the metadata object that one trace of a step passes to every layer (outside a trace, where
    the host may refill the positions in place, they are computed anew)."""
    inverse = jnp.asarray(inverse_frequencies, jnp.float32)
    if not isinstance(metadata.positions, Tracer):
        return rope_cos_sin(metadata.positions, inverse, attention_factor)
    tables = metadata.__dict__.setdefault("_rope_cos_sin", {})
    key = (inverse_frequencies, attention_factor)
    if key not in tables:
        cos, sin = rope_cos_sin(metadata.positions, inverse, attention_factor)
        # One array through a no-op rounding (float32 to float32): XLA then computes the tables once and does
        # not duplicate them into the layers' fusions, which it does with cos and sin apart, or with
        # optimization_barrier (removed before fusion on the CPU). tests/models/test_rope_tables.py counts them.
        both = jax.lax.reduce_precision(jnp.stack([cos, sin]), exponent_bits=8, mantissa_bits=23)
        tables[key] = both[0], both[1]
    return tables[key]


def rotate(x, cos, sin):
    """x [T, heads, D] rotated by cos and sin [T, 1, R] (rope_cos_sin) in x's dtype, rotate-half convention as
    HF Llama; only the first R lanes rotate (partial rotary), the rest pass through."""
    rotary = cos.shape[-1]
    x, passed = x[..., :rotary], x[..., rotary:]
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    half = rotary // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    x = x * cos + rotated * sin
    return jnp.concatenate([x, passed], axis=-1) if passed.shape[-1] else x


def apply_rope(x, positions, inverse_frequencies, attention_factor: float = 1.0):
    """x [T, heads, D], rotate-half convention as HF Llama; angles in float32, applied in x's dtype. Only
    the first 2 * len(inverse_frequencies) lanes rotate (partial rotary), the rest pass through; cos and
    sin are scaled by attention_factor (LongRoPE)."""
    return rotate(x, *rope_cos_sin(positions, inverse_frequencies, attention_factor))


def project(x, weight, bias=None, *, matmul: Matmul, transposed: bool = False):
    """x [..., in] times weight [in, out] ([out, in] when transposed), plus bias: accumulated in float32 by
    the engine's matmul plan, returned in the weight's dtype (x is cast to it first, as nnx.Linear does)."""
    *lead, size = x.shape
    rows = x.reshape(-1, size).astype(weight.dtype)  # as nnx.Linear, computing in the params' dtype
    return _finish(matmul(rows, weight, transposed=transposed), bias, rows.dtype, lead)


def _finish(y, bias, dtype, lead):
    """A float32 projection [rows, out] plus bias, in `dtype`, with x's leading axes back."""
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(dtype).reshape(*lead, y.shape[-1])


def project_many(x, linears, norm: RMSNorm | None = None):
    """The same x through several Linears (a layer's q, k and v; gate and up): in one call where the plan
    joins them (the CPU kernel: its threads share their work and a decode step makes fewer calls);
    otherwise each Linear on its own. Same results as [linear(x) for linear in linears]. With `norm`, x is
    first normalized by it: inside that call where the plan's kernel takes the norm (norm(x) up to the order
    of its sum of squares), otherwise by norm(x)."""
    if norm is not None:
        ys = _project_normed(x, linears, norm)
        if ys is not None:
            return ys
        x = norm(x)
    weights = [linear.projected_weight() if isinstance(linear, Linear) else linear.kernel[...] for linear in linears]
    *lead, size = x.shape
    dtype = weights[0].dtype
    rows = x.reshape(-1, size).astype(dtype)
    if all(isinstance(linear, Linear) and linear.dtype in (None, dtype) for linear in linears) and all(
        w.dtype == dtype for w in weights
    ):
        ys = linears[0].matmul.together(rows, weights)
        if ys is not None:
            return [
                _finish(y, None if linear.bias is None else linear.bias[...], dtype, lead)
                for y, linear in zip(ys, linears)
            ]
    return [linear(x) for linear in linears]


def _project_normed(x, linears, norm: RMSNorm) -> list | None:
    """project_many(norm(x), linears) in one call with the norm inside, where the plan's kernel does that: plain
    Linears (no adapters) of x's dtype and a norm without Gemma's unit offset; else None."""
    ys = _joined_float32(x, linears, norm)
    if ys is None:
        return None
    lead = x.shape[:-1]
    return [
        _finish(y, None if linear.bias is None else linear.bias[...], x.dtype, lead) for y, linear in zip(ys, linears)
    ]


def _joined_float32(x, linears, norm: RMSNorm | None) -> tuple | None:
    """x [..., E] (through `norm` first, inside the call) by plain Linears (no adapters, of x's dtype) in one
    kernel call -> their float32 results [rows, N_i], before bias and the cast to x's dtype; None where the plan
    does not join them (or take the norm: Gemma's unit offset, a norm of another dtype)."""
    dtype = x.dtype
    plain = all(
        isinstance(linear, Linear) and linear.lora is None and linear.dtype in (None, dtype) for linear in linears
    )
    if not plain or (norm is not None and (norm.unit_offset or norm.weight.dtype != dtype)):
        return None
    weights = [linear.kernel[...] for linear in linears]
    if any(w.dtype != dtype for w in weights):
        return None
    rows = x.reshape(-1, x.shape[-1])
    matmul = linears[0].matmul
    if norm is None:
        return matmul.together(rows, weights)
    return matmul.together_normed(rows, norm.weight[...], norm.eps, weights)


class Linear(nnx.Linear):
    """nnx.Linear's params and names (checkpoints, sharding rules and the HF names see no difference),
    computed by `project` with the matmul plan it was built with."""

    matmul: Matmul
    lora: Any = None  # jaxserve/lora's LoraSlots where adapters may target this projection
    reads_kernel_whole = False  # its module reads the kernel as a matrix: kept [K, N] (device/panel_weights.py)

    def projected_weight(self):
        """The kernel, or with adapter slots attached the kernel beside them (a LoraWeight that the plan's
        LoRA entry serves)."""
        return self.kernel[...] if self.lora is None else self.lora.weight(self.kernel[...])

    def __call__(self, inputs, out_sharding=None):
        if self.lora is None and (out_sharding is not None or self.dtype not in (None, self.kernel.dtype)):
            return super().__call__(inputs, out_sharding)
        bias = None if self.bias is None else self.bias[...]
        return project(inputs, self.projected_weight(), bias, matmul=self.matmul)


def linear(
    in_features: int,
    out_features: int,
    axes: tuple[str | None, str | None],
    *,
    bias: bool,
    dtype,
    matmul: Matmul,
    rngs: nnx.Rngs,
):
    """A Linear (kernel [in, out]) whose kernel and bias carry their logical axes, projecting with `matmul`."""
    module = Linear(
        in_features,
        out_features,
        use_bias=bias,
        dtype=dtype,
        param_dtype=dtype,
        rngs=rngs,
        kernel_metadata={"logical_axes": axes},
        bias_metadata={"logical_axes": axes[1:]},
    )
    module.matmul = matmul
    return module


class Attention(nnx.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        dtype,
        write_and_attend: WriteAndAttend,
        matmul: Matmul,
        rngs: nnx.Rngs,
    ):
        e, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        qkv_bias, out_bias = config.attention_bias, config.attention_output_bias
        q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
        self.q_proj = linear(e, q_size, ("embed", "heads"), bias=qkv_bias, dtype=dtype, matmul=matmul, rngs=rngs)
        self.k_proj = linear(e, kv_size, ("embed", "kv_heads"), bias=qkv_bias, dtype=dtype, matmul=matmul, rngs=rngs)
        self.v_proj = linear(e, kv_size, ("embed", "kv_heads"), bias=qkv_bias, dtype=dtype, matmul=matmul, rngs=rngs)
        self.o_proj = linear(q_size, e, ("heads", "embed"), bias=out_bias, dtype=dtype, matmul=matmul, rngs=rngs)
        # Qwen3 and Gemma 3 normalize each query and key head on its own
        offset = config.norm_unit_offset
        self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype, "head_dim", offset) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype, "head_dim", offset) if config.qk_norm else None
        self.sliding_window = config.layer_sliding_window(layer)
        self.logits_soft_cap = config.attention_logit_soft_cap
        # GPT-OSS: a learned logit per query head that joins every softmax's denominator
        sinks = nnx.Param(jnp.zeros((config.num_heads,), dtype), logical_axes=("heads",))  # [H]
        self.sinks = sinks if config.attention_sinks else None
        # Gemma scales scores by query_pre_attn_scalar ** -0.5; the kernels by head_dim ** -0.5, so the
        # queries make up the difference
        scalar = config.query_pre_attention_scalar
        self.query_scale = 1.0 if scalar is None or scalar == d else math.sqrt(d / scalar)
        self.write_and_attend = write_and_attend
        theta, scaling = config.layer_rope(layer)
        # A tuple, not an array: module attributes that are not params must be static and hashable.
        self.inverse_frequencies = tuple(
            rope_inverse_frequencies(config.rotary_dim, theta, scaling, config.context_length).tolist()
        )
        self.rope_attention_factor = rope_attention_factor(scaling)

    def __call__(self, x, key_pages, value_pages, metadata: AttentionMetadata, norm: RMSNorm | None = None):
        """x [T, E] (with `norm`: before that norm, which project_many applies) -> (out [T, E], pages)."""
        num_tokens = x.shape[0]
        q, k, v = project_many(x, (self.q_proj, self.k_proj, self.v_proj), norm)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = step_rope_cos_sin(metadata, self.inverse_frequencies, self.rope_attention_factor)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.query_scale != 1.0:
            q = (q.astype(jnp.float32) * self.query_scale).astype(q.dtype)
        out, key_pages, value_pages = self.write_and_attend(
            q,
            k,
            v,
            key_pages,
            value_pages,
            metadata,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            **({} if self.sinks is None else {"sinks": self.sinks[...]}),
        )
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim)), key_pages, value_pages


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, dtype, matmul: Matmul, rngs: nnx.Rngs, *, shared_expert: bool = False):
        """shared_expert: Qwen2-MoE's MLP beside the routed experts, of its own width (and logical axis)."""
        e, bias = config.hidden_size, config.mlp_bias
        f, axis = (config.intermediate_size, "mlp")
        if shared_expert:
            f, axis = (config.shared_expert_intermediate_size, "shared_expert_mlp")
        self.gate_proj = linear(e, f, ("embed", axis), bias=bias, dtype=dtype, matmul=matmul, rngs=rngs)
        self.up_proj = linear(e, f, ("embed", axis), bias=bias, dtype=dtype, matmul=matmul, rngs=rngs)
        self.down_proj = linear(f, e, (axis, "embed"), bias=bias, dtype=dtype, matmul=matmul, rngs=rngs)
        self.activation = config.hidden_act

    def __call__(self, x, norm: RMSNorm | None = None):
        """x [T, E] (with `norm`: before that norm, which project_many applies) -> [T, E]."""
        fused = self._gated_in_down_call(x, norm)
        if fused is not None:
            return fused
        gate, up = project_many(x, (self.gate_proj, self.up_proj), norm)
        return self.down_proj(gated_activation(ACTIVATIONS[self.activation], gate, up))

    def _gated_in_down_call(self, x, norm: RMSNorm | None):
        """The MLP with the activation inside the down projection's call, where the plan's kernel takes it (the CPU
        float kernel, silu): gate and up joined in one call (the norm in it where the plan takes that too), their
        float32 results straight into the down call, no XLA op between (issue #29: XLA:CPU splits the activation's
        fusion over its pool in a step of several rows, and the split waits for a pool thread to wake). Plain
        Linears of x's dtype only (no adapters; gate and up without bias), the norm without Gemma's unit offset; else
        None, and nothing computed."""
        down = self.down_proj
        if not isinstance(down, Linear) or down.lora is not None or down.dtype not in (None, x.dtype):
            return None
        if self.gate_proj.bias is not None or self.up_proj.bias is not None or down.kernel.dtype != x.dtype:
            return None
        gate_up = _joined_float32(x, (self.gate_proj, self.up_proj), norm)
        if gate_up is None:
            return None
        gate, up = gate_up
        lead = x.shape[:-1]
        y = down.matmul.gated(self.activation, gate, up, down.kernel[...])
        if y is None:  # the kernel joined gate and up but does not compute this activation: as project_many would
            gate, up = (_finish(part, None, x.dtype, lead) for part in gate_up)
            return down(gated_activation(ACTIVATIONS[self.activation], gate, up))
        return _finish(y, None if down.bias is None else down.bias[...], x.dtype, lead)
