"""The set-up both Pallas kernels (pallas_gpu.py, pallas_tpu.py) do around their pallas_call.

A program of either kernel serves one query block for one kv head: its rows are the block's B tokens
x the G query heads that read that kv head (row = b * G + g), padded to the kernel's row tile with
padding rows at position -1, which come out as zeros. Each block reads its sequence's row of the
page table, in spans of `block_sizes` pages.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked span gives no NaN

cdiv = pl.cdiv

# Legend: T = query tokens, N = query blocks, B = tokens per block, H = query heads, K = kv heads,
# G = query heads per kv head, R = rows per program (B * G, padded), D = head dim, P = pages per row.


def block_sizes(head_dim: int, page_size: int, dtype) -> int:
    """Pages per span: about 64 keys of float32 (128 of 16-bit types) per step of the online softmax,
    so a span's K and V tiles stay within fast memory for head dims up to 256."""
    keys = 128 if jnp.dtype(dtype).itemsize <= 2 else 64
    keys = keys if head_dim <= 128 else keys // 2
    return max(1, keys // page_size)


def block_page_rows(page_table, token_seq_ids, query_block: int, num_pages: int):
    """[N, num_pages]: each query block's row of the page table, zero padded to num_pages (whole spans);
    page-table entries, not pages."""
    rows = page_table[token_seq_ids[::query_block]]
    return jnp.pad(rows, ((0, 0), (0, num_pages - rows.shape[1])))


def query_rows(q, query_block: int, num_kv_heads: int, padded_rows: int):
    """q [T, H, D] -> [N, K, R, D]: a block's rows for one kv head are contiguous."""
    num_tokens, num_heads, head_dim = q.shape
    groups = num_heads // num_kv_heads
    rows = q.reshape(num_tokens // query_block, query_block, num_kv_heads, groups, head_dim).transpose(0, 2, 1, 3, 4)
    rows = rows.reshape(num_tokens // query_block, num_kv_heads, query_block * groups, head_dim)
    return jnp.pad(rows, ((0, 0), (0, 0), (0, padded_rows - query_block * groups), (0, 0)))


def row_positions(positions, query_block: int, groups: int, padded_rows: int):
    """positions [T] -> [N, R]: each row's token position, -1 for padding rows."""
    by_row = jnp.repeat(positions.reshape(-1, query_block), groups, axis=1)
    return jnp.pad(by_row, ((0, 0), (0, padded_rows - query_block * groups)), constant_values=-1)


def tokens_from_rows(out, query_block: int, groups: int):
    """[N, K, R, D] -> [T, H, D], dropping the padding rows."""
    num_blocks, num_kv_heads, _, head_dim = out.shape
    out = out[:, :, : query_block * groups].reshape(num_blocks, num_kv_heads, query_block, groups, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(num_blocks * query_block, num_kv_heads * groups, head_dim)


def row_sinks(sinks, query_block: int, num_kv_heads: int, padded_rows: int):
    """sinks [H] (None: none) -> [K, R] float32: each row's sink, MASK_VALUE for padding rows and without
    sinks (a starting max that weighs nothing)."""
    if sinks is None:
        return jnp.full((num_kv_heads, padded_rows), MASK_VALUE, jnp.float32)
    by_head = sinks.astype(jnp.float32).reshape(num_kv_heads, -1)  # [K, G]
    by_row = jnp.tile(by_head, (1, query_block))  # row b * G + g: head g's
    return jnp.pad(by_row, ((0, 0), (0, padded_rows - by_row.shape[1])), constant_values=MASK_VALUE)
