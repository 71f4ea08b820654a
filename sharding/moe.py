"""How a mixture-of-experts layer's routed tokens reach their experts: the `experts` functions a model
is built with (jaxserve/models/moe.py routes; these run the experts and combine their outputs).

`LocalExperts`: every device holds every expert (or XLA splits each expert's columns over the tensor
shards); the routed copies of the tokens are grouped by expert and each projection is one grouped
matmul (`grouped_expert_mlp`).

`ExpertParallel`: inside `shard_map` over the whole mesh, every device holds a share of the tokens
and a share of the experts (`expert_to_device` / `expert_slot` say which device holds expert e, and
where among its local experts). Each device packs each routed copy of its tokens into a
per-destination buffer, exchanges buffers with one all-to-all, runs the same grouped matmuls over
its local experts, and sends the results back with a second all-to-all, where they are weighted and
summed per token. Buffers are sized for the worst case (every copy to one device), so nothing is
ever dropped. The placement arrays are inputs, not constants: moving experts between devices changes
no shapes and compiles nothing.

An expert count that does not divide the devices is spread unevenly, as vLLM does: each device holds
floor(X / D) or ceil(X / D) experts, and the weight arrays are padded with zero rows to ceil(X / D)
per device (`num_expert_rows`), so that every device's share has one shape. No expert id points at a
padding row: its group in the grouped matmuls is always empty, and the all-to-all buffers, sized by
routed copies rather than by experts, do not change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallas_kernels.matmul.lora import ExpertLora, add_expert_lora
from pallas_kernels.matmul.quantized_experts import expert_matmul

# Legend: T = tokens, D = devices on the axis, t = tokens per device, k = experts per token, C = t * k
# routed copies per device, R = routed copies, E = embed, X = experts, F = expert mlp, L = expert rows per device
# (ceil(X / D)), S = D * L stored expert rows (X plus padding).


class ExpertPlacement(nnx.Variable):
    """Which device holds each expert, and where among that device's experts ([X] int32 each).

    Not a param: it lives beside the params so the compiled step takes it as an input, and moving
    experts between devices (sharding/expert_placement.py) changes values, never shapes.
    """


def grouped_expert_mlp(
    rows,
    group_sizes,
    gate_proj,
    up_proj,
    down_proj,
    activation,
    biases=(),
    glu=None,
    lora: ExpertLora | None = None,
    matmul=None,
):
    """rows [R, E] sorted by expert, group_sizes [X] (rows past their sum are left out) -> [R, E]:
    each expert's gated MLP over its own rows; gate/up [X, E, F], down [X, F, E]. biases (GPT-OSS): the
    experts' gate, up and down biases ([X, F], [X, F], [X, E]), or () for none; glu(gate, up) -> hidden
    replaces activation(gate) * up where the model gates otherwise (GPT-OSS's clamped SwiGLU). lora: each
    row's adapter on the expert projections (jaxserve/lora; row_slots [R]), or None. matmul: the projections' plan
    where float experts go through its CPU kernel (expert_matmul), else None."""
    gate = expert_matmul(rows, gate_proj, group_sizes, matmul)  # a float or quantized (int8 / int4) [X, E, F] weight
    up = expert_matmul(rows, up_proj, group_sizes, matmul)
    if biases:
        gate_bias, up_bias, down_bias = (_bias_by_row(bias, group_sizes, rows.shape[0]) for bias in biases)
        gate, up = gate + gate_bias.astype(gate.dtype), up + up_bias.astype(up.dtype)
    if lora is not None:
        gate = add_expert_lora(gate, rows, group_sizes, lora.gate, lora.row_slots)
        up = add_expert_lora(up, rows, group_sizes, lora.up, lora.row_slots)
    hidden = glu(gate, up) if glu is not None else activation(gate) * up
    out = expert_matmul(hidden, down_proj, group_sizes, matmul)
    if lora is not None:
        out = add_expert_lora(out, hidden, group_sizes, lora.down, lora.row_slots)
    return out + down_bias.astype(out.dtype) if biases else out


def _bias_by_row(bias, group_sizes, num_rows: int):
    """bias [X, N] -> [R, N]: each grouped row's expert's bias; zero for rows past the groups."""
    ends = jnp.cumsum(group_sizes)
    expert_of_row = jnp.searchsorted(ends, jnp.arange(num_rows), side="right")  # [R]; X past the groups
    return jnp.where((expert_of_row < bias.shape[0])[:, None], bias[jnp.minimum(expert_of_row, bias.shape[0] - 1)], 0)


@dataclass(frozen=True)
class LocalExperts:
    """Every expert on every device: one grouped matmul per projection over all routed copies. matmul: the
    projections' plan when it has the CPU kernel (float experts through it: rows alike in any step), else None."""

    matmul: Any = None

    def num_expert_rows(self, num_experts: int) -> int:
        return num_experts

    def initial_placement(self, num_experts: int) -> tuple:
        return ()  # nothing to place: every expert is everywhere

    def __call__(
        self,
        x,
        weights,
        expert_ids,
        gate_proj,
        up_proj,
        down_proj,
        placement: tuple,
        *,
        activation,
        biases=(),
        glu=None,
        lora: ExpertLora | None = None,
    ):
        """x [T, E], weights / expert_ids [T, k] -> [T, E]; placement: () as initial_placement gave; biases and
        glu as grouped_expert_mlp takes them; lora: the adapter slots, each token's slot [T] (None: none)."""
        num_tokens, top_k = expert_ids.shape
        flat_experts = expert_ids.reshape(-1)  # [R]
        order = jnp.argsort(flat_experts, stable=True)
        token_of_copy = order // top_k  # [R]
        group_sizes = jnp.bincount(flat_experts, length=gate_proj.shape[0]).astype(jnp.int32)
        if lora is not None:  # each routed copy runs its token's adapter
            lora = dataclasses.replace(lora, row_slots=lora.row_slots[token_of_copy])
        out = grouped_expert_mlp(
            x[token_of_copy], group_sizes, gate_proj, up_proj, down_proj, activation, biases, glu, lora, self.matmul
        )
        out = out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
        combined = jnp.zeros((num_tokens, x.shape[1]), jnp.float32).at[token_of_copy].add(out)
        return combined.astype(x.dtype)


@dataclass(frozen=True)
class ExpertParallel:
    """Experts spread over every device of the mesh; tokens travel to them and back."""

    mesh: Mesh

    def num_expert_rows(self, num_experts: int) -> int:
        return num_expert_rows(num_experts, self.mesh.size)

    def initial_placement(self, num_experts: int) -> tuple[ExpertPlacement, ExpertPlacement]:
        """Contiguous blocks of experts per device, until a load profile says otherwise."""
        device_of, slot_of, _ = place_experts(None, num_experts, self.mesh.size)
        return ExpertPlacement(device_of), ExpertPlacement(slot_of)

    def __call__(
        self,
        x,
        weights,
        expert_ids,
        gate_proj,
        up_proj,
        down_proj,
        placement: tuple,
        *,
        activation,
        biases=(),
        glu=None,
        lora: ExpertLora | None = None,
    ):
        expert_to_device, expert_slot = placement
        return expert_parallel_moe(
            x,
            weights,
            expert_ids,
            gate_proj,
            up_proj,
            down_proj,
            expert_to_device,
            expert_slot,
            mesh=self.mesh,
            axis=self.mesh.axis_names,
            activation=activation,
            biases=biases,
            glu=glu,
            lora=lora,
        )


def expert_dispatch(mesh: Mesh | None = None, matmul=None) -> LocalExperts | ExpertParallel:
    """The experts function a mixture-of-experts model is built with: spread over `mesh`, or local (float experts
    through `matmul`, the projections' plan, where it has the CPU kernel)."""
    if mesh is not None:
        return ExpertParallel(mesh)
    return LocalExperts(matmul if matmul is not None and getattr(matmul, "has_cpu_kernel", False) else None)


def _local_moe(
    x,
    weights,
    expert_ids,
    gate_proj,
    up_proj,
    down_proj,
    expert_to_device,
    expert_slot,
    lora,
    *biases,
    axis,
    activation,
    glu,
):
    num_devices = jax.lax.psum(1, axis)
    tokens, embed = x.shape
    top_k = expert_ids.shape[1]
    copies = tokens * top_k
    flat_experts = expert_ids.reshape(-1)  # [C]
    destination = expert_to_device[flat_experts]  # [C]
    # Pack copies per destination device: slot j of buffer d holds the j-th copy bound for d.
    order = jnp.argsort(destination, stable=True)
    sorted_destination = destination[order]
    counts = jnp.bincount(destination, length=num_devices)  # [D]
    starts = jnp.cumsum(counts) - counts
    position_in_buffer = jnp.arange(copies) - starts[sorted_destination]
    send_tokens = (
        jnp.zeros((num_devices, copies, embed), x.dtype)
        .at[sorted_destination, position_in_buffer]
        .set(x[order // top_k])
    )
    send_slots = (
        jnp.full((num_devices, copies), -1, jnp.int32)
        .at[sorted_destination, position_in_buffer]
        .set(expert_slot[flat_experts[order]])
    )
    received = jax.lax.all_to_all(send_tokens, axis, 0, 0, tiled=False)  # [D, C, E] from each source
    received_slots = jax.lax.all_to_all(send_slots, axis, 0, 0, tiled=False)  # -1: an empty slot
    if lora is not None:  # each copy's LoRA adapter slot travels with it
        send_adapters = (
            jnp.zeros((num_devices, copies), jnp.int32)
            .at[sorted_destination, position_in_buffer]
            .set(lora.row_slots[order // top_k])
        )
        received_adapters = jax.lax.all_to_all(send_adapters, axis, 0, 0, tiled=False)

    # Grouped matmuls over this device's L rows; empty buffer slots sort last, past every group, and a
    # padding row (no expert id maps to it) is a group of none.
    rows = received.reshape(num_devices * copies, embed)
    slots = received_slots.reshape(-1)
    local_experts = gate_proj.shape[0]
    sort_key = jnp.where(slots < 0, local_experts, slots)
    row_order = jnp.argsort(sort_key, stable=True)
    group_sizes = jnp.bincount(sort_key, length=local_experts + 1)[:local_experts].astype(jnp.int32)
    if lora is not None:
        lora = dataclasses.replace(lora, row_slots=received_adapters.reshape(-1)[row_order])
    out_grouped = grouped_expert_mlp(
        rows[row_order], group_sizes, gate_proj, up_proj, down_proj, activation, tuple(biases), glu, lora
    )
    out_rows = jnp.zeros_like(out_grouped).at[row_order].set(out_grouped)
    returned = jax.lax.all_to_all(out_rows.reshape(num_devices, copies, embed), axis, 0, 0, tiled=False)

    # Unpack: copy i (in destination order) comes back at [its destination, its position].
    out_copies = (
        jnp.zeros((copies, embed), jnp.float32)
        .at[order]
        .set(returned[sorted_destination, position_in_buffer].astype(jnp.float32))
    )
    combined = (out_copies * weights.reshape(-1)[:, None]).reshape(tokens, top_k, embed).sum(axis=1)
    return combined.astype(x.dtype)


def expert_parallel_moe(
    x,
    weights,
    expert_ids,
    gate_proj,
    up_proj,
    down_proj,
    expert_to_device,
    expert_slot,
    *,
    mesh,
    axis,
    activation=jax.nn.silu,
    biases=(),
    glu=None,
    lora: ExpertLora | None = None,
):
    """x [T, E] and its routing (weights / expert_ids [T, k], ids < X) split over `axis`; gate/up [S, E, F] and
    down [S, F, E] stored per device, L rows each (expert_to_device / expert_slot [X] say where each expert
    is; `store_experts` lays canonical weights out so); biases ([S, F], [S, F], [S, E] or ()) stored alike;
    lora: adapter slots stored alike (expert rows first), its row_slots [T] split like x (None: none).
    Returns [T, E], split like x."""
    num_rows = gate_proj.shape[0]
    axes = axis if isinstance(axis, tuple) else (axis,)
    num_devices = 1
    for name in axes:
        num_devices *= mesh.shape[name]
    if num_rows % num_devices:
        raise ValueError(
            f"{num_rows} stored expert rows do not divide over {num_devices} devices on mesh axis "
            f"{axis!r}: pad them to num_expert_rows (store_experts)"
        )
    num_tokens = x.shape[0]
    padding = ((0, -num_tokens % num_devices), (0, 0))  # every device gets the same number of tokens
    x, weights, expert_ids = (jnp.pad(a, padding) for a in (x, weights, expert_ids))  # padding: weight 0
    if lora is not None:  # padding tokens: no adapter
        lora = dataclasses.replace(lora, row_slots=jnp.pad(lora.row_slots, padding[:1]))
    body = jax.shard_map(
        lambda *args: _local_moe(*args, axis=axis, activation=activation, glu=glu),
        mesh=mesh,
        # tokens, routing, experts; placements; adapter slots (expert rows) and each token's slot; biases
        in_specs=(P(axis),) * 6 + (P(), P()) + (P(axis),) * (1 + len(biases)),
        out_specs=P(axis),
        check_vma=False,
    )
    operands = (x, weights, expert_ids, gate_proj, up_proj, down_proj, expert_to_device, expert_slot, lora, *biases)
    return body(*operands)[:num_tokens]


def num_expert_rows(num_experts: int, num_devices: int) -> int:
    """Rows of each stored expert weight array: ceil(X / D) per device, every device's share one shape."""
    return num_devices * -(-num_experts // num_devices)


def place_experts(load: jax.Array | None, num_experts: int, num_devices: int):
    """Expert -> (device, slot) maps ([X] each) and the expert each stored row holds ([S]; -1: padding).

    Each device holds floor(X / D) or ceil(X / D) experts, as in vLLM. Without a load profile, experts
    go to devices in contiguous blocks, the first X mod D devices holding one more. With one (tokens
    routed to each expert), the heaviest experts are dealt out first, each to the device with the least
    load so far that still has room, which evens out the devices' loads; the load also decides which
    devices hold the extra experts.
    """
    base, extra = divmod(num_experts, num_devices)
    if load is None:
        device_of = [device for device in range(num_devices) for _ in range(base + (device < extra))]
    else:
        device_load, device_count, device_of = [0.0] * num_devices, [0] * num_devices, [0] * num_experts
        for expert in sorted(range(num_experts), key=lambda e: -float(load[e])):
            # room: below floor, or at floor while fewer than X mod D devices have taken an extra expert
            extra_left = extra - sum(count > base for count in device_count)
            device = min(
                (
                    d
                    for d in range(num_devices)
                    if device_count[d] < base or (device_count[d] == base and extra_left > 0)
                ),
                key=lambda d: device_load[d],
            )
            device_of[expert] = device
            device_load[device] += float(load[expert])
            device_count[device] += 1
    rows_per_device = -(-num_experts // num_devices)
    storage_order, slot_of, num_placed = [-1] * (rows_per_device * num_devices), [0] * num_experts, [0] * num_devices
    for expert, device in enumerate(device_of):  # each device's experts in id order, padding after them
        slot_of[expert] = num_placed[device]
        storage_order[device * rows_per_device + num_placed[device]] = expert
        num_placed[device] += 1
    return (jnp.asarray(device_of, jnp.int32), jnp.asarray(slot_of, jnp.int32), jnp.asarray(storage_order, jnp.int32))


def store_experts(weights, storage_order):
    """Canonical expert weights [X, ...] -> the stored layout [S, ...] that storage_order (from place_experts)
    gives, padding rows zero."""
    padded = jnp.concatenate([weights, jnp.zeros_like(weights[:1])])  # row X: the zero row padding copies
    return padded[jnp.where(storage_order < 0, weights.shape[0], storage_order)]
