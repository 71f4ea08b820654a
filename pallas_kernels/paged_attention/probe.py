"""A start-up check that the Pallas kernels lower and agree with the reference on this device.

`attention_impl="auto"` picks the Pallas kernels on GPU and TPU; before an engine commits to them it
runs one small step shaped like its own (head counts, head_dim, page_size, dtype, query blocks)
through both the kernels and the reference. A lowering error or a mismatch makes it fall back to the
reference with a warning instead of serving wrong tokens or failing at warm-up.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import reference

TOLERANCE = {2: 5e-2, 4: 2e-3}  # by dtype itemsize: bfloat16/float16, float32


def _step(rng, num_heads, num_kv_heads, head_dim, page_size, dtype, query_block, cache_head_dim, page_dtype):
    """Two sequences (one mid-page, one several pages long) and a padding block; new tokens' K/V."""
    lengths, num_pages = [page_size + 3, 4 * page_size + 1], 12
    page_table = np.zeros((3, 6), np.int32)
    page_table[0, :2], page_table[1, :5] = [3, 7], [1, 9, 4, 11, 2]
    token_seq_ids, positions = [], []
    for row, length in enumerate(lengths):
        num_new = min(query_block, length)
        token_seq_ids += [row] * query_block
        positions += list(range(length - num_new, length)) + [-1] * (query_block - num_new)
    token_seq_ids += [2] * query_block
    positions += [-1] * query_block
    positions = np.asarray(positions, np.int32)
    kv_indices = np.where(
        positions >= 0,
        page_table[token_seq_ids, np.maximum(positions, 0) // page_size] * page_size
        + np.maximum(positions, 0) % page_size,
        0,
    ).astype(np.int32)
    tokens = len(positions)
    cast = lambda shape, as_dtype=dtype: jnp.asarray(rng.standard_normal(shape), as_dtype)
    return dict(
        q=cast((tokens, num_heads, head_dim)),
        k=cast((tokens, num_kv_heads, head_dim)),
        v=cast((tokens, num_kv_heads, head_dim)),
        k_pages=cast((num_pages, page_size, num_kv_heads, cache_head_dim), page_dtype),
        v_pages=cast((num_pages, page_size, num_kv_heads, cache_head_dim), page_dtype),
        page_table=jnp.asarray(page_table),
        token_seq_ids=jnp.asarray(token_seq_ids, jnp.int32),
        positions=jnp.asarray(positions),
        kv_indices=jnp.asarray(kv_indices),
    )


def _write_and_attend(module, writer, step, query_block):
    k_pages, v_pages = writer.write_kv_pages(
        jnp.array(step["k_pages"]), jnp.array(step["v_pages"]), step["k"], step["v"], step["kv_indices"]
    )
    return module.ragged_paged_attention(
        step["q"],
        k_pages,
        v_pages,
        step["page_table"],
        step["token_seq_ids"],
        step["positions"],
        query_block=query_block,
    )


def pallas_problem(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype,
    query_blocks: tuple[int, ...],
    cache_head_dim: int | None = None,
    page_dtype=None,
) -> str | None:
    """None when the Pallas kernels (as the dispatch would pick them here) match the reference on a
    step of this shape for every query block; otherwise what went wrong. cache_head_dim: the width
    the engine gives its KV pages (kv_cache_head_dim); page_dtype: its pages' dtype (default: `dtype`;
    cache.kv_dtype bfloat16 / float16 beside a float32 model, whose matmuls then run in 16 bits)."""
    from pallas_kernels.paged_attention import kernel_modules  # the dispatch's own choice

    module, writer = kernel_modules("pallas")
    cache_head_dim = cache_head_dim or head_dim
    page_dtype = dtype if page_dtype is None else page_dtype
    itemsize = min(jnp.dtype(dtype).itemsize, jnp.dtype(page_dtype).itemsize)
    rng = np.random.default_rng(0)
    for query_block in query_blocks:
        step = _step(rng, num_heads, num_kv_heads, head_dim, page_size, dtype, query_block, cache_head_dim, page_dtype)
        try:
            got = np.asarray(_write_and_attend(module, writer, step, query_block), np.float32)
        except Exception as error:  # a lowering or compile failure on this backend: report, do not crash
            return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        # the reference reads pages of the model's width: the same data without the padding lanes
        unpadded = {**step, "k_pages": step["k_pages"][..., :head_dim], "v_pages": step["v_pages"][..., :head_dim]}
        want = np.asarray(_write_and_attend(reference, reference, unpadded, query_block), np.float32)
        real = np.asarray(step["positions"]) >= 0
        error = float(np.abs(got[real] - want[real]).max())
        if not np.isfinite(error) or error > TOLERANCE.get(itemsize, 5e-2):
            return f"outputs differ from the reference by {error:.3g} (query_block={query_block})"
    return None
