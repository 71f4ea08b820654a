"""Where attention runs, with which kernel, over what cache layout: decided once at start-up."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
from jax.sharding import Mesh

from jaxserve.config import EngineConfig
from jaxserve.models.config import ModelConfig
from pallas_kernels import kv_cache_head_dim, resolve_attention_impl
from pallas_kernels.paged_attention.kv_quantization import FLOAT_KV_DTYPES
from pallas_kernels.paged_attention.probe import pallas_problem
from sharding.attention import kv_head_replicas

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionPlan:
    impl: str  # a concrete kernel: reference | cpu | pallas
    # Set: every device attends over its own sequences and KV heads under shard_map
    # (sharding/attention.py). None: one device, or XLA's partitioner splits the reference.
    mesh: Mesh | None
    num_cache_kv_heads: int  # KV heads the cache stores: the model's, times copies under tensor parallelism
    cache_head_dim: int  # the model's head dim, or wider (zero padded) where a kernel needs it


def choose_attention(model: ModelConfig, config: EngineConfig, dtype: str, mesh: Mesh | None) -> AttentionPlan:
    """Attention runs the single-device kernels per shard when data-parallel ranks or KV heads split the
    work (the cache storing copies of each KV head when there are fewer than tensor shards); tensor
    parallelism over heads that cannot split relies on XLA's partitioner, which only the jax.numpy
    reference goes through. Under "auto", the Pallas kernels must first pass a start-up check on this
    device (probe.py): a lowering error or mismatch falls back to the reference with a warning."""
    platform = jax.default_backend()
    tensor_parallel = config.parallel.tensor_parallel_size
    replicas = kv_head_replicas(model.num_heads, model.num_kv_heads, tensor_parallel) if tensor_parallel > 1 else None
    attention_mesh = mesh if mesh is not None and (config.parallel.data_parallel_size > 1 or replicas) else None
    impl = resolve_attention_impl(
        config.compile.attention_impl,
        platform,
        dtype,
        # a mesh of one device (parallel.device_ids naming one) partitions nothing: its kernels are a one-device
        # engine's
        partitioned=mesh is not None and mesh.size > 1 and attention_mesh is None,
        head_dim=model.head_dim,
        page_size=config.cache.page_size,
    )
    if config.compile.attention_impl == "auto" and impl == "pallas" and not model.is_latent_attention:
        problem = pallas_problem(
            model.num_heads,
            model.num_kv_heads,
            model.head_dim,
            config.cache.page_size,
            dtype,
            query_blocks=(1, config.scheduler.prefill_query_block),
            cache_head_dim=kv_cache_head_dim("pallas", platform, model.head_dim),
            # a 16-bit cache beside a float32 model is checked as served (quantized pools: the float path only)
            page_dtype=config.cache.kv_dtype if config.cache.kv_dtype in FLOAT_KV_DTYPES else dtype,
        )
        if problem is not None:
            logger.warning(
                "Pallas attention kernels fail their start-up check on %s (%s); using the reference attention",
                platform,
                problem,
            )
            impl = "reference"
    return AttentionPlan(
        impl=impl,
        mesh=attention_mesh,
        num_cache_kv_heads=model.num_kv_heads * (replicas or 1),
        # MLA's pools hold half a latent entry each (ModelConfig.kv_cache_head_dim), read as they lie
        cache_head_dim=model.kv_cache_head_dim
        if model.is_latent_attention
        else kv_cache_head_dim(impl, platform, model.head_dim),
    )
