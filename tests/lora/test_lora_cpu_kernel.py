"""The C++ segmented LoRA product (pallas_kernels/matmul/cpu_lora.py, cpu_lora_matmul.cc) against lora.py's
row-by-row reference: odd shapes, ranks that are not whole vectors, many slots with some unused, rows
without an adapter, more rows than one work item takes, each float dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul import choose_matmul, cpu_lora
from pallas_kernels.matmul.lora import LoraMatmul, LoraWeight, reference, route_rows, with_lora
from tests.kernels.row_invariance import assert_rows_as_alone

TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3}


def weight_and_rows(seed, num_rows, size_in, size_out, num_slots, rank, dtype, row_slots):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(size_in, num_slots, rank)).astype(np.float32) / np.sqrt(size_in)
    b = rng.normal(size=(num_slots, rank, size_out)).astype(np.float32)
    a[:, 0], b[0] = 0, 0  # slot 0: no adapter
    weight = LoraWeight(
        jnp.asarray(rng.normal(size=(size_in, size_out)) / np.sqrt(size_in), dtype),
        jnp.asarray(a, dtype),
        jnp.asarray(b, dtype),
        route_rows(jnp.asarray(row_slots, jnp.int32), num_slots),
    )
    return weight, jnp.asarray(rng.normal(size=(num_rows, size_in)), dtype)


CASES = [  # rows, K, N, slots, rank, dtype, which slots the rows use
    (1, 16, 8, 3, 2, jnp.float32, "all"),
    (5, 37, 41, 6, 3, jnp.float32, "all"),
    (70, 33, 300, 17, 16, jnp.float32, "some"),  # several shrink and expand items per slot, slots unused
    (40, 64, 130, 33, 20, jnp.bfloat16, "some"),  # rank not a whole number of vectors, many slots
    (33, 24, 77, 5, 64, jnp.float16, "all"),
    (9, 19, 23, 4, 1, jnp.bfloat16, "one"),
]


@pytest.mark.parametrize("num_rows, size_in, size_out, num_slots, rank, dtype, used", CASES)
def test_segmented_lora_matches_reference(num_rows, size_in, size_out, num_slots, rank, dtype, used):
    rng = np.random.default_rng(num_rows)
    if used == "one":
        row_slots = np.where(rng.random(num_rows) < 0.5, num_slots - 1, 0)
    elif used == "some":  # every other slot, and about a quarter of the rows without an adapter
        row_slots = np.where(rng.random(num_rows) < 0.25, 0, 1 + 2 * rng.integers(0, (num_slots - 1) // 2, num_rows))
    else:
        row_slots = rng.integers(0, num_slots, num_rows)
    weight, rows = weight_and_rows(num_rows, num_rows, size_in, size_out, num_slots, rank, dtype, row_slots)
    product = jnp.dot(rows, weight.base, preferred_element_type=jnp.float32)
    got = np.asarray(jax.jit(cpu_lora.add_lora)(rows, product, weight.a, weight.b, weight.rows.slots))
    want = np.asarray(reference(rows, weight))
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=TOLERANCE[jnp.dtype(dtype)] * scale)
    plain = row_slots == 0
    np.testing.assert_array_equal(got[plain], np.asarray(product)[plain])  # untouched, bit for bit
    assert np.abs(got[~plain] - np.asarray(product)[~plain]).max() > 0.1 * scale  # the adapters did add


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_a_row_computes_alike_in_calls_of_any_decode_or_verify_size(dtype):
    """tests/kernels/row_invariance.py's rule for the LoRA product (session 16): a row's x @ A sums K in order, its
    t @ B the rank in order, whichever rows share its adapter, however many there are (one slot with 40 rows:
    several shrink and expand items) and wherever the row falls in a register tile; so rows 0 and M // 2 of an
    M-row call are the bits of the one-row call with that row's slot, on every path. (Nothing to fix: checked.)"""
    from pallas_kernels import cpu_library

    i = np.arange(64)
    row_slots = np.where(i % 7 == 5, 0, np.where(i % 4 == 3, 2 + (i // 4) % 2, 1))
    weight, rows = weight_and_rows(26, 64, 33, 300, 4, 20, dtype, row_slots)
    product = jnp.asarray(np.random.default_rng(27).normal(size=(64, 300)), jnp.float32)
    slots = jnp.asarray(row_slots, jnp.int32)
    for path in cpu_library.runnable_paths():
        call = jax.jit(lambda r, p, s, path=path: cpu_lora.add_lora(r, p, weight.a, weight.b, s, path=path))
        assert_rows_as_alone(
            lambda idx, call=call: (call(rows[idx], product[idx], slots[idx]),), f"{path}, {jnp.dtype(dtype)}"
        )


def test_engine_plan_on_one_cpu_device_uses_the_segmented_kernel():
    plan = with_lora(choose_matmul("cpu", 1))
    entry = plan.entries[0]
    assert isinstance(entry, LoraMatmul) and entry.segmented
    assert not with_lora(choose_matmul("cpu", 2)).entries[0].segmented  # sharded slots: the XLA product
    row_slots = np.array([0, 2, 1, 2, 0, 3])
    weight, rows = weight_and_rows(7, 6, 24, 40, 4, 8, jnp.float32, row_slots)
    got = jax.jit(lambda r, w: plan(r, w))(rows, weight)
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference(rows, weight)), rtol=1e-5, atol=1e-4)


def test_bad_operands_are_refused_by_name():
    weight, rows = weight_and_rows(0, 4, 16, 8, 3, 2, jnp.float32, np.zeros(4))
    product = jnp.zeros((4, 8), jnp.float32)
    with pytest.raises(ValueError, match="one dtype"):
        cpu_lora.add_lora(rows.astype(jnp.bfloat16), product, weight.a, weight.b, weight.rows.slots)
    with pytest.raises(ValueError, match="product"):
        cpu_lora.add_lora(rows, product[:, :5], weight.a, weight.b, weight.rows.slots)
    with pytest.raises(ValueError, match="one slot per row"):
        cpu_lora.add_lora(rows, product, weight.a, weight.b, weight.rows.slots[:3])
