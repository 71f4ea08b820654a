"""The device side of the KV cache and the per-step metadata attention needs."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jaxserve.arrays import HostOrDeviceArray


@jax.tree_util.register_dataclass
@dataclass
class KVPages:
    """One key and one value page pool per layer; page 0 is reserved for padding writes."""

    keys: list[jax.Array]  # num_layers x [num_pages, page_size, num_kv_heads, head_dim]
    values: list[jax.Array]  # num_layers x [num_pages, page_size, num_kv_heads, head_dim]

    @classmethod
    def zeros(cls, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype):
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        return cls(
            keys=[jnp.zeros(shape, dtype) for _ in range(num_layers)],
            values=[jnp.zeros(shape, dtype) for _ in range(num_layers)],
        )

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    """Where each query token's KV goes and which pages it reads (see pallas_kernels)."""

    positions: HostOrDeviceArray  # [T] int32, -1 for padding
    kv_indices: HostOrDeviceArray  # [T] int32, page * page_size + offset; padding -> reserved page 0
    token_seq_ids: HostOrDeviceArray  # [T] int32, row of page_table each token belongs to
    page_table: HostOrDeviceArray  # [S, P] int32
    query_block: int = field(default=1, metadata=dict(static=True))  # tokens per query block
