"""Where each param lives: its own logical axes (declared where the model creates it, as
`logical_axes` metadata) mapped to the mesh by one rules table."""

from __future__ import annotations

from flax import nnx
from jax.sharding import Mesh, NamedSharding

from sharding.rules import LOGICAL_AXIS_RULES, partition_spec


def param_shardings(
    abstract_state: nnx.State, mesh: Mesh | None, sizes: dict[str, int], rules: dict = LOGICAL_AXIS_RULES
) -> dict[tuple, NamedSharding]:
    """Param path -> its NamedSharding on `mesh` ({} without a mesh: everything on the default device).

    sizes: how many units each logical axis has (heads, kv_heads, mlp, vocab, ...); an axis whose
    units the mesh axis does not divide is replicated rather than cut through a head. An expert axis's
    units are its array's rows: padded to a whole number per device under expert parallelism."""
    if mesh is None:
        return {}
    shardings = {}
    for path, variable in nnx.to_flat_state(abstract_state):
        axes = variable.get_metadata("logical_axes", None)
        if axes is None:
            raise ValueError(f"param {'.'.join(map(str, path))} declares no logical axes")
        units = {**sizes, "expert": variable.get_value().shape[axes.index("expert")]} if "expert" in axes else sizes
        shardings[path] = NamedSharding(mesh, partition_spec(axes, mesh, units, rules))
    return shardings
