"""On-device sampling with per-row parameters, inside the step's executable (no host sync inside).

Each row draws its randomness from (its seed, the index of the token being sampled) alone, so a seeded
request samples the same tokens whatever else shares the batch, and after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.arrays import HostOrDeviceArray
from jaxserve.models.layers import row_log_softmax, row_softmax

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
    """argmax over the last axis (first index on ties), as a max over blocks then within one block.

    XLA's CPU argmax over a [S, V] vocabulary row is several times slower than this two-level form.
    """
    num_rows, size = values.shape
    blocks = jnp.pad(values, ((0, 0), (0, -size % block)), constant_values=-jnp.inf).reshape(num_rows, -1, block)
    best_block = jnp.argmax(blocks.max(axis=-1), axis=-1)  # [S]
    within = jnp.take_along_axis(blocks, best_block[:, None, None], axis=1)[:, 0]  # [S, block]
    return (best_block * block + jnp.argmax(within, axis=-1)).astype(jnp.int32)


def _filter_top_k_top_p_min_p(scaled_logits, inputs: SamplingInputs):
    """Mask (to -inf) every token that top-k, top-p or min-p rules out; the most likely always stays."""
    vocab_size = scaled_logits.shape[-1]
    order = jnp.argsort(-scaled_logits, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled_logits, order, axis=-1)
    rank = jnp.arange(vocab_size)[None, :]
    keep = (inputs.top_k[:, None] <= 0) | (rank < inputs.top_k[:, None])
    probs = row_softmax(jnp.where(keep, sorted_logits, -jnp.inf))  # a row's mass alike in any step
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < inputs.top_p[:, None]
    keep &= probs >= inputs.min_p[:, None] * probs[:, :1]
    keep |= rank == 0
    filtered_sorted = jnp.where(keep, sorted_logits, -jnp.inf)
    rows = jnp.arange(scaled_logits.shape[0])[:, None]
    return jnp.full_like(scaled_logits, -jnp.inf).at[rows, order].set(filtered_sorted)


def _sample_random(logits, greedy_token_ids, inputs: SamplingInputs):
    is_random = inputs.temperature > 0
    scaled = logits / jnp.where(is_random, inputs.temperature, 1.0)[:, None]
    needs_filter = jnp.any(is_random & ((inputs.top_k > 0) | (inputs.top_p < 1) | (inputs.min_p > 0)))
    scaled = jax.lax.cond(needs_filter, _filter_top_k_top_p_min_p, lambda x, _: x, scaled, inputs)
    keys = jax.vmap(lambda seed, index: jax.random.fold_in(jax.random.wrap_key_data(seed), index))(
        inputs.seeds, inputs.token_indices
    )
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(keys)
    sampled = first_argmax(scaled + gumbel)
    return jnp.where(is_random, sampled, greedy_token_ids)


def sample(logits, inputs: SamplingInputs, max_logprobs: int, model_logits=None) -> SamplerOutput:
    """logits [S, V] float32 (after the logits processors) -> sampled tokens and their log-probabilities
    under the model's own distribution (`model_logits`, before the processors; default: `logits`), as
    vLLM reports them."""
    greedy_token_ids = first_argmax(logits)
    token_ids = jax.lax.cond(
        jnp.any(inputs.temperature > 0), _sample_random, lambda _, g, __: g, logits, greedy_token_ids, inputs
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
