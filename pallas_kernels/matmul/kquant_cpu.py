"""The C++ K-quant matmul (cpu_kquant_matmul.cc): rows times GGUF Q4_K / Q5_K / Q6_K weights held at the
file's bytes (kquant.py's KQuantWeight), widened from their planes in registers, sums scaled once per
sub-block; x quantized to int8 per 32 k with integer dots as llama.cpp (AVX-512 VNNI) or kept in float;
with int8 x, any number of rows (prefill chunks too: from 9 rows each weight is widened once per call);
several weights by the same rows (a layer's q, k and v; gate and up: a Q4_K_M file mixes Q4_K and Q6_K
within a layer) in one call whose threads share the work. Built into the CPU kernels' one library
(pallas_kernels/cpu_library.py); `path=` builds and calls another instruction path's library (tests).

A custom call XLA's partitioner cannot split: it must only see whole weights on one device. Where the plan's
quantized kernel is the int8-dot one (a one-device CPU engine, `quantized_activations` int8) the 2-d K-quant
weights are moved at load into that kernel's tiles (quantized_tiles.py: read far faster, issue 25 session 41);
this kernel serves the rest (x kept in float, the planes as loaded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_library
from pallas_kernels.matmul import kquant, quantized_cpu
from pallas_kernels.matmul.row_blocks import ROW_INVARIANT_ROWS, in_row_blocks

KQUANT_TARGET = "jaxserve_cpu_kquant_matmul"
KERNEL_MAX_ROWS = 64  # float x: every decode bucket (its tiles widen the weights again every 8 rows)
ROW_DTYPES = tuple(jnp.dtype(name) for name in ("float32", "bfloat16", "float16"))
INT8_PATHS = ("avx512", "avx2")  # the builds with the int8 tiles (cpu_kquant_int8.h's KQUANT_INT8)
KIND_NUMBERS = {"q4_k": 4, "q5_k": 5, "q6_k": 6, "q5_0": 50, "q5_1": 51}  # cpu_kquant_matmul.cc's


KQUANT = cpu_library.CustomCall(KQUANT_TARGET, "JaxserveKQuantMatmul")
target, available = KQUANT.target, KQUANT.available


def serves_weight(weight) -> bool:
    """Whether the kernel computes this weight: a 2-d KQuantWeight (K in whole blocks, as loaded)."""
    return kquant.is_kquant(weight) and weight.low.ndim == 2 and jnp.dtype(weight.dtype) in ROW_DTYPES


def computes_int8(path: str | None = None) -> bool:
    """Whether `path`'s build (None: the engine's) has the int8-activation tiles (cpu_kquant_int8.h: the avx512
    path, with VNNI's vpdpbusd where the CPU has it, and the avx2 path through vpmaddubsw; the same integers);
    the portable path keeps x in float on an int8 request."""
    return cpu_library.chosen_path(path) in INT8_PATHS


def kquant_matmuls(x, weights, *, path: str | None = None, activations: str = "int8") -> tuple:
    """x [M, K] by each KQuantWeight [K, N_i] in one call -> float32 [M, N_i] each; the weights may be of
    different kinds. `path` (cpu_library.PATHS) picks another path's build; `activations`
    int8 quantizes x per 32 k as llama.cpp (where the path has the tiles: computes_int8), float keeps it."""
    quantized_cpu.check_activations(activations)
    weights = tuple(weights)
    if not weights:
        raise ValueError("kquant_matmuls wants at least one weight")
    for weight in weights:
        if not serves_weight(weight):
            raise ValueError(f"the CPU K-quant matmul does not serve this weight: {jax.tree.map(jnp.shape, weight)}")
        if x.ndim != 2 or x.shape[1] != weight.shape[0]:
            raise ValueError(f"kquant_matmul wants x [M, {weight.shape[0]}], got {x.shape}")
    if jnp.dtype(x.dtype) not in ROW_DTYPES:
        raise ValueError(f"kquant_matmul takes float32, bfloat16 or float16 rows, got {x.dtype}")
    if not available(path):
        raise RuntimeError("the CPU K-quant matmul could not be built; project with the reference")
    absent = jnp.zeros((1, 1), jnp.uint8)  # a kind's missing planes (Q4_K's high, Q6_K's mins and dmin)
    arrays = []
    for w in weights:
        arrays += [w.low, absent if w.high is None else w.high, absent if w.sub_scales is None else w.sub_scales]
        arrays += [absent if w.sub_mins is None else w.sub_mins, w.d, absent if w.dmin is None else w.dmin]
    results = tuple(jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32) for w in weights)
    kinds = np.asarray([KIND_NUMBERS[w.kind] for w in weights], np.int64)
    int8 = np.int64(activations == "int8")
    return tuple(jax.ffi.ffi_call(target(path), results)(x, *arrays, kinds=kinds, int8_activations=int8))


@dataclass(frozen=True)
class KQuantSmallMatmul:
    """The C++ kernel, for up to `max_rows` rows of K-quant weights (all of a call's weights; the rest: the
    reference), or any number where x is int8 and this build has the int8 tiles (prefill chunks: faster
    than the reference's dequantize-and-dot at 16-512 rows on SmolLM2's shapes, issue 25 session 12); a
    layer's weights by the same rows in one call, x kept as `activations` (int8 | float) says."""

    max_rows: int
    activations: str = "int8"
    joins_weights: ClassVar[bool] = True

    def serves(self, num_rows: int, weights: tuple) -> bool:
        any_rows = (self.activations == "int8" and computes_int8()) or self.max_rows >= ROW_INVARIANT_ROWS
        return (any_rows or num_rows <= self.max_rows) and all(serves_weight(weight) for weight in weights)

    def __call__(self, rows, weights: tuple, *, transposed: bool) -> tuple:
        if transposed:
            raise ValueError("quantized weights are stored [K, N]; a transposed projection takes a float weight")
        # 64 rows a call: a prefill chunk's row is the bits a decode row's is (row_blocks.py)
        return in_row_blocks(lambda block: kquant_matmuls(block, weights, activations=self.activations), rows)


__all__ = ["KERNEL_MAX_ROWS", "KQuantSmallMatmul", "available", "computes_int8", "kquant_matmuls", "serves_weight"]
