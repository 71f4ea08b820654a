"""Copying KV pages out of and into the device pool: to host memory and back (the prefix cache's host
tier), for a KV handover between a prefill and a decode replica, and from the target's pool into a draft
model's of the same layout (engine/draft_proposer.py: a row's tokens the draft lacks).

Host-tier pages move in groups of PAGE_COPY_GROUP (padded with the reserved page) so that one compiled
copy serves every count; the transfer to the host device is asynchronous. Handover pages move in
power-of-two chunks (handover_chunk_sizes), each size compiled at warm-up, so that the bytes that travel
are exactly the missing pages' and a handover never compiles while serving.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.host.page_allocator import RESERVED_PAGE
from jaxserve.models.kv_pages import KVPages
from pallas_kernels.paged_attention.kv_quantization import from_page_bytes, page_bytes

logger = logging.getLogger(__name__)
PAGE_COPY_GROUP = 16  # pages per host-tier copy


@dataclass(frozen=True)
class HostPage:
    """One page's KV in host memory: a column of a copied group [2 * num_layers, group, page_size, K, D]
    (quantized pages: bytes, D + 4 wide with their scales)."""

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
        group = pages[start : start + PAGE_COPY_GROUP]
        on_host = jax.device_put(_gather_pages(kv_pages, _padded_group(group)), host_device)
        handles += [HostPage(on_host, column) for column in range(len(group))]
    return handles


def write_pages(kv_pages: KVPages, pages: list[int], host_pages: list[HostPage]) -> KVPages:
    """Copy host KV back into pages (the pool is donated and returned)."""
    for start in range(0, len(pages), PAGE_COPY_GROUP):
        group = pages[start : start + PAGE_COPY_GROUP]
        data = host_pages_to_array(host_pages[start : start + len(group)])
        padding = np.zeros((data.shape[0], PAGE_COPY_GROUP - len(group)) + data.shape[2:], data.dtype)
        kv_pages = _scatter_pages(kv_pages, _padded_group(group), np.concatenate([data, padding], axis=1))
    return kv_pages


def handover_chunk_sizes(num_pages: int) -> list[int]:
    """num_pages as a sum of powers of two, largest first (13 -> 8, 4, 1). A handover copies its pages in
    chunks of these sizes: the copies of every power of two up to a sequence's pages compile at warm-up,
    and no padding page is ever moved (the bytes sent are exactly the pages asked for)."""
    sizes, size = [], 1 << max(num_pages.bit_length() - 1, 0)
    while num_pages:
        if size <= num_pages:
            sizes.append(size)
            num_pages -= size
        size >>= 1
    return sizes


def _chunks(pages: list[int]) -> list[np.ndarray]:
    chunks, start = [], 0
    for size in handover_chunk_sizes(len(pages)):
        chunks.append(np.asarray(pages[start : start + size], np.int32))
        start += size
    return chunks


def gather_pages(kv_pages: KVPages, pages: list[int]) -> list[jax.Array]:
    """The pages' KV as chunks [2 * num_layers, chunk, page_size, K, D] on the pool's devices, in page
    order (handover_chunk_sizes); exactly these pages, no padding."""
    return [_gather_pages(kv_pages, chunk) for chunk in _chunks(pages)]


def scatter_pages(kv_pages: KVPages, pages: list[int], chunks: list[jax.Array]) -> KVPages:
    """Write gather_pages' chunks into pages (the pool is donated and returned)."""
    indices = _chunks(pages)
    if [len(i) for i in indices] != [chunk.shape[1] for chunk in chunks]:
        raise ValueError(f"{len(pages)} pages to write but chunks of {[chunk.shape[1] for chunk in chunks]} pages")
    stored = jax.eval_shape(_gather_pages, kv_pages, np.zeros(1, np.int32))  # what this pool's pages copy as
    for chunk in chunks:  # a replica whose cache differs (kv_dtype, heads, width) sent them
        if (chunk.shape[0], *chunk.shape[2:], chunk.dtype) != (stored.shape[0], *stored.shape[2:], stored.dtype):
            raise ValueError(f"page chunk {chunk.shape} {chunk.dtype} does not fit this cache's pages ({stored})")
    for index, chunk in zip(indices, chunks):
        kv_pages = _scatter_pages(kv_pages, index, chunk)
    return kv_pages


def warm_up_handover_copies(kv_pages: KVPages, max_pages: int, chunk_sharding) -> KVPages:
    """Compile the gather and the scatter of every chunk size up to max_pages, the scatter taking its
    chunk where a handover puts it (chunk_sharding). They copy the reserved page onto itself. The first
    copy runs twice: a fresh pool is not committed to its devices, while every pool a step returns is
    (another executable)."""
    sizes = [1] + [1 << power for power in range(max(max_pages, 1).bit_length())]
    for size in sizes:
        pages = np.full(size, RESERVED_PAGE, np.int32)
        chunk = jax.device_put(_gather_pages(kv_pages, pages), chunk_sharding)
        kv_pages = _scatter_pages(kv_pages, pages, chunk)
    return kv_pages


def pools_alike(source: KVPages, dest: KVPages) -> bool:
    """Whether a page of `source` copies into `dest` as it is: the same layers, page size, heads, width and
    dtypes (scales too, for quantized pools); the page counts may differ."""
    if jax.tree.structure(source) != jax.tree.structure(dest):
        return False
    return all(
        a.shape[1:] == b.shape[1:] and a.dtype == b.dtype
        for a, b in zip(jax.tree.leaves(source), jax.tree.leaves(dest))
    )


class PagesBetweenPools:
    """Copies pages of one pool into another of the same layout (pools_alike), PAGE_COPY_GROUP pages a call padded
    with the reserved page: compiled once ahead of time for the two pools, so that neither pool's being committed to
    its device or not (which changes as steps return them) compiles the copy again while serving."""

    def __init__(self, source: KVPages, dest: KVPages):
        group = _padded_group([RESERVED_PAGE])
        self._copy = _copy_between.lower(source, dest, group, group).compile()

    def __call__(self, source: KVPages, dest: KVPages, source_pages: list[int], dest_pages: list[int]) -> KVPages:
        """source_pages[i] -> dest_pages[i]; dest is donated and returned."""
        if len(source_pages) != len(dest_pages):
            raise ValueError(f"{len(source_pages)} pages to copy into {len(dest_pages)}")
        for start in range(0, len(source_pages), PAGE_COPY_GROUP):
            end = start + PAGE_COPY_GROUP
            dest = self._copy(
                source, dest, _padded_group(source_pages[start:end]), _padded_group(dest_pages[start:end])
            )
        return dest


BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_counting = threading.local()  # compiles seen on this thread while a CountingCompiles is open


def _on_event_duration(event: str, duration_secs: float, **kwargs) -> None:
    if event == BACKEND_COMPILE_EVENT and getattr(_counting, "depth", 0):
        _counting.num_compiles += 1


jax.monitoring.register_event_duration_secs_listener(_on_event_duration)


class CountingCompiles:
    """Around a copy on a warm runner: adds any executable compiled meanwhile (on this thread: jit compiles
    where it is called) to the runner's count."""

    def __init__(self, runner):
        self.runner = runner

    def __enter__(self):
        _counting.depth = getattr(_counting, "depth", 0) + 1
        _counting.num_compiles = self.before = getattr(_counting, "num_compiles", 0)

    def __exit__(self, *exc_info):
        _counting.depth -= 1
        compiled = _counting.num_compiles - self.before
        if compiled and self.runner.warmed_up:
            logger.warning("compiled %d page copies while serving", compiled)
            self.runner.num_compiles_after_warmup += compiled


# A quantized pool's pages travel as bytes, values and scales together (kv_quantization.page_bytes), so
# every copy here (host tier, handover, multi-host) moves the scales with the pages.
@jax.jit
def _gather_pages(kv_pages: KVPages, pages):
    return jax.numpy.stack([page_bytes(layer, pages) for layer in kv_pages.keys + kv_pages.values])


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter_pages(kv_pages: KVPages, pages, data):
    num_layers = len(kv_pages.keys)
    layers = [from_page_bytes(layer, pages, data[i]) for i, layer in enumerate(kv_pages.keys + kv_pages.values)]
    return KVPages(keys=layers[:num_layers], values=layers[num_layers:])


@functools.partial(jax.jit, donate_argnums=(1,))
def _copy_between(source: KVPages, dest: KVPages, source_pages, dest_pages):
    # leaf by leaf: a quantized pool's values and scales alike have the page axis first
    return jax.tree.map(lambda s, d: d.at[dest_pages].set(s[source_pages]), source, dest)
