"""Sharded attention: every device attends over its own sequences and its own KV heads, with the
single-device kernels, under `shard_map`.

Data parallelism: the step's tokens, page tables and page pool are laid out rank by rank
(jaxserve/batch.py), with page ids local to each rank, so each "data" shard holds exactly its
sequences and their pages. Tensor parallelism: when the KV heads divide over "tensor", each shard
holds its KV heads' slice of every page and the query heads that read them (query head h reads KV
head h // groups, so equal contiguous slices of both line up). When they do not divide, the KV
heads are replicated and the query heads gathered on every tensor shard (the engine only takes
this path with data parallelism; tensor parallelism alone then goes through XLA's partitioner).
All specs come from the logical-axis rules.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec

from pallas_kernels import ragged_paged_attention, write_kv_pages
from sharding.rules import partition_spec


def _write_and_attend(q, k, v, key_pages, value_pages, positions, slot_ids, token_seq_ids, page_table, *,
                      query_block: int, sliding_window: int | None, impl: str):
    key_pages, value_pages = write_kv_pages(key_pages, value_pages, k, v, slot_ids, impl=impl)
    out = ragged_paged_attention(q, key_pages, value_pages, page_table, token_seq_ids, positions,
                                 query_block=query_block, sliding_window=sliding_window, impl=impl)
    return out, key_pages, value_pages


def attention_specs(mesh, num_kv_heads: int) -> dict[str, PartitionSpec]:
    """Partition specs of the sharded attention's operands, from the rules table."""
    sizes = {"kv_heads": num_kv_heads}
    kv = partition_spec(("batch", "kv_heads"), mesh, sizes)
    pages = partition_spec(("pages", "page_offset", "kv_heads"), mesh, sizes)
    tokens = partition_spec(("batch",), mesh)
    if pages[0] != tokens[0]:
        raise ValueError(f"sharded attention needs tokens and pages split alike, got {tokens} and {pages}")
    # query heads follow their kv heads (split exactly when those are): the "heads" spec is kv's
    return {"tokens": tokens, "heads": kv, "pages": pages}


def sharded_write_and_attend(mesh, q, k, v, key_pages, value_pages, metadata, *, sliding_window, impl):
    specs = attention_specs(mesh, k.shape[1])
    tokens, heads, pages = specs["tokens"], specs["heads"], specs["pages"]
    body = jax.shard_map(
        functools.partial(_write_and_attend, query_block=metadata.query_block, sliding_window=sliding_window,
                          impl=impl),
        mesh=mesh, in_specs=(heads, heads, heads, pages, pages) + (tokens,) * 4, out_specs=(heads, pages, pages),
        check_vma=False)
    return body(q, k, v, key_pages, value_pages, metadata.positions, metadata.slot_ids, metadata.token_seq_ids,
                metadata.page_table)
