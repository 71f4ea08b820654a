"""Ragged paged latent attention as a Pallas kernel (Triton on GPU; interpret mode on the CPU): the
contract of latent_reference.ragged_paged_latent_attention, reading both pools' pages in place.

Grid: (query block,). With one cache head, a program's rows are all of its block's tokens x query heads
(pallas_layout.py, padded to a power of two of at least MIN_ROWS rows). It walks the block's pages in
spans, gathering the span's halves from the two pools through the page table, and scores them as a sum
of matmuls (the query's first half against the key pool's, its second against the value pool's), never
joining the halves into one tile. Triton lowers only power-of-two tiles, and a half need not be one
(DeepSeek's entry is 512 + 64 lanes, halves of 288), so each half is read in power-of-two lane pieces
(256 + 32; lane_chunks), each its own matmul. The same tiles are the values, folded into one
accumulator each with an online softmax in float32. Spans past the block's newest position are never
visited.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.paged_attention.pallas_layout import (
    MASK_VALUE,
    block_page_rows,
    block_sizes,
    cdiv,
    query_rows,
    row_positions,
    tokens_from_rows,
)

MIN_ROWS = 16  # matmul tiles on GPUs want at least 16 rows (and Triton, a power of two)

# Legend: N = query blocks, R = rows per program (B tokens x H heads, padded), C = lanes per pool, L = keys.


def lane_chunks(width: int) -> tuple[tuple[int, int], ...]:
    """(start, size) pieces of a row of `width` lanes, each a power of two, largest first (288 -> 256, 32):
    Triton lowers only power-of-two tiles, and an entry half (DeepSeek's 576 / 2) need not be one."""
    chunks, start = [], 0
    for bit in reversed(range(width.bit_length())):
        if width & (1 << bit):
            chunks.append((start, 1 << bit))
            start += 1 << bit
    return tuple(chunks)


def _kernel(
    first_q_ref,
    second_q_ref,
    first_pages_ref,
    second_pages_ref,
    pages_ref,
    positions_ref,
    first_out_ref,
    second_out_ref,
    *,
    pages_per_span: int,
    scale: float,
):
    rows, half = first_q_ref.shape
    chunks = lane_chunks(half)
    page_size = first_pages_ref.shape[1]
    span = pages_per_span * page_size
    dtype = first_pages_ref.dtype
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None  # no TF32 for float32
    q_refs, pool_refs, out_refs = (
        (first_q_ref, second_q_ref),
        (first_pages_ref, second_pages_ref),
        (
            first_out_ref,
            second_out_ref,
        ),
    )
    queries = [q_ref[:, pl.ds(start, size)].astype(dtype) for q_ref in q_refs for start, size in chunks]
    positions = positions_ref[...]  # [R]; -1 for padding rows
    newest = jnp.max(positions)  # the block's newest key
    num_spans = jnp.clip((newest + span) // span, 0, pages_ref.shape[0] // pages_per_span)

    def attend_span(index, carry):
        running_max, denominator, sums = carry
        pages = pages_ref[pl.ds(index * pages_per_span, pages_per_span)]
        tiles = [
            pool_ref[pages, :, pl.ds(start, size)].reshape(span, size)
            for pool_ref in pool_refs
            for start, size in chunks
        ]  # [L, size] each: the entry's lanes, piece by piece
        # rows past the block's newest key hold whatever the page's last owner left (NaN, even): zeroed
        written = (index * span + jnp.arange(span) <= newest)[:, None]  # [L, 1]
        tiles = [jnp.where(written, tile, jnp.zeros_like(tile)) for tile in tiles]
        scores = sum(
            jnp.dot(query, tile.T, preferred_element_type=jnp.float32, precision=precision)
            for query, tile in zip(queries, tiles)
        )
        scores = scores * scale  # [R, L]
        visible = index * span + jnp.arange(span)[None, :] <= positions[:, None]
        scores = jnp.where(visible, scores, MASK_VALUE)
        new_max = jnp.maximum(running_max, scores.max(axis=-1))
        rescale = jnp.exp(running_max - new_max)
        weights = jnp.where(visible, jnp.exp(scores - new_max[:, None]), 0.0)
        denominator = denominator * rescale + weights.sum(axis=-1)
        weights = weights.astype(dtype)
        sums = tuple(
            total * rescale[:, None] + jnp.dot(weights, tile, preferred_element_type=jnp.float32, precision=precision)
            for total, tile in zip(sums, tiles)
        )
        return new_max, denominator, sums

    init = (
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        tuple(jnp.zeros((rows, size), jnp.float32) for _ in pool_refs for _, size in chunks),
    )
    _, denominator, sums = jax.lax.fori_loop(0, num_spans, attend_span, init)
    normalizer = jnp.where(denominator > 0, denominator, 1.0)[:, None]
    seen = (positions >= 0)[:, None]
    pieces = iter(sums)
    for out_ref in out_refs:
        for start, size in chunks:
            out_ref[:, pl.ds(start, size)] = jnp.where(seen, next(pieces) / normalizer, 0.0).astype(out_ref.dtype)


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
    """Same arguments and result as latent_reference.ragged_paged_latent_attention."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    num_tokens, num_heads, width = q.shape
    num_pages, page_size, num_cache_heads, half = first_pages.shape
    if num_cache_heads != 1 or width != 2 * half:
        raise ValueError(
            f"latent attention reads one cache head of q's width / 2, got {first_pages.shape}, q {q.shape}"
        )
    num_blocks = num_tokens // query_block
    pages_per_span = block_sizes(half, page_size, first_pages.dtype)
    table_pages = cdiv(page_table.shape[1], pages_per_span) * pages_per_span
    block_pages = block_page_rows(page_table, token_seq_ids, query_block, table_pages)
    padded_rows = max(MIN_ROWS, 1 << (query_block * num_heads - 1).bit_length())
    queries = query_rows(q, query_block, 1, padded_rows)[:, 0]  # [N, R, 2C]
    positions_by_row = row_positions(positions, query_block, num_heads, padded_rows)

    rows_spec = pl.BlockSpec((None, padded_rows, half), lambda n: (n, 0, 0))
    pool_spec = pl.BlockSpec((num_pages, page_size, None, half), lambda n: (0, 0, 0, 0))
    out_shape = jax.ShapeDtypeStruct((num_blocks, padded_rows, half), q.dtype)
    first_out, second_out = pl.pallas_call(
        functools.partial(_kernel, pages_per_span=pages_per_span, scale=scale),
        grid=(num_blocks,),
        in_specs=[
            rows_spec,
            rows_spec,
            pool_spec,
            pool_spec,
            pl.BlockSpec((None, table_pages), lambda n: (n, 0)),
            pl.BlockSpec((None, padded_rows), lambda n: (n, 0)),
        ],
        out_specs=[rows_spec, rows_spec],
        out_shape=[out_shape, out_shape],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4 if padded_rows <= 32 else 8, num_stages=2),
        name="ragged_paged_latent_attention",
    )(queries[..., :half], queries[..., half:], first_pages, second_pages, block_pages, positions_by_row)
    out = jnp.concatenate([first_out, second_out], axis=-1)[:, None]  # [N, 1, R, 2C]
    return tokens_from_rows(out, query_block, num_heads)
