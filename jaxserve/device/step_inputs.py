"""The one place host state becomes device arrays: scheduled chunks -> padded, bucketed step inputs.

Tokens are laid out flat, each chunk starting on a multiple of `query_block` (1 for decode steps).
Padding tokens have position -1 (they attend to nothing) and write their KV to the reserved page 0;
padding rows sample garbage that nobody reads.

The token buffer: the step writes each sampled token into the device's token buffer at its sequence's
entry, and reads a token the host has not seen yet (sampled by the step still running, when steps
overlap) from there. Where each data-parallel rank's entries, rows and tokens sit: device/rank_layout.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import numpy as np

from jaxserve.arrays import HostOrDeviceArray
from jaxserve.config import Buckets
from jaxserve.device.rank_layout import RankLayout
from jaxserve.device.sampler import SamplingInputs
from jaxserve.device.sampling_inputs import SamplingWidths, build_sampling_inputs
from jaxserve.host.page_allocator import RESERVED_PAGE, num_pages_for
from jaxserve.host.scheduler import ScheduledChunk, padded_to_blocks
from jaxserve.models.kv_pages import AttentionMetadata


@jax.tree_util.register_dataclass
@dataclass
class StepInputs:
    token_ids: HostOrDeviceArray  # [T] int32
    attention: AttentionMetadata
    logits_indices: HostOrDeviceArray  # [S] int32, the last token of each chunk
    sampling: SamplingInputs
    token_sources: HostOrDeviceArray  # [T] int32: rank-local token buffer entry to read the token from, or -1
    sampled_entries: HostOrDeviceArray  # [S] int32: rank-local token buffer entry each row's sampled token goes to
    # [T] int32: the prompt token that follows this position, whose logprob the step returns
    # (device/prompt_logprobs.py), or -1
    prompt_logprob_targets: HostOrDeviceArray
    # [T] int32: each token's LoRA adapter slot (jaxserve/lora; 0: the base model, and padding). Per token,
    # not per row: the model's projections see tokens, and ranks' tokens lie end to end as these do
    lora_slots: HostOrDeviceArray


@dataclass(frozen=True)
class StepShape:
    """The bucket a step is padded to; one compiled executable per distinct shape."""

    num_tokens: int  # T
    num_seqs: int  # S
    pages_per_seq: int  # P
    query_block: int = field(default=1)
    verifies: bool = False  # speculative verify rows (device/verify_step.py): query_block is k + 1

    @property
    def kind(self) -> str:
        if self.verifies:
            return "verify"
        return "decode" if self.query_block == 1 else "prefill"


def build_step_inputs(
    chunks: list[ScheduledChunk],
    shape: StepShape,
    page_size: int,
    widths: SamplingWidths,
    scratch_entry: int = 0,
) -> StepInputs:
    """Host numpy arrays for one step; the runner moves them to the device. Token buffer entries are the
    rank's own (its scheduler's, and scratch_entry for rows that sample for nobody)."""
    num_tokens, num_seqs, block = shape.num_tokens, shape.num_seqs, shape.query_block
    token_ids = np.zeros(num_tokens, np.int32)
    token_sources = np.full(num_tokens, -1, np.int32)
    sampled_entries = np.full(num_seqs, scratch_entry, np.int32)
    positions = np.full(num_tokens, -1, np.int32)
    kv_indices = np.full(num_tokens, RESERVED_PAGE * page_size, np.int32)
    token_seq_ids = np.zeros(num_tokens, np.int32)
    page_table = np.full((num_seqs, shape.pages_per_seq), RESERVED_PAGE, np.int32)
    logits_indices = np.zeros(num_seqs, np.int32)
    prompt_logprob_targets = np.full(num_tokens, -1, np.int32)
    lora_slots = np.zeros(num_tokens, np.int32)

    cursor = 0
    for row, chunk in enumerate(chunks):
        seq, n = chunk.seq, chunk.num_tokens
        pages = np.asarray(seq.page_ids[: num_pages_for(chunk.end, page_size)], np.int32)
        chunk_positions = np.arange(chunk.start, chunk.end, dtype=np.int32)
        # beyond it: the token the step before samples (overlapped, or a decode chain's step after a step in it)
        known_end = max(chunk.start, min(chunk.end, seq.num_tokens))
        token_ids[cursor : cursor + known_end - chunk.start] = seq.token_slice(chunk.start, known_end)
        if known_end < chunk.end:
            token_sources[cursor + known_end - chunk.start : cursor + n] = seq.token_buffer_entry
        if chunk.samples_next_token:
            sampled_entries[row] = seq.token_buffer_entry
        positions[cursor : cursor + n] = chunk_positions
        kv_indices[cursor : cursor + n] = pages[chunk_positions // page_size] * page_size + chunk_positions % page_size
        padded = padded_to_blocks(n, block)
        token_seq_ids[cursor : cursor + padded] = row
        page_table[row, : len(pages)] = pages
        lora_slots[cursor : cursor + n] = seq.lora_slot
        logits_indices[row] = cursor + n - 1
        scored = chunk.scored_positions  # position p's target: prompt token p + 1
        if scored:
            first = cursor + scored.start - chunk.start
            targets = seq.prompt_token_ids[scored.start + 1 : scored.stop + 1]
            prompt_logprob_targets[first : first + len(scored)] = targets
        cursor += padded
    if cursor > num_tokens or len(chunks) > num_seqs:
        raise AssertionError(f"{len(chunks)} chunks of {cursor} tokens do not fit the bucket {shape}")

    attention = AttentionMetadata(
        positions=positions,
        kv_indices=kv_indices,
        token_seq_ids=token_seq_ids,
        page_table=page_table,
        query_block=block,
    )
    return StepInputs(
        token_ids=token_ids,
        attention=attention,
        logits_indices=logits_indices,
        sampling=build_sampling_inputs(chunks, num_seqs, widths),
        token_sources=token_sources,
        sampled_entries=sampled_entries,
        prompt_logprob_targets=prompt_logprob_targets,
        lora_slots=lora_slots,
    )


def chunk_token_slots(chunks: list[ScheduledChunk], block: int) -> list[int]:
    """The token slot each chunk starts at within its rank's part of a step, as build_step_inputs lays them."""
    slots, cursor = [], 0
    for chunk in chunks:
        slots.append(cursor)
        cursor += padded_to_blocks(chunk.num_tokens, block)
    return slots


def build_ranked_inputs(
    per_rank_chunks: list[list[ScheduledChunk]],
    shape: StepShape,
    page_size: int,
    layout: RankLayout,
    widths: SamplingWidths,
) -> StepInputs:
    """One step for every data-parallel rank: each rank's inputs (with its own local page ids) laid end
    to end, as `layout` says (its own token buffer entries too). Only logits_indices point into the whole."""
    if len(per_rank_chunks) != layout.num_ranks:
        raise AssertionError(f"{len(per_rank_chunks)} ranks' chunks for a layout of {layout.num_ranks} ranks")
    per_rank = [build_step_inputs(chunks, shape, page_size, widths, layout.scratch_entry) for chunks in per_rank_chunks]
    if len(per_rank) == 1:
        return per_rank[0]
    for rank, inputs in enumerate(per_rank):
        inputs.logits_indices = inputs.logits_indices + layout.first_token(rank, shape.num_tokens)
    return jax.tree.map(lambda *arrays: np.concatenate(arrays), *per_rank)


def catch_up_step_shape(per_rank_chunks: list[list[ScheduledChunk]], buckets: Buckets, page_size: int) -> StepShape:
    """A decode step whose rows hold up to catch_up_width tokens each (a draft model's catch-up): the decode
    bucket of the rows, each row a query block of that width."""
    every = [chunk for chunks in per_rank_chunks for chunk in chunks]
    pages_per_seq = Buckets.fit(max(num_pages_for(chunk.end, page_size) for chunk in every), buckets.pages_per_seq)
    num_seqs = Buckets.fit(max(len(chunks) for chunks in per_rank_chunks), buckets.decode_seqs)
    width = buckets.catch_up_width
    return StepShape(num_seqs * width, num_seqs, pages_per_seq, width)


def decode_step_shapes(buckets: Buckets) -> list[StepShape]:
    """The decode buckets' shapes (one token per row)."""
    return [StepShape(s, s, p, 1) for s in buckets.decode_seqs for p in buckets.pages_per_seq]


def all_step_shapes(buckets: Buckets, prefill_query_block: int) -> list[StepShape]:
    """Every shape the runner compiles at warm-up: decode buckets, catch-up decode buckets (a draft
    model's), then prefill buckets."""
    shapes = decode_step_shapes(buckets)
    width = buckets.catch_up_width
    if width:
        shapes += [StepShape(s * width, s, p, width) for s in buckets.decode_seqs for p in buckets.pages_per_seq]
    block = prefill_query_block
    return shapes + [StepShape(t, t // block, p, block) for t in buckets.prefill_tokens for p in buckets.pages_per_seq]


def step_shape(
    per_rank_chunks: list[list[ScheduledChunk]],
    is_decode: bool,
    buckets: Buckets,
    page_size: int,
    prefill_query_block: int,
) -> StepShape:
    """The smallest bucket every rank's chunks fit in (ranks share one shape)."""
    every = [chunk for chunks in per_rank_chunks for chunk in chunks]
    pages_per_seq = Buckets.fit(max(num_pages_for(chunk.end, page_size) for chunk in every), buckets.pages_per_seq)
    if is_decode:
        num_seqs = Buckets.fit(max(len(chunks) for chunks in per_rank_chunks), buckets.decode_seqs)
        return StepShape(num_seqs, num_seqs, pages_per_seq, 1)
    block = prefill_query_block
    num_tokens = Buckets.fit(
        max(sum(padded_to_blocks(c.num_tokens, block) for c in chunks) for chunks in per_rank_chunks),
        buckets.prefill_tokens,
    )
    return StepShape(num_tokens, num_tokens // block, pages_per_seq, block)
