"""Quantized params in orbax checkpoints (loading/orbax_checkpoint.py): saved and restored quantized.

A QuantizedWeight is saved as plain arrays under its param's name plus `.values`, `.scales` and `.mins`
(a GGUF K-quant's KQuantWeight: `.low`, `.high`, `.sub_scales`, `.sub_mins`, `.d`, `.dmin`, layout "kquant");
the checkpoint's marker file (jaxserve_checkpoint.json) lists each quantized param with its static fields
and each array's shape and dtype, which is everything a restore needs to rebuild the abstract target
without reading the arrays. A restore places each array as loading/quantize.py places a fresh load.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxserve.loading.quantize import place_shardings
from pallas_kernels.matmul.kquant import KQuantWeight
from pallas_kernels.matmul.panels import is_panels
from pallas_kernels.matmul.quantized import QuantizedWeight, untiled

LEAVES = ("values", "scales", "mins")
KQUANT_LEAVES = ("low", "high", "sub_scales", "sub_mins", "d", "dmin")


def split_for_saving(flat: dict) -> tuple[dict, dict]:
    """{param name: array or QuantizedWeight} -> ({array name: array}, {param name: its description})."""
    arrays, quantized = {}, {}
    for name, value in flat.items():
        if is_panels(value):  # the CPU kernel's layout of a float weight (device/panel_weights.py): saved [K, N]
            arrays[name] = value.matrix()
            continue
        value = untiled(value)  # the CPU int8 kernel's tiles (quantized_tiles.py): saved [K, N], re-tiled at load
        if not isinstance(value, (QuantizedWeight, KQuantWeight)):
            arrays[name] = value
            continue
        two_level = isinstance(value, KQuantWeight)
        leaves = {}
        for leaf in KQUANT_LEAVES if two_level else LEAVES:
            array = getattr(value, leaf)
            if array is not None:
                arrays[f"{name}.{leaf}"] = array
                leaves[leaf] = [list(array.shape), str(np.dtype(array.dtype))]
        if isinstance(value, KQuantWeight):
            quantized[name] = dict(layout="kquant", kind=value.kind, compute_dtype=value.compute_dtype, leaves=leaves)
        else:
            quantized[name] = dict(
                bits=value.bits, group_size=value.group_size, compute_dtype=value.compute_dtype, leaves=leaves
            )
    return arrays, quantized


def restore_targets(name: str, description: dict, sharding, stored_transposed: bool) -> dict:
    """The abstract arrays (ShapeDtypeStruct, placed) a quantized param restores from, by array name."""
    abstract = _assemble(
        description,
        {
            leaf: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))
            for leaf, (shape, dtype) in description["leaves"].items()
        },
    )
    shardings = place_shardings(abstract, sharding, stored_transposed)
    return {
        f"{name}.{leaf}": jax.ShapeDtypeStruct(
            getattr(abstract, leaf).shape, getattr(abstract, leaf).dtype, sharding=getattr(shardings, leaf)
        )
        for leaf in description["leaves"]
    }


def assemble(name: str, description: dict, restored: dict) -> QuantizedWeight | KQuantWeight:
    return _assemble(description, {leaf: restored[f"{name}.{leaf}"] for leaf in description["leaves"]})


def _assemble(description: dict, leaves: dict) -> QuantizedWeight | KQuantWeight:
    if description.get("layout") == "kquant":
        return KQuantWeight(
            leaves["low"],
            leaves.get("high"),
            leaves.get("sub_scales"),
            leaves.get("sub_mins"),
            leaves["d"],
            leaves.get("dmin"),
            kind=description["kind"],
            compute_dtype=description["compute_dtype"],
        )
    return QuantizedWeight(
        leaves["values"],
        leaves["scales"],
        leaves.get("mins"),
        bits=description["bits"],
        group_size=description["group_size"],
        compute_dtype=description["compute_dtype"],
    )


__all__ = ["assemble", "restore_targets", "split_for_saving"]
