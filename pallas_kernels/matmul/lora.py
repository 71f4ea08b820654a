"""Batched LoRA projections (Punica / S-LoRA style): every row of a step has its own adapter.

A projection with adapters attached sees a `LoraWeight`: the base weight [K, N] beside the stacked adapter
slots A [slots, K, r] and B [slots, r, N] (B already scaled by alpha / r, or alpha / sqrt(r) for rsLoRA)
and the adapter slot of each row [M] (slot 0 holds zeros: no adapter). The result is

    rows @ base + (rows @ A[slot]) @ B[slot]     per row, accumulated in float32

The base product goes through the plan entries that serve the base weight (the C++ small matmul on a CPU
decode step, XLA's dots otherwise); `lora_delta` adds the low-rank part. It has two forms, chosen at trace
time by the number of rows (shapes are static, so a compiled step holds one of them):

  gathered   few rows: each row's A and B gathered ([M, K, r], [M, r, N]), one small product per row;
             reads r * (K + N) adapter elements per row
  masked     many rows (prefill): every slot's x @ A at once ([M, slots * r], one dense matmul), each row's
             other slots zeroed, then one dense matmul by all the B's stacked [slots * r, N]

A step whose rows all have slot 0 skips the adapters (lax.cond), so base-only traffic pays only the test.
Slot contents change by writing new values into the same arrays (jaxserve/lora/slots.py): nothing here
depends on which adapters are loaded, so loading, unloading and mixing adapters never recompiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from pallas_kernels.matmul import MatmulPlan

# Legend: M = rows (tokens) in the step, K = in features, N = out features, L = adapter slots, r = slot rank.


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoraWeight:
    """A base weight with the adapter slots of its projection and the slot of each row of this step."""

    base: jax.Array  # [K, N]
    a: jax.Array  # [L, K, r]
    b: jax.Array  # [L, r, N], scaling folded in
    row_slots: jax.Array  # [M] int32, 0: no adapter

    @property
    def dtype(self):
        return self.base.dtype

    @property
    def shape(self):
        return self.base.shape


def lora_delta(rows, a, b, row_slots):
    """rows [M, K] (in the adapters' dtype) -> float32 [M, N]: each row's (x @ A[slot]) @ B[slot]."""
    num_rows, (num_slots, _, rank) = rows.shape[0], a.shape
    if num_rows <= num_slots:
        xa = jnp.einsum("mk,mkr->mr", rows, a[row_slots], preferred_element_type=jnp.float32)
        return jnp.einsum("mr,mrn->mn", xa.astype(b.dtype), b[row_slots], preferred_element_type=jnp.float32)
    xa = jnp.einsum("mk,lkr->mlr", rows, a, preferred_element_type=jnp.float32)  # [M, L, r]
    own = (row_slots[:, None] == jnp.arange(num_slots)[None, :]).astype(jnp.float32)  # [M, L]
    xa = (xa * own[:, :, None]).reshape(num_rows, num_slots * rank).astype(b.dtype)
    return jnp.dot(xa, b.reshape(num_slots * rank, -1), preferred_element_type=jnp.float32)


def add_lora(rows, base_product, weight: LoraWeight):
    """The base product [M, N] float32 plus the rows' adapters, skipped when no row has one."""
    return jax.lax.cond(
        jnp.any(weight.row_slots > 0),
        lambda: base_product + lora_delta(rows.astype(weight.a.dtype), weight.a, weight.b, weight.row_slots),
        lambda: base_product,
    )


def reference(rows, weight: LoraWeight):
    """The specification: rows [M, K] @ base + each row's adapter, all in float32, one row at a time."""
    x = rows.astype(jnp.float32)
    a = weight.a[weight.row_slots].astype(jnp.float32)
    b = weight.b[weight.row_slots].astype(jnp.float32)
    low_rank = jnp.einsum("mr,mrn->mn", jnp.einsum("mk,mkr->mr", x, a), b)
    return x @ weight.base.astype(jnp.float32) + low_rank


@dataclass(frozen=True)
class LoraMatmul:
    """A matmul plan entry for calls where some weight carries adapters: the base products by `base` (the
    plan without this entry), then each adapter's low-rank product added."""

    base: MatmulPlan  # whatever serves the base weights
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
        return tuple(
            add_lora(rows, product, weight) if isinstance(weight, LoraWeight) else product
            for product, weight in zip(products, weights)
        )


def with_lora(plan: MatmulPlan) -> MatmulPlan:
    """The plan with LoRA in front: calls with adapters go through LoraMatmul, the rest as before."""
    return MatmulPlan((LoraMatmul(plan), *plan.entries))
