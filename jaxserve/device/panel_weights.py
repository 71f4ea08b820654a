"""A one-device CPU engine's float projections stored in column panels (pallas_kernels/matmul/panels.py), the layout
the CPU kernel reads fastest at a decode step's few rows (cpu_matmul_panels.h, issue 29); its quantized ones in
the int8-dot kernel's tiles (quantized_tiles.py, cpu_int8_dot_tiles.h, issue 25).

Done once at load, a weight at a time (the [K, N] array is dropped as its panels are made), for the Linears whose
kernel goes only through the matmul plan: a Linear that reads its kernel as a matrix itself (DeepSeek's kv_b_proj,
absorbed into attention: `reads_kernel_whole`) keeps it. Adapter slots, checkpoints and the reference take the
panels too (lora/slots.py reads the logical shape, quantize_orbax.py saves the matrix).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.layers import Linear
from pallas_kernels.matmul import quantized_tiles
from pallas_kernels.matmul.kquant import KQuantWeight
from pallas_kernels.matmul.panels import to_panels
from pallas_kernels.matmul.quantized import QuantizedWeight


def store_projections_in_panels(model, dtypes) -> int:
    """Moves the model's eligible projection kernels of `dtypes` (its matmul plan's panel_dtypes: the CPU kernel
    serves them at every row count) into panels, in place; returns how many."""
    dtypes = {jnp.dtype(dtype) for dtype in dtypes}
    moved = 0
    for _, node in nnx.iter_graph(model):
        if not isinstance(node, Linear) or node.reads_kernel_whole:
            continue
        kernel = node.kernel.get_value()
        eligible = isinstance(kernel, jax.Array) and kernel.ndim == 2 and jnp.dtype(kernel.dtype) in dtypes
        if not eligible or node.dtype not in (None, kernel.dtype):  # (a Linear computing in another dtype casts)
            continue
        node.kernel.set_value(to_panels(kernel))  # pyright: ignore[reportArgumentType]  # a weight type, as quantized
        del kernel
        moved += 1
    return moved


def store_quantized_in_tiles(model) -> int:
    """Moves the model's [K, N] QuantizedWeights and 2-d GGUF K-quants (KQuantWeight) that have a tiled form
    (quantized_tiles.can_tile) into tiles, in place, a weight at a time; returns how many. Projections whose
    kernel goes only through the matmul plan, and a quantized embedding (stored [E, V], the head it also is where
    tied: its lookup reads tiles too). Call only where the plan's quantized kernel is the CPU int8-dot one (MatmulPlan.tiles_quantized): XLA's dots would untile the
    weight on every step."""
    moved = 0
    for _, node in nnx.iter_graph(model):
        if isinstance(node, Linear) and not node.reads_kernel_whole:
            param = node.kernel
        elif isinstance(node, nnx.Embed):
            param = node.embedding
        else:
            continue
        weight = param.get_value()
        if isinstance(weight, (QuantizedWeight, KQuantWeight)) and quantized_tiles.can_tile(weight):
            param.set_value(quantized_tiles.to_tiles(weight))  # pyright: ignore[reportArgumentType]
            del weight
            moved += 1
    return moved
