"""Where each expert lives under expert parallelism, and moving experts so device loads even out.

Each MoE layer stores its experts' weights device by device: row `device * per_device + slot` of its
[X, ...] weight arrays holds the expert that the layer's placement puts at (device, slot). The
placement is two [X] int32 arrays per layer (sharding.moe.ExpertPlacement), kept beside the
params so the compiled step takes them as inputs: moving experts changes values, never shapes, and
compiles nothing. Checkpoints are always written with experts in their canonical order.

A load profile is tokens routed per expert, [layers, experts] (`llm.stats()["expert_tokens"]`, or a
JSON file holding it); each layer is placed on its own, heaviest experts first onto the least loaded
device with room (sharding.moe.place_experts).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from sharding.moe import ExpertPlacement, place_experts

EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


def read_load_profile(source, num_layers: int, num_experts: int) -> np.ndarray:
    """[layers, experts] float64 from a JSON file path or an array-like; a single [experts] row
    applies to every layer. The JSON may be the list itself or an object with "expert_tokens"."""
    if isinstance(source, (str, os.PathLike)):
        try:
            with open(source) as f:
                source = json.load(f)
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read the expert load profile {os.fspath(source)!r}: {error}") from None
        if isinstance(source, dict):
            if "expert_tokens" not in source:
                raise ValueError("an expert load profile object needs an 'expert_tokens' entry ([layers][experts])")
            source = source["expert_tokens"]
    try:
        load = np.asarray(source, np.float64)
    except (TypeError, ValueError):
        raise ValueError("an expert load profile must be numbers: [layers][experts] or [experts]") from None
    if load.ndim == 1:
        load = np.broadcast_to(load, (num_layers, load.shape[0]))
    if load.shape != (num_layers, num_experts):
        raise ValueError(f"expert load profile has shape {load.shape}; this model needs "
                         f"({num_layers}, {num_experts}) (or ({num_experts},) for every layer)")
    if not np.all(np.isfinite(load)) or (load < 0).any():
        raise ValueError("expert load profile entries must be finite and >= 0")
    return load


def initial_placement(abstract_placement: nnx.State, num_experts: int, mesh) -> nnx.State:
    """Concrete contiguous placements (replicated on the mesh) for an abstract model's ExpertPlacements."""
    device_of, slot_of, _ = place_experts(None, num_experts, mesh.devices.size)
    replicated = NamedSharding(mesh, PartitionSpec())
    values = {"expert_device": device_of, "expert_slot": slot_of}
    return nnx.from_flat_state([(path, variable.replace(jax.device_put(values[path[-1]], replicated)))
                                for path, variable in nnx.to_flat_state(abstract_placement)])


def _moe_layers(flat: dict) -> list[tuple]:
    """Path prefixes of the MoE layers (those with a placement), in layer order."""
    return sorted((path[:-1] for path in flat if path[-1] == "expert_device"),
                  key=lambda prefix: [p for p in prefix if isinstance(p, int)])


def _stored_rows(flat: dict, prefix: tuple) -> np.ndarray:
    """Row of the weight arrays where each expert currently is, [X]."""
    placed = flat[prefix + ("expert_device",)].get_value()
    device_of, slot_of = np.asarray(placed), np.asarray(flat[prefix + ("expert_slot",)].get_value())
    return device_of * (len(device_of) // placed.sharding.mesh.devices.size) + slot_of


def device_of_experts(state: nnx.State) -> np.ndarray:
    """[layers, experts]: the device each expert of each MoE layer sits on."""
    flat = dict(nnx.to_flat_state(state))
    return np.stack([np.asarray(flat[prefix + ("expert_device",)].get_value()) for prefix in _moe_layers(flat)])


def move_rows(array: jax.Array, gather) -> jax.Array:
    """result[j] = array[gather[j]] along axis 0, with array's sharding. Each device receives only the
    rows it will hold (runs of consecutive rows travel as one slice), so no device ever holds the
    whole array, as a gather under jit would make it."""
    gather = np.asarray(gather)
    dims = array.shape

    def normalized(index):
        return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, dims))

    shards = [(normalized(s.index), s) for s in array.addressable_shards]
    new_shards = []
    for device, index in array.sharding.addressable_devices_indices_map(dims).items():
        index = normalized(index)
        pieces, j, rows = [], index[0].start, index[0].stop
        while j < rows:
            source_index, shard = min(
                ((i, s) for i, s in shards if i[1:] == index[1:] and i[0].start <= gather[j] < i[0].stop),
                key=lambda item: item[1].device != device)  # a copy already on this device first
            run = 1
            while (j + run < rows and gather[j + run] == gather[j] + run
                   and gather[j + run] < source_index[0].stop):
                run += 1
            local = gather[j] - source_index[0].start
            pieces.append(jax.device_put(shard.data[local:local + run], device))
            j += run
        new_shards.append(pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces))
    return jax.make_array_from_single_device_arrays(dims, array.sharding, new_shards)


def rebalance(state: nnx.State, load: np.ndarray) -> nnx.State:
    """The state with every MoE layer's experts moved to the placement its row of `load` gives."""
    flat = dict(nnx.to_flat_state(state))
    for layer, prefix in enumerate(_moe_layers(flat)):
        placed = flat[prefix + ("expert_device",)].get_value()
        num_experts, num_devices = placed.shape[0], placed.sharding.mesh.devices.size
        device_of, slot_of, storage_order = place_experts(load[layer], num_experts, num_devices)
        if (np.array_equal(device_of, placed) and
                np.array_equal(slot_of, flat[prefix + ("expert_slot",)].get_value())):
            continue  # this layer's experts already sit where they should
        gather = _stored_rows(flat, prefix)[np.asarray(storage_order)]  # new row j <- expert storage_order[j]
        for name in EXPERT_WEIGHTS:
            variable = flat[prefix + (name,)]
            flat[prefix + (name,)] = variable.replace(move_rows(variable.get_value(), gather))
        for name, value in (("expert_device", device_of), ("expert_slot", slot_of)):
            variable = flat[prefix + (name,)]
            flat[prefix + (name,)] = variable.replace(jax.device_put(value, variable.get_value().sharding))
    return nnx.from_flat_state(list(flat.items()))


def canonical_params(state: nnx.State) -> nnx.State:
    """The params alone, each layer's experts back in checkpoint order (as sharded now)."""
    flat = dict(nnx.to_flat_state(state))
    for prefix in _moe_layers(flat):
        rows = _stored_rows(flat, prefix)  # expert e <- its current row
        for name in EXPERT_WEIGHTS:
            variable = flat[prefix + (name,)]
            flat[prefix + (name,)] = variable.replace(move_rows(variable.get_value(), rows))
    return nnx.from_flat_state([(path, variable) for path, variable in flat.items()
                                if not isinstance(variable, ExpertPlacement)])
