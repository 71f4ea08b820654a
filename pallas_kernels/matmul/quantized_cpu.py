"""The C++ quantized matmul (cpu_quantized_matmul.cc): a few rows times a QuantizedWeight (quantized.py), each
weight byte read once and widened in registers, group sums scaled once per group. Built at first use into
the CPU kernels' one library (pallas_kernels/cpu_library.py).

A custom call XLA's partitioner cannot split: it must only see whole weights on one device.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_library
from pallas_kernels.matmul import quantized

QUANTIZED_TARGET = "jaxserve_cpu_quantized_matmul"
QUANTIZED_MAX_ROWS = 8  # where one pass over the weights serves every row (cpu_quantized_matmul.cc's kRowGroup)
KERNEL_MAX_ROWS = 64  # cpu_quantized_matmul.cc's kMaxRows
ROW_DTYPES = tuple(jnp.dtype(name) for name in ("float32", "bfloat16", "float16"))
SCALE_DTYPES = ROW_DTYPES


@functools.cache
def _register() -> bool:
    library = cpu_library.load()
    if library is None or not hasattr(library, "JaxserveQuantizedMatmul"):
        return False
    target = jax.ffi.pycapsule(library.JaxserveQuantizedMatmul)
    jax.ffi.register_ffi_target(QUANTIZED_TARGET, target, platform="cpu")
    return True


def available() -> bool:
    return _register()


def serves_weight(weight) -> bool:
    """Whether the kernel computes this weight: a 2-d QuantizedWeight with scales of a float width it reads."""
    return (
        quantized.is_quantized(weight)
        and weight.values.ndim == 2
        and jnp.dtype(weight.scales.dtype) in SCALE_DTYPES
        and jnp.dtype(weight.dtype) in ROW_DTYPES
        and (weight.bits == 8 or weight.group_size % 2 == 0)
    )


def quantized_matmul(x, weight: quantized.QuantizedWeight):
    """x [M <= KERNEL_MAX_ROWS, K] @ weight [K, N] -> float32 [M, N]."""
    if not serves_weight(weight):
        raise ValueError(f"the CPU quantized matmul does not serve this weight: {jax.tree.map(jnp.shape, weight)}")
    if x.ndim != 2 or x.shape[0] > KERNEL_MAX_ROWS or x.shape[1] != weight.shape[0]:
        raise ValueError(f"quantized_matmul wants x [M <= {KERNEL_MAX_ROWS}, {weight.shape[0]}], got {x.shape}")
    if jnp.dtype(x.dtype) not in ROW_DTYPES:
        raise ValueError(f"quantized_matmul takes float32, bfloat16 or float16 rows, got {x.dtype}")
    if not _register():
        raise RuntimeError("the CPU quantized matmul could not be built; project with the reference")
    has_mins = weight.mins is not None
    mins = weight.mins if has_mins else jnp.zeros((1, 1), weight.scales.dtype)
    result = jax.ShapeDtypeStruct((x.shape[0], weight.shape[1]), jnp.float32)
    call = jax.ffi.ffi_call(QUANTIZED_TARGET, result)
    return call(x, weight.values, weight.scales, mins, bits=int(weight.bits), has_mins=has_mins)


@dataclass(frozen=True)
class QuantizedSmallMatmul:
    """The C++ kernel, for up to `max_rows` rows of quantized weights it serves (the rest: the reference)."""

    max_rows: int
    joins_weights: ClassVar[bool] = False

    def serves(self, num_rows: int, weights: tuple) -> bool:
        return num_rows <= self.max_rows and all(serves_weight(weight) for weight in weights)

    def __call__(self, rows, weights: tuple, *, transposed: bool) -> tuple:
        if transposed:
            raise ValueError("quantized weights are stored [K, N]; a transposed projection takes a float weight")
        return tuple(quantized_matmul(rows, weight) for weight in weights)
