"""Ragged paged attention for TPUs (Mosaic): the reference's contract, pages copied HBM -> VMEM by DMA.

Grid: (query block, kv head); a program holds its block's query rows for one kv head (pallas_layout.py;
padded to whole tiles of MIN_ROWS sublanes). The page table rows and each block's newest position are
scalar-prefetched into SMEM; a program walks its sequence's pages in spans of `pages_per_span`,
DMAing each span's K and V pages (just this kv head's slice of each page, read in place from the
page pool in HBM) into one of two VMEM buffers while the other span is computed (double buffering),
and folds the span into an online softmax in float32 (matmuls in the KV dtype).
Spans past the block's newest position are never copied. On the CPU it runs in Pallas' TPU
interpret mode, which emulates the DMAs and semaphores.

Quantized pages (int8 / float8_e4m3, kv_quantization.py): each page's scales [page_size] for this kv head
travel by DMA beside its values; the values are widened to the queries' dtype in VMEM and the scales applied
to the scores' columns and the weights (the matmuls unchanged).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention.kv_quantization import split_pages
from pallas_kernels.paged_attention.pallas_layout import (
    MASK_VALUE,
    block_page_rows,
    block_sizes,
    cdiv,
    query_rows,
    row_positions,
    row_sinks,
    tokens_from_rows,
)

MIN_ROWS = 8  # sublanes of a TPU vector register


def _kernel(
    block_pages_ref,
    block_max_position_ref,
    q_ref,
    positions_ref,
    sinks_ref,
    k_pages_hbm,
    v_pages_hbm,
    *refs,
    pages_per_seq: int,
    pages_per_span: int,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    has_sinks: bool,
    quantized: bool,
):
    # quantized: the scale pools [num_pages, page_size, K] in HBM, and after the output their VMEM buffers
    if quantized:
        k_scales_hbm, v_scales_hbm, o_ref, k_buffers, v_buffers, k_scale_buffers, v_scale_buffers, semaphores = refs
    else:
        o_ref, k_buffers, v_buffers, semaphores = refs
        k_scales_hbm = v_scales_hbm = k_scale_buffers = v_scale_buffers = None
    block, kv_head = pl.program_id(0), pl.program_id(1)
    rows, head_dim = q_ref.shape
    page_size = k_buffers.shape[2]
    span = pages_per_span * page_size
    dtype = q_ref.dtype if quantized else k_buffers.dtype  # the matmuls' dtype
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None  # float32 stays float32 on the MXU
    queries = q_ref[...].astype(dtype)
    positions = positions_ref[...]  # [R, 1]; -1 for padding rows
    num_spans = (block_max_position_ref[block] + span) // span

    def span_copies(index, buffer):
        """The DMAs of span `index`'s K and V pages (this kv head's slice of each) into `buffer`."""
        copies = []
        for slot in range(pages_per_span):
            page = block_pages_ref[block * pages_per_seq + index * pages_per_span + slot]
            for source, target, kind in ((k_pages_hbm, k_buffers, 0), (v_pages_hbm, v_buffers, 1)):
                copies.append(
                    pltpu.make_async_copy(
                        source.at[page, :, kv_head, :], target.at[buffer, slot], semaphores.at[kind, buffer, slot]
                    )
                )
            if k_scales_hbm is not None and v_scales_hbm is not None:
                assert k_scale_buffers is not None and v_scale_buffers is not None
                for source, target, kind in ((k_scales_hbm, k_scale_buffers, 2), (v_scales_hbm, v_scale_buffers, 3)):
                    copies.append(
                        pltpu.make_async_copy(
                            source.at[page, :, kv_head], target.at[buffer, slot], semaphores.at[kind, buffer, slot]
                        )
                    )
        return copies

    @pl.when(num_spans > 0)
    def _():
        for copy in span_copies(0, 0):
            copy.start()

    def attend_span(index, carry):
        running_max, denominator, accumulator = carry
        buffer = index % 2

        @pl.when(index + 1 < num_spans)
        def _():  # double buffering: the next span's pages travel while this one is computed
            for copy in span_copies(index + 1, 1 - buffer):
                copy.start()

        for copy in span_copies(index, buffer):
            copy.wait()
        keys = k_buffers[buffer].reshape(span, head_dim).astype(dtype)
        values = v_buffers[buffer].reshape(span, head_dim).astype(dtype)
        scores = jax.lax.dot_general(
            queries, keys, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        ) * (head_dim**-0.5)  # [R, L]
        if k_scale_buffers is not None:
            scores = scores * k_scale_buffers[buffer].reshape(1, span)
        if logits_soft_cap:
            scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
        key_positions = index * span + jax.lax.broadcasted_iota(jnp.int32, (1, span), 1)
        visible = key_positions <= positions
        if sliding_window:
            visible &= key_positions > positions - sliding_window
        scores = jnp.where(visible, scores, MASK_VALUE)
        new_max = jnp.maximum(running_max, scores.max(axis=-1, keepdims=True))
        rescale = jnp.exp(running_max - new_max)
        weights = jnp.exp(scores - new_max)
        denominator = denominator * rescale + weights.sum(axis=-1, keepdims=True)
        # a page's rows past the block's newest key hold whatever its last owner left (NaN or inf, even), and a
        # weight of 0 times them is not 0: zeroed (their scales too), so only written keys reach the sums
        newest = block_max_position_ref[block]
        written_rows = index * span + jax.lax.broadcasted_iota(jnp.int32, (span, 1), 0) <= newest
        values = jnp.where(written_rows, values, jnp.zeros_like(values))
        if v_scale_buffers is not None:
            weights = weights * jnp.where(key_positions <= newest, v_scale_buffers[buffer].reshape(1, span), 0.0)
        accumulator = accumulator * rescale + jnp.dot(
            weights.astype(dtype), values, precision=precision, preferred_element_type=jnp.float32
        )
        return new_max, denominator, accumulator

    init = (
        jnp.full((rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    if has_sinks:  # each row's sink as a first key of weight exp(sink), no value
        init = (sinks_ref[...], jnp.ones((rows, 1), jnp.float32), init[2])
    _, denominator, accumulator = jax.lax.fori_loop(0, num_spans, attend_span, init)
    out = accumulator / jnp.where(denominator > 0, denominator, 1.0)
    o_ref[...] = jnp.where(positions >= 0, out, 0.0).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("query_block", "sliding_window", "logits_soft_cap", "interpret"))
def ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    page_table,
    token_seq_ids,
    positions,
    *,
    query_block: int,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks=None,
    interpret: bool | pltpu.InterpretParams | None = None,
):
    """Same arguments and result as reference.ragged_paged_attention. interpret: Pallas' TPU
    interpret mode (default: off a TPU), or its InterpretParams (to detect DMA races, say). Pages may be
    quantized (kv_quantization.QuantizedPages)."""
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    (k_pages, k_scales), (v_pages, v_scales) = split_pages(k_pages), split_pages(v_pages)
    quantized = k_scales is not None and v_scales is not None
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    groups = num_heads // num_kv_heads
    num_blocks = num_tokens // query_block
    pages_per_span = block_sizes(head_dim, page_size, k_pages.dtype)

    block_pages = block_page_rows(
        page_table, token_seq_ids, query_block, cdiv(page_table.shape[1], pages_per_span) * pages_per_span
    )
    pages_per_seq = block_pages.shape[1]
    block_max_position = positions.reshape(num_blocks, query_block).max(axis=1)  # [N]
    padded_rows = cdiv(query_block * groups, MIN_ROWS) * MIN_ROWS
    queries = query_rows(q, query_block, num_kv_heads, padded_rows)
    positions_by_row = row_positions(positions, query_block, groups, padded_rows)[..., None]  # [N, R, 1]
    sinks_by_row = row_sinks(sinks, query_block, num_kv_heads, padded_rows)[..., None]  # [K, R, 1]

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(num_blocks, num_kv_heads),
        in_specs=[
            pl.BlockSpec((None, None, padded_rows, head_dim), lambda n, k, *_: (n, k, 0, 0)),
            pl.BlockSpec((None, padded_rows, 1), lambda n, k, *_: (n, 0, 0)),
            pl.BlockSpec((None, padded_rows, 1), lambda n, k, *_: (k, 0, 0)),
            pl.BlockSpec(memory_space=pl.ANY),  # the page pools stay in HBM: pages are DMA'd in place
            pl.BlockSpec(memory_space=pl.ANY),
        ]
        + [pl.BlockSpec(memory_space=pl.ANY)] * (2 if quantized else 0),  # scale pools, likewise
        out_specs=pl.BlockSpec((None, None, padded_rows, head_dim), lambda n, k, *_: (n, k, 0, 0)),
        scratch_shapes=[
            pltpu.VMEM((2, pages_per_span, page_size, head_dim), k_pages.dtype),  # two buffers
            pltpu.VMEM((2, pages_per_span, page_size, head_dim), v_pages.dtype),
        ]
        + [pltpu.VMEM((2, pages_per_span, page_size), jnp.float32)] * (2 if quantized else 0)
        + [pltpu.SemaphoreType.DMA((4 if quantized else 2, 2, pages_per_span))],  # (K, V(, their scales), buffer, page)
    )
    out = pl.pallas_call(
        functools.partial(
            _kernel,
            pages_per_seq=pages_per_seq,
            pages_per_span=pages_per_span,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            has_sinks=sinks is not None,
            quantized=quantized,
        ),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_blocks, num_kv_heads, padded_rows, head_dim), q.dtype),
        interpret=interpret
        if isinstance(interpret, pltpu.InterpretParams)
        else (pltpu.InterpretParams() if interpret else False),
        name="ragged_paged_attention_tpu",
    )(
        block_pages.reshape(-1),
        block_max_position,
        queries,
        positions_by_row,
        sinks_by_row,
        k_pages,
        v_pages,
        *((k_scales, v_scales) if quantized else ()),
    )
    return tokens_from_rows(out, query_block, groups)
