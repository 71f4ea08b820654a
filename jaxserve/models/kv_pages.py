"""The device side of the KV cache and the per-step metadata attention needs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jaxserve.arrays import HostOrDeviceArray
from pallas_kernels.paged_attention.kv_quantization import FLOAT_KV_DTYPES, QuantizedPages, bytes_per_token_head


@jax.tree_util.register_dataclass
@dataclass
class KVPages:
    """One key and one value page pool per layer; page 0 is reserved for padding writes. With
    cache.kv_dtype int8 / float8_e4m3 a pool is a QuantizedPages (values plus a scale per token-head,
    pallas_kernels/paged_attention/kv_quantization.py) that the model passes through as it would an array;
    with bfloat16 / float16 beside a float32 model, a plain 16-bit array."""

    keys: list[jax.Array | QuantizedPages]  # num_layers x [num_pages, page_size, num_kv_heads, head_dim]
    values: list[jax.Array | QuantizedPages]  # num_layers x [num_pages, page_size, num_kv_heads, head_dim]

    @classmethod
    def zeros(
        cls,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype,
        kv_dtype: str = "auto",
    ):
        shape = (num_pages, page_size, num_kv_heads, head_dim)

        def pool():
            if kv_dtype == "auto" or kv_dtype in FLOAT_KV_DTYPES:
                return jnp.zeros(shape, dtype if kv_dtype == "auto" else kv_dtype)
            return QuantizedPages.zeros(shape, kv_dtype)

        return cls(keys=[pool() for _ in range(num_layers)], values=[pool() for _ in range(num_layers)])

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype, kv_dtype: str = "auto"
    ) -> int:
        """Values and (quantized) scales of every layer's key and value pools."""
        return 2 * num_layers * page_size * num_kv_heads * bytes_per_token_head(head_dim, kv_dtype, dtype)


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    """Where each query token's KV goes and which pages it reads (see pallas_kernels)."""

    positions: HostOrDeviceArray  # [T] int32, -1 for padding
    kv_indices: HostOrDeviceArray  # [T] int32, page * page_size + offset; padding -> reserved page 0
    token_seq_ids: HostOrDeviceArray  # [T] int32, row of page_table each token belongs to
    page_table: HostOrDeviceArray  # [S, P] int32
    query_block: int = field(default=1, metadata=dict(static=True))  # tokens per query block


def kv_cache_bytes_per_token(kv_pages) -> int:
    """What one token's KV takes in the cache, every layer's key and value pools together (copies of a KV head
    kept for tensor parallelism included): for DeepSeek's MLA, its latent and rope key, not full K/V."""
    # every leaf: a quantized pool's scales count too (cache.kv_dtype)
    return sum(math.prod(leaf.shape[2:]) * leaf.dtype.itemsize for leaf in jax.tree.leaves(kv_pages))
