"""Copying KV pages between the device pool and host memory (the prefix cache's host tier).

Pages move in groups of PAGE_COPY_GROUP (padded with the reserved page) so that one compiled copy
serves every count; the transfer to the host device is asynchronous.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.host.page_allocator import RESERVED_PAGE
from jaxserve.models.kv_pages import KVPages

PAGE_COPY_GROUP = 16  # pages per host-tier copy


@dataclass(frozen=True)
class HostPage:
    """One page's KV in host memory: a column of a copied group [2 * num_layers, group, page_size, K, D]."""

    group: jax.Array
    column: int


def host_pages_to_array(host_pages: list[HostPage]) -> np.ndarray:
    """[2 * num_layers, len(host_pages), page_size, num_kv_heads, head_dim]."""
    return np.stack([np.asarray(page.group)[:, page.column] for page in host_pages], axis=1)


def _padded_group(pages: list[int]) -> np.ndarray:
    return np.asarray(pages + [RESERVED_PAGE] * (PAGE_COPY_GROUP - len(pages)), np.int32)


def read_pages(kv_pages: KVPages, pages: list[int], host_device) -> list[HostPage]:
    """Start copying pages' KV to host memory; returns a handle per page without waiting."""
    handles = []
    for start in range(0, len(pages), PAGE_COPY_GROUP):
        group = pages[start:start + PAGE_COPY_GROUP]
        on_host = jax.device_put(_gather_pages(kv_pages, _padded_group(group)), host_device)
        handles += [HostPage(on_host, column) for column in range(len(group))]
    return handles


def write_pages(kv_pages: KVPages, pages: list[int], host_pages: list[HostPage]) -> KVPages:
    """Copy host KV back into pages (the pool is donated and returned)."""
    for start in range(0, len(pages), PAGE_COPY_GROUP):
        group = pages[start:start + PAGE_COPY_GROUP]
        data = host_pages_to_array(host_pages[start:start + len(group)])
        padding = np.zeros((data.shape[0], PAGE_COPY_GROUP - len(group)) + data.shape[2:], data.dtype)
        kv_pages = _scatter_pages(kv_pages, _padded_group(group), np.concatenate([data, padding], axis=1))
    return kv_pages


def gather_pages(kv_pages: KVPages, pages: list[int]) -> jax.Array:
    """[2 * num_layers, len(pages), page_size, K, D] on the pool's devices, exactly these pages (a KV
    handover moves no padding; one compile per count)."""
    return _gather_pages(kv_pages, np.asarray(pages, np.int32))


def scatter_pages(kv_pages: KVPages, pages: list[int], data: jax.Array) -> KVPages:
    """Write gather_pages' layout into pages (the pool is donated and returned)."""
    return _scatter_pages(kv_pages, np.asarray(pages, np.int32), data)


@jax.jit
def _gather_pages(kv_pages: KVPages, pages):
    return jax.numpy.stack([layer[pages] for layer in kv_pages.keys + kv_pages.values])


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter_pages(kv_pages: KVPages, pages, data):
    num_layers = len(kv_pages.keys)
    layers = [layer.at[pages].set(data[i]) for i, layer in enumerate(kv_pages.keys + kv_pages.values)]
    return KVPages(keys=layers[:num_layers], values=layers[num_layers:])
