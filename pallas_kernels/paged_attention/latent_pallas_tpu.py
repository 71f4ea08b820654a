"""Ragged paged latent attention for TPUs (Mosaic): the contract of latent_reference.ragged_paged_latent_attention.

Grid: (query block, page of its sequence). The page table rows and each block's newest position are
scalar-prefetched; the index maps pick each step's page of both pools straight from the page pool in HBM
(Pallas pipelines the copies into VMEM, double buffered), so only the block's own pages are read. A page
past the block's newest position maps to the last one needed, which Pallas does not copy again, and is
skipped. A program's rows are the block's tokens x all query heads (one cache head), padded to whole
sublane tiles; the online softmax state lives in VMEM scratch across the page steps, in float32. Each
entry half is scored and accumulated as it lies (no power-of-two constraint on Mosaic: a block's last
dims are the arrays' own). On the CPU it runs in Pallas' TPU interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention.pallas_layout import (
    MASK_VALUE,
    block_page_rows,
    cdiv,
    query_rows,
    row_positions,
    tokens_from_rows,
)

MIN_ROWS = 8  # sublanes of a TPU vector register

# Legend: N = query blocks, R = rows per program (B tokens x H heads, padded), C = lanes per pool.


def _scores(queries, keys):
    """queries [R, C] . keys [L, C] -> [R, L] in float32, contracting lanes (no transpose materialized)."""
    return jax.lax.dot_general(queries, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _kernel(
    block_pages_ref,
    block_max_position_ref,
    first_q_ref,
    second_q_ref,
    positions_ref,
    first_page_ref,
    second_page_ref,
    first_out_ref,
    second_out_ref,
    running_max_ref,
    denominator_ref,
    first_sum_ref,
    second_sum_ref,
    *,
    scale: float,
):
    del block_pages_ref  # used by the index maps
    block, page = pl.program_id(0), pl.program_id(1)
    page_size = first_page_ref.shape[0]

    @pl.when(page == 0)
    def _start():
        running_max_ref[...] = jnp.full(running_max_ref.shape, MASK_VALUE, jnp.float32)
        denominator_ref[...] = jnp.zeros(denominator_ref.shape, jnp.float32)
        first_sum_ref[...] = jnp.zeros(first_sum_ref.shape, jnp.float32)
        second_sum_ref[...] = jnp.zeros(second_sum_ref.shape, jnp.float32)

    @pl.when(page * page_size <= block_max_position_ref[block])
    def _attend():
        first, second = first_page_ref[...], second_page_ref[...]  # [page_size, C] each
        # rows past the block's newest key hold whatever the page's last owner left (NaN, even): zeroed
        rows = page * page_size + jax.lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
        written = rows <= block_max_position_ref[block]
        first = jnp.where(written, first, jnp.zeros_like(first))
        second = jnp.where(written, second, jnp.zeros_like(second))
        dtype = first.dtype
        scores = _scores(first_q_ref[...].astype(dtype), first) + _scores(second_q_ref[...].astype(dtype), second)
        scores = scores * scale  # [R, page_size]
        key_positions = page * page_size + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        visible = key_positions <= positions_ref[...]  # [R, 1]: -1 for padding rows
        scores = jnp.where(visible, scores, MASK_VALUE)
        running_max = running_max_ref[...]
        new_max = jnp.maximum(running_max, scores.max(axis=-1, keepdims=True))
        rescale = jnp.exp(running_max - new_max)
        weights = jnp.where(visible, jnp.exp(scores - new_max), 0.0)
        denominator_ref[...] = denominator_ref[...] * rescale + weights.sum(axis=-1, keepdims=True)
        running_max_ref[...] = new_max
        weights = weights.astype(dtype)
        first_sum_ref[...] = first_sum_ref[...] * rescale + jnp.dot(weights, first, preferred_element_type=jnp.float32)
        second_sum_ref[...] = second_sum_ref[...] * rescale + jnp.dot(
            weights, second, preferred_element_type=jnp.float32
        )

    @pl.when(page == pl.num_programs(1) - 1)
    def _finish():
        denominator = denominator_ref[...]
        normalizer = jnp.where(denominator > 0, denominator, 1.0)
        seen = positions_ref[...] >= 0
        first_out_ref[...] = jnp.where(seen, first_sum_ref[...] / normalizer, 0.0).astype(first_out_ref.dtype)
        second_out_ref[...] = jnp.where(seen, second_sum_ref[...] / normalizer, 0.0).astype(second_out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("query_block", "scale", "interpret"))
def ragged_paged_latent_attention(
    q,
    first_pages,
    second_pages,
    page_table,
    token_seq_ids,
    positions,
    *,
    query_block: int,
    scale: float,
    interpret: bool | None = None,
):
    """Same arguments and result as latent_reference.ragged_paged_latent_attention; interpret: Pallas' TPU
    interpret mode (default: off a TPU)."""
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    num_tokens, num_heads, width = q.shape
    _, page_size, num_cache_heads, half = first_pages.shape
    if num_cache_heads != 1 or width != 2 * half:
        raise ValueError(
            f"latent attention reads one cache head of q's width / 2, got {first_pages.shape}, q {q.shape}"
        )
    num_blocks = num_tokens // query_block
    block_pages = block_page_rows(page_table, token_seq_ids, query_block, page_table.shape[1])  # [N, P]
    block_max_position = positions.reshape(num_blocks, query_block).max(axis=1)  # [N]
    padded_rows = cdiv(query_block * num_heads, MIN_ROWS) * MIN_ROWS
    queries = query_rows(q, query_block, 1, padded_rows)[:, 0]  # [N, R, 2C]
    positions_by_row = row_positions(positions, query_block, num_heads, padded_rows)[..., None]  # [N, R, 1]

    def page_index(block, page, block_pages, block_max_position):
        last_needed = jnp.maximum(block_max_position[block], 0) // page_size  # later pages: the same block again
        return (block_pages[block, jnp.minimum(page, last_needed)], 0, 0, 0)

    rows = lambda block, page, *_: (block, 0, 0)  # noqa: E731
    rows_spec = pl.BlockSpec((None, padded_rows, half), rows)
    page_spec = pl.BlockSpec((None, page_size, None, half), page_index)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(num_blocks, block_pages.shape[1]),
        in_specs=[rows_spec, rows_spec, pl.BlockSpec((None, padded_rows, 1), rows), page_spec, page_spec],
        out_specs=[rows_spec, rows_spec],
        scratch_shapes=[
            pltpu.VMEM((padded_rows, 1), jnp.float32),
            pltpu.VMEM((padded_rows, 1), jnp.float32),
            pltpu.VMEM((padded_rows, half), jnp.float32),
            pltpu.VMEM((padded_rows, half), jnp.float32),
        ],
    )
    out_shape = jax.ShapeDtypeStruct((num_blocks, padded_rows, half), q.dtype)
    first_out, second_out = pl.pallas_call(
        functools.partial(_kernel, scale=scale),
        grid_spec=grid_spec,
        out_shape=[out_shape, out_shape],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="ragged_paged_latent_attention",
    )(
        block_pages,
        block_max_position,
        queries[..., :half],
        queries[..., half:],
        positions_by_row,
        first_pages,
        second_pages,
    )
    out = jnp.concatenate([first_out, second_out], axis=-1)[:, None]  # [N, 1, R, 2C]
    return tokens_from_rows(out, query_block, num_heads)
