"""Ragged paged attention: one call serves decode tokens and prefill chunks of many sequences.

Layout of a step's tokens: a flat array of T query tokens in blocks of `query_block` tokens, every
block belonging to one sequence (a decode step uses query_block=1, a prefill step pads each chunk
to whole blocks). Each block attends to the pages of its sequence, causally by absolute position.
Padding tokens carry position -1 and attend to nothing.
Per layer, a sliding window (a query at position p sees keys after p - window; None or 0: none) and a
logits soft-cap (scaled scores become cap * tanh(score / cap); None or 0: none; Gemma 2), both static,
and attention sinks (an array [H]: one logit per query head in every softmax's denominator, with no
value; None: none; GPT-OSS).

Implementations, all with the reference's signature:
  reference  pure jax.numpy, any dtype, any backend: the specification
  cpu        C++ kernels (XLA FFI) on the CPU for float32, bfloat16 and float16 pages, built at first
             use; they also write the pages, in place
  pallas     Pallas kernels: Mosaic with DMA'd pages on TPU (pallas_tpu.py), the Triton kernel
             elsewhere (pallas_gpu.py); on the CPU they run in interpret mode: exact but slow
  auto       cpu on CPU (for those dtypes), pallas on GPU/TPU (checked at start-up by probe.py), else
             reference
"""

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import cpu, pallas_gpu, pallas_tpu, reference

ATTENTION_IMPLS = ("auto", "reference", "cpu", "pallas")


def resolve_attention_impl(
    impl: str,
    platform: str,
    dtype,
    partitioned: bool = False,
    head_dim: int | None = None,
    page_size: int | None = None,
) -> str:
    """The concrete implementation `impl` means on this platform for this KV dtype; `partitioned` when
    the step runs sharded over several devices by XLA's partitioner (only the jax.numpy reference
    partitions itself). "auto": the C++ kernels on the CPU for the dtypes they serve, Pallas on
    GPU/TPU where the kernel supports the sizes (the engine then checks it with probe.pallas_problem),
    else the reference."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention_impl {impl!r}; expected one of {ATTENTION_IMPLS}")
    if partitioned:
        if impl not in ("auto", "reference"):
            raise ValueError(f"attention_impl={impl!r} does not run sharded yet; use 'reference' or 'auto'")
        return "reference"
    if impl == "cpu" and (platform != "cpu" or jnp.dtype(dtype) not in cpu.DTYPES):
        raise ValueError(
            f"attention_impl='cpu' needs the CPU platform and one of {[str(d) for d in cpu.DTYPES]}, "
            f"not {platform}/{jnp.dtype(dtype)}"
        )
    unsupported = (
        pallas_gpu.supported(head_dim, page_size, platform) if head_dim is not None and page_size is not None else None
    )
    if impl == "pallas" and unsupported:
        raise ValueError(f"attention_impl='pallas': {unsupported}; use 'reference' or 'auto'")
    if impl == "auto":
        if platform == "cpu":
            return "cpu" if jnp.dtype(dtype) in cpu.DTYPES and cpu.available() else "reference"
        return "pallas" if platform in ("gpu", "tpu") and not unsupported else "reference"
    return impl


def kv_cache_head_dim(impl: str, platform: str, head_dim: int) -> int:
    """The head dim to allocate KV pages with: wider than the model's (zero padded) where the kernel
    needs it (the Triton kernel's power-of-two tiles), the model's own otherwise."""
    return pallas_gpu.cache_head_dim(head_dim, platform) if impl == "pallas" else head_dim


def kernel_modules(impl: str):
    """(attention module, KV-writer module) for a concrete implementation on this backend.

    On TPU the Mosaic attention kernel; its pages are written by XLA's in-place scatter, since the
    generic write kernel maps the whole page pool as one block, which Mosaic would stage in VMEM."""
    on_tpu = jax.default_backend() == "tpu"
    if impl == "pallas":
        return (pallas_tpu, reference) if on_tpu else (pallas_gpu, pallas_gpu)
    implementation = {"reference": reference, "cpu": cpu}.get(impl)
    if implementation is None:
        raise ValueError(f"unknown attention_impl {impl!r}; resolve 'auto' with resolve_attention_impl first")
    return implementation, implementation


def ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    page_table,
    token_seq_ids,
    positions,
    *,
    query_block: int,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks=None,
    impl: str = "reference",
):
    return kernel_modules(impl)[0].ragged_paged_attention(
        q,
        k_pages,
        v_pages,
        page_table,
        token_seq_ids,
        positions,
        query_block=query_block,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
        sinks=sinks,
    )


def write_kv_pages(k_pages, v_pages, k, v, kv_indices, *, impl: str = "reference"):
    """Token t's K/V [K, D] into row kv_indices[t] of the pages (page * page_size + offset), in place (the pages are donated)."""
    return kernel_modules(impl)[1].write_kv_pages(k_pages, v_pages, k, v, kv_indices)
