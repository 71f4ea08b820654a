"""Ragged paged attention: one call serves decode tokens and prefill chunks of many sequences.

Layout of a step's tokens: a flat array of T query tokens in blocks of `query_block` tokens, every
block belonging to one sequence (a decode step uses query_block=1, a prefill step pads each chunk
to whole blocks). Each block attends to the pages of its sequence, causally by absolute position.
Padding tokens carry position -1 and attend to nothing.

Implementations, all with the reference's signature:
  reference  pure jax.numpy, any dtype, any backend: the specification
  cpu        a C++ kernel (XLA FFI) for float32 on the CPU, built at first use
  pallas     Pallas kernels: Mosaic with DMA'd pages on TPU (pallas_tpu.py), the Triton-style kernel
             elsewhere (pallas.py); on the CPU they run in interpret mode: exact but slow
"""

import jax.numpy as jnp

import jax

from pallas_kernels.paged_attention import cpu, pallas, pallas_tpu, reference

ATTENTION_IMPLS = ("auto", "reference", "cpu", "pallas")


def resolve_attention_impl(impl: str, platform: str, dtype, partitioned: bool = False) -> str:
    """The concrete implementation `impl` means on this platform for this KV dtype; `partitioned` when
    the step runs sharded over several devices (only the jax.numpy reference partitions itself)."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention_impl {impl!r}; expected one of {ATTENTION_IMPLS}")
    if partitioned:
        if impl not in ("auto", "reference"):
            raise ValueError(f"attention_impl={impl!r} does not run sharded yet; use 'reference' or 'auto'")
        return "reference"
    if impl == "cpu" and (platform != "cpu" or jnp.dtype(dtype) != jnp.float32):
        raise ValueError(f"attention_impl='cpu' needs the CPU platform and float32, not {platform}/{jnp.dtype(dtype)}")
    if impl == "auto":
        # The Pallas kernel has only run in interpret mode so far; "auto" takes it on GPU/TPU once a
        # device run has checked its lowering there (bench/gpu_checks.sh).
        use_cpu_kernel = platform == "cpu" and jnp.dtype(dtype) == jnp.float32 and cpu.available()
        return "cpu" if use_cpu_kernel else "reference"
    return impl


def ragged_paged_attention(q, k_pages, v_pages, page_table, token_seq_ids, positions, *,
                           query_block: int, sliding_window: int | None = None, impl: str = "reference"):
    if impl == "pallas" and jax.default_backend() == "tpu":
        impl = "pallas_tpu"
    implementation = {"reference": reference, "cpu": cpu, "pallas": pallas, "pallas_tpu": pallas_tpu}.get(impl)
    if implementation is None:
        raise ValueError(f"unknown attention_impl {impl!r}; resolve 'auto' with resolve_attention_impl first")
    return implementation.ragged_paged_attention(
        q, k_pages, v_pages, page_table, token_seq_ids, positions,
        query_block=query_block, sliding_window=sliding_window)


def write_kv_pages(k_pages, v_pages, k, v, slot_ids, *, impl: str = "reference"):
    """The Pallas implementation writes with its own kernel; the others with the reference's in-place scatter."""
    writer = pallas if impl == "pallas" else reference
    return writer.write_kv_pages(k_pages, v_pages, k, v, slot_ids)
