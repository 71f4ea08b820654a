"""On-device sampling with per-row parameters, inside the step's executable (no host sync inside).

Each row draws its randomness from (its seed, the index of the token being sampled) alone, so a seeded
request samples the same tokens whatever else shares the batch, and after a preemption: one uniform a
row, turned into a token by the inverse of the (filtered) distribution's CDF (sampling_draws.py).

This jax.numpy sampler is the reference, and what GPUs and TPUs run; on a CPU the draw is one C++ custom call
with the same rules and the same uniforms (pallas_kernels/sampling), where XLA:CPU took ~0.8 s to compile the
reference's ~100 small kernels into every step executable.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.arrays import HostOrDeviceArray
from jaxserve.device.sampling_draws import (
    CANDIDATES,
    draw_within,
    inverse_cdf,
    nucleus_by_thresholds,
    nucleus_from_candidates,
    top_candidates,
)
from jaxserve.models.layers import row_log_softmax
from pallas_kernels.sampling import cpu as cpu_sampler

# Legend: S = sequences sampled in the step, V = vocab, K = max_logprobs.


@jax.tree_util.register_dataclass
@dataclass
class SamplingInputs:
    temperature: HostOrDeviceArray  # [S] float32, 0 = greedy
    top_k: HostOrDeviceArray  # [S] int32, 0 = no cut
    top_p: HostOrDeviceArray  # [S] float32
    min_p: HostOrDeviceArray  # [S] float32
    seeds: HostOrDeviceArray  # [S, 2] uint32, threefry key data
    token_indices: HostOrDeviceArray  # [S] int32, index of the output token being sampled
    wants_logprobs: HostOrDeviceArray  # [S] bool
    # logits processors (device/logits_processors.py); B = max_bias_entries, W = ceil(V / 32)
    bias_token_ids: HostOrDeviceArray  # [S, B] int32, -1 = padding
    bias_values: HostOrDeviceArray  # [S, B] float32, -inf = banned
    bias_until: HostOrDeviceArray  # [S, B] int32, applies while token_indices is below it
    allowed_tokens: HostOrDeviceArray  # [S, W] int32 bitmask (grammar, allowed_token_ids); all bits: any
    presence_penalty: HostOrDeviceArray  # [S] float32
    frequency_penalty: HostOrDeviceArray  # [S] float32
    repetition_penalty: HostOrDeviceArray  # [S] float32, 1 = none


@jax.tree_util.register_dataclass
@dataclass
class SamplerOutput:
    token_ids: HostOrDeviceArray  # [S] int32
    logprobs: HostOrDeviceArray  # [S] float32, log-probability of the sampled token under the model
    top_logprobs: HostOrDeviceArray  # [S, K] float32
    top_token_ids: HostOrDeviceArray  # [S, K] int32
    # [S] int32: the sampled token's rank under the model (1: the most likely; vLLM's Logprob.rank), 0 unasked
    ranks: HostOrDeviceArray
    # [S] bool: the processors left no token (every logit -inf: a grammar at a dead end, bans that cover
    # allowed_token_ids); token_ids holds noise there
    no_token_allowed: HostOrDeviceArray


def first_argmax(values, block: int = 128):
    """argmax over the last axis (first index on ties, the first NaN where a row has one, as jnp.argmax), as a
    max over blocks then within one block.

    XLA's CPU argmax over a [S, V] vocabulary row is several times slower than this two-level form. Its max
    over a block may skip a NaN, so a row with a NaN (a broken model) takes its first NaN on its own.
    """
    num_rows, size = values.shape
    blocks = jnp.pad(values, ((0, 0), (0, -size % block)), constant_values=-jnp.inf).reshape(num_rows, -1, block)
    best_block = jnp.argmax(blocks.max(axis=-1), axis=-1)  # [S]
    within = jnp.take_along_axis(blocks, best_block[:, None, None], axis=1)[:, 0]  # [S, block]
    best = best_block * block + jnp.argmax(within, axis=-1)
    nan = jnp.isnan(values)
    return jnp.where(nan.any(axis=-1), jnp.argmax(nan, axis=-1), best).astype(jnp.int32)


def row_uniforms(inputs: SamplingInputs):
    """[S] float32 in [0, 1): each row's draw for its token, from its seed folded with the token's index."""
    keys = jax.vmap(lambda seed, index: jax.random.fold_in(jax.random.wrap_key_data(seed), index))(
        inputs.seeds, inputs.token_indices
    )
    return jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)


def _nucleus_candidates(scaled, uniforms, inputs: SamplingInputs, candidates: int):
    """Rows with top-k / top-p / min-p, drawn from their nucleus within the `candidates` most likely tokens ->
    (tokens [S], resolved [S]: the nucleus ends within them; the rest are drawn from their whole row)."""
    values, ids = top_candidates(scaled, candidates)
    keep, resolved = nucleus_from_candidates(values, scaled, inputs.top_k, inputs.top_p, inputs.min_p)
    kept = jnp.where(keep, jnp.exp(values - values[:, :1]), 0.0)
    drawn = jnp.take_along_axis(ids, draw_within(kept, uniforms)[:, None], axis=1)[:, 0]
    return drawn, resolved


def _sample_random(logits, greedy_token_ids, inputs: SamplingInputs, candidates: int):
    """Rows with a temperature: a draw from the row scaled by it, one uniform a row: rows with top-k / top-p /
    min-p from their nucleus (within their most likely candidates, else over the whole row by thresholds), the
    rest from the whole row; greedy rows keep their argmax."""
    scaled = logits / jnp.where(inputs.temperature > 0, inputs.temperature, 1.0)[:, None]
    # No distribution to draw from where the scaled row's maximum is not finite: a temperature near 0 whose
    # division overflowed (+inf ties would hide the row's own argmax), +inf or NaN logits (a broken model), or no
    # finite logit at all: the row's argmax, as the CPU kernel takes it (pallas_kernels/sampling/cpu_sampler.cc).
    top = jnp.max(jnp.where(jnp.isnan(scaled), jnp.inf, scaled), axis=-1)  # XLA's max may skip a NaN
    is_random = (inputs.temperature > 0) & jnp.isfinite(top)
    uniforms = row_uniforms(inputs)
    filtered = is_random & ((inputs.top_k > 0) | (inputs.top_p < 1) | (inputs.min_p > 0))
    from_nucleus, resolved = jax.lax.cond(
        jnp.any(filtered),
        lambda: _nucleus_candidates(scaled, uniforms, inputs, candidates),
        lambda: (jnp.zeros_like(greedy_token_ids), jnp.ones_like(filtered)),
    )
    unresolved = filtered & ~resolved
    whole_row = is_random & (~filtered | unresolved)

    def from_whole_rows():  # one draw over [S, V] for both kinds: a row without filter keeps every token
        if candidates >= scaled.shape[-1]:  # the candidates are the vocabulary: every nucleus resolved
            return inverse_cdf(scaled, uniforms)
        keep = jax.lax.cond(
            jnp.any(unresolved),
            lambda: nucleus_by_thresholds(scaled, inputs.top_k, inputs.top_p, inputs.min_p) | ~unresolved[:, None],
            lambda: jnp.ones(scaled.shape, jnp.bool_),
        )
        return inverse_cdf(jnp.where(keep, scaled, -jnp.inf), uniforms)

    from_row = jax.lax.cond(jnp.any(whole_row), from_whole_rows, lambda: jnp.zeros_like(greedy_token_ids))
    return jnp.where(is_random, jnp.where(whole_row, from_row, from_nucleus), greedy_token_ids)


def sample(
    logits,
    inputs: SamplingInputs,
    max_logprobs: int,
    model_logits=None,
    candidates: int = CANDIDATES,
    rows_sharding=None,
    cpu_kernel: bool | None = None,
) -> SamplerOutput:
    """logits [S, V] float32 (after the logits processors) -> sampled tokens and their log-probabilities
    under the model's own distribution (`model_logits`, before the processors; default: `logits`), as
    vLLM reports them. candidates: how many of a row's most likely tokens its top-k / top-p / min-p set is
    looked for in before whole-row thresholds decide it (sampling_draws.py). cpu_kernel: draw with the C++
    kernel (pallas_kernels/sampling: the same rules, one custom call instead of ~100 small XLA kernels in every
    step executable); None: where it serves (a CPU that builds it). rows_sharding: how the rows lie on a mesh
    (the kernel draws each device's own)."""
    if cpu_sampler.serves() if cpu_kernel is None else cpu_kernel:
        token_ids = cpu_sampler.sample_tokens(
            logits,
            inputs.temperature,
            inputs.top_k,
            inputs.top_p,
            inputs.min_p,
            inputs.seeds,
            inputs.token_indices,
            rows_sharding=rows_sharding,
        )
    else:
        greedy_token_ids = first_argmax(logits)
        token_ids = jax.lax.cond(
            jnp.any(inputs.temperature > 0),
            lambda: _sample_random(logits, greedy_token_ids, inputs, candidates),
            lambda: greedy_token_ids,
        )
    num_rows, num_top = logits.shape[0], max(max_logprobs, 1)

    def logprobs_of(logits):  # the model's
        logprobs = row_log_softmax(logits)  # every row alike in a call of any size (a decode or verify step)
        top_logprobs, top_token_ids = jax.lax.top_k(logprobs, num_top)
        sampled = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
        return sampled, top_logprobs, top_token_ids.astype(jnp.int32), token_ranks(logprobs, sampled)

    def no_logprobs(_):
        return (
            jnp.zeros((num_rows,), jnp.float32),
            jnp.zeros((num_rows, num_top), jnp.float32),
            jnp.zeros((num_rows, num_top), jnp.int32),
            jnp.zeros((num_rows,), jnp.int32),
        )

    sampled_logprobs, top_logprobs, top_token_ids, ranks = jax.lax.cond(
        jnp.any(inputs.wants_logprobs), logprobs_of, no_logprobs, logits if model_logits is None else model_logits
    )
    no_token_allowed = jnp.take_along_axis(logits, token_ids[:, None], axis=-1)[:, 0] == -jnp.inf
    return SamplerOutput(token_ids, sampled_logprobs, top_logprobs, top_token_ids, ranks, no_token_allowed)


def token_ranks(logprobs, chosen):
    """logprobs [N, V], chosen [N] (a token's logprob in each row) -> [N] int32: the tokens at least as likely as it,
    itself included (vLLM's rank: 1 for the most likely; tied tokens share the worse rank)."""
    return jnp.sum(logprobs >= chosen[:, None], axis=-1, dtype=jnp.int32)
