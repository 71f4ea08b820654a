"""Ragged paged attention as a Pallas kernel: the reference's contract, reading K/V pages in place.

Grid: (query block, kv head). A program holds its block's query rows for one kv head (B tokens x G
query heads, padded to a multiple of MIN_ROWS for the matmul units) and walks the block's sequence
pages in spans of `pages_per_span` pages: it gathers those pages straight from the page pool through
the page table (no dense copy of the context), scores them with one matmul, and folds them into an
online softmax kept in float32. Spans past the block's newest position are never visited.

Written to Pallas' generic (Triton-style) GPU model; on the CPU it runs with interpret=True.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MIN_ROWS = 16  # matmul tiles on GPUs want at least 16 rows (and Triton, a power of two)
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked span gives no NaN


def block_sizes(head_dim: int, page_size: int, dtype) -> int:
    """Pages per span: about 64 keys of float32 (128 of 16-bit types) per step of the online softmax,
    so a span's K and V tiles stay within fast memory for head dims up to 256."""
    keys = 128 if jnp.dtype(dtype).itemsize <= 2 else 64
    keys = keys if head_dim <= 128 else keys // 2
    return max(1, keys // page_size)


def _kernel(q_ref, k_pages_ref, v_pages_ref, pages_ref, positions_ref, o_ref, *, pages_per_span: int,
            sliding_window: int | None):
    rows, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[1]
    span = pages_per_span * page_size
    queries = q_ref[...].astype(jnp.float32) * (head_dim ** -0.5)
    positions = positions_ref[...]  # [R]; -1 for padding rows
    num_spans = (jnp.max(positions) + span) // span

    def attend_span(index, carry):
        running_max, denominator, accumulator = carry
        pages = pages_ref[pl.ds(index * pages_per_span, pages_per_span)]
        keys = k_pages_ref[pages].reshape(span, head_dim).astype(jnp.float32)
        values = v_pages_ref[pages].reshape(span, head_dim).astype(jnp.float32)
        scores = jnp.dot(queries, keys.T, preferred_element_type=jnp.float32)  # [R, L]
        key_positions = index * span + jnp.arange(span)[None, :]
        visible = key_positions <= positions[:, None]
        if sliding_window:
            visible &= key_positions > positions[:, None] - sliding_window
        scores = jnp.where(visible, scores, MASK_VALUE)
        new_max = jnp.maximum(running_max, scores.max(axis=-1))
        rescale = jnp.exp(running_max - new_max)
        weights = jnp.exp(scores - new_max[:, None])
        denominator = denominator * rescale + weights.sum(axis=-1)
        accumulator = accumulator * rescale[:, None] + jnp.dot(weights, values, preferred_element_type=jnp.float32)
        return new_max, denominator, accumulator

    init = (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    _, denominator, accumulator = jax.lax.fori_loop(0, num_spans, attend_span, init)
    out = accumulator / jnp.where(denominator > 0, denominator, 1.0)[:, None]
    o_ref[...] = jnp.where((positions >= 0)[:, None], out, 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("query_block", "sliding_window", "interpret"))
def ragged_paged_attention(q, k_pages, v_pages, page_table, token_seq_ids, positions, *, query_block: int,
                           sliding_window: int | None = None, interpret: bool | None = None):
    """Same arguments and result as reference.ragged_paged_attention."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    groups = num_heads // num_kv_heads
    num_blocks = num_tokens // query_block
    pages_per_span = block_sizes(head_dim, page_size, k_pages.dtype)

    block_pages = page_table[token_seq_ids[::query_block]]  # [N, P]: page-table rows, not pages
    block_pages = jnp.pad(block_pages, ((0, 0), (0, -block_pages.shape[1] % pages_per_span)))
    rows = query_block * groups
    padded_rows = max(MIN_ROWS, 1 << (rows - 1).bit_length())  # Triton blocks are powers of two
    # [N, K, B*G, D]: a block's rows for one kv head are contiguous
    queries = q.reshape(num_blocks, query_block, num_kv_heads, groups, head_dim).transpose(0, 2, 1, 3, 4)
    queries = queries.reshape(num_blocks, num_kv_heads, rows, head_dim)
    queries = jnp.pad(queries, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
    row_positions = jnp.repeat(positions.reshape(num_blocks, query_block), groups, axis=1)
    row_positions = jnp.pad(row_positions, ((0, 0), (0, padded_rows - rows)), constant_values=-1)

    out = pl.pallas_call(
        functools.partial(_kernel, pages_per_span=pages_per_span, sliding_window=sliding_window),
        grid=(num_blocks, num_kv_heads),
        in_specs=[
            pl.BlockSpec((None, None, padded_rows, head_dim), lambda n, k: (n, k, 0, 0)),
            pl.BlockSpec((num_pages, page_size, None, head_dim), lambda n, k: (0, 0, k, 0)),
            pl.BlockSpec((num_pages, page_size, None, head_dim), lambda n, k: (0, 0, k, 0)),
            pl.BlockSpec((None, block_pages.shape[1]), lambda n, k: (n, 0)),
            pl.BlockSpec((None, padded_rows), lambda n, k: (n, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, padded_rows, head_dim), lambda n, k: (n, k, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((num_blocks, num_kv_heads, padded_rows, head_dim), q.dtype),
        interpret=interpret,
        name="ragged_paged_attention",
    )(queries, k_pages, v_pages, block_pages, row_positions)
    out = out[:, :, :rows].reshape(num_blocks, num_kv_heads, query_block, groups, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(num_tokens, num_heads, head_dim)


def _write_kernel(slot_ids_ref, k_ref, v_ref, k_pages_in_ref, v_pages_in_ref, k_pages_ref, v_pages_ref, *,
                  tokens_per_program: int):
    del k_pages_in_ref, v_pages_in_ref  # aliased to the outputs: the pages are updated in place
    page_size = k_pages_ref.shape[1]
    first = pl.program_id(0) * tokens_per_program

    def write_token(index, carry):
        slot = slot_ids_ref[first + index]
        page, offset = slot // page_size, slot % page_size
        k_pages_ref[page, offset] = k_ref[index].astype(k_pages_ref.dtype)
        v_pages_ref[page, offset] = v_ref[index].astype(v_pages_ref.dtype)
        return carry

    jax.lax.fori_loop(0, tokens_per_program, write_token, 0)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0, 1))
def write_kv_pages(k_pages, v_pages, k, v, slot_ids, *, interpret: bool | None = None):
    """Same contract as reference.write_kv_pages: token t's K/V [K, D] goes to slot slot_ids[t]."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    num_tokens, num_kv_heads, head_dim = k.shape
    tokens_per_program = next(n for n in (16, 8, 4, 2, 1) if num_tokens % n == 0)
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
    return pl.pallas_call(
        functools.partial(_write_kernel, tokens_per_program=tokens_per_program),
        grid=(num_tokens // tokens_per_program,),
        in_specs=[whole(slot_ids.shape),
                  pl.BlockSpec((tokens_per_program, num_kv_heads, head_dim), lambda i: (i, 0, 0)),
                  pl.BlockSpec((tokens_per_program, num_kv_heads, head_dim), lambda i: (i, 0, 0)),
                  whole(k_pages.shape), whole(v_pages.shape)],
        out_specs=[whole(k_pages.shape), whole(v_pages.shape)],
        out_shape=[jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={3: 0, 4: 1},
        interpret=interpret,
        name="write_kv_pages",
    )(slot_ids, k, v, k_pages, v_pages)
