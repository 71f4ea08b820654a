"""Expert parallelism for a mixture-of-experts layer: tokens travel to their experts' devices and back.

Inside `shard_map` over one mesh axis: every device holds a share of the tokens and a share of the
experts (`expert_to_device` / `expert_slot` say which device holds expert e, and where among its
local experts). Each device routes its tokens, packs each routed copy into a per-destination buffer,
exchanges buffers with one all-to-all, runs grouped matmuls over its local experts, and sends the
results back with a second all-to-all, where they are weighted and summed per token.

Buffers are sized for the worst case (every copy to one device), so nothing is ever dropped. The
placement arrays are inputs, not constants: moving experts between devices changes no shapes and
compiles nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

# Legend: D = devices on the axis, t = tokens per device, k = experts per token, C = t * k routed
# copies per device, E = embed, F = expert mlp, L = experts per device.


def _local_moe(x, router, gate_proj, up_proj, down_proj, expert_to_device, expert_slot, *, axis: str, top_k: int,
               activation):
    num_devices = jax.lax.psum(1, axis)
    tokens, embed = x.shape
    copies = tokens * top_k
    probs = jax.nn.softmax((x @ router).astype(jnp.float32), axis=-1)  # [t, X]
    weights, experts = jax.lax.top_k(probs, top_k)
    weights = weights / weights.sum(axis=-1, keepdims=True)
    flat_experts = experts.reshape(-1)  # [C]
    destination = expert_to_device[flat_experts]  # [C]
    # Pack copies per destination device: slot j of buffer d holds the j-th copy bound for d.
    order = jnp.argsort(destination, stable=True)
    sorted_destination = destination[order]
    counts = jnp.bincount(destination, length=num_devices)  # [D]
    starts = jnp.cumsum(counts) - counts
    position_in_buffer = jnp.arange(copies) - starts[sorted_destination]
    send_tokens = jnp.zeros((num_devices, copies, embed), x.dtype).at[sorted_destination, position_in_buffer].set(
        x[order // top_k])
    send_slots = jnp.full((num_devices, copies), -1, jnp.int32).at[sorted_destination, position_in_buffer].set(
        expert_slot[flat_experts[order]])
    received = jax.lax.all_to_all(send_tokens, axis, 0, 0, tiled=False)  # [D, C, E] from each source
    received_slots = jax.lax.all_to_all(send_slots, axis, 0, 0, tiled=False)  # -1: an empty slot

    # Grouped matmuls over this device's experts; empty slots sort last, past every group.
    rows = received.reshape(num_devices * copies, embed)
    slots = received_slots.reshape(-1)
    local_experts = gate_proj.shape[0]
    sort_key = jnp.where(slots < 0, local_experts, slots)
    row_order = jnp.argsort(sort_key, stable=True)
    group_sizes = jnp.bincount(sort_key, length=local_experts + 1)[:local_experts].astype(jnp.int32)
    grouped = rows[row_order]
    hidden = activation(jax.lax.ragged_dot(grouped, gate_proj, group_sizes)) * jax.lax.ragged_dot(
        grouped, up_proj, group_sizes)
    out_grouped = jax.lax.ragged_dot(hidden, down_proj, group_sizes)
    out_rows = jnp.zeros_like(out_grouped).at[row_order].set(out_grouped)
    returned = jax.lax.all_to_all(out_rows.reshape(num_devices, copies, embed), axis, 0, 0, tiled=False)

    # Unpack: copy i (in destination order) comes back at [its destination, its position].
    out_copies = jnp.zeros((copies, embed), jnp.float32).at[order].set(
        returned[sorted_destination, position_in_buffer].astype(jnp.float32))
    combined = (out_copies * weights.reshape(-1)[:, None]).reshape(tokens, top_k, embed).sum(axis=1)
    return combined.astype(x.dtype)


def expert_parallel_moe(x, router, gate_proj, up_proj, down_proj, expert_to_device, expert_slot, *, mesh,
                        axis: str, top_k: int, activation=jax.nn.silu):
    """x [T, E] split over `axis`; gate/up [X, E, F] and down [X, F, E] stored per device (expert_slot
    orders each device's experts); router [E, X] replicated. Returns [T, E], split like x."""
    num_experts = router.shape[1]
    axes = axis if isinstance(axis, tuple) else (axis,)
    num_devices = 1
    for name in axes:
        num_devices *= mesh.shape[name]
    if num_experts % num_devices:
        raise ValueError(f"{num_experts} experts do not divide over {num_devices} devices on mesh axis {axis!r}")
    num_tokens = x.shape[0]
    x = jnp.pad(x, ((0, -num_tokens % num_devices), (0, 0)))  # every device gets the same number of tokens
    body = jax.shard_map(
        lambda *args: _local_moe(*args, axis=axis, top_k=top_k, activation=activation),
        mesh=mesh,
        in_specs=(P(axis), P(), P(axis), P(axis), P(axis), P(), P()),
        out_specs=P(axis),
        check_vma=False,
    )
    return body(x, router, gate_proj, up_proj, down_proj, expert_to_device, expert_slot)[:num_tokens]


def place_experts(load: jax.Array | None, num_experts: int, num_devices: int):
    """Expert -> (device, slot) maps and the order to store expert weights in ([X] each).

    Without a load profile, experts go to devices in contiguous blocks. With one (tokens routed to
    each expert), the heaviest experts are dealt out first, each to the device with the least load so
    far that still has room, which evens out the devices' loads.
    """
    per_device = num_experts // num_devices
    if load is None:
        device_of = [e // per_device for e in range(num_experts)]
    else:
        device_load, device_count, device_of = [0.0] * num_devices, [0] * num_devices, [0] * num_experts
        for expert in sorted(range(num_experts), key=lambda e: -float(load[e])):
            device = min((d for d in range(num_devices) if device_count[d] < per_device), key=lambda d: device_load[d])
            device_of[expert] = device
            device_load[device] += float(load[expert])
            device_count[device] += 1
    storage_order = sorted(range(num_experts), key=lambda e: (device_of[e], e))  # weights stored device by device
    slot_of = [0] * num_experts
    for position, expert in enumerate(storage_order):
        slot_of[expert] = position % per_device
    return (jnp.asarray(device_of, jnp.int32), jnp.asarray(slot_of, jnp.int32), jnp.asarray(storage_order, jnp.int32))
