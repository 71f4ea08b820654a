"""The device side of multi-LoRA: adapter slots beside each targeted projection, and writing into them.

`attach_lora` gives every targeted Linear of the loaded model a `LoraSlots` (A [K, L, r], B [L, r, N], zeros,
placed by the rules table: A's K and B's N as the base kernel's in and out axes, the slot and rank axes
replicated) and puts the LoRA entry in front of its matmul plan. Their params join the model's, so the
runner's step takes them like any weight. Each step, `bind_row_slots` hands every LoraSlots the adapter slot
of each token (from the step inputs' per-row slots), and the projections build LoraWeights from it.

A mixture-of-experts layer's routed experts are not Linears: `attach_lora` gives its SparseMoE an
`ExpertLoraSlots` (per expert projection A [S, K, L, r] and B [S, L, r, N]: expert rows first, as the expert
weights, so the rules table splits them with the experts under expert parallelism and expert placement moves
them with their experts), applied inside the grouped expert matmul (sharding/moe.py).

Loading an adapter into slot s writes A[s] and B[s] of every targeted projection with one jitted update of
fixed shapes (the slot is a traced scalar), donated so the arrays are rewritten in place: compiled once at
start-up, it never compiles again whichever adapters come and go.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.device.placement import zeros_on
from jaxserve.models.layers import Linear
from jaxserve.models.moe import SparseMoE
from pallas_kernels.matmul.lora import ExpertLora, LoraWeight, RowAdapters, route_rows, with_lora
from sharding import partition_spec
from sharding.rules import LOGICAL_AXIS_RULES


class LoraSlots(nnx.Module):
    """One projection's adapter slots; slot 0 stays zeros (rows without an adapter)."""

    def __init__(self, a, b, in_axis: str | None, out_axis: str | None):
        self.a = nnx.Param(a, logical_axes=(in_axis, "lora_slots", "lora_rank"))  # [K, L, r]
        self.b = nnx.Param(b, logical_axes=("lora_slots", "lora_rank", out_axis))  # [L, r, N], scaled
        self.row_adapters: RowAdapters | None = None  # during a step (bind_row_slots)

    def weight(self, base) -> LoraWeight:
        if self.row_adapters is None:
            raise ValueError("a projection with LoRA slots ran outside a step that bound each row's adapter")
        return LoraWeight(base, self.a[...], self.b[...], self.row_adapters)


class ExpertSlots(nnx.Module):
    """One routed-expert projection's adapter slots, per stored expert row; slot 0 stays zeros."""

    def __init__(self, a, b, in_axis: str | None, out_axis: str | None):
        self.a = nnx.Param(a, logical_axes=("expert", in_axis, "lora_slots", "lora_rank"))  # [S, K, L, r]
        self.b = nnx.Param(b, logical_axes=("expert", "lora_slots", "lora_rank", out_axis))  # [S, L, r, N], scaled


class ExpertLoraSlots(nnx.Module):
    """The adapter slots of an MoE layer's targeted expert projections (None: not targeted)."""

    def __init__(self, slots: dict[str, ExpertSlots]):
        self.gate_proj = slots.get("gate_proj")
        self.up_proj = slots.get("up_proj")
        self.down_proj = slots.get("down_proj")
        self.row_slots = None  # [T] int32 during a step (bind_row_slots)

    def weights(self) -> ExpertLora:
        if self.row_slots is None:
            raise ValueError("experts with LoRA slots ran outside a step that bound each row's adapter")

        def pair(slots):
            return None if slots is None else (slots.a[...], slots.b[...])

        return ExpertLora(self.row_slots, pair(self.gate_proj), pair(self.up_proj), pair(self.down_proj))

    def projections(self) -> dict[str, ExpertSlots]:
        found = {name: getattr(self, name) for name in ("gate_proj", "up_proj", "down_proj")}
        return {name: slots for name, slots in found.items() if slots is not None}


def targeted_linears(model, target_modules) -> dict[str, Linear]:
    """Our module path ("layers.0.self_attn.q_proj") -> each decoder-layer Linear named in target_modules
    (a mixture-of-experts block's routed experts are not Linears: they get no slots)."""
    found = {}
    for path, module in nnx.iter_graph(model):
        if isinstance(module, Linear) and path and path[0] == "layers" and path[-1] in target_modules:
            found[".".join(str(part) for part in path)] = module
    return found


def attach_lora(
    model,
    *,
    num_slots: int,
    max_rank: int,
    target_modules,
    mesh: Mesh | None,
    sizes=None,
    rules=None,
    routed_experts: bool = False,
):
    """Give the model's targeted projections num_slots zero slots of rank max_rank (placed on the mesh by
    the rules table), and with routed_experts its MoE layers' targeted expert projections too; returns
    {module path: its LoraSlots, or for experts ("layers.0.mlp.gate_proj") its ExpertSlots}."""
    attached = {}
    for path, linear in targeted_linears(model, target_modules).items():
        kernel = linear.kernel[...]
        in_axis, out_axis = linear.kernel.get_metadata().get("logical_axes", (None, None))
        (in_features, out_features), dtype = kernel.shape, kernel.dtype
        a = _placed(
            (in_features, num_slots, max_rank),
            dtype,
            (in_axis, "lora_slots", "lora_rank"),
            mesh,
            sizes,
            rules,
        )
        b = _placed(
            (num_slots, max_rank, out_features),
            dtype,
            ("lora_slots", "lora_rank", out_axis),
            mesh,
            sizes,
            rules,
        )
        linear.lora = nnx.data(LoraSlots(a, b, in_axis, out_axis))  # a submodule added after construction
        linear.matmul = with_lora(linear.matmul)  # type: ignore[arg-type]  # always a MatmulPlan at build time
        attached[path] = linear.lora
    experts = {}
    for path, moe in adaptable_experts(model).items() if routed_experts else ():
        slots = {}
        for name in (name for name in ("gate_proj", "up_proj", "down_proj") if name in target_modules):
            param = getattr(moe, name)
            _, in_axis, out_axis = param.get_metadata().get("logical_axes", (None, None, None))
            rows, size_in, size_out = param[...].shape
            dtype = param[...].dtype
            a = (rows, size_in, num_slots, max_rank)
            b = (rows, num_slots, max_rank, size_out)
            slots[name] = ExpertSlots(
                _placed(a, dtype, ("expert", in_axis, "lora_slots", "lora_rank"), mesh, sizes, rules),
                _placed(b, dtype, ("expert", "lora_slots", "lora_rank", out_axis), mesh, sizes, rules),
                in_axis,
                out_axis,
            )
            experts[f"{path}.{name}"] = slots[name]
        if slots:
            moe.lora = nnx.data(ExpertLoraSlots(slots))
    if not attached and not experts:
        raise ValueError(f"the model has no projections named {list(target_modules)} for LoRA slots")
    return {**attached, **experts}


def adaptable_experts(model) -> dict[str, SparseMoE]:
    """Our module path ("layers.0.mlp") -> each MoE block whose routed experts adapters may reach: gated
    MLPs as Mixtral's and Qwen's (GPT-OSS's biased, clamped experts are laid out otherwise by PEFT)."""
    return {
        ".".join(str(part) for part in path): module
        for path, module in nnx.iter_graph(model)
        if isinstance(module, SparseMoE) and path and path[0] == "layers" and module.swiglu is None
    }


def _placed(shape: tuple[int, ...], dtype, axes, mesh: Mesh | None, sizes, rules):
    """Zero slots of `shape`, each device making only its shard (not the whole made on one device and then
    split: the slots of every projection together are an adapter's size times the slots)."""
    if mesh is None:
        return jnp.zeros(shape, dtype)
    if "expert" in axes:  # as the expert weights (sharding/placement.py): its units are the stored rows
        sizes = {**(sizes or {}), "expert": shape[axes.index("expert")]}
    spec = partition_spec(axes, mesh, sizes, rules or LOGICAL_AXIS_RULES)
    return zeros_on(jax.ShapeDtypeStruct(shape, dtype), NamedSharding(mesh, spec))


def bind_row_slots(model, token_slots) -> None:
    """Each token's adapter slot [T] for this step's projections (called on the step's merged model). The
    step's mix of adapters (route_rows) is worked out here once, for every projection."""
    modules = [module for _, module in nnx.iter_graph(model) if isinstance(module, (LoraSlots, ExpertLoraSlots))]
    linear_slots = [module for module in modules if isinstance(module, LoraSlots)]
    routing = route_rows(token_slots, linear_slots[0].b[...].shape[0]) if linear_slots else None
    for module in modules:
        if isinstance(module, LoraSlots):
            module.row_adapters = routing
        else:
            module.row_slots = token_slots  # the routed copies' slots are gathered from these per layer


def slot_value_sharding(sharding, ndim: int, slot_axis: int):
    """Where one slot's new value ([K, r] of an A [K, L, r], and so on) goes for an array of `ndim` axes on
    `sharding`: split as the array is, less its slot axis, so that each device receives only the shard it
    writes (one device: that device)."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = (*sharding.spec, *(None,) * (ndim - len(sharding.spec)))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[:slot_axis], *spec[slot_axis + 1 :]))


def write_slot(slot_arrays: list, slot, new_values: list, *, slot_axes: tuple[int, ...]) -> list:
    """slot_arrays: every A and B ([L, K, r], [L, r, N]; experts' [S, K, L, r], [S, L, r, N]), whose slot
    axis is slot_axes' entry; new_values: the same list's slot-sized entries ([K, r], [r, N]; [S, K, r],
    [S, r, N]). Slot `slot` of each takes its new value."""
    return [
        jax.lax.dynamic_update_index_in_dim(array, value.astype(array.dtype), slot, axis)
        for array, value, axis in zip(slot_arrays, new_values, slot_axes)
    ]
