"""Data-parallel attention: every rank attends over its own sequences and its own range of KV pages.

The step's tokens, page tables and page pool are laid out rank by rank (jaxserve/batch.py), with
page ids local to each rank, so under `shard_map` over the "data" axis each device runs the plain
single-device attention on exactly its part. (Across "tensor" the heads are gathered, for now.)
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels import ragged_paged_attention, write_kv_pages
from sharding.rules import partition_spec


def _write_and_attend(q, k, v, key_pages, value_pages, positions, slot_ids, token_seq_ids, page_table, *,
                      query_block: int, sliding_window: int | None, impl: str):
    key_pages, value_pages = write_kv_pages(key_pages, value_pages, k, v, slot_ids, impl=impl)
    out = ragged_paged_attention(q, key_pages, value_pages, page_table, token_seq_ids, positions,
                                 query_block=query_block, sliding_window=sliding_window, impl=impl)
    return out, key_pages, value_pages


def data_parallel_write_and_attend(mesh, q, k, v, key_pages, value_pages, metadata, *, sliding_window, impl):
    # Tokens and their metadata follow the "batch" rule, the page pool the "pages" rule: both put
    # each rank's share on its own "data" device, which is what lets every rank attend alone.
    tokens, pages = partition_spec(("batch",), mesh), partition_spec(("pages",), mesh)
    if tokens != pages:
        raise ValueError(f"data-parallel attention needs tokens and pages split alike, got {tokens} and {pages}")
    body = jax.shard_map(
        functools.partial(_write_and_attend, query_block=metadata.query_block, sliding_window=sliding_window,
                          impl=impl),
        mesh=mesh, in_specs=(tokens,) * 3 + (pages,) * 2 + (tokens,) * 4, out_specs=(tokens, pages, pages),
        check_vma=False)
    return body(q, k, v, key_pages, value_pages, metadata.positions, metadata.slot_ids, metadata.token_seq_ids,
                metadata.page_table)
