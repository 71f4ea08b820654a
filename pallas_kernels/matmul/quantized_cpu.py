"""The C++ quantized matmuls: rows times QuantizedWeights (quantized.py): a decode step's few, each weight byte
read once, and with int8 activations a prefill chunk's too (in blocks of 64 rows, a block of weight columns
kept in cache while the row blocks pass);
several weights by the same rows (a layer's q, k and v; gate and up) in one call whose threads share the
work. Two kernels with one interface, picked by the engine option `quantized_activations` (EngineConfig,
`model.quantized_activations` in a config file), which the builder hands to `choose_matmul` and the plan's
entry keeps (library code reads no environment variable):

- `int8` (default; cpu_quantized_int8_dot.cc): each row of x quantized to int8 per 32 k (llama.cpp's
  quantize_row_q8_0 rounding), integer dot products (AVX-512 VNNI, or AVX2 maddubs), one float multiply per
  32-block. What llama.cpp computes on the same file, so results differ from the dequantized float product
  by the activations' rounding (a relative ~0.4% of each block's largest |x| per element).
- `float` (cpu_quantized_matmul.cc): x stays float, the weights are widened to float32 in registers: the
  dequantized product to float rounding, at the float instruction rate (the A/B baseline).

Built at first use into the CPU kernels' one library (pallas_kernels/cpu_library.py), for this CPU's
instruction path (or JAXSERVE_CPU_KERNEL_PATH's); `path=` builds and calls another path's library beside
it (tests, benches).

A custom call XLA's partitioner cannot split: it must only see whole weights on one device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_library
from pallas_kernels.matmul import quantized
from pallas_kernels.matmul.cpu import check_norm_scale
from pallas_kernels.matmul.quantized_tiles import TiledQuantizedWeight
from pallas_kernels.matmul.row_blocks import ROW_INVARIANT_ROWS, in_row_blocks

QUANTIZED_TARGET = "jaxserve_cpu_quantized_matmul"  # every kernel's custom call name starts with it
NORMED_TARGET, NORMED_SYMBOL = QUANTIZED_TARGET + "_normed", "JaxserveQuantizedInt8DotNormed"  # x through a norm first
# activations -> (the library's FFI symbol, the custom call's name suffix)
KERNELS = {"int8": ("JaxserveQuantizedInt8Dot", ""), "float": ("JaxserveQuantizedMatmul", "_float_rows")}
# Rows one call takes: cpu_quantized_matmul.cc's kMaxRows; the int8 kernel any number (blocks of 64 rows)
KERNEL_MAX_ROWS = {"int8": None, "float": 64}
# Rows the plan sends to each kernel. float: all of a decode step's (64, the default largest decode bucket):
# it passes over a group's weight rows once per 8 rows of x (the register tile) from cache; XLA's reference
# dequantizes the whole weight from 32 rows and ran a 48-row step at a third of the kernel's speed. int8:
# prefill chunks too, up to PREFILL_MAX_ROWS (docs/notes/quantized-int8-activations.md, Session 12).
PREFILL_MAX_ROWS = 2048
PLAN_MAX_ROWS = {"int8": PREFILL_MAX_ROWS, "float": KERNEL_MAX_ROWS["float"]}
QUANTIZED_MAX_ROWS = PLAN_MAX_ROWS["int8"]  # the default kernel's
ROW_DTYPES = tuple(jnp.dtype(name) for name in ("float32", "bfloat16", "float16"))
SCALE_DTYPES = ROW_DTYPES


def check_activations(activations: str) -> str:
    """`activations` if a kernel of that name exists; a ValueError naming the option otherwise."""
    if activations not in KERNELS:
        raise ValueError(f"unknown quantized_activations {activations!r}; expected one of {', '.join(KERNELS)}")
    return activations


def target(path: str | None = None, activations: str = "int8") -> str:
    """The custom call's name for `path`'s library (None: the engine's own) and kernel."""
    return cpu_library.target_name(QUANTIZED_TARGET + KERNELS[activations][1], path)


def _register(path: str | None = None, activations: str = "int8") -> bool:
    return cpu_library.register(QUANTIZED_TARGET + KERNELS[activations][1], KERNELS[activations][0], path)


def _register_normed(path: str | None = None) -> bool:
    return cpu_library.register(NORMED_TARGET, NORMED_SYMBOL, path)


def available(activations: str = "int8") -> bool:
    return _register(None, check_activations(activations))


def serves_weight(weight, activations: str = "int8") -> bool:
    """Whether the kernel computes this weight: a 2-d QuantizedWeight with scales of a float width it reads, or its
    tiles (quantized_tiles.py; the int8 kernel only)."""
    tiled = isinstance(weight, TiledQuantizedWeight)
    two_level = tiled and weight.super_scales is not None  # K-quant tiles: uint8 sc and m (Q6_K: int8 sc)
    return (
        (isinstance(weight, quantized.QuantizedWeight) or (tiled and activations == "int8"))  # K-quants: kquant_cpu.py
        and (tiled or weight.values.ndim == 2)
        and (two_level or jnp.dtype(weight.scales.dtype) in SCALE_DTYPES)
        and jnp.dtype(weight.dtype) in ROW_DTYPES
        and (weight.bits == 8 or weight.group_size % 2 == 0)
    )


def quantized_matmul(x, weight: quantized.QuantizedWeight, *, path: str | None = None, activations: str = "int8"):
    """x [M, K] @ weight [K, N] -> float32 [M, N] (M up to KERNEL_MAX_ROWS[activations])."""
    return quantized_matmuls(x, (weight,), path=path, activations=activations)[0]


def quantized_matmuls(x, weights, *, path: str | None = None, activations: str = "int8") -> tuple:
    """x [M, K] by each weight [K, N_i] in one call -> float32 [M, N_i] each (M up to KERNEL_MAX_ROWS[activations];
    the int8 kernel any). The weights may
    differ in bits, groups and scale widths (a GGUF file mixes block types within a layer). `path`
    (cpu_library.PATHS) picks another instruction path's build than the engine's; `activations` (int8,
    float) the kernel."""
    weights = _checked(x, weights, path, activations)
    call = jax.ffi.ffi_call(target(path, activations), _results(x, weights))
    return tuple(call(x, *_operands(weights, activations), **_attributes(weights)))


def quantized_matmuls_normed(x, scale, eps: float, weights, *, path: str | None = None) -> tuple:
    """quantized_matmuls of RMSNorm(x) (the int8 kernel), the norm inside the call: x's rows through x * rsqrt(mean(x^2)
    + eps) in float32, rounded to x's dtype, times `scale` [K] (x's dtype), as models/layers.py's RMSNorm without
    Gemma's unit offset (the float kernel's norm, cpu_rms_norm.h: the sum of squares in its own order, so float32
    rows may differ from XLA's in the last bits), then rounded to int8 as any x. In a decode step this saves the
    norm's XLA thunks between two kernel calls (issue 25: a Q4_0 step is ~5 ms, a norm's thunks ~5 us each)."""
    weights = _checked(x, weights, path, "int8")
    check_norm_scale(x, scale, "quantized_matmuls_normed")
    if not _register_normed(path):
        raise RuntimeError("the CPU quantized matmul could not be built; project with the reference")
    call = jax.ffi.ffi_call(cpu_library.target_name(NORMED_TARGET, path), _results(x, weights))
    return tuple(call(x, scale, *_operands(weights, "int8"), **_attributes(weights), eps=np.float32(eps)))


def _checked(x, weights, path: str | None, activations: str) -> tuple:
    """The weights as a tuple, once each has been found one the kernel computes with x's shape and dtype (a ValueError
    naming what does not fit), and the kernel built."""
    check_activations(activations)
    weights = tuple(weights)
    if not weights:
        raise ValueError("quantized_matmuls wants at least one weight")
    for weight in weights:
        if not serves_weight(weight, activations):
            raise ValueError(f"the CPU quantized matmul does not serve this weight: {jax.tree.map(jnp.shape, weight)}")
        if x.ndim != 2 or x.shape[1] != weight.shape[0]:
            raise ValueError(f"quantized_matmul wants x [M, {weight.shape[0]}], got {x.shape}")
    max_rows = KERNEL_MAX_ROWS[activations]
    if max_rows is not None and x.shape[0] > max_rows:
        raise ValueError(f"the {activations}-activation kernel takes at most {max_rows} rows, got {x.shape[0]}")
    if jnp.dtype(x.dtype) not in ROW_DTYPES:
        raise ValueError(f"quantized_matmul takes float32, bfloat16 or float16 rows, got {x.dtype}")
    if not _register(path, activations):
        raise RuntimeError("the CPU quantized matmul could not be built; project with the reference")
    return weights


def _operands(weights: tuple, activations: str) -> list:
    """Each weight's arrays as the kernel takes them: values, scales, mins (and for the int8 kernel the K-quant tiles'
    super-block scales and mins), a placeholder where the weight has none."""
    arrays = []
    absent = jnp.zeros((1, 1, 1), jnp.float16)  # a weight's missing super-block scales (all but Q4_K / Q5_K tiles)
    for weight in weights:
        mins = weight.mins if weight.mins is not None else jnp.zeros((1,) * weight.scales.ndim, weight.scales.dtype)
        arrays += [weight.values, weight.scales, mins]
        if activations == "int8":  # (the float kernel takes no tiles)
            supers = [getattr(weight, "super_scales", None), getattr(weight, "super_mins", None)]
            arrays += [absent if a is None else a for a in supers]
    return arrays


def _results(x, weights: tuple) -> tuple:
    return tuple(jax.ShapeDtypeStruct((x.shape[0], weight.shape[1]), jnp.float32) for weight in weights)


def _attributes(weights: tuple) -> dict:
    bits = [int(weight.bits) for weight in weights]
    has_mins = [int(weight.mins is not None) for weight in weights]
    return {"bits": np.asarray(bits, np.int64), "has_mins": np.asarray(has_mins, np.int64)}


@dataclass(frozen=True)
class QuantizedSmallMatmul:
    """The C++ kernel, for up to `max_rows` rows of quantized weights it serves (the rest: the reference);
    a layer's weights by the same rows in one call, x kept as `activations` (int8 | float) says."""

    max_rows: int
    activations: str = "int8"
    joins_weights: ClassVar[bool] = True

    def serves(self, num_rows: int, weights: tuple) -> bool:
        return (num_rows <= self.max_rows or self.max_rows >= ROW_INVARIANT_ROWS) and all(
            serves_weight(weight, self.activations) for weight in weights
        )

    def __call__(self, rows, weights: tuple, *, transposed: bool) -> tuple:
        if transposed:
            raise ValueError("quantized weights are stored [K, N]; a transposed projection takes a float weight")
        # 64 rows a call: a prefill chunk's row is the bits a decode row's is (row_blocks.py)
        return in_row_blocks(lambda block: quantized_matmuls(block, weights, activations=self.activations), rows)

    @property
    def takes_norm(self) -> bool:
        """Whether `normed` serves: the int8 kernel takes the norm into its call (the float one does not)."""
        return self.activations == "int8" and _register_normed()

    def normed(self, rows, scale, eps: float, weights: tuple) -> tuple:
        """RMSNorm(rows; scale, eps) by each weight, the norm inside the int8 kernel's call (takes_norm)."""
        if not self.takes_norm:
            raise ValueError(f"the {self.activations}-activation quantized kernel takes no norm into its call")
        compute = lambda block: quantized_matmuls_normed(block, scale, eps, weights)  # noqa: E731
        return in_row_blocks(compute, rows)
