"""The C++ CPU latent (MLA) attention kernel (cpu_latent_kernel.cc), built at first use into the CPU kernels'
one library (pallas_kernels/cpu_library.py): latent_reference.ragged_paged_latent_attention's contract for
float32, bfloat16 and float16 pools (accumulating in float32). It reads each tile of entries once for every
head, in place through the page table; the pools are written by cpu.write_kv_pages (latent.py).

`available()` is False when the library cannot be built; latent.py then runs the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_library
from pallas_kernels.paged_attention.cpu import DTYPES

LATENT = cpu_library.CustomCall("jaxserve_cpu_paged_latent_attention", "JaxservePagedLatentAttention")
available = LATENT.available


def ragged_paged_latent_attention(
    q, first_pages, second_pages, page_table, token_seq_ids, positions, *, query_block: int, scale: float
):
    """q [T, H, 2C] (absorbed, unscaled); pools [num_pages, page_size, 1, C], all of one dtype -> [T, H, 2C]."""
    num_tokens, _, width = q.shape
    if first_pages.ndim != 4 or first_pages.shape[2] != 1 or width != 2 * first_pages.shape[-1]:
        raise ValueError(
            f"latent attention reads one cache head of q's width / 2, got {first_pages.shape}, q {q.shape}"
        )
    if second_pages.shape != first_pages.shape:
        raise ValueError(f"the latent pools differ in shape: {first_pages.shape} and {second_pages.shape}")
    if query_block < 1 or num_tokens % query_block:
        raise ValueError(f"query_block={query_block} must divide the {num_tokens} query tokens")
    dtypes = {jnp.dtype(q.dtype), jnp.dtype(first_pages.dtype), jnp.dtype(second_pages.dtype)}
    if len(dtypes) != 1 or jnp.dtype(q.dtype) not in DTYPES:
        raise ValueError(
            f"the CPU latent kernel wants q and pools of one of {[str(d) for d in DTYPES]}, got "
            f"{q.dtype}, {first_pages.dtype}, {second_pages.dtype}"
        )
    if not available():
        raise RuntimeError("the CPU attention kernels could not be built; use attention_impl='reference'")
    call = jax.ffi.ffi_call(LATENT.name, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q,
        first_pages,
        second_pages,
        page_table.astype(np.int32),
        token_seq_ids.astype(np.int32),
        positions.astype(np.int32),
        query_block=np.int64(query_block),
        scale=np.float32(scale),
        own_helpers=jax.device_count() == 1,
    )
