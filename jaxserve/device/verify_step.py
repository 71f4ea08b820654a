"""Speculative verification inside one compiled step: every row is a block of W = k + 1 tokens (its
newest token, then up to k proposed ones), and the target model scores all W positions at once.

Acceptance, on the device. Position i of a row is sampled exactly as a plain decode step would sample
output token `token_index + i` after the proposals before it: the same logits processors (penalties
counting the proposals before i as output, logit bias, min_tokens' bans by token index, the allowed-token
mask), the same top-k / top-p / min-p filter, and the same random draw (the row's seed folded with the
token's index, inverse CDF). The row accepts the longest prefix of proposals equal to those samples, then
the sample after it (the correction, or the bonus token when every proposal was accepted).

Why that is exact (Leviathan et al. with a point-mass draft): for a deterministic proposer the draft
distribution puts all its mass on the proposal d, so rejection sampling accepts d with probability
p(d) and otherwise samples from p with d removed, renormalized. Any exact draw from p gives exactly that: the
sample equals d with probability p(d), and given that it does not, it is distributed as p restricted
to the other tokens. So every output token is a sample from the target's own distribution given the
tokens before it; greedy rows (a point mass at the argmax) accept the longest prefix equal to the
argmax. As a consequence a seeded request produces the same tokens with speculation on or off.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.arrays import HostOrDeviceArray
from jaxserve.device.logits_processors import process_logits
from jaxserve.device.prompt_logprobs import no_prompt_logprobs
from jaxserve.device.sampler import SamplingInputs, sample
from jaxserve.device.sequence_buffers import SequenceBuffers, gather_entries, rows_by_rank
from jaxserve.device.step import expert_token_counts, rows_whole
from jaxserve.device.step_inputs import StepInputs
from jaxserve.lora.slots import bind_row_slots
from jaxserve.models.kv_pages import KVPages
from pallas_kernels.matmul.row_blocks import verify_rows

# Legend: S = verify rows, W = tokens per row (k + 1), V = vocab, E = token buffer entries.


@jax.tree_util.register_dataclass
@dataclass
class VerifyInputs:
    """A plain step's inputs laid out in W-token query blocks, with one sampling row per position:
    logits_indices and sampling have S * W rows (row s's position i at s * W + i); sampled_entries has S."""

    step: StepInputs
    draft_token_ids: HostOrDeviceArray  # [S, W - 1] int32: row s's proposals, -1 beyond them


def accepted_lengths(sampled_token_ids, no_token_allowed, draft_token_ids):
    """[S * W] samples, [S, W - 1] proposals -> [S] int32: proposals accepted, each row's longest prefix
    equal to the samples (a position whose processors allowed no token accepts nothing after it)."""
    num_rows, width = draft_token_ids.shape[0], draft_token_ids.shape[1] + 1
    samples = sampled_token_ids.reshape(num_rows, width)[:, :-1]
    allowed = ~no_token_allowed.reshape(num_rows, width)[:, :-1]
    matches = (samples == draft_token_ids) & allowed & (draft_token_ids >= 0)
    return jnp.cumprod(matches.astype(jnp.int32), axis=1).sum(axis=1).astype(jnp.int32)


def counts_with_drafts(output_counts, draft_token_ids):
    """[S, V] output counts -> [S * W, V]: position i of a row counts the row's first i proposals as
    output too (the tokens it follows, were they accepted)."""
    num_rows, width = draft_token_ids.shape[0], draft_token_ids.shape[1] + 1
    vocab_size = output_counts.shape[-1]
    counts = jnp.repeat(output_counts, width, axis=0)
    before = jnp.arange(width - 1)[None, :] < jnp.arange(width)[:, None]  # [W, W - 1]: proposal j precedes i
    tokens = jnp.where(before[None] & (draft_token_ids[:, None, :] >= 0), draft_token_ids[:, None, :], vocab_size)
    rows = jnp.broadcast_to(jnp.arange(num_rows * width).reshape(num_rows, width, 1), tokens.shape)
    return counts.at[rows, tokens].add(1, mode="drop")  # out-of-range columns: nothing to count


def verify(
    logits, sampling: SamplingInputs, draft_token_ids, penalty_state_of_rows, max_logprobs: int, rows_sharding=None
):
    """logits [S * W, V] -> (samples and their logprobs per position, [S] proposals accepted).
    penalty_state_of_rows: () -> the rows' [S, V] output counts and [S, W'] prompt bitmasks."""
    width = draft_token_ids.shape[1] + 1

    def penalty_state():
        counts, prompt = penalty_state_of_rows()
        return counts_with_drafts(counts, draft_token_ids), jnp.repeat(prompt, width, axis=0)

    processed = process_logits(logits, sampling, penalty_state)
    sampled = sample(processed, sampling, max_logprobs, model_logits=logits, rows_sharding=rows_sharding)
    return sampled, accepted_lengths(sampled.token_ids, sampled.no_token_allowed, draft_token_ids)


def record_accepted(buffers: SequenceBuffers, entries, sampled_token_ids, num_accepted) -> SequenceBuffers:
    """Each row's accepted proposals and the sample after them become its output on the device: the last
    is its entry's newest token, all are counted (penalties). entries: rank-local, as the step's."""
    num_rows = entries.shape[0]
    samples = sampled_token_ids.reshape(num_rows, -1)  # [S, W]
    vocab_size = jnp.asarray(buffers.output_counts).shape[-1]
    kept = jnp.arange(samples.shape[1])[None, :] <= num_accepted[:, None]
    columns = jnp.where(kept, samples, vocab_size)
    newest = samples[jnp.arange(num_rows), num_accepted]

    def one_rank(newest_part, counts_part, rank_entries, rank_newest, rank_columns):
        rows = jnp.broadcast_to(rank_entries[:, None], rank_columns.shape)
        return newest_part.at[rank_entries].set(rank_newest), counts_part.at[rows, rank_columns].add(1, mode="drop")

    newest_token_ids, output_counts = jax.vmap(one_rank)(
        jnp.asarray(buffers.newest_token_ids),
        jnp.asarray(buffers.output_counts),
        *rows_by_rank(buffers, entries, newest, columns),
    )
    return SequenceBuffers(
        newest_token_ids=newest_token_ids, output_counts=output_counts, prompt_tokens=buffers.prompt_tokens
    )


def verify_step(
    graphdef,
    params_treedef,
    param_leaves,
    kv_pages: KVPages,
    buffers: SequenceBuffers,
    inputs: VerifyInputs,
    *,
    max_logprobs: int,
    num_experts: int,
    sampler_sharding=None,
):
    """step()'s contract for verify rows: (samples [S * W], prompt logprobs (none), routing counts, pages,
    buffers, [S] proposals accepted). Every row's tokens are known to the host (a row proposes only
    after its newest token was fetched), so nothing is read from the token buffer."""
    step_inputs = inputs.step
    model = nnx.merge(graphdef, jax.tree.unflatten(params_treedef, param_leaves))
    bind_row_slots(model, step_inputs.lora_slots)  # each token's LoRA adapter (jaxserve/lora)
    with verify_rows():  # each row computed as a decode row is (pallas_kernels/matmul/row_blocks.py)
        (hidden, kv_pages), intermediates = nnx.capture(model, nnx.Intermediate)(
            step_inputs.token_ids, kv_pages, step_inputs.attention
        )
        logits = rows_whole(model.compute_logits(hidden[step_inputs.logits_indices]), sampler_sharding)
    counts = expert_token_counts(jax.tree.leaves(intermediates), step_inputs, num_experts)
    sampled, num_accepted = verify(
        logits,
        step_inputs.sampling,
        inputs.draft_token_ids,
        lambda: gather_entries(buffers, step_inputs.sampled_entries),
        max_logprobs,
        rows_sharding=sampler_sharding,
    )
    buffers = record_accepted(buffers, step_inputs.sampled_entries, sampled.token_ids, num_accepted)
    # verify rows decode: they score no prompt token (the outputs keep step()'s structure)
    scored = no_prompt_logprobs(step_inputs.token_ids.shape[0], max(max_logprobs, 1))
    return sampled, scored, counts, kv_pages, buffers, num_accepted
