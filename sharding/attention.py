"""Sharded attention: every device attends over its own sequences and its own KV heads, with the
single-device kernels, under `shard_map`.

Data parallelism: the step's tokens, page tables and page pool are laid out rank by rank
(jaxserve/device/rank_layout.py), with page ids local to each rank, so each "data" shard holds exactly its
sequences and their pages. Tensor parallelism: each "tensor" shard holds its KV heads' slice of
every page and the query heads that read them (query head h reads KV head h // groups, so equal
contiguous slices of both line up). With fewer KV heads than tensor shards (MQA, GQA on many
devices), the cache stores each KV head `kv_head_replicas` times so that every shard holds one copy
of the head its query heads read, as vLLM does: a shard's cache is one head wide instead of all of
them. Where neither works (query heads that do not split evenly), the KV heads are replicated and
the query heads gathered on every tensor shard (the engine only takes this path with data
parallelism; tensor parallelism alone then goes through XLA's partitioner). All specs come from the
logical-axis rules.

A model is built with one of the two as its `write_and_attend` function (`attention_dispatch`):
`WriteAndAttend` on one device, `ShardedWriteAndAttend` per shard of a mesh.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels import ragged_paged_attention, write_kv_pages
from pallas_kernels.paged_attention.kv_quantization import QuantizedPages, is_quantized
from pallas_kernels.paged_attention.latent import ragged_paged_latent_attention, write_latent_pages
from sharding.rules import partition_spec


def _write_and_attend(
    q,
    k,
    v,
    key_pages,
    value_pages,
    positions,
    kv_indices,
    token_seq_ids,
    page_table,
    sinks=None,
    *,
    query_block: int,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    impl: str,
):
    """sinks: [H] attention sinks of this shard's query heads, or None."""
    key_pages, value_pages = write_kv_pages(key_pages, value_pages, k, v, kv_indices, impl=impl)
    out = ragged_paged_attention(
        q,
        key_pages,
        value_pages,
        page_table,
        token_seq_ids,
        positions,
        query_block=query_block,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        sinks=sinks,
        impl=impl,
    )
    return out, key_pages, value_pages


def _write_and_attend_latent(
    q, entries, first_pages, second_pages, positions, kv_indices, token_seq_ids, page_table, *, query_block, scale, impl
):
    """MLA (pallas_kernels/paged_attention/latent.py): one latent entry per token, every head reads it."""
    first_pages, second_pages = write_latent_pages(first_pages, second_pages, entries, kv_indices, impl=impl)
    out = ragged_paged_latent_attention(
        q,
        first_pages,
        second_pages,
        page_table,
        token_seq_ids,
        positions,
        query_block=query_block,
        scale=scale,
        impl=impl,
    )
    return out, first_pages, second_pages


def sharded_write_and_attend_latent(mesh, q, entries, first_pages, second_pages, metadata, *, scale, impl):
    """Per data-parallel rank over its own pages; under tensor parallelism each shard keeps a whole copy of
    the one latent head (kv_head_replicas) and attends with its slice of the query heads."""
    specs = attention_specs(mesh, first_pages.shape[2])
    tokens, heads, pages = specs["tokens"], specs["heads"], specs["pages"]
    body = functools.partial(_write_and_attend_latent, query_block=metadata.query_block, scale=scale, impl=impl)
    sharded = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(heads, PartitionSpec(tokens[0], None), pages, pages) + (tokens,) * 4,
        out_specs=(heads, pages, pages),
        check_vma=False,
    )
    return sharded(
        q,
        entries,
        first_pages,
        second_pages,
        metadata.positions,
        metadata.kv_indices,
        metadata.token_seq_ids,
        metadata.page_table,
    )


def kv_head_replicas(num_heads: int, num_kv_heads: int, tensor_parallel_size: int) -> int | None:
    """How many copies of each KV head the cache stores so that the KV heads split over the tensor
    shards: 1 when they already divide, tp / K when K divides tp and the query heads split evenly
    (each shard's query heads then read a single KV head), None when the heads cannot be split."""
    if num_kv_heads % tensor_parallel_size == 0:
        return 1
    if tensor_parallel_size % num_kv_heads == 0 and num_heads % tensor_parallel_size == 0:
        return tensor_parallel_size // num_kv_heads
    return None


def kv_pages_spec(mesh, num_cache_heads: int) -> PartitionSpec:
    """[pages, page_size, kv heads, head dim] pools: each data-parallel rank holds its own pages, each
    tensor shard its KV heads' slice of them; num_cache_heads: the KV heads the cache stores
    (replicas included)."""
    return partition_spec(("pages", "page_offset", "kv_heads", "head_dim"), mesh, {"kv_heads": num_cache_heads})


def devices_per_page(mesh, num_cache_heads: int) -> int:
    """How many devices share each page of a rank's pool (its KV heads split over them): a device holds
    1/this of a page's bytes, which is what a budget of one device's memory buys pages at."""
    if mesh is None:
        return 1
    heads_axis = kv_pages_spec(mesh, num_cache_heads)[2]
    return mesh.shape[heads_axis] if heads_axis is not None else 1


def pool_spec(pool, spec: PartitionSpec):
    """The spec of one layer's pool: a quantized pool's scales [pages, page_size, kv heads] split as its
    values are (kv_quantization.py)."""
    if is_quantized(pool):
        return QuantizedPages(data=spec, scales=PartitionSpec(*spec[:3]))  # pyright: ignore[reportArgumentType]
    return spec


def kv_pages_shardings(kv_pages, mesh, num_cache_heads: int):
    """NamedShardings for a KVPages pytree (quantized pools and their scales included)."""
    spec = kv_pages_spec(mesh, num_cache_heads)

    def pool_sharding(pool):
        specs = pool_spec(pool, spec)
        is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
        return jax.tree.map(lambda leaf_spec: NamedSharding(mesh, leaf_spec), specs, is_leaf=is_spec)

    return type(kv_pages)(
        keys=[pool_sharding(pool) for pool in kv_pages.keys], values=[pool_sharding(pool) for pool in kv_pages.values]
    )


def attention_specs(mesh, num_cache_heads: int) -> dict[str, PartitionSpec]:
    """Partition specs of the sharded attention's operands, from the rules table."""
    pages = kv_pages_spec(mesh, num_cache_heads)
    tokens = partition_spec(("batch",), mesh)
    if pages[0] != tokens[0]:
        raise ValueError(f"sharded attention needs tokens and pages split alike, got {tokens} and {pages}")
    # query heads split exactly when the cache's KV heads do, over the same mesh axis
    return {"tokens": tokens, "heads": PartitionSpec(tokens[0], pages[2]), "pages": pages}


def _write_and_attend_replicated(q, k, v, key_pages, value_pages, *rest, head_axis: str, replicas: int, **kwargs):
    """k/v arrive with all K heads; this shard keeps the one head its cache slice copies."""
    head = jax.lax.axis_index(head_axis) // replicas
    k, v = (jax.lax.dynamic_slice_in_dim(x, head, 1, axis=1) for x in (k, v))
    return _write_and_attend(q, k, v, key_pages, value_pages, *rest, **kwargs)


def sharded_write_and_attend(
    mesh, q, k, v, key_pages, value_pages, metadata, *, sliding_window, logits_soft_cap, impl, sinks=None
):
    replicas = key_pages.shape[2] // k.shape[1]
    specs = attention_specs(mesh, key_pages.shape[2])
    tokens, heads, pages = specs["tokens"], specs["heads"], specs["pages"]
    options = dict(
        query_block=metadata.query_block, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, impl=impl
    )
    body = functools.partial(_write_and_attend, **options)
    kv_heads = heads
    if replicas > 1:  # k/v replicated over the head axis; each shard picks its head
        body = functools.partial(
            _write_and_attend_replicated,
            head_axis=pages[2],
            replicas=replicas,
            **options,
        )
        kv_heads = PartitionSpec(tokens[0], None)
    pages = pool_spec(key_pages, pages)
    in_specs = (heads, kv_heads, kv_heads, pages, pages) + (tokens,) * 4
    operands = (q, k, v, key_pages, value_pages, metadata.positions, metadata.kv_indices, metadata.token_seq_ids)
    operands += (metadata.page_table,)
    if sinks is not None:  # per query head: split as the query heads are
        in_specs += (PartitionSpec(heads[1]),)
        operands += (sinks,)
    sharded = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(heads, pages, pages), check_vma=False)
    return sharded(*operands)


@dataclass(frozen=True)
class WriteAndAttend:
    """The single-device kernels as the model calls them: this step's keys and values into their pages,
    then attention over the pages (XLA may still partition the reference over the tensor shards)."""

    impl: str  # reference | cpu | pallas

    def __call__(self, q, k, v, key_pages, value_pages, metadata, *, sliding_window, logits_soft_cap, sinks=None):
        return _write_and_attend(
            q,
            k,
            v,
            key_pages,
            value_pages,
            metadata.positions,
            metadata.kv_indices,
            metadata.token_seq_ids,
            metadata.page_table,
            sinks,
            query_block=metadata.query_block,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            impl=self.impl,
        )

    def latent(self, q, entries, key_pages, value_pages, metadata, *, scale):
        return _write_and_attend_latent(
            q,
            entries,
            key_pages,
            value_pages,
            metadata.positions,
            metadata.kv_indices,
            metadata.token_seq_ids,
            metadata.page_table,
            query_block=metadata.query_block,
            scale=scale,
            impl=self.impl,
        )


@dataclass(frozen=True)
class ShardedWriteAndAttend:
    """The same, per shard of the mesh: each device over its own sequences and KV heads."""

    mesh: Mesh
    impl: str

    def __call__(self, q, k, v, key_pages, value_pages, metadata, *, sliding_window, logits_soft_cap, sinks=None):
        return sharded_write_and_attend(
            self.mesh,
            q,
            k,
            v,
            key_pages,
            value_pages,
            metadata,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            impl=self.impl,
            sinks=sinks,
        )

    def latent(self, q, entries, key_pages, value_pages, metadata, *, scale):
        return sharded_write_and_attend_latent(
            self.mesh, q, entries, key_pages, value_pages, metadata, scale=scale, impl=self.impl
        )


def attention_dispatch(impl: str, mesh: Mesh | None = None) -> WriteAndAttend | ShardedWriteAndAttend:
    """The attention dispatch a model is built with: per shard of `mesh`, or on one device without one."""
    return WriteAndAttend(impl) if mesh is None else ShardedWriteAndAttend(mesh, impl)
