"""Moving experts and writing them out in canonical order when the mesh spans processes.

sharding/expert_placement.py moves each device's rows with per-device copies (no device ever holds a
whole expert weight), which only reaches devices of this process. Across processes the rows travel
inside one jitted gather that every process runs (the rows a device receives may sit on another
host); the placement, every process's same host values, is put on the mesh as it is.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.distributed.plan import REBALANCE
from jaxserve.engine.expert_balancer import ExpertBalancer
from sharding.expert_placement import (
    _expert_arrays,
    _lora_arrays,
    _moe_layers,
    _rebalance_gather,
    _stored_rows,
    canonical_sharding,
    device_of_experts,
)
from sharding.moe import ExpertPlacement, place_experts


def _take_rows(array: jax.Array, rows: np.ndarray, sharding) -> jax.Array:
    """array[rows] along axis 0, laid out as `sharding`, on every process's devices at once."""
    rows = jax.device_put(np.asarray(rows, np.int32), NamedSharding(sharding.mesh, PartitionSpec()))
    return _gather(array, rows, sharding)


@jax.jit
def _gather_jit(array, rows):
    return jnp.take(array, rows, axis=0)


def _gather(array, rows, sharding):
    return jax.jit(_gather_jit, out_shardings=sharding)(array, rows)


def _take_rows_of_each(value, rows: np.ndarray, sharding_of):
    """_take_rows on every array of a param: a float weight, or a quantized one's values, scales and mins
    (which move their rows alike), each laid out as sharding_of(array)."""
    return jax.tree.map(lambda array: _take_rows(array, rows, sharding_of(array)), value)


def rebalance_everywhere(state: nnx.State, load: np.ndarray) -> nnx.State:
    """sharding.expert_placement.rebalance for a mesh over several processes (every process calls it)."""
    flat = dict(nnx.to_flat_state(state))
    for layer, prefix in enumerate(_moe_layers(flat)):
        placed = flat[prefix + ("expert_device",)].get_value()
        num_experts, num_devices = placed.shape[0], placed.sharding.mesh.devices.size
        device_of, slot_of, storage_order = (
            np.asarray(x) for x in place_experts(load[layer], num_experts, num_devices)
        )
        if np.array_equal(device_of, np.asarray(placed)) and np.array_equal(
            slot_of, np.asarray(flat[prefix + ("expert_slot",)].get_value())
        ):
            continue
        gather = _rebalance_gather(_stored_rows(flat, prefix), storage_order)
        # as sharding.expert_placement.rebalance: the weights (quantized ones' every array), biases (GPT-OSS)
        # and LoRA slots on the experts all move their rows alike
        for path in [prefix + (name,) for name in _expert_arrays(flat, prefix)] + _lora_arrays(flat, prefix):
            variable = flat[path]
            flat[path] = variable.replace(
                _take_rows_of_each(variable.get_value(), gather, lambda array: array.sharding)
            )
        for name, value in (("expert_device", device_of), ("expert_slot", slot_of)):
            variable = flat[prefix + (name,)]
            flat[prefix + (name,)] = variable.replace(jax.device_put(value, variable.get_value().sharding))
    return nnx.from_flat_state(list(flat.items()))


def _canonical_rows_sharding(stored: jax.Array, num_rows: int):
    """Where num_rows canonical rows of a stored [S, ...] array go: its own sharding if they fill it."""
    if num_rows == stored.shape[0]:
        return stored.sharding
    sharding = stored.sharding
    assert isinstance(sharding, NamedSharding)  # (every param on a mesh is laid out by name)
    return canonical_sharding((num_rows,) + stored.shape[1:], sharding.mesh)


def canonical_everywhere(state: nnx.State) -> nnx.State:
    """sharding.expert_placement.canonical_params for a mesh over several processes."""
    flat = dict(nnx.to_flat_state(state))
    for prefix in _moe_layers(flat):
        rows = _stored_rows(flat, prefix)
        sharding_of = functools.partial(_canonical_rows_sharding, num_rows=len(rows))
        for name in _expert_arrays(flat, prefix):  # as canonical_params: weights (every array) and biases
            variable = flat[prefix + (name,)]
            flat[prefix + (name,)] = variable.replace(_take_rows_of_each(variable.get_value(), rows, sharding_of))
    return nnx.from_flat_state(
        [(path, variable) for path, variable in flat.items() if not isinstance(variable, ExpertPlacement)]
    )


class DistributedExpertBalancer(ExpertBalancer):
    """Process 0 sends each move as a plan; every process applies it with rebalance_everywhere."""

    def rebalance(self, load=None) -> None:
        load = self.checked_load(load)
        run_everywhere = getattr(self.runner, "run_everywhere", None)
        if run_everywhere is None:  # a follower, or the builder (every process runs it by itself)
            self.apply(load)
        else:
            run_everywhere(REBALANCE, (load,), lambda: self.apply(load))

    def apply(self, load: np.ndarray) -> None:
        runner = getattr(self.runner, "inner", self.runner)
        runner.replace_params(rebalance_everywhere(runner.params(), load))
        self.expert_devices = device_of_experts(runner.params())
        self.num_rebalances += 1
