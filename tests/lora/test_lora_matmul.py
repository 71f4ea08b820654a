"""The batched LoRA matmul (pallas_kernels/matmul/lora.py) against its row-by-row reference: every branch
size (the distinct adapters among the rows), through each base plan, in float32 and bfloat16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul import REFERENCE_PLAN, choose_matmul
from pallas_kernels.matmul.lora import (
    LoraWeight,
    expert_lora_delta,
    expert_reference,
    lora_delta,
    reference,
    route_rows,
    with_lora,
)

TOLERANCE = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 3e-2}


def lora_weight(rng, num_rows, size_in, size_out, num_slots, rank, dtype, row_slots=None):
    a = rng.normal(size=(size_in, num_slots, rank)).astype(np.float32)
    b = rng.normal(size=(num_slots, rank, size_out)).astype(np.float32)
    a[:, 0], b[0] = 0, 0  # slot 0: no adapter
    if row_slots is None:
        row_slots = rng.integers(0, num_slots, size=num_rows)
    return LoraWeight(
        jnp.asarray(rng.normal(size=(size_in, size_out)), dtype),
        jnp.asarray(a, dtype),
        jnp.asarray(b, dtype),
        route_rows(jnp.asarray(row_slots, jnp.int32), num_slots),
    )


@pytest.mark.parametrize(  # up to 1, 3, 5 and 5 distinct adapters of 5
    "num_rows, dtype", [(1, jnp.float32), (3, jnp.bfloat16), (6, jnp.float32), (40, jnp.bfloat16)]
)
def test_batched_lora_matches_reference(num_rows, dtype):
    rng = np.random.default_rng(num_rows)
    weight = lora_weight(rng, num_rows, 24, 40, 6, 4, dtype)
    rows = jnp.asarray(rng.normal(size=(num_rows, 24)), dtype)
    want = np.asarray(reference(rows, weight))
    scale = np.abs(want).max()
    for plan in (REFERENCE_PLAN, choose_matmul(jax.default_backend(), 1)):
        got = jax.jit(lambda r, w, plan=plan: with_lora(plan)(r, w))(rows, weight)
        assert got.dtype == jnp.float32 and got.shape == (num_rows, 40)
        np.testing.assert_allclose(np.asarray(got), want, atol=TOLERANCE[jnp.dtype(dtype)] * scale)


def test_rows_without_adapters_get_the_base_product_exactly():
    rng = np.random.default_rng(0)
    weight = lora_weight(rng, 6, 16, 8, 3, 2, jnp.float32, row_slots=np.zeros(6))
    rows = jnp.asarray(rng.normal(size=(6, 16)), jnp.float32)
    got = with_lora(REFERENCE_PLAN)(rows, weight)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(REFERENCE_PLAN(rows, weight.base)))


@pytest.mark.parametrize("num_distinct", [0, 1, 3, 9])  # no branch, and those for 1, 4 and 9
def test_each_branch_size_matches_reference(num_distinct):
    """9 slots past the base: branches for 1, 2, 4, 8 and 9 adapters; rows use num_distinct of them (some
    rows none), in an order that leaves gaps among the slots used."""
    rng = np.random.default_rng(num_distinct)
    used = rng.permutation(np.arange(1, 10))[:num_distinct]
    row_slots = np.concatenate([used, used, [0, 0]]) if num_distinct else np.zeros(4, np.int64)
    weight = lora_weight(rng, len(row_slots), 16, 8, 10, 3, jnp.float32, row_slots=rng.permutation(row_slots))
    rows = jnp.asarray(rng.normal(size=(len(row_slots), 16)), jnp.float32)
    delta = jax.jit(lora_delta)(rows, weight.a, weight.b, weight.rows)
    want = np.asarray(reference(rows, weight)) - np.asarray(rows @ weight.base)
    np.testing.assert_allclose(np.asarray(delta), want, rtol=1e-4, atol=1e-4)
    assert (np.abs(np.asarray(delta)).max() > 1) == (num_distinct > 0)


def test_joined_projections_mix_adapted_and_plain_weights():
    """A layer's q, k, v in one call where only some carry slots (target_modules naming only q_proj)."""
    rng = np.random.default_rng(2)
    adapted = lora_weight(rng, 4, 16, 8, 3, 2, jnp.float32)
    plain = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
    rows = jnp.asarray(rng.normal(size=(4, 16)), jnp.float32)
    plan = with_lora(choose_matmul(jax.default_backend(), 1))
    joined = plan.together(rows, (adapted, plain))
    assert joined is not None
    np.testing.assert_allclose(np.asarray(joined[0]), np.asarray(reference(rows, adapted)), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(joined[1]), np.asarray(rows @ plain), rtol=1e-4, atol=1e-4)


def test_expert_lora_matches_reference():
    """Routed copies grouped by expert (an empty group, rows past the groups), each with its token's slot."""
    rng = np.random.default_rng(5)
    num_experts, size_in, size_out, num_slots, rank = 4, 12, 10, 3, 2
    group_sizes = np.array([3, 0, 4, 2])
    expert_ids = np.repeat(np.arange(num_experts), group_sizes)  # 9 grouped rows, then 2 past the groups
    row_slots = rng.integers(0, num_slots, size=11)
    a = rng.normal(size=(num_experts, size_in, num_slots, rank)).astype(np.float32)
    b = rng.normal(size=(num_experts, num_slots, rank, size_out)).astype(np.float32)
    a[:, :, 0], b[:, 0] = 0, 0
    rows = rng.normal(size=(11, size_in)).astype(np.float32)
    got = jax.jit(expert_lora_delta)(rows, jnp.asarray(group_sizes, jnp.int32), a, b, jnp.asarray(row_slots))
    want = np.asarray(expert_reference(rows[:9], expert_ids, a, b, row_slots[:9]))
    np.testing.assert_allclose(np.asarray(got)[:9], want, rtol=1e-4, atol=1e-4)
    assert not np.asarray(got)[9:].any() and np.abs(want).max() > 1
