"""The C++ small matmul (cpu_matmul.cc): a few rows times float32, bfloat16 or float16 weights, each weight
element read once at its stored width and widened in registers, accumulated in float32. Built at first use
into the CPU kernels' one library (pallas_kernels/cpu_library.py), for this CPU's instruction path (or
JAXSERVE_CPU_KERNEL_PATH's); `path=` builds and calls another path's library beside it (tests, benches).

A custom call XLA's partitioner cannot split: it must only see whole weights on one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_library
from pallas_kernels.matmul.panels import is_panels

MATMUL_TARGET = "jaxserve_cpu_small_matmul"
NORMED_TARGET = "jaxserve_cpu_small_matmul_normed"  # x through an RMS norm first (small_matmuls_normed)
GATED_TARGET = "jaxserve_cpu_small_matmul_gated"  # x = silu(gate) * up first (small_matmuls_gated)
GATED_ACTIVATIONS = ("silu",)  # the activations cpu_gated_rows.h computes
MATMUL_MAX_ROWS = 256  # cpu_matmul.cc's kMaxRows
DTYPES = tuple(jnp.dtype(name) for name in ("float32", "bfloat16", "float16"))  # of the weights it serves


def target(path: str | None = None, name: str = MATMUL_TARGET) -> str:
    return cpu_library.target_name(name, path)


def _register(path: str | None = None) -> bool:
    return (
        cpu_library.register(MATMUL_TARGET, "JaxserveSmallMatmul", path)
        and cpu_library.register(NORMED_TARGET, "JaxserveSmallMatmulNormed", path)
        and cpu_library.register(GATED_TARGET, "JaxserveSmallMatmulGated", path)
    )


def available() -> bool:
    return _register()


def kernel_path(path: str | None = None) -> str | None:
    """The instruction path the library for `path` (default: the engine's) was compiled for, as the
    library itself reports it; None where it does not build."""
    library = cpu_library.load(path)
    return None if library is None else library.JaxserveCpuKernelPath().decode()


def panel_dtypes(path: str | None = None) -> tuple:
    """The weight dtypes the kernel reads in column panels (panels.py) as fast as or faster than [K, N]: all it
    serves (bfloat16 in vdpbf16ps pairs too, on AVX-512 BF16 without AMX: cpu_matmul_panels.h's pair tiles). Empty
    where the kernel does not build."""
    return DTYPES if cpu_library.load(path) is not None else ()


def amx_tiles(path: str | None = None) -> bool:
    """Whether the library runs bfloat16 calls above a walk's 8 rows on AMX tiles (cpu_matmul_amx.h: built for an
    AMX CPU and granted the tiles by the kernel): such rows are then not the bits of a one-row call."""
    library = cpu_library.load(path)
    return library is not None and bool(library.JaxserveCpuAmxTiles())


def small_matmul(x, w, *, transposed: bool = False, path: str | None = None):
    """x [M, K] @ w [K, N] (w [N, K] when transposed; or ColumnPanels) -> float32 [M, N], for M <=
    MATMUL_MAX_ROWS, x and w of one dtype."""
    return small_matmuls(x, (w,), transposed=transposed, path=path)[0]


def small_matmuls(x, weights, *, transposed: bool = False, path: str | None = None):
    """small_matmul of one x by several weights in one call (a layer's q, k and v): the threads share the
    work of all of them. Returns a tuple of float32 [M, N_i]. `path` (cpu_library.PATHS) picks another
    instruction path's build than the engine's."""
    weights = tuple(weights)
    _check(x, weights, transposed, path)
    results = tuple(
        jax.ShapeDtypeStruct((x.shape[0], w.shape[0] if transposed else w.shape[1]), jnp.float32) for w in weights
    )
    return tuple(jax.ffi.ffi_call(target(path), results)(x, *map(_operand, weights), transposed=transposed))


def small_matmuls_normed(x, scale, eps: float, weights, *, path: str | None = None):
    """small_matmuls of RMSNorm(x) by [K, N_i] weights, the norm inside the call: x's rows through
    x * rsqrt(mean(x^2) + eps) in float32, rounded to x's dtype, times `scale` [K] (x's dtype), as
    models/layers.py's RMSNorm (without Gemma's unit offset; the sum of squares in its own order, so float32 rows
    may differ from XLA's in the last bits). In a decode step this saves the norm's four XLA thunks between two
    kernel calls (issue #29)."""
    weights = tuple(weights)
    _check(x, weights, False, path)
    check_norm_scale(x, scale, "small_matmuls_normed")
    results = tuple(jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32) for w in weights)
    operands = map(_operand, weights)
    return tuple(jax.ffi.ffi_call(target(path, NORMED_TARGET), results)(x, scale, *operands, eps=np.float32(eps)))


def small_matmuls_gated(gate, up, weights, *, path: str | None = None):
    """small_matmuls of silu(gate) * up by [F, N_i] weights, the activation inside the call: gate and up [M, F]
    float32 (the gate and up projections' results) rounded to the weights' dtype, silu in float32, rounded, times
    up, rounded, as models/layers.py's gated_activation (its exp not XLA's to the last bit: cpu_gated_rows.h). In a
    step of several rows this saves a fusion XLA:CPU splits over its pool (issue #29, session 51)."""
    weights = tuple(weights)
    if gate.dtype != jnp.float32 or up.dtype != jnp.float32 or gate.shape != up.shape or gate.ndim != 2:
        raise ValueError(
            f"small_matmuls_gated wants gate and up [M, F] float32 alike, got {gate.shape} "
            f"{gate.dtype} and {up.shape} {up.dtype}"
        )
    rows = jax.ShapeDtypeStruct(gate.shape, weights[0].dtype if weights else gate.dtype)  # x as the kernel makes it
    _check(rows, weights, False, path)
    results = tuple(jax.ShapeDtypeStruct((gate.shape[0], w.shape[1]), jnp.float32) for w in weights)
    operands = map(_operand, weights)
    return tuple(jax.ffi.ffi_call(target(path, GATED_TARGET), results)(gate, up, *operands))


def check_norm_scale(x, scale, caller: str) -> None:
    """A ValueError naming `caller` unless the norm's scale is [K] in x's dtype (the normed calls' contract)."""
    if scale.shape != (x.shape[1],) or scale.dtype != x.dtype:
        raise ValueError(f"{caller} wants the norm's scale [{x.shape[1]}] {x.dtype}, got {scale.shape} {scale.dtype}")


def _operand(weight):
    """What the kernel reads of a weight: the array, or a ColumnPanels' panels (3-d: the kernel knows them so)."""
    return weight.panels if is_panels(weight) else weight


def _check(x, weights: tuple, transposed: bool, path: str | None) -> None:
    for w in weights:
        if jnp.dtype(w.dtype) not in DTYPES:
            raise ValueError(f"the CPU small matmul serves {[str(d) for d in DTYPES]} weights, not {w.dtype}")
        if is_panels(w) and transposed:
            raise ValueError("a ColumnPanels weight is [K, N]: it cannot be contracted transposed")
        depth = w.shape[-1] if transposed else w.shape[0]
        if x.dtype != w.dtype or x.ndim != 2 or w.ndim != 2 or x.shape[0] > MATMUL_MAX_ROWS or depth != x.shape[1]:
            raise ValueError(
                f"small_matmul wants x [M <= {MATMUL_MAX_ROWS}, K] and 2-d weights of x's dtype "
                f"with K {'columns' if transposed else 'rows'}, got {x.shape} {x.dtype} and "
                f"{w.shape} {w.dtype}"
            )
    if not weights:
        raise ValueError("small_matmuls wants at least one weight")
    if not _register(path):
        raise RuntimeError("the CPU small matmul could not be built; project with the reference")
