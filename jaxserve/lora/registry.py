"""Which adapter sits in which device slot, and loading or unloading one while the engine serves.

The engine asks `resolve(name)` for each request that names an adapter (its slot, a step input per row,
and its identity, which seeds the request's prefix-cache keys so that pages computed under one adapter
never serve another or the base model). `load` reads and checks a PEFT directory entirely before touching
the device, so a bad adapter leaves every slot as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.config import LoraConfig
from jaxserve.device.page_copies import CountingCompiles
from jaxserve.lora.adapter import LoraAdapter, read_adapter, split_fused
from jaxserve.lora.slots import LoraSlots, write_slot

BASE_SLOT = 0  # zeros in every projection: rows without an adapter


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    slot: int
    path: str
    rank: int
    identity: int  # seeds the prefix-cache keys of its requests' pages


class LoraRegistry:
    """Host bookkeeping of the adapter slots plus the compiled-once write of a slot's values."""

    def __init__(self, config: LoraConfig, runner, slots: dict[str, LoraSlots]):
        self.runner = runner
        self.max_rank = config.max_rank
        self.num_slots = int(config.max_adapters or 0) + 1
        self.target_modules = tuple(config.target_modules)
        self.shapes = {path: (s.a.shape[1], s.b.shape[2]) for path, s in slots.items()}  # path -> (in, out)
        self.adapters: dict[str, LoadedAdapter] = {}
        # Where each slot array sits among the runner's flat params, in (module path, "a" | "b") order.
        self._leaf_names, self._leaf_indices = _lora_leaves(runner)
        missing = {path for path, _ in self._leaf_names} ^ set(self.shapes)
        if missing:
            raise AssertionError(f"LoRA slots and the runner's params disagree on {sorted(missing)}")
        leaves = [runner.param_leaves[i] for i in self._leaf_indices]
        self._write = jax.jit(write_slot, donate_argnums=(0,), out_shardings=[leaf.sharding for leaf in leaves])
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
            if path not in self.shapes:
                if ".experts." in f".{path}.":
                    raise ValueError(
                        f"adapter {adapter.path!r} adapts routed experts ({path}); LoRA slots cover attention, "
                        "dense MLPs and shared experts, not routed expert projections yet"
                    )
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

    def _write_slot(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Slot `slot` of every projection takes the adapter's A and B (zero-padded to the slot rank), or
        zeros where it adapts nothing (and everywhere for None)."""
        values = []
        for path, half in self._leaf_names:
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
        leaves = list(self.runner.param_leaves)
        written = self._write([leaves[i] for i in self._leaf_indices], np.int32(slot), values)
        for index, array in zip(self._leaf_indices, written):
            leaves[index] = array
        self.runner.replace_params(jax.tree.unflatten(self.runner.params_treedef, leaves))

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
        if "lora" in parts:
            at = parts.index("lora")
            names.append((".".join(str(part) for part in parts[:at]), str(parts[at + 1])))
            indices.append(index)
    return names, indices
