"""Batched LoRA projections (Punica / S-LoRA style): every row of a step has its own adapter.

A projection with adapters attached sees a `LoraWeight`: the base weight [K, N] beside the stacked adapter
slots A [K, slots, r] and B [slots, r, N] (B already scaled by alpha / r, or alpha / sqrt(r) for rsLoRA)
and the step's RowAdapters (each row's slot [M], slot 0 holds zeros: no adapter; worked out once per step
by route_rows for every projection). The result is

    rows @ base + (rows @ A[slot]) @ B[slot]     per row, accumulated in float32

The base product goes through the plan entries that serve the base weight (the C++ small matmul on a CPU
decode step, XLA's dots otherwise); `lora_delta` adds the low-rank part. Its cost follows the adapters the
step's rows use, not the number of slots: the n distinct adapters present are found on the device, and a
lax.switch branch sized for n (1, 2, 4, ... slots - 1) gathers just their A and B, multiplies every row by
all n A's at once ([M, K] @ [K, n * r]), zeroes each row's columns of the other adapters, and multiplies by
the n B's stacked ([M, n * r] @ [n * r, N]): two dense matmuls, whatever the mix. The last branch (more
than half the slots in use) does the same over every slot as stored, copying nothing. A step without
adapter rows takes the branch that hands the base product back. All branches live in one executable.

Routed experts (ExpertLora) keep their slots per expert and run inside the grouped expert matmul
(expert_lora_delta, called from sharding/moe.py).
Slot contents change by writing new values into the same arrays (jaxserve/lora/slots.py): nothing here
depends on which adapters are loaded, so loading, unloading and mixing adapters never recompiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from pallas_kernels.matmul import MatmulPlan, SmallMatmul, cpu_lora
from pallas_kernels.matmul.panels import ColumnPanels

# Legend: M = rows (tokens) in the step, K = in features, N = out features, L = adapter slots, r = slot rank.


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoraWeight:
    """A base weight with the adapter slots of its projection and the slot of each row of this step."""

    base: jax.Array | ColumnPanels  # [K, N] (a one-device CPU engine's in panels: panels.py)
    a: jax.Array  # [K, L, r]: the slot axis inside, so that all slots side by side ([K, L * r]) is a free reshape
    b: jax.Array  # [L, r, N], scaling folded in
    rows: RowAdapters  # each row's adapter, and the step's mix of adapters

    @property
    def dtype(self):
        return self.base.dtype

    @property
    def shape(self):
        return self.base.shape


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RowAdapters:
    """Each row's adapter slot in a step and what the batched product needs to know about the step's mix of
    adapters: worked out once per step (route_rows) and shared by every projection, not once per projection
    (a decode step has ~7 x layers of them, and each of these small ops costs as much as a projection's
    matmul on a small batch)."""

    slots: jax.Array  # [M] int32, 0: no adapter
    active: jax.Array  # [L - 1] int32: the slots in use first (the rest 0)
    position: jax.Array  # [M] int32: each row's place among the active slots; -1: no adapter
    branch: jax.Array  # [] int32: 0 when no row has an adapter, else 1 + the index of the branch sized for them


def route_rows(row_slots, num_slots: int) -> RowAdapters:
    """row_slots [M] (0: no adapter) among num_slots slots -> the step's RowAdapters."""
    present = jnp.zeros(num_slots, jnp.int32).at[row_slots].set(1).at[0].set(0)  # [L]: slots in use
    num_present = jnp.sum(present)
    (active,) = jnp.nonzero(present, size=num_slots - 1, fill_value=0)  # [L - 1]: the slots in use first
    position = jnp.cumsum(present) - 1  # slot -> its place among the active ones
    row_position = jnp.where(row_slots > 0, position[row_slots], -1)  # [M]; -1: no adapter
    index = jnp.searchsorted(jnp.asarray(branch_sizes(num_slots - 1), jnp.int32), num_present) + 1
    branch = jnp.where(num_present > 0, index, 0).astype(jnp.int32)
    return RowAdapters(row_slots.astype(jnp.int32), active.astype(jnp.int32), row_position, branch)


def lora_delta(rows, a, b, routing: RowAdapters):
    """rows [M, K] (in the adapters' dtype) -> float32 [M, N]: each row's (x @ A[slot]) @ B[slot].

    Costs what the adapters present in the step need, whatever the number of slots: for the n distinct
    slots among the rows (slot 0 aside; route_rows found them), a branch sized for n (the next power of
    two, under lax.switch: one executable) gathers their A and B and runs two dense matmuls, the columns of
    other adapters zeroed per row. No adapter: zeros, without touching A or B."""
    return _add_delta(jnp.zeros((rows.shape[0], b.shape[2]), jnp.float32), rows, a, b, routing)


def _add_delta(product, rows, a, b, routing: RowAdapters):
    """product [M, N] float32 plus lora_delta's: the branch without adapters hands the product back as it
    is; the branch for the most adapters reads every slot in place, gathering nothing."""
    sizes = branch_sizes(a.shape[1] - 1)
    branches = [lambda: product]
    branches += [
        functools.partial(_plus_active_delta, product, rows, a, b, routing.active[:size], routing.position)
        for size in sizes[:-1]
    ]
    branches.append(functools.partial(_plus_every_slot_delta, product, rows, a, b, routing.slots))
    return jax.lax.switch(routing.branch, branches)


def branch_sizes(max_active: int) -> list[int]:
    """1, 2, 4, ... up to max_active (always ending with it): how many adapters each branch makes room for."""
    sizes, size = [], 1
    while size < max_active:
        sizes.append(size)
        size *= 2
    return [*sizes, max_active]


def _plus_active_delta(product, rows, a, b, active, row_position):
    """product plus the low-rank products of the n adapters in `active` [n] (their A and B gathered)."""
    return product + _masked_delta(rows, a[:, active], b[active], row_position)


def _plus_every_slot_delta(product, rows, a, b, row_slots):
    """product plus the low-rank products through every slot as stored (slot 0 zeros): no copy of A or B,
    at up to L / n times the gathered branch's flops, which wins once most slots are in use."""
    return product + _masked_delta(rows, a, b, row_slots)


def _masked_delta(rows, a, b, row_position):
    """rows [M, K] times n slots' a [K, n, r] side by side, each row's columns of the other slots zeroed (its
    own: row_position [M], -1 none), times their b [n, r, N] stacked -> float32 [M, N]."""
    (size_in, num_active, rank), num_rows = a.shape, rows.shape[0]
    xa = jnp.dot(rows, a.reshape(size_in, num_active * rank), preferred_element_type=jnp.float32)
    own = (row_position[:, None] == jnp.arange(num_active)[None, :]).astype(jnp.float32)  # [M, n]
    xa = (xa.reshape(num_rows, num_active, rank) * own[:, :, None]).reshape(num_rows, num_active * rank)
    return jnp.dot(xa.astype(b.dtype), b.reshape(num_active * rank, -1), preferred_element_type=jnp.float32)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ExpertLora:
    """The adapter slots of one mixture-of-experts layer's routed-expert projections and the slot of each row.

    Each projection's slots keep the expert rows first, as the expert weights do (so expert placement moves
    them alike): A [S, K, L, r], B [S, L, r, N], B scaled; None where the adapters do not reach it."""

    row_slots: jax.Array  # [T] per token; per routed copy [R] once the copies are grouped by expert
    gate: tuple[jax.Array, jax.Array] | None  # A [S, E, L, r], B [S, L, r, F]
    up: tuple[jax.Array, jax.Array] | None  # as gate
    down: tuple[jax.Array, jax.Array] | None  # A [S, F, L, r], B [S, L, r, E]


def expert_lora_delta(rows, group_sizes, a, b, row_slots):
    """rows [R, K] sorted by expert (group_sizes [S]), a [S, K, L, r], b [S, L, r, N], row_slots [R] ->
    float32 [R, N]: each row's (x @ A[expert, slot]) @ B[expert, slot].

    Two grouped matmuls over the same expert groups as the base projection: every row times all L slots of
    its expert's A at once ([R, L * r]), the columns of the other slots zeroed per row, times the slots' B
    stacked ([L * r, N])."""
    num_rows, (num_rows_stored, depth, num_slots, rank) = rows.shape[0], a.shape
    xa = jax.lax.ragged_dot(
        rows.astype(a.dtype),
        a.reshape(num_rows_stored, depth, num_slots * rank),
        group_sizes,
        preferred_element_type=jnp.float32,
    ).reshape(num_rows, num_slots, rank)
    own = (row_slots[:, None] == jnp.arange(num_slots)[None, :]).astype(jnp.float32)  # [R, L]
    xa = (xa * own[:, :, None]).reshape(num_rows, num_slots * rank).astype(b.dtype)
    return jax.lax.ragged_dot(
        xa, b.reshape(num_rows_stored, num_slots * rank, -1), group_sizes, preferred_element_type=jnp.float32
    )


def add_expert_lora(product, rows, group_sizes, slots, row_slots):
    """A grouped expert projection's product [R, N] plus each row's adapter (slots: (A, B), or None: not
    adapted); a step without adapter rows skips the low-rank products."""
    if slots is None:
        return product
    a, b = slots
    delta = jax.lax.cond(
        jnp.any(row_slots > 0),
        lambda: expert_lora_delta(rows, group_sizes, a, b, row_slots),
        lambda: jnp.zeros(product.shape, jnp.float32),
    )
    return (product.astype(jnp.float32) + delta).astype(product.dtype)


def expert_reference(rows, expert_ids, a, b, row_slots):
    """The specification of expert_lora_delta, one row at a time in float32: row i's expert expert_ids[i]."""
    x = rows.astype(jnp.float32)
    a_rows = a[expert_ids, :, row_slots].astype(jnp.float32)  # [R, K, r]
    b_rows = b[expert_ids, row_slots].astype(jnp.float32)  # [R, r, N]
    return jnp.einsum("mr,mrn->mn", jnp.einsum("mk,mkr->mr", x, a_rows), b_rows)


def add_lora(rows, base_product, weight: LoraWeight):
    """The base product [M, N] float32 plus the rows' adapters (nothing added where no row has one)."""
    return _add_delta(base_product, rows.astype(weight.a.dtype), weight.a, weight.b, weight.rows)


def reference(rows, weight: LoraWeight):
    """The specification: rows [M, K] @ base + each row's adapter, all in float32, one row at a time."""
    x = rows.astype(jnp.float32)
    a = jnp.moveaxis(weight.a, 1, 0)[weight.rows.slots].astype(jnp.float32)
    b = weight.b[weight.rows.slots].astype(jnp.float32)
    low_rank = jnp.einsum("mr,mrn->mn", jnp.einsum("mk,mkr->mr", x, a), b)
    base = (
        weight.base.matrix() if isinstance(weight.base, ColumnPanels) else weight.base
    )  # (a CPU engine's layout: panels.py)
    return x @ base.astype(jnp.float32) + low_rank


@dataclass(frozen=True)
class LoraMatmul:
    """A matmul plan entry for calls where some weight carries adapters: the base products by `base` (the
    plan without this entry), then each adapter's low-rank product added: by the C++ segmented kernel
    (cpu_lora.py: each row times its own adapter only) when `segmented`, else by the masked XLA product."""

    base: MatmulPlan  # whatever serves the base weights
    segmented: bool = False  # one CPU device where the kernel library builds
    joins_weights: ClassVar[bool] = True

    def serves(self, num_rows: int, weights: tuple) -> bool:
        return any(isinstance(weight, LoraWeight) for weight in weights)

    def __call__(self, rows, weights: tuple, *, transposed: bool) -> tuple:
        if transposed:
            raise ValueError("LoRA adapters are not served on a transposed (tied) weight")
        bases = tuple(weight.base if isinstance(weight, LoraWeight) else weight for weight in weights)
        products = self.base.together(rows, bases)
        if products is None:
            products = tuple(self.base(rows, base) for base in bases)
        add = add_lora_segmented if self.segmented else add_lora
        return tuple(
            add(rows, product, weight) if isinstance(weight, LoraWeight) else product
            for product, weight in zip(products, weights)
        )


def add_lora_segmented(rows, base_product, weight: LoraWeight):
    """add_lora by the C++ segmented kernel: each row's own adapter only, its A and B read once a step."""
    return cpu_lora.add_lora(rows.astype(weight.a.dtype), base_product, weight.a, weight.b, weight.rows.slots)


def with_lora(plan: MatmulPlan) -> MatmulPlan:
    """The plan with LoRA in front: calls with adapters go through LoraMatmul, the rest as before. The plan
    holds the C++ small matmul exactly where a custom call sees whole weights on one CPU device
    (choose_matmul); there the segmented kernel adds the adapters, where it builds."""
    segmented = any(isinstance(entry, SmallMatmul) for entry in plan.entries) and cpu_lora.available()
    return MatmulPlan((LoraMatmul(plan, segmented), *plan.entries))
