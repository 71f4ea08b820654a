"""Where each expert lives under expert parallelism, and moving experts so device loads even out.

Each MoE layer stores its experts' weights device by device: row `device * rows_per_device + slot` of
its [S, ...] weight arrays holds the expert that the layer's placement puts at (device, slot). When
the X experts do not divide over the D devices, S = D * ceil(X / D) and the rows no expert holds are
zero padding (sharding.moe.place_experts). The placement is two [X] int32 arrays per layer
(sharding.moe.ExpertPlacement), kept beside the params so the compiled step takes them as inputs:
moving experts changes values, never shapes, and compiles nothing. Checkpoints hold exactly the X
experts in their canonical order; reading one (`expert_parallel_reader`) lays them out again.

A load profile is tokens routed per expert, [layers, experts] (`llm.stats()["expert_tokens"]`, or a
JSON file holding it); each layer is placed on its own, heaviest experts first onto the least loaded
device with room (sharding.moe.place_experts).
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from pallas_kernels.matmul.quantized import QuantizedWeight, place_shardings
from sharding.moe import ExpertPlacement, place_experts, store_experts

EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")
EXPERT_BIASES = ("gate_proj_bias", "up_proj_bias", "down_proj_bias")  # GPT-OSS's, stored row by row alike


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
        raise ValueError(
            f"expert load profile has shape {load.shape}; this model needs "
            f"({num_layers}, {num_experts}) (or ({num_experts},) for every layer)"
        )
    if not np.all(np.isfinite(load)) or (load < 0).any():
        raise ValueError("expert load profile entries must be finite and >= 0")
    return load


def initial_placement(
    abstract_placement: nnx.State, num_experts: int, mesh, load: np.ndarray | None = None
) -> nnx.State:
    """Concrete placements (replicated on the mesh) for an abstract model's ExpertPlacements: contiguous, or
    where a load profile ([MoE layers, X]) puts each layer's experts, as expert_parallel_reader lays them out."""
    flat = dict(nnx.to_flat_state(abstract_placement))
    layers = _in_layer_order({path[:-1] for path in flat})
    _check_profile_layers(load, len(layers))
    replicated = NamedSharding(mesh, PartitionSpec())
    placed = []
    for layer, prefix in enumerate(layers):
        device_of, slot_of, _ = place_experts(None if load is None else load[layer], num_experts, mesh.devices.size)
        for name, value in (("expert_device", device_of), ("expert_slot", slot_of)):
            variable = flat[prefix + (name,)]
            placed.append((prefix + (name,), variable.replace(jax.device_put(np.asarray(value), replicated))))
    return nnx.from_flat_state(placed)


def _in_layer_order(prefixes) -> list[tuple]:
    return sorted(prefixes, key=lambda prefix: [p for p in prefix if isinstance(p, int)])


def _check_profile_layers(load: np.ndarray | None, num_layers: int) -> None:
    if load is not None and load.shape[0] != num_layers:
        raise ValueError(f"the expert load profile has {load.shape[0]} layers; this model has {num_layers} MoE layers")


def _moe_layers(flat: dict) -> list[tuple]:
    """Path prefixes of the MoE layers (those with a placement), in layer order."""
    return _in_layer_order(path[:-1] for path in flat if path[-1] == "expert_device")


def _stored_rows(flat: dict, prefix: tuple) -> np.ndarray:
    """Row of the weight arrays where each expert currently is, [X]."""
    placed = flat[prefix + ("expert_device",)].get_value()
    device_of, slot_of = np.asarray(placed), np.asarray(flat[prefix + ("expert_slot",)].get_value())
    rows_per_device = flat[prefix + (EXPERT_WEIGHTS[0],)].get_value().shape[0] // placed.sharding.mesh.devices.size
    return device_of * rows_per_device + slot_of


def _expert_arrays(flat: dict, prefix: tuple) -> tuple[str, ...]:
    """The per-expert arrays of an MoE layer: its weights, and its biases where the model has them."""
    return EXPERT_WEIGHTS + tuple(name for name in EXPERT_BIASES if prefix + (name,) in flat)


def _lora_arrays(flat: dict, prefix: tuple) -> list[tuple]:
    """Paths of an MoE layer's LoRA slots on its experts (jaxserve/lora: A [S, K, L, r], B [S, L, r, N],
    stored row by row as the expert weights)."""
    return [path for path in flat if path[: len(prefix) + 1] == prefix + ("lora",)]


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
                key=lambda item: item[1].device != device,
            )  # a copy already on this device first
            run = 1
            while j + run < rows and gather[j + run] == gather[j] + run and gather[j + run] < source_index[0].stop:
                run += 1
            local = gather[j] - source_index[0].start
            pieces.append(jax.device_put(shard.data[local : local + run], device))
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
        if np.array_equal(device_of, placed) and np.array_equal(slot_of, flat[prefix + ("expert_slot",)].get_value()):
            continue  # this layer's experts already sit where they should
        gather = _rebalance_gather(_stored_rows(flat, prefix), np.asarray(storage_order))
        for name in _expert_arrays(flat, prefix):
            variable = flat[prefix + (name,)]
            # a quantized weight's arrays (values, scales, mins) each move their rows alike
            flat[prefix + (name,)] = variable.replace(
                jax.tree.map(functools.partial(move_rows, gather=gather), variable.get_value())
            )
        for path in _lora_arrays(flat, prefix):  # LoRA adapter slots on the experts move with them
            flat[path] = flat[path].replace(move_rows(flat[path].get_value(), gather))
        for name, value in (("expert_device", device_of), ("expert_slot", slot_of)):
            variable = flat[prefix + (name,)]
            flat[prefix + (name,)] = variable.replace(jax.device_put(value, variable.get_value().sharding))
    return nnx.from_flat_state(list(flat.items()))


def _rebalance_gather(stored_rows: np.ndarray, storage_order: np.ndarray) -> np.ndarray:
    """New row j <- old row gather[j]: expert storage_order[j]'s, or for a padding row (-1) an old padding
    row, paired in order so that padding which stays put is not copied from another device."""
    gather = np.empty(len(storage_order), np.int64)
    padding = storage_order < 0
    gather[~padding] = stored_rows[storage_order[~padding]]
    gather[padding] = np.setdiff1d(np.arange(len(storage_order)), stored_rows)
    return gather


def canonical_params(state: nnx.State) -> nnx.State:
    """The params alone, each layer's X experts back in checkpoint order (padding rows left out)."""
    flat = dict(nnx.to_flat_state(state))
    for prefix in _moe_layers(flat):
        rows = _stored_rows(flat, prefix)  # expert e <- its current row
        for name in _expert_arrays(flat, prefix):
            variable = flat[prefix + (name,)]
            canonical = jax.tree.map(functools.partial(_canonical_rows, rows=rows), variable.get_value())
            flat[prefix + (name,)] = variable.replace(canonical)
    return nnx.from_flat_state(
        [(path, variable) for path, variable in flat.items() if not isinstance(variable, ExpertPlacement)]
    )


def _canonical_rows(stored, rows: np.ndarray) -> jax.Array:
    """One stored [S, ...] array's rows in canonical order ([X, ...]): row e <- stored row rows[e]."""
    if len(rows) == stored.shape[0]:
        return move_rows(stored, rows)  # the same sharding fits X rows
    # X rows do not split over the devices: gather them where another axis is split
    sharding = canonical_sharding((len(rows),) + stored.shape[1:], stored.sharding.mesh)
    return _gather_rows(jax.device_put(stored, sharding), jnp.asarray(rows), sharding)


def canonical_sharding(shape: tuple[int, ...], mesh) -> NamedSharding:
    """Where a canonical [X, ...] expert weight whose X does not divide the devices lives while read or
    saved: its largest other axis split over every device if it divides (each device holds 1/D, as
    stored), replicated if none does (tiny models only)."""
    num_devices = mesh.size
    for dim in sorted(range(1, len(shape)), key=lambda d: -shape[d]):
        if shape[dim] % num_devices == 0:
            return NamedSharding(
                mesh, PartitionSpec(*[mesh.axis_names if d == dim else None for d in range(len(shape))])
            )
    return NamedSharding(mesh, PartitionSpec())


@functools.partial(jax.jit, static_argnums=2)
def _gather_rows(array, order, sharding):
    """store_experts(array, order), split as `sharding`: with the row axis unsplit, every device gathers
    its own share of the rows."""
    return jax.lax.with_sharding_constraint(store_experts(array, order), sharding)


def expert_parallel_reader(read_params, num_experts: int, mesh, load: np.ndarray | None = None):
    """A ModelSource's read_params (abstract params, dtype, placement) for a model whose experts are spread
    over `mesh`: each expert weight is read as the checkpoint holds it, X experts in canonical order (split
    by canonical_sharding where X does not divide the devices or a profile reorders them), then laid out in
    its stored rows as initial_placement puts them, padding rows zero. With a load profile ([MoE layers, X])
    each layer's experts are laid out where the profile places them: placing by a profile at start-up costs
    no copy of the experts once the KV pool took the memory left."""
    default_order = place_experts(None, num_experts, mesh.devices.size)[2]

    def read(abstract: nnx.State, dtype, placement) -> nnx.State:
        flat = list(nnx.to_flat_state(abstract))
        layers = _in_layer_order({path[:-1] for path, variable in flat if _is_expert_weight(variable)})
        _check_profile_layers(load, len(layers))
        storage_orders = {
            prefix: default_order if load is None else place_experts(load[layer], num_experts, mesh.devices.size)[2]
            for layer, prefix in enumerate(layers)
        }
        as_checkpointed = {
            path: jax.ShapeDtypeStruct((num_experts,) + variable.get_value().shape[1:], variable.get_value().dtype)
            for path, variable in flat
            if _is_expert_weight(variable) and (load is not None or variable.get_value().shape[0] != num_experts)
        }
        if not as_checkpointed:  # X divides the devices: the initial placement keeps the canonical order
            return read_params(abstract, dtype, placement)
        canonical = {path: canonical_sharding(shape.shape, mesh) for path, shape in as_checkpointed.items()}
        loaded = dict(
            nnx.to_flat_state(
                read_params(
                    nnx.from_flat_state(
                        [
                            (path, variable.replace(as_checkpointed[path]) if path in canonical else variable)
                            for path, variable in flat
                        ]
                    ),
                    dtype,
                    lambda path: canonical[path] if path in canonical else placement(path),
                )
            )
        )
        for path in canonical:  # one at a time: each read copy is freed as its rows are stored
            variable = loaded[path]
            stored = _store_rows(variable.get_value(), storage_orders[path[:-1]], placement(path))
            loaded[path] = variable.replace(stored)
        return nnx.from_flat_state(list(loaded.items()))

    return read


def _store_rows(canonical, storage_order, sharding):
    """A canonical [X, ...] expert weight (an array, or a QuantizedWeight's arrays each) laid out in its stored
    rows and placed by `sharding` (the float param's; per array of the stored [S, ...] for a quantized weight,
    whose rows then split as the float param's do)."""
    stored = jax.tree.map(lambda array: _gather_rows(array, storage_order, array.sharding), canonical)
    if not isinstance(stored, QuantizedWeight):
        return jax.device_put(stored, sharding)
    return jax.tree.map(jax.device_put, stored, place_shardings(stored, sharding))


def _is_expert_weight(variable) -> bool:
    axes = variable.get_metadata("logical_axes", None)
    return bool(axes) and axes[0] == "expert"
