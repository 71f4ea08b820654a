"""The C++ CPU kernels (cpu_kernel.cc): built with the system's C++ compiler at first use, then cached.

They serve float32, bfloat16 and float16 pages (accumulating in float32) and write new K/V into the
donated pages in place. The reference cannot do that with 16-bit pages: XLA:CPU computes 16-bit
gathers and scatters in float32, converting the whole page pool (and back) every step (issue #16).

The build is keyed by the source, the JAX version and the host, so a changed kernel or a different
machine rebuilds. `available()` is False when no compiler works; callers then use the reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = (os.path.join(HERE, "cpu_kernel.cc"), os.path.join(HERE, "cpu_matmul.cc"))  # one library
HEADERS = (os.path.join(HERE, "cpu_workers.h"),)  # part of the build's cache key
ATTENTION_TARGET = "jaxserve_cpu_paged_attention"
WRITE_TARGET = "jaxserve_cpu_write_kv_pages"
MATMUL_TARGET = "jaxserve_cpu_small_matmul"
MATMUL_MAX_ROWS = 64  # cpu_matmul.cc's kMaxRows
DTYPES = tuple(jnp.dtype(name) for name in ("float32", "bfloat16", "float16"))  # of the pages it serves
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "kernels")


def _build(library_path: str) -> None:
    compiler = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    os.makedirs(os.path.dirname(library_path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(library_path)) as staging:
        staged = os.path.join(staging, "kernel.so")
        command = [
            compiler,
            "-O3",
            "-march=native",
            "-mprefer-vector-width=512",
            "-fopenmp-simd",
            "-fno-math-errno",
            "-fno-trapping-math",
            "-std=c++17",
            "-shared",
            "-fPIC",
            "-I",
            jax.ffi.include_dir(),
            *SOURCES,
            "-o",
            staged,
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"building {SOURCES} failed:\n{result.stderr[-2000:]}")
        os.replace(staged, library_path)  # atomic: concurrent builders never see a partial library


@functools.cache
def _register() -> bool:
    sources = b""
    for source in SOURCES + HEADERS:
        with open(source, "rb") as f:
            sources += f.read()
    key = hashlib.sha256(
        sources + jax.__version__.encode() + platform.processor().encode() + platform.machine().encode()
    ).hexdigest()[:16]
    library_path = os.path.join(CACHE_DIR, f"paged_attention_{key}.so")
    try:
        if not os.path.isfile(library_path):
            _build(library_path)
        library = ctypes.cdll.LoadLibrary(library_path)
        jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(library.JaxservePagedAttention), platform="cpu")
        jax.ffi.register_ffi_target(WRITE_TARGET, jax.ffi.pycapsule(library.JaxserveWriteKvPages), platform="cpu")
        jax.ffi.register_ffi_target(MATMUL_TARGET, jax.ffi.pycapsule(library.JaxserveSmallMatmul), platform="cpu")
    except (RuntimeError, OSError) as error:
        logger.warning("CPU attention kernel unavailable, using the jax.numpy reference: %s", error)
        return False
    return True


def available() -> bool:
    return _register()


def _require(dtype) -> None:
    if jnp.dtype(dtype) not in DTYPES:
        raise ValueError(f"the CPU kernels serve {[str(d) for d in DTYPES]} pages, not {jnp.dtype(dtype)}")
    if not _register():
        raise RuntimeError("the CPU attention kernel could not be built; use attention_impl='reference'")


def ragged_paged_attention(
    q, k_pages, v_pages, page_table, token_seq_ids, positions, *, query_block: int, sliding_window: int | None = None
):
    """The reference's contract, with q in the pages' dtype."""
    _require(k_pages.dtype)
    if q.dtype != k_pages.dtype or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            f"the CPU kernel wants q and pages of one dtype, got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}"
        )
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q,
        k_pages,
        v_pages,
        page_table.astype(np.int32),
        token_seq_ids.astype(np.int32),
        positions.astype(np.int32),
        query_block=np.int64(query_block),
        sliding_window=np.int64(sliding_window or 0),
        own_helpers=jax.device_count() == 1,
    )


def write_kv_pages(k_pages, v_pages, k, v, slot_ids):
    """The reference's contract; the results alias the pages, so donated pages are updated in place."""
    _require(k_pages.dtype)
    pages = (jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype), jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype))
    call = jax.ffi.ffi_call(WRITE_TARGET, pages, input_output_aliases={0: 0, 1: 1})
    return tuple(call(k_pages, v_pages, k.astype(k_pages.dtype), v.astype(v_pages.dtype), slot_ids.astype(np.int32)))


def small_matmul(x, w, *, transposed: bool = False):
    """x [M, K] @ w [K, N] (w [N, K] when transposed) -> float32 [M, N], for M <= MATMUL_MAX_ROWS, x and w
    of one dtype: each weight element read once and widened in registers (cpu_matmul.cc)."""
    return small_matmuls(x, (w,), transposed=transposed)[0]


def small_matmuls(x, weights, *, transposed: bool = False):
    """small_matmul of one x by several weights in one call (a layer's q, k and v): the threads share the
    work of all of them. Returns a tuple of float32 [M, N_i]."""
    weights = tuple(weights)
    for w in weights:
        _require(w.dtype)
        depth = w.shape[-1] if transposed else w.shape[0]
        if x.dtype != w.dtype or x.ndim != 2 or w.ndim != 2 or x.shape[0] > MATMUL_MAX_ROWS or depth != x.shape[1]:
            raise ValueError(
                f"small_matmul wants x [M <= {MATMUL_MAX_ROWS}, K] and 2-d weights of x's dtype "
                f"with K {'columns' if transposed else 'rows'}, got {x.shape} {x.dtype} and "
                f"{w.shape} {w.dtype}"
            )
    if not weights:
        raise ValueError("small_matmuls wants at least one weight")
    results = tuple(
        jax.ShapeDtypeStruct((x.shape[0], w.shape[0] if transposed else w.shape[1]), jnp.float32) for w in weights
    )
    return tuple(jax.ffi.ffi_call(MATMUL_TARGET, results)(x, *weights, transposed=transposed))
