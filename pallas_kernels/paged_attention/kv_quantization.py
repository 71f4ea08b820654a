"""Quantized KV pages (cache.kv_dtype int8 | float8_e4m3): one scale per token and KV head.

A quantized pool is a `QuantizedPages` pytree in place of a page array: the values in one byte and a
float32 scale per (page, offset, kv head), so that row r of a page holds `data[r] * scales[r]`. The
model passes it through untouched; the KV write quantizes this step's keys and values (absmax of each
token-head over head_dim, as vLLM's and SGLang's per-token-head KV scales) and every attention
implementation widens the bytes and applies the scale as it reads a span of keys.

Scales are float32: a bfloat16 scale would add its own 0.4% relative error to every key, about the
size of int8's rounding, for 2 of the (head_dim + 4) bytes a token-head takes.

cache.kv_dtype bfloat16 | float16 are not quantized: a plain 16-bit page array (no scales) beside a float32
model, half of its cache's bytes, as llama.cpp keeps its cache in float16 by default; every attention
implementation widens the pages as it reads them.

Page movers see the pool through `page_bytes` / `from_page_bytes`: every leaf of a layer as raw bytes
[pages, page_size, K, D (+ 4 scale bytes)], so a page's values and scales travel together in one array
(host tier, KV handover, multi-host copies) whatever the format.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

KV_DTYPES = ("auto", "bfloat16", "float16", "int8", "float8_e4m3")
FLOAT_KV_DTYPES = ("bfloat16", "float16")  # 16-bit float pages, no scales (see the module docstring)
# The stored value types, and the largest magnitude each holds.
_STORAGE = {"int8": (jnp.int8, 127.0), "float8_e4m3": (jnp.float8_e4m3fn, 448.0)}
STORAGE_DTYPES = tuple(jnp.dtype(dtype) for dtype, _ in _STORAGE.values())


@jax.tree_util.register_dataclass
@dataclass
class QuantizedPages:
    """One layer's key (or value) pool, quantized; shape/dtype/sharding describe the values."""

    data: jax.Array  # [num_pages, page_size, K, D] int8 or float8_e4m3fn
    scales: jax.Array  # [num_pages, page_size, K] float32: row r holds data[r] * scales[r]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def sharding(self):
        return self.data.sharding

    @classmethod
    def zeros(cls, shape: tuple[int, ...], kv_dtype: str) -> QuantizedPages:
        return cls(data=jnp.zeros(shape, storage_dtype(kv_dtype)), scales=jnp.zeros(shape[:-1], jnp.float32))


def storage_dtype(kv_dtype: str):
    """The one-byte type a quantized kv_dtype stores its values in."""
    if kv_dtype not in _STORAGE:
        raise ValueError(f"unknown cache.kv_dtype {kv_dtype!r}; expected one of {KV_DTYPES}")
    return _STORAGE[kv_dtype][0]


def is_quantized(pages) -> bool:
    return isinstance(pages, QuantizedPages)


def bytes_per_token_head(head_dim: int, kv_dtype: str, dtype) -> int:
    """Cache bytes one token's key (or value) takes per KV head: values plus a quantized format's scale."""
    if kv_dtype == "auto":
        return head_dim * jnp.dtype(dtype).itemsize
    if kv_dtype in FLOAT_KV_DTYPES:
        return head_dim * jnp.dtype(kv_dtype).itemsize
    return head_dim * jnp.dtype(storage_dtype(kv_dtype)).itemsize + 4


def quantize(x, dtype):
    """x [..., D] -> (values [..., D] in `dtype` (int8 or float8_e4m3fn), scales [...] float32), the
    scale of each row its absmax over the largest value the type holds (0 for an all-zero row)."""
    largest = 127.0 if jnp.dtype(dtype) == jnp.int8 else 448.0
    x = x.astype(jnp.float32)
    scales = jnp.max(jnp.abs(x), axis=-1) / largest
    inverse = jnp.where(scales > 0, 1.0 / jnp.where(scales > 0, scales, 1.0), 0.0)
    scaled = x * inverse[..., None]
    if jnp.dtype(dtype) == jnp.int8:
        values = jnp.clip(jnp.round(scaled), -127, 127).astype(jnp.int8)
    else:
        values = jnp.clip(scaled, -largest, largest).astype(dtype)
    return values, scales


def dequantize(values, scales):
    """values [..., D], scales [...] -> float32 [..., D]."""
    return values.astype(jnp.float32) * scales[..., None]


def write_quantized(pages: QuantizedPages, x, kv_indices) -> QuantizedPages:
    """Token t's [K, D] quantized into row kv_indices[t] (page * page_size + offset), by XLA's scatter."""
    page_size = pages.data.shape[1]
    values, scales = quantize(x, pages.data.dtype)
    page, offset = kv_indices // page_size, kv_indices % page_size
    return QuantizedPages(
        data=pages.data.at[page, offset].set(values, mode="promise_in_bounds"),
        scales=pages.scales.at[page, offset].set(scales, mode="promise_in_bounds"),
    )


def gather_dequantized(pages, page_ids):
    """pages[page_ids] as float32 for a quantized pool, as stored otherwise."""
    if is_quantized(pages):
        return dequantize(pages.data[page_ids], pages.scales[page_ids])
    return pages[page_ids]


def page_bytes(pages, page_ids):
    """The pages' contents [n, page_size, ...] as one array: a float pool as it is, a quantized one as
    bytes [n, page_size, K, D + 4] (values, then the scale's four bytes)."""
    if not is_quantized(pages):
        return pages[page_ids]
    values = jax.lax.bitcast_convert_type(pages.data[page_ids], jnp.uint8)
    scales = jax.lax.bitcast_convert_type(pages.scales[page_ids], jnp.uint8)  # [n, page_size, K, 4]
    return jnp.concatenate([values, scales], axis=-1)


def from_page_bytes(pages, page_ids, contents):
    """page_bytes' inverse: contents written into the pages (a scatter; donate the pool)."""
    if not is_quantized(pages):
        return pages.at[page_ids].set(contents)
    head_dim = pages.data.shape[-1]
    values = jax.lax.bitcast_convert_type(contents[..., :head_dim], pages.data.dtype)
    scales = jax.lax.bitcast_convert_type(contents[..., head_dim:], jnp.float32)
    return QuantizedPages(data=pages.data.at[page_ids].set(values), scales=pages.scales.at[page_ids].set(scales))


def split_pages(pages):
    """(values, scales or None): what a kernel reads."""
    return (pages.data, pages.scales) if is_quantized(pages) else (pages, None)


def numpy_quantize(x: np.ndarray, kv_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The host's copy of `quantize`, for building test pages."""
    values, scales = quantize(jnp.asarray(x), storage_dtype(kv_dtype))
    return np.asarray(values), np.asarray(scales)
