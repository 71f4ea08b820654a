"""Ragged paged attention as a Pallas (Triton) kernel: the reference's contract, reading K/V pages in place.

Grid: (query block, kv head, context split). A program holds its block's query rows for one kv head
(pallas_layout.py; padded to a power of two of at least MIN_ROWS rows for the matmul units)
and walks its split of the block's sequence pages in spans of `pages_per_span` pages: it gathers
those pages straight from the page pool through the page table (no dense copy of the context),
scores them with one matmul in the KV dtype accumulating in float32, and folds them into an online
softmax kept in float32. Spans past the block's newest position are never visited.

Context splits (flash-decoding): a decode step of a few sequences has too few (block, kv head)
programs to keep a GPU's cores busy, so the page table is cut into `num_splits` parts that run in
parallel; each writes its unnormalized output with its running max and denominator, and a small
combine outside the kernel merges them. With one split the kernel normalizes in place.

Lowered with Triton on a GPU (chosen through its compiler params: JAX would otherwise pick Mosaic GPU
and stage whole blocks in shared memory), whose tiles must have power-of-two sizes and whose matmuls
want every dimension >= 16. page_size must then be a power of two (`supported`); a head_dim that is
not is served from a cache whose pages are wider (`cache_head_dim`, zero padded): the engine
allocates them so, the write kernel zero-fills the extra lanes, queries are padded to match, and
the softmax scale stays that of the real head_dim. On the CPU it runs with interpret=True, any sizes.

Quantized pages (int8 / float8_e4m3 with a float32 scale per token-head, kv_quantization.py): a span's
keys and values are widened to the queries' dtype (exact for both formats) and their scales applied to the
scores' columns and to the weights, so the matmuls stay as they are and no scaled copy of a page is made.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.paged_attention.kv_quantization import QuantizedPages, is_quantized, quantize, split_pages
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

MIN_ROWS = 16  # matmul tiles on GPUs want at least 16 rows (and Triton, a power of two)
PROGRAMS_PER_CORE = 2  # context splits aim for this many programs per GPU core (SM)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(head_dim: int, page_size: int, platform: str) -> str | None:
    """Why the kernel cannot run with these sizes on this platform (None: it can)."""
    if platform == "gpu" and not _is_power_of_two(page_size):  # Triton: power-of-two tiles
        return f"the Pallas GPU (Triton) kernel needs a power-of-two page_size, got {page_size}"
    return None


def cache_head_dim(head_dim: int, platform: str) -> int:
    """The head dim of the KV pages the kernel reads on this platform: on a GPU a power of two >= 16
    (Triton's tiles and matmuls), zero padded; the real head_dim elsewhere."""
    if platform != "gpu":
        return head_dim
    return max(16, 1 << (head_dim - 1).bit_length())


def default_num_splits(num_programs: int, num_spans: int, cores: int | None = None) -> int:
    """Context splits so that (blocks x kv heads x splits) covers the device's cores about
    PROGRAMS_PER_CORE times over, never more splits than spans in the page table. One on a CPU,
    where interpret mode runs programs one after another."""
    if cores is None:
        cores = getattr(jax.devices()[0], "core_count", 0) if jax.default_backend() == "gpu" else 0
    if not cores:
        return 1
    return max(1, min(num_spans, (PROGRAMS_PER_CORE * cores) // max(1, num_programs)))


def _kernel(
    q_ref,
    k_pages_ref,
    v_pages_ref,
    pages_ref,
    positions_ref,
    sinks_ref,
    *refs,
    pages_per_span: int,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    has_sinks: bool,
    normalize: bool,
    scale: float,
    quantized: bool,
):
    # quantized pages: their scales [num_pages, page_size] (this kv head's) come before the outputs
    k_scales_ref, v_scales_ref, *out_refs = refs if quantized else (None, None, *refs)
    rows, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[1]
    span = pages_per_span * page_size
    spans_per_split = pages_ref.shape[0] // pages_per_span
    first_span = pl.program_id(2) * spans_per_split
    keys_dtype = q_ref.dtype if quantized else k_pages_ref.dtype  # the matmuls' dtype
    precision = jax.lax.Precision.HIGHEST if keys_dtype == jnp.float32 else None  # no TF32 for float32
    queries = q_ref[...].astype(keys_dtype)
    positions = positions_ref[...]  # [R]; -1 for padding rows
    newest = jnp.max(positions)  # the block's newest key
    num_spans = jnp.clip((newest + span) // span - first_span, 0, spans_per_split)

    def attend_span(index, carry):
        running_max, denominator, accumulator = carry
        pages = pages_ref[pl.ds(index * pages_per_span, pages_per_span)]
        keys = k_pages_ref[pages].reshape(span, head_dim).astype(keys_dtype)
        values = v_pages_ref[pages].reshape(span, head_dim).astype(keys_dtype)
        scores = jnp.dot(queries, keys.T, preferred_element_type=jnp.float32, precision=precision)  # [R, L]
        scores = scores * scale  # the real head_dim's, when the pages are padded wider
        if quantized:
            assert k_scales_ref is not None
            scores = scores * k_scales_ref[pages].reshape(1, span)
        if logits_soft_cap:
            scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
        key_positions = (first_span + index) * span + jnp.arange(span)[None, :]
        visible = key_positions <= positions[:, None]
        if sliding_window:
            visible &= key_positions > positions[:, None] - sliding_window
        scores = jnp.where(visible, scores, MASK_VALUE)
        new_max = jnp.maximum(running_max, scores.max(axis=-1))
        rescale = jnp.exp(running_max - new_max)
        weights = jnp.where(visible, jnp.exp(scores - new_max[:, None]), 0.0)
        denominator = denominator * rescale + weights.sum(axis=-1)
        # a page's rows past the block's newest key hold whatever its last owner left (NaN or inf, even), and a
        # weight of 0 times them is not 0: zeroed (their scales too), so only written keys reach the sums
        written = (first_span + index) * span + jnp.arange(span) <= newest  # [L]
        values = jnp.where(written[:, None], values, jnp.zeros_like(values))
        if v_scales_ref is not None:
            weights = weights * jnp.where(written[None, :], v_scales_ref[pages].reshape(1, span), 0.0)
        accumulator = accumulator * rescale[:, None] + jnp.dot(
            weights.astype(keys_dtype), values, preferred_element_type=jnp.float32, precision=precision
        )
        return new_max, denominator, accumulator

    init = (
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    if has_sinks:  # each row's sink as a first key of weight exp(sink), no value; in the first split only
        first_split = (pl.program_id(2) == 0).astype(jnp.float32)  # arithmetic: Triton broadcasts no i1 scalar
        init = (
            sinks_ref[...] * first_split + MASK_VALUE * (1.0 - first_split),
            jnp.zeros((rows,), jnp.float32) + first_split,
            init[2],
        )
    running_max, denominator, accumulator = jax.lax.fori_loop(0, num_spans, attend_span, init)
    if normalize:
        (o_ref,) = out_refs
        out = accumulator / jnp.where(denominator > 0, denominator, 1.0)[:, None]
        o_ref[...] = jnp.where((positions >= 0)[:, None], out, 0.0).astype(o_ref.dtype)
    else:
        accumulator_ref, max_ref, denominator_ref = out_refs
        accumulator_ref[...] = accumulator
        max_ref[...] = running_max
        denominator_ref[...] = denominator


def _combine_splits(accumulator, running_max, denominator):
    """Merge per-split online-softmax states [S, ..., R(, D)] into normalized outputs [..., R, D]."""
    overall_max = running_max.max(axis=0)
    weight = jnp.exp(running_max - overall_max[None])
    denominator = (denominator * weight).sum(axis=0)
    accumulator = (accumulator * weight[..., None]).sum(axis=0)
    return accumulator / jnp.where(denominator > 0, denominator, 1.0)[..., None]


@functools.partial(
    jax.jit, static_argnames=("query_block", "sliding_window", "logits_soft_cap", "interpret", "num_splits")
)
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
    interpret: bool | None = None,
    num_splits: int | None = None,
):
    """Same arguments and result as reference.ragged_paged_attention; num_splits: context splits
    (default: default_num_splits for this device). The pages may be wider than q's head dim
    (cache_head_dim): their extra lanes hold zeros. Pages may be quantized (kv_quantization.QuantizedPages)."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    (k_pages, k_scales), (v_pages, v_scales) = split_pages(k_pages), split_pages(v_pages)
    quantized = k_scales is not None and v_scales is not None
    num_tokens, num_heads, true_head_dim = q.shape
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    q = jnp.pad(q, ((0, 0), (0, 0), (0, head_dim - true_head_dim)))  # zero lanes add nothing to scores
    groups = num_heads // num_kv_heads
    num_blocks = num_tokens // query_block
    pages_per_span = block_sizes(head_dim, page_size, k_pages.dtype)
    table_spans = cdiv(page_table.shape[1], pages_per_span)
    splits = num_splits or default_num_splits(num_blocks * num_kv_heads, table_spans)
    pages_per_split = cdiv(table_spans, splits) * pages_per_span

    block_pages = block_page_rows(page_table, token_seq_ids, query_block, splits * pages_per_split)
    padded_rows = max(MIN_ROWS, 1 << (query_block * groups - 1).bit_length())  # Triton blocks are powers of two
    queries = query_rows(q, query_block, num_kv_heads, padded_rows)
    positions_by_row = row_positions(positions, query_block, groups, padded_rows)
    sinks_by_row = row_sinks(sinks, query_block, num_kv_heads, padded_rows)

    normalize = splits == 1
    rows_spec = pl.BlockSpec((None, None, None, padded_rows), lambda n, k, s: (s, n, k, 0))
    rows_shape = jax.ShapeDtypeStruct((splits, num_blocks, num_kv_heads, padded_rows), jnp.float32)
    out_spec = pl.BlockSpec((None, None, None, padded_rows, head_dim), lambda n, k, s: (s, n, k, 0, 0))
    out_shape = jax.ShapeDtypeStruct(
        (splits, num_blocks, num_kv_heads, padded_rows, head_dim), q.dtype if normalize else jnp.float32
    )
    outs = pl.pallas_call(
        functools.partial(
            _kernel,
            pages_per_span=pages_per_span,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            has_sinks=sinks is not None,
            normalize=normalize,
            scale=true_head_dim**-0.5,
            quantized=quantized,
        ),
        grid=(num_blocks, num_kv_heads, splits),
        in_specs=[
            pl.BlockSpec((None, None, padded_rows, head_dim), lambda n, k, s: (n, k, 0, 0)),
            pl.BlockSpec((num_pages, page_size, None, head_dim), lambda n, k, s: (0, 0, k, 0)),
            pl.BlockSpec((num_pages, page_size, None, head_dim), lambda n, k, s: (0, 0, k, 0)),
            pl.BlockSpec((None, pages_per_split), lambda n, k, s: (n, s)),
            pl.BlockSpec((None, padded_rows), lambda n, k, s: (n, 0)),
            pl.BlockSpec((None, padded_rows), lambda n, k, s: (k, 0)),
        ]
        + [pl.BlockSpec((num_pages, page_size, None), lambda n, k, s: (0, 0, k))] * (2 if quantized else 0),
        out_specs=[out_spec] if normalize else [out_spec, rows_spec, rows_spec],
        out_shape=[out_shape] if normalize else [out_shape, rows_shape, rows_shape],
        interpret=interpret,
        # Triton, not Mosaic GPU (JAX's default for pallas_call on GPU), which would stage whole blocks,
        # here a kv head's slice of the page pool, in shared memory.
        compiler_params=pltriton.CompilerParams(num_warps=4 if padded_rows <= 32 else 8, num_stages=2),
        name="ragged_paged_attention",
    )(
        queries,
        k_pages,
        v_pages,
        block_pages,
        positions_by_row,
        sinks_by_row,
        *((k_scales, v_scales) if quantized else ()),
    )
    if normalize:
        out = outs[0][0]
    else:
        out = _combine_splits(*outs)
        out = jnp.where((positions_by_row >= 0)[:, None, :, None], out, 0.0).astype(q.dtype)
    return tokens_from_rows(out[..., :true_head_dim], query_block, groups)


def _write_kernel(
    kv_indices_ref, k_ref, v_ref, k_pages_in_ref, v_pages_in_ref, k_pages_ref, v_pages_ref, *, tokens_per_program: int
):
    """One kv head's [D] vectors of a group of tokens, each into its KV index (pages updated in place)."""
    del k_pages_in_ref, v_pages_in_ref  # aliased to the outputs
    page_size = k_pages_ref.shape[1]
    first = pl.program_id(0) * tokens_per_program

    def write_token(index, carry):
        kv_index = kv_indices_ref[first + index]
        page, offset = kv_index // page_size, kv_index % page_size
        k_pages_ref[page, offset] = k_ref[index].astype(k_pages_ref.dtype)
        v_pages_ref[page, offset] = v_ref[index].astype(v_pages_ref.dtype)
        return carry

    jax.lax.fori_loop(0, tokens_per_program, write_token, 0)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0, 1))
def write_kv_pages(k_pages, v_pages, k, v, kv_indices, *, interpret: bool | None = None):
    """Same contract as reference.write_kv_pages: token t's K/V [K, D] goes to row kv_indices[t]; pages
    wider than D (cache_head_dim) get zeros in their extra lanes.
    Grid: (token group, kv head); each program stores [D] vectors, whatever the number of kv heads.
    Quantized pools: the kernel stores the quantized values; their scales [T, K] go in by XLA's scatter."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    padding = ((0, 0), (0, 0), (0, k_pages.shape[-1] - k.shape[-1]))
    k, v = jnp.pad(k, padding), jnp.pad(v, padding)
    if is_quantized(k_pages) and is_quantized(v_pages):
        (k, k_scales), (v, v_scales) = quantize(k, k_pages.dtype), quantize(v, v_pages.dtype)
        k_values, v_values = _write_values(k_pages.data, v_pages.data, k, v, kv_indices, interpret)
        page_size = k_pages.shape[1]
        page, offset = kv_indices // page_size, kv_indices % page_size
        return (
            QuantizedPages(k_values, k_pages.scales.at[page, offset].set(k_scales, mode="promise_in_bounds")),
            QuantizedPages(v_values, v_pages.scales.at[page, offset].set(v_scales, mode="promise_in_bounds")),
        )
    return _write_values(k_pages, v_pages, k, v, kv_indices, interpret)


def _write_values(k_pages, v_pages, k, v, kv_indices, interpret: bool):
    num_tokens, num_kv_heads, head_dim = k.shape
    num_pages, page_size = k_pages.shape[:2]
    tokens_per_program = next(n for n in (16, 8, 4, 2, 1) if num_tokens % n == 0)
    tokens_spec = pl.BlockSpec((tokens_per_program, None, head_dim), lambda i, h: (i, h, 0))
    pages_spec = pl.BlockSpec((num_pages, page_size, None, head_dim), lambda i, h: (0, 0, h, 0))
    return pl.pallas_call(
        functools.partial(_write_kernel, tokens_per_program=tokens_per_program),
        grid=(num_tokens // tokens_per_program, num_kv_heads),
        in_specs=[pl.BlockSpec(kv_indices.shape, lambda i, h: (0,)), tokens_spec, tokens_spec, pages_spec, pages_spec],
        out_specs=[pages_spec, pages_spec],
        out_shape=[
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ],
        input_output_aliases={3: 0, 4: 1},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),  # [D] vector stores
        name="write_kv_pages",
    )(kv_indices, k, v, k_pages, v_pages)
