"""The C++ CPU attention kernels (cpu_kernel.cc), built at first use into the CPU kernels' one library
(pallas_kernels/cpu_library.py).

They serve float32, bfloat16 and float16 pages (accumulating in float32), or quantized pages (int8 or
float8_e4m3 with a scale per token-head, kv_quantization.py) read by queries of those types, and write
new K/V into the donated pages in place. The reference cannot do that with 16-bit pages: XLA:CPU computes 16-bit
gathers and scatters in float32, converting the whole page pool (and back) every step (issue #16).

`available()` is False when the library cannot be built; callers then use the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_library
from pallas_kernels.paged_attention.kv_quantization import QuantizedPages, is_quantized, quantize, split_pages

ATTENTION_TARGET = "jaxserve_cpu_paged_attention"
WRITE_TARGET = "jaxserve_cpu_write_kv_pages"
DTYPES = tuple(jnp.dtype(name) for name in ("float32", "bfloat16", "float16"))  # of the pages it serves


def target(path: str | None = None, name: str = ATTENTION_TARGET) -> str:
    return cpu_library.target_name(name, path)


def _register(path: str | None = None) -> bool:
    return cpu_library.register(ATTENTION_TARGET, "JaxservePagedAttention", path) and cpu_library.register(
        WRITE_TARGET, "JaxserveWriteKvPages", path
    )


def available() -> bool:
    return _register()


def _require(dtype, path: str | None = None) -> None:
    if jnp.dtype(dtype) not in DTYPES:
        raise ValueError(f"the CPU kernels serve {[str(d) for d in DTYPES]} pages, not {jnp.dtype(dtype)}")
    if not _register(path):
        raise RuntimeError("the CPU attention kernel could not be built; use attention_impl='reference'")


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
    path: str | None = None,
):
    """The reference's contract, with q in the pages' dtype, 16-bit pages beside float32 q, or pages quantized
    (sinks in float32, whatever it). `path` (cpu_library.PATHS) picks another instruction path's build than the
    engine's."""
    _require(q.dtype, path)
    widened = q.dtype == jnp.float32 and k_pages.dtype in DTYPES  # a float32 model's cache in 16 bits
    if is_quantized(k_pages) != is_quantized(v_pages) or (
        not is_quantized(k_pages) and ((q.dtype != k_pages.dtype and not widened) or v_pages.dtype != k_pages.dtype)
    ):
        raise ValueError(
            f"the CPU kernel wants q and pages of one dtype (16-bit pages beside float32 q, or quantized pages), got "
            f"{q.dtype}, {k_pages.dtype}, {v_pages.dtype}"
        )
    (k_values, k_scales), (v_values, v_scales) = split_pages(k_pages), split_pages(v_pages)
    no_scales = np.zeros((0,), np.float32)
    call = jax.ffi.ffi_call(target(path), jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q,
        k_values,
        v_values,
        no_scales if k_scales is None else k_scales,
        no_scales if v_scales is None else v_scales,
        page_table.astype(np.int32),
        token_seq_ids.astype(np.int32),
        positions.astype(np.int32),
        np.zeros((0,), np.float32) if sinks is None else sinks.astype(np.float32),  # empty: none
        query_block=np.int64(query_block),
        sliding_window=np.int64(sliding_window or 0),
        soft_cap=np.float32(logits_soft_cap or 0.0),
        own_helpers=jax.device_count() == 1,
    )


def write_kv_pages(k_pages, v_pages, k, v, kv_indices):
    """The reference's contract; the results alias the pages, so donated pages are updated in place.
    Quantized pools: the rows are quantized here, then values and scales are written by the same kernel."""
    if is_quantized(k_pages) and is_quantized(v_pages):
        (k_values, k_scales), (v_values, v_scales) = quantize(k, k_pages.data.dtype), quantize(v, v_pages.data.dtype)
        k_data, v_data = _write_rows(k_pages.data, v_pages.data, k_values, v_values, kv_indices)
        k_scale_pool, v_scale_pool = _write_rows(k_pages.scales, v_pages.scales, k_scales, v_scales, kv_indices)
        return QuantizedPages(k_data, k_scale_pool), QuantizedPages(v_data, v_scale_pool)
    _require(k_pages.dtype)
    return _write_rows(k_pages, v_pages, k.astype(k_pages.dtype), v.astype(v_pages.dtype), kv_indices)


def _write_rows(k_pages, v_pages, k, v, kv_indices):
    """Row t of k / v [T, ...] into row kv_indices[t] of the pools [N, page_size, ...], in place."""
    if not _register():
        raise RuntimeError("the CPU attention kernel could not be built; use attention_impl='reference'")
    pages = (jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype), jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype))
    call = jax.ffi.ffi_call(WRITE_TARGET, pages, input_output_aliases={0: 0, 1: 1})
    return tuple(call(k_pages, v_pages, k, v, kv_indices.astype(np.int32)))
