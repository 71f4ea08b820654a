"""The C++ CPU kernels' one shared library: paged attention (paged_attention/cpu_kernel.cc) and the small
matmul (matmul/cpu_matmul.cc), built with the system's C++ compiler at first use, then cached.

One library rather than one per kernel: both run on the same process-wide helper threads (cpu_workers.h),
which spin briefly after each call so that the next call finds them awake. Two libraries would each start
and spin their own set, taking cores from each other between a projection and the attention after it.

The build is keyed by the sources, the JAX version and the host, so a changed kernel or a different
machine rebuilds. `load()` is None when no compiler works; each kernel's `available()` is then False and
the engine uses the jax.numpy references.
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

logger = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = (os.path.join(HERE, "paged_attention", "cpu_kernel.cc"), os.path.join(HERE, "matmul", "cpu_matmul.cc"))
SOURCES += (os.path.join(HERE, "matmul", "cpu_quantized_matmul.cc"),)  # quantized weights (issue 25)
HEADERS = (os.path.join(HERE, "cpu_workers.h"),)  # included from HERE (-I); part of the build's cache key
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
            HERE,
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
def load() -> ctypes.CDLL | None:
    """The kernels' library, built first where this host has no copy of these sources' build; None when it
    cannot be built or loaded (with a warning saying why)."""
    sources = b""
    for source in SOURCES + HEADERS:
        with open(source, "rb") as f:
            sources += f.read()
    key = hashlib.sha256(
        sources + jax.__version__.encode() + platform.processor().encode() + platform.machine().encode()
    ).hexdigest()[:16]
    library_path = os.path.join(CACHE_DIR, f"cpu_kernels_{key}.so")
    try:
        if not os.path.isfile(library_path):
            _build(library_path)
        return ctypes.cdll.LoadLibrary(library_path)
    except (RuntimeError, OSError) as error:
        logger.warning("CPU kernels unavailable, using the jax.numpy references: %s", error)
        return None
