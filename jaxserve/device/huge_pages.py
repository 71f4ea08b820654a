"""A one-device CPU engine's weights in transparent huge pages (issue #16).

A decode step streams every weight once, and on the CPU that stream is what a step costs; a read over
2 MiB huge pages runs about twice as fast as one over 4 KiB pages (bench/decode_step.py measures both;
figures in bench/results/). XLA:CPU allocates its buffers with malloc, in 4 KiB pages
(transparent huge pages are usually "madvise" only), so the weights are moved into one arena that asks
for huge pages, and each weight is handed to XLA without a copy (a CPU `device_put` of a suitably aligned
numpy array aliases it).

One weight at a time: its old buffer is dropped as soon as its copy is in place, so loading never holds
two copies of the weights. Wherever something does not hold (another platform, a mesh, XLA copying
instead of aliasing), the weights stay where they are: a slower read, never a different result.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import jax
import numpy as np
from flax import nnx

from pallas_kernels.matmul.panels import is_panels
from pallas_kernels.matmul.quantized import is_quantized

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
ALIGNMENT = 4096  # each weight's start in the arena (XLA aliases host buffers aligned to at least 64 bytes)
MADV_HUGEPAGE = 14


def _ask_for_huge_pages(arena: np.ndarray) -> bool:
    """madvise(MADV_HUGEPAGE) before the arena is first touched, so its pages are faulted in huge."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return libc.madvise(arena.ctypes.data, arena.nbytes, MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def huge_page_arena(num_bytes: int) -> np.ndarray | None:
    """Untouched host memory of num_bytes, aligned to a huge page and marked for huge pages (None where
    the platform refuses): its pages come into being, huge, as it is first written."""
    raw = np.empty(num_bytes + HUGE_PAGE_BYTES, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE_BYTES
    arena = raw[start : start + num_bytes]
    return arena if sys.platform.startswith("linux") and _ask_for_huge_pages(arena) else None


def _weights(model) -> list[nnx.Variable]:
    return [
        node
        for _, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Variable)
        and (isinstance(node.get_value(), jax.Array) or is_quantized(node.get_value()) or is_panels(node.get_value()))
    ]


def _arrays(variable: nnx.Variable) -> list[jax.Array]:
    """A weight's arrays: the weight itself, or a quantized one's values, scales and mins (issue 25: its
    decode reads stream as a float weight's do)."""
    return jax.tree.leaves(variable.get_value())


def move_weights_to_huge_pages(model) -> int:
    """Moves a one-device CPU model's weights into a huge-page arena, in place. Returns the bytes moved
    (0 where it does not apply or the platform refuses)."""
    if not sys.platform.startswith("linux") or jax.default_backend() != "cpu" or jax.device_count() != 1:
        return 0
    variables = _weights(model)
    sizes = [-(-array.nbytes // ALIGNMENT) * ALIGNMENT for variable in variables for array in _arrays(variable)]
    total = sum(sizes)
    if total < HUGE_PAGE_BYTES:
        return 0
    # Untouched memory: pages come into being as weights are copied in, while old buffers are freed.
    arena = huge_page_arena(total)
    if arena is None:
        logger.info("madvise(MADV_HUGEPAGE) refused: weights stay in XLA's own buffers")
        return 0
    offset = 0
    sizes_left = iter(sizes)
    for variable in variables:
        olds, treedef = jax.tree.flatten(variable.get_value())
        news = []
        for old, size in zip(olds, sizes_left):
            view = arena[offset : offset + old.nbytes].view(old.dtype).reshape(old.shape)
            np.copyto(view, np.asarray(old))
            # As committed as before: a committed argument costs the compiled step's dispatch a little more.
            new = jax.device_put(view, old.sharding if old.committed else None)
            if new.unsafe_buffer_pointer() != view.ctypes.data:  # XLA copied: keep the weights where they were
                logger.info("XLA copied a host buffer instead of aliasing it: weights stay in its own buffers")
                return offset
            news.append(new)
            offset += size
        variable.set_value(jax.tree.unflatten(treedef, news))
        del olds, news
    return offset
