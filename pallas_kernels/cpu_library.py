"""The C++ CPU kernels' one shared library: paged attention (paged_attention/cpu_kernel.cc) and the small
matmul (matmul/cpu_matmul.cc), built with the system's C++ compiler at first use, then cached.

One library rather than one per kernel: both run on the same process-wide helper threads (cpu_workers.h),
which spin briefly after each call so that the next call finds them awake. Two libraries would each start
and spin their own set, taking cores from each other between a projection and the attention after it.

Instruction paths (issue #29): the kernels are written once on the compiler's vector types; the flags
they are compiled with pick the path. By default the best this CPU has (`native_path`): avx512 (AVX-512
F/BW/VL), avx2 (AVX2 + FMA + F16C), or portable (x86-64's SSE2 baseline; other architectures' defaults).
JAXSERVE_CPU_KERNEL_PATH=avx512|avx2|portable forces one (read when the library is first loaded; a path
this CPU cannot run is refused), e.g. avx2 on an AVX-512 machine to measure what an AVX2-only one gets.

The build is keyed by the sources, the JAX version, the host and the path's flags, so a changed kernel, a
different machine or another path rebuilds. `load()` is None when no compiler works; each kernel's
`available()` is then False and the engine uses the jax.numpy references.
"""

from __future__ import annotations

import ctypes
import dataclasses
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
SOURCES += (os.path.join(HERE, "matmul", "cpu_kquant_matmul.cc"),)  # GGUF K-quants at their bytes (issue 25)
SOURCES += (os.path.join(HERE, "matmul", "cpu_quantized_int8_dot.cc"),)  # int8-activation dots (issue 25)
SOURCES += (os.path.join(HERE, "paged_attention", "cpu_latent_kernel.cc"),)  # DeepSeek's MLA (issue 27)
SOURCES += (os.path.join(HERE, "matmul", "cpu_lora_matmul.cc"),)  # segmented multi-LoRA (issue 28)
SOURCES += (os.path.join(HERE, "sampling", "cpu_sampler.cc"),)  # the sampler's draw
HEADERS = (os.path.join(HERE, "cpu_workers.h"),)  # included from HERE (-I); part of the build's cache key
HEADERS += (os.path.join(HERE, "matmul", "cpu_float_vectors.h"),)  # every matmul kernel's float32 vectors
HEADERS += (os.path.join(HERE, "matmul", "cpu_matmul_vectors.h"),)  # cpu_matmul.cc's vector basics
HEADERS += (os.path.join(HERE, "matmul", "cpu_rms_norm.h"),)  # the norm inside the float and int8-dot calls
HEADERS += (os.path.join(HERE, "matmul", "cpu_gated_rows.h"),)  # the gated activation inside a down projection's call
HEADERS += (os.path.join(HERE, "matmul", "cpu_matmul_bf16_pairs.h"),)  # cpu_matmul.cc's AVX-512 BF16 tiles
HEADERS += (os.path.join(HERE, "matmul", "cpu_matmul_few_rows.h"),)  # cpu_matmul.cc's 2-8 row walks
HEADERS += (os.path.join(HERE, "matmul", "cpu_matmul_panels.h"),)  # cpu_matmul.cc's weights in column panels
HEADERS += (os.path.join(HERE, "matmul", "cpu_matmul_amx.h"),)  # cpu_matmul.cc's bfloat16 on AMX tiles
HEADERS += (
    os.path.join(HERE, "paged_attention", "cpu_attention_basics.h"),
)  # cpu_latent_kernel.cc's, the sampler's exp
HEADERS += (os.path.join(HERE, "matmul", "cpu_int8_dot_vectors.h"),)  # cpu_quantized_int8_dot.cc's vector basics
HEADERS += (os.path.join(HERE, "matmul", "cpu_int8_dot_activations.h"),)  # its inputs, x quantized
HEADERS += (os.path.join(HERE, "matmul", "cpu_int8_dot_chunks.h"),)  # its walk over one chunk
HEADERS += (os.path.join(HERE, "matmul", "cpu_int8_dot_tiles.h"),)  # its walk over weights in tiles
HEADERS += (os.path.join(HERE, "matmul", "cpu_kquant_vectors.h"),)  # cpu_kquant_matmul.cc's vector basics
HEADERS += (os.path.join(HERE, "matmul", "cpu_kquant_int8.h"),)  # cpu_kquant_matmul.cc's int8-activation tiles
HEADERS += (os.path.join(HERE, "matmul", "cpu_weight_basics.h"),)  # the quantized kernels' scalar basics, prefetch
HEADERS += (os.path.join(HERE, "matmul", "cpu_call_plan.h"),)  # the quantized kernels' one-call plan (few rows)
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "kernels")

PATH_ENV = "JAXSERVE_CPU_KERNEL_PATH"
PATHS = ("avx512", "avx2", "portable")  # fastest first
# /proc/cpuinfo flags each x86 path needs (the kernels use F16C to widen float16, FMA to accumulate).
PATH_CPU_FLAGS = {"avx512": {"avx512f", "avx512bw", "avx512vl"}, "avx2": {"avx2", "fma", "f16c"}}


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def _cpuinfo_field(*names: str) -> str:
    """The first /proc/cpuinfo line's value whose key starts with one of `names` ('' where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(names):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (empty where there is no /proc/cpuinfo)."""
    return frozenset(_cpuinfo_field("flags", "Features").split())


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...); empty where there is none."""
    return _cpuinfo_field("vendor_id")


def native_path() -> str:
    """The fastest instruction path this CPU runs."""
    flags = cpu_flags()
    if _is_x86():
        for path in ("avx512", "avx2"):
            if PATH_CPU_FLAGS[path] <= flags:
                return path
    return "portable"


def runnable_paths() -> tuple[str, ...]:
    """The paths this CPU can run: the native one and every slower one."""
    return PATHS[PATHS.index(native_path()) :]


def chosen_path(requested: str | None = None) -> str:
    """`requested`, else JAXSERVE_CPU_KERNEL_PATH, else the native path; ValueError for an unknown path or
    one this CPU cannot run (its instructions would fault)."""
    requested = requested or os.environ.get(PATH_ENV, "").strip().lower() or "native"
    if requested in ("native", "auto"):
        return native_path()
    if requested not in PATHS:
        raise ValueError(f"{PATH_ENV}={requested!r}: expected one of {', '.join(PATHS)} (or native)")
    if requested not in runnable_paths():
        raise ValueError(
            f"{PATH_ENV}={requested!r}: this CPU ({platform.machine()}) runs only {', '.join(runnable_paths())}"
        )
    return requested


def compile_flags(path: str) -> list[str]:
    """The compiler flags that select `path`: the host's own ISA, less AVX-512 for avx2 (what an AVX2-only
    CPU of the same family has), or the architecture's baseline for portable. On AMD CPUs the small matmul's
    one-row float32 walk is a sweep of whole weight rows (JAXSERVE_ONE_ROW_SWEEP, cpu_matmul_few_rows.h: its
    column-strip tiles read memory at ~0.6 of a stream there), and its few-row walks keep blocks of 32 weight rows
    with their prefetch 32 rows ahead (cpu_matmul_few_rows.h: 16 / 16 elsewhere, measured on an Intel Xeon; on the
    AMD EPYC a block of 8 was slower at one row and 16 was not measured)."""
    vendor = (
        ["-DJAXSERVE_ONE_ROW_SWEEP=1", "-DJAXSERVE_WALK_BLOCK_ROWS=32", "-DJAXSERVE_WALK_AHEAD_ROWS=32"]
        if cpu_vendor() == "AuthenticAMD"
        else []
    )
    if path == "avx512":
        return ["-march=native", "-mprefer-vector-width=512", *vendor]
    if path == "avx2":
        return ["-march=native", "-mno-avx512f", "-mprefer-vector-width=256", *vendor]
    return ["-march=x86-64", "-mtune=generic"] if _is_x86() else []


def _build(library_path: str, path: str) -> None:
    compiler = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    os.makedirs(os.path.dirname(library_path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(library_path)) as staging:
        staged = os.path.join(staging, "kernel.so")
        command = [
            compiler,
            "-O3",
            *compile_flags(path),
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
def load(path: str | None = None) -> ctypes.CDLL | None:
    """The kernels' library for `path` (default: JAXSERVE_CPU_KERNEL_PATH, else this CPU's best), built
    first where this host has no copy of these sources' build; None when it cannot be built or loaded
    (with a warning saying why)."""
    path = chosen_path(path)
    sources = b""
    for source in SOURCES + HEADERS:
        with open(source, "rb") as f:
            sources += f.read()
    key = hashlib.sha256(
        sources
        + jax.__version__.encode()
        + platform.processor().encode()
        + platform.machine().encode()
        + " ".join([path, *compile_flags(path)]).encode()
        + ",".join(sorted(cpu_flags())).encode()
    ).hexdigest()[:16]
    library_path = os.path.join(CACHE_DIR, f"cpu_kernels_{path}_{key}.so")
    try:
        if not os.path.isfile(library_path):
            _build(library_path, path)
        library = ctypes.cdll.LoadLibrary(library_path)
        library.JaxserveCpuKernelPath.restype = ctypes.c_char_p
        return library
    except (RuntimeError, OSError) as error:
        logger.warning("CPU kernels unavailable, using the jax.numpy references: %s", error)
        return None


def target_name(name: str, path: str | None = None) -> str:
    """A custom call's name for `path`'s library: `name` itself for the engine's own (path None), so that
    another path's build (tests, benchmarks) runs beside it under a name of its own."""
    return name if path is None else f"{name}_{path}"


@functools.cache
def register(name: str, symbol: str, path: str | None = None) -> bool:
    """Registers the library's FFI handler `symbol` as the CPU custom call target_name(name, path), once; False
    where the library did not build or lacks the symbol (an older build: the kernel's jnp reference serves)."""
    library = load(path)
    if library is None or not hasattr(library, symbol):
        return False
    jax.ffi.register_ffi_target(target_name(name, path), jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return True


@dataclasses.dataclass(frozen=True)
class CustomCall:
    """A kernel's one custom call: the library's FFI handler `symbol` under `name` (`target(path)` for another
    instruction path's build beside the engine's own)."""

    name: str
    symbol: str

    def target(self, path: str | None = None) -> str:
        return target_name(self.name, path)

    def available(self, path: str | None = None) -> bool:
        """Registered (built and loaded) for `path`'s library; False where it cannot be."""
        return register(self.name, self.symbol, path)
