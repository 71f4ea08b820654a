"""Ragged paged latent attention: DeepSeek's multi-head latent attention over a compressed KV cache.

The cache holds, per token, one entry shared by every query head: the normalized latent (kv_lora_rank
lanes) and the rope key (qk_rope_head_dim lanes), zero padded to an even width 2C. Its first C lanes
live in the key pool and its last C in the value pool ([num_pages, page_size, 1, C] each), so both
pools keep one shape and the engine's page accounting and copies (prefix cache, host tier, handover)
move them as any model's. Queries come absorbed (the model folds each head's key projection into
its query, mla.py): each head scores the whole entry and reads the entry back as its value; the model
keeps the latent lanes and projects them out through the value projection.

Implementations, one signature each (latent_reference.py is the specification):
  reference  pure jax.numpy, any backend, any dtype
  cpu        the C++ kernel (cpu_latent.py, cpu_latent_kernel.cc) for float32, bfloat16 and float16 pools
             of q's dtype, the reference otherwise or where the kernels' library cannot be built; pages
             written by the C++ writer, in place
  pallas     latent_pallas.py (Triton) off a TPU, interpret mode on the CPU; latent_pallas_tpu.py (Mosaic)
             on a TPU
"""

from __future__ import annotations

import jax

from pallas_kernels.paged_attention import (
    cpu,
    cpu_latent,
    kernel_modules,
    latent_pallas,
    latent_pallas_tpu,
    latent_reference,
)


def ragged_paged_latent_attention(
    q, first_pages, second_pages, page_table, token_seq_ids, positions, *, query_block: int, scale: float, impl: str
):
    """q [T, H, 2C] (absorbed, unscaled); pools [num_pages, page_size, 1, C] -> [T, H, 2C]."""
    module = latent_reference
    if impl == "pallas":
        module = latent_pallas_tpu if jax.default_backend() == "tpu" else latent_pallas
    elif impl == "cpu" and _cpu_kernel_serves(q, first_pages, second_pages):
        module = cpu_latent
    return module.ragged_paged_latent_attention(
        q, first_pages, second_pages, page_table, token_seq_ids, positions, query_block=query_block, scale=scale
    )


def write_latent_pages(first_pages, second_pages, entries, kv_indices, *, impl: str):
    """entries [T, 1, <= 2C] -> their halves into row kv_indices[t] of the two pools (in place: donated)."""
    half = first_pages.shape[-1]
    padded = jax.numpy.pad(entries, ((0, 0), (0, 0), (0, 2 * half - entries.shape[-1])))
    writer = kernel_modules(impl)[1]
    return writer.write_kv_pages(first_pages, second_pages, padded[..., :half], padded[..., half:], kv_indices)


def _cpu_kernel_serves(q, first_pages, second_pages) -> bool:
    """The C++ kernel takes q and both pools in one of its dtypes, and its library built."""
    dtypes = {jax.numpy.dtype(a.dtype) for a in (q, first_pages, second_pages)}
    return len(dtypes) == 1 and dtypes <= set(cpu.DTYPES) and cpu_latent.available()
