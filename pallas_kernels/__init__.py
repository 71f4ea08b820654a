"""Attention over the paged KV cache.

Every kernel lives beside a pure-jax.numpy reference with the same signature; the reference is the
specification the kernels are tested against. Models call `ragged_paged_attention` and
`write_kv_pages` from here, never an implementation directly.
"""

from pallas_kernels.paged_attention import (
    ATTENTION_IMPLS,
    kv_cache_head_dim,
    ragged_paged_attention,
    resolve_attention_impl,
    write_kv_pages,
)

__all__ = ["ATTENTION_IMPLS", "kv_cache_head_dim", "ragged_paged_attention", "resolve_attention_impl", "write_kv_pages"]
