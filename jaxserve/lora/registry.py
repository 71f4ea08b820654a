"""Which adapter sits in which device slot, and loading or unloading one while the engine serves.

The engine asks `resolve(name)` for each request that names an adapter (its slot, a step input per row,
and its identity, which seeds the request's prefix-cache keys so that pages computed under one adapter
never serve another or the base model). `load` reads and checks a PEFT directory entirely before touching
the device, so a bad adapter leaves every slot as it was.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.config import LoraConfig
from jaxserve.device.page_copies import CountingCompiles
from jaxserve.device.placement import put_on
from jaxserve.lora.adapter import LoraAdapter, read_adapter, split_fused
from jaxserve.lora.expert_adapter import split_expert_path
from jaxserve.lora.slots import ExpertSlots, LoraSlots, slot_value_sharding, write_slot

BASE_SLOT = 0  # zeros in every projection: rows without an adapter
EXPERT_TARGETS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    slot: int
    path: str
    rank: int
    identity: int  # seeds the prefix-cache keys of its requests' pages


class LoraRegistry:
    """Host bookkeeping of the adapter slots plus the compiled-once write of a slot's values."""

    def __init__(self, config: LoraConfig, runner, all_slots: dict[str, LoraSlots | ExpertSlots]):
        slots = {path: s for path, s in all_slots.items() if isinstance(s, LoraSlots)}
        expert_slots = {path: s for path, s in all_slots.items() if isinstance(s, ExpertSlots)}
        self.runner = runner
        self.max_rank = config.max_rank
        self.num_slots = int(config.max_adapters or 0) + 1
        self.target_modules = tuple(config.target_modules)
        self.shapes = {path: (s.a.shape[0], s.b.shape[2]) for path, s in slots.items()}  # path -> (in, out)
        # routed experts: "layers.0.mlp.gate_proj" -> (stored expert rows, in, out)
        self.expert_shapes = {path: (s.a.shape[0], s.a.shape[1], s.b.shape[3]) for path, s in expert_slots.items()}
        self.adapters: dict[str, LoadedAdapter] = {}
        # Where each slot array sits among the runner's flat params, in (module path, "a" | "b") order.
        self._leaf_names, self._leaf_indices = _lora_leaves(runner)
        missing = {path for path, _ in self._leaf_names} ^ (set(self.shapes) | set(self.expert_shapes))
        if missing:
            raise AssertionError(f"LoRA slots and the runner's params disagree on {sorted(missing)}")
        leaves = [runner.param_leaves[i] for i in self._leaf_indices]
        slot_axes = tuple(
            (2 if half == "a" else 1) if path in self.expert_shapes else (1 if half == "a" else 0)
            for path, half in self._leaf_names
        )  # A [S, K, L, r] and B [S, L, r, N] for experts; A [K, L, r] and B [L, r, N] otherwise
        # Each new slot value arrives split as its slot array is and in its dtype (put_on): a host float32
        # value handed to the jit as it is would reach every device whole, in float32.
        self._value_shardings = [
            slot_value_sharding(leaf.sharding, leaf.ndim, axis) for leaf, axis in zip(leaves, slot_axes)
        ]
        self._value_dtypes = [leaf.dtype for leaf in leaves]
        self._write = jax.jit(
            functools.partial(write_slot, slot_axes=slot_axes),
            donate_argnums=(0,),
            in_shardings=([leaf.sharding for leaf in leaves], None, self._value_shardings),
            out_shardings=[leaf.sharding for leaf in leaves],
        )
        # Compiled now: zeros into the base slot (twice: fresh arrays are not yet committed to a device,
        # the written ones are, and each is its own executable).
        for _ in range(2):
            self._write_slot(BASE_SLOT, None)

    # -- requests ------------------------------------------------------------------------------------

    def resolve(self, name: str) -> LoadedAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            known = sorted(self.adapters) or "none loaded"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {known})")
        return adapter

    # -- loading -------------------------------------------------------------------------------------

    def load(self, name: str, path: str) -> LoadedAdapter:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a LoRA adapter needs a non-empty name, got {name!r}")
        if name in self.adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded (unload it first)")
        used = {adapter.slot for adapter in self.adapters.values()}
        free = [slot for slot in range(1, self.num_slots) if slot not in used]
        if not free:
            raise ValueError(
                f"all {self.num_slots - 1} LoRA adapter slots are in use ({sorted(self.adapters)}); unload one "
                "first, or start the engine with a larger lora max_adapters"
            )
        adapter = split_fused(read_adapter(path), {module: shape[1] for module, shape in self.shapes.items()})
        self.check(adapter)
        with CountingCompiles(self.runner):
            self._write_slot(free[0], adapter)
        loaded = LoadedAdapter(name, free[0], path, adapter.max_rank, adapter.identity)
        self.adapters[name] = loaded
        return loaded

    def unload(self, name: str) -> None:
        adapter = self.resolve(name)
        with CountingCompiles(self.runner):
            self._write_slot(adapter.slot, None)
        del self.adapters[name]

    def check(self, adapter: LoraAdapter) -> None:
        """That every projection the adapter adapts has slots here, of its shape and at least its rank."""
        for path, projection in adapter.projections.items():
            module = path.rsplit(".", 1)[-1]
            if split_expert_path(path) is not None or ".experts." in f".{path}.":
                self._check_expert(adapter, path, projection)
                continue
            if path not in self.shapes:
                if module in self.target_modules:
                    raise ValueError(
                        f"adapter {adapter.path!r} adapts {path}, which this model does not have "
                        "(an adapter for another base model?)"
                    )
                raise ValueError(
                    f"adapter {adapter.path!r} targets {module} ({path}); LoRA slots are only on "
                    f"{list(self.target_modules)} (lora target_modules) of the decoder layers"
                )
            if projection.rank > self.max_rank:
                raise ValueError(
                    f"adapter {adapter.path!r} has rank {projection.rank} at {path}, above the slot rank "
                    f"{self.max_rank} (lora max_rank)"
                )
            shape = (projection.a.shape[0], projection.b.shape[1])
            if shape != self.shapes[path]:
                raise ValueError(
                    f"adapter {adapter.path!r} maps {shape[0]} -> {shape[1]} features at {path}, where the model "
                    f"maps {self.shapes[path][0]} -> {self.shapes[path][1]} (an adapter for another base model?)"
                )

    def _check_expert(self, adapter: LoraAdapter, path: str, projection) -> None:
        """That a routed expert's projection has expert slots here, of its shape and at least its rank."""
        where = split_expert_path(path)
        if where is None or where[0] not in self.expert_shapes:
            raise ValueError(
                f"adapter {adapter.path!r} adapts routed experts ({path}), which have no LoRA slots in this engine "
                f"(slots on the experts' {list(EXPERT_TARGETS)} need lora routed_experts and those names in "
                "target_modules, and a Mixtral / Qwen-MoE style expert MLP)"
            )
        slots_path, expert, _ = where
        num_experts = len(self._expert_rows()[slots_path.rsplit(".", 1)[0]])
        _, size_in, size_out = self.expert_shapes[slots_path]
        shape = (projection.a.shape[0], projection.b.shape[1])
        if expert >= num_experts or shape != (size_in, size_out):
            raise ValueError(
                f"adapter {adapter.path!r} maps {shape[0]} -> {shape[1]} features at {path}, where the model has "
                f"{num_experts} experts mapping {size_in} -> {size_out} (an adapter for another base model?)"
            )
        if projection.rank > self.max_rank:
            raise ValueError(
                f"adapter {adapter.path!r} has rank {projection.rank} at {path}, above the slot rank "
                f"{self.max_rank} (lora max_rank)"
            )

    def _expert_rows(self) -> dict[str, np.ndarray]:
        """MoE layer path ("layers.0.mlp") -> the stored row of each of its experts [X] (expert placement
        may have moved them: sharding/expert_placement.py)."""
        flat = {  # "layers.0.mlp.expert_device" -> its array (a state's leaves end in the variable's value)
            ".".join(str(key.key) for key in key_path if isinstance(key, jax.tree_util.DictKey)): leaf
            for key_path, leaf in jax.tree_util.tree_flatten_with_path(self.runner.params())[0]
        }
        rows = {}
        for path, (num_rows, _, _) in self.expert_shapes.items():
            layer = path.rsplit(".", 1)[0]
            device_of, slot_of = flat.get(f"{layer}.expert_device"), flat.get(f"{layer}.expert_slot")
            if device_of is None or slot_of is None:
                rows[layer] = np.arange(num_rows)
            else:
                rows_per_device = num_rows // device_of.sharding.mesh.devices.size
                rows[layer] = np.asarray(device_of) * rows_per_device + np.asarray(slot_of)
        return rows

    def _write_slot(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Slot `slot` of every projection takes the adapter's A and B (zero-padded to the slot rank), or
        zeros where it adapts nothing (and everywhere for None)."""
        values = []
        expert_rows = self._expert_rows() if self.expert_shapes else {}
        for path, half in self._leaf_names:
            if path in self.expert_shapes:
                values.append(self._expert_value(path, half, adapter, expert_rows))
                continue
            size_in, size_out = self.shapes[path]
            shape = (size_in, self.max_rank) if half == "a" else (self.max_rank, size_out)
            value = np.zeros(shape, np.float32)
            projection = None if adapter is None else adapter.projections.get(path)
            if projection is not None:
                if half == "a":
                    value[:, : projection.rank] = projection.a
                else:
                    value[: projection.rank] = projection.b
            values.append(value)
        placed = [
            put_on(np.asarray(value, dtype), sharding, f"LoRA slot value of {path}.{half}")
            for value, dtype, sharding, (path, half) in zip(
                values, self._value_dtypes, self._value_shardings, self._leaf_names
            )
        ]
        leaves = list(self.runner.param_leaves)
        written = self._write([leaves[i] for i in self._leaf_indices], np.int32(slot), placed)
        for index, array in zip(self._leaf_indices, written):
            leaves[index] = array
        self.runner.replace_params(jax.tree.unflatten(self.runner.params_treedef, leaves))

    def _expert_value(self, path: str, half: str, adapter: LoraAdapter | None, expert_rows) -> np.ndarray:
        """One expert projection's new slot: [S, K, r] (A) or [S, r, N] (B), each expert's in its stored row."""
        num_rows, size_in, size_out = self.expert_shapes[path]
        value = np.zeros((num_rows, size_in, self.max_rank) if half == "a" else (num_rows, self.max_rank, size_out))
        if adapter is None:
            return value.astype(np.float32)
        layer, projection_name = path.rsplit(".", 1)
        for expert, row in enumerate(expert_rows[layer]):
            projection = adapter.projections.get(f"{layer}.experts.{expert}.{projection_name}")
            if projection is None:
                continue
            if half == "a":
                value[row, :, : projection.rank] = projection.a
            else:
                value[row, : projection.rank] = projection.b
        return value.astype(np.float32)

    def root_keys(self) -> dict[str, int]:
        """Each loaded adapter's name -> its identity, the key its requests' page keys chain from (what a
        router needs to key them as this cache does)."""
        return {name: adapter.identity for name, adapter in self.adapters.items()}

    def describe(self) -> list[dict]:
        return [
            dict(name=a.name, slot=a.slot, path=a.path, rank=a.rank)
            for a in sorted(self.adapters.values(), key=lambda a: a.slot)
        ]


def _lora_leaves(runner) -> tuple[list[tuple[str, str]], list[int]]:
    """(module path, "a" | "b") and the index in runner.param_leaves of every LoRA slot array."""
    names, indices = [], []
    flat = jax.tree_util.tree_flatten_with_path(runner.params())[0]
    for index, (key_path, _) in enumerate(flat):
        parts = [getattr(key, "key", getattr(key, "name", None)) for key in key_path]
        if "lora" in parts:  # ...q_proj.lora.a (a Linear's) or ...mlp.lora.gate_proj.a (routed experts')
            at = parts.index("lora")
            half = max(i for i, part in enumerate(parts) if part in ("a", "b"))
            names.append((".".join(str(part) for part in parts[:at] + parts[at + 1 : half]), str(parts[half])))
            indices.append(index)
    return names, indices
