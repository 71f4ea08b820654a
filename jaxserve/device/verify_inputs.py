"""Host arrays for a verify step (device/verify_step.py): each verify chunk (a decode row widened by
its proposals) fills one query block of W = k + 1 token slots, and each of its positions gets a
sampling row of its own, the token index advancing by one per position.

Built on build_step_inputs (the one place host state becomes arrays), then widened: the proposals go
into the token slots after the newest token, logits are read at every position, and each row's
sampling parameters repeat W times.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxserve.config import Buckets
from jaxserve.device.rank_layout import RankLayout
from jaxserve.device.sampling_inputs import SamplingWidths
from jaxserve.device.step_inputs import StepShape, build_step_inputs
from jaxserve.device.verify_step import VerifyInputs
from jaxserve.host.page_allocator import num_pages_for
from jaxserve.host.schedule import ScheduledChunk


def build_verify_inputs(
    chunks: list[ScheduledChunk],
    shape: StepShape,
    page_size: int,
    widths: SamplingWidths,
    scratch_entry: int = 0,
) -> VerifyInputs:
    width, num_rows = shape.query_block, shape.num_seqs
    step = build_step_inputs(chunks, shape, page_size, widths, scratch_entry)
    drafts = np.full((num_rows, width - 1), -1, np.int32)
    for row, chunk in enumerate(chunks):
        num_drafts = len(chunk.draft_token_ids)
        slot = row * width  # every chunk fits one block
        step.token_ids[slot + 1 : slot + 1 + num_drafts] = chunk.draft_token_ids
        step.token_sources[slot + 1 : slot + 1 + num_drafts] = -1  # the proposals, not the token buffer
        drafts[row, :num_drafts] = chunk.draft_token_ids
    step.logits_indices = np.arange(num_rows * width, dtype=np.int32)
    sampling = jax.tree.map(lambda x: np.repeat(x, width, axis=0), step.sampling)
    sampling.token_indices = sampling.token_indices + np.tile(np.arange(width, dtype=np.int32), num_rows)
    for row, chunk in enumerate(chunks):
        masks = chunk.seq.draft_token_masks  # a grammar row's: each position's after the proposals before it
        if chunk.draft_token_ids and masks is not None:
            sampling.allowed_tokens[row * width + 1 : row * width + 1 + len(masks)] = masks
    step.sampling = sampling
    return VerifyInputs(step=step, draft_token_ids=drafts)


def build_ranked_verify_inputs(
    per_rank_chunks: list[list[ScheduledChunk]],
    shape: StepShape,
    page_size: int,
    layout: RankLayout,
    widths: SamplingWidths,
) -> VerifyInputs:
    """Every data-parallel rank's verify rows laid end to end (as build_ranked_inputs does for steps)."""
    per_rank = [
        build_verify_inputs(chunks, shape, page_size, widths, layout.scratch_entry) for chunks in per_rank_chunks
    ]
    if len(per_rank) == 1:
        return per_rank[0]
    for rank, inputs in enumerate(per_rank):
        inputs.step.logits_indices = inputs.step.logits_indices + layout.first_token(rank, shape.num_tokens)
    return jax.tree.map(lambda *arrays: np.concatenate(arrays), *per_rank)


def verify_shapes(buckets: Buckets) -> list[StepShape]:
    """Every verify shape the runner compiles at warm-up (none when speculation is off)."""
    width = buckets.verify_width
    return [
        StepShape(rows * width, rows, pages, width, verifies=True)
        for rows in buckets.verify_seqs
        for pages in buckets.pages_per_seq
    ]


def verify_step_shape(per_rank_chunks: list[list[ScheduledChunk]], buckets: Buckets, page_size: int) -> StepShape:
    """The smallest verify bucket every rank's rows fit in."""
    every = [chunk for chunks in per_rank_chunks for chunk in chunks]
    pages = Buckets.fit(max(num_pages_for(chunk.end, page_size) for chunk in every), buckets.pages_per_seq)
    rows = Buckets.fit(max(len(chunks) for chunks in per_rank_chunks), buckets.verify_seqs)
    return StepShape(rows * buckets.verify_width, rows, pages, buckets.verify_width, verifies=True)
