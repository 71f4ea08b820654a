"""A one-device CPU engine's weights moved into a huge-page arena (jaxserve/device/huge_pages.py): XLA
aliases the arena without a copy, the values and results are unchanged, and the old buffers are gone."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.device.huge_pages import ALIGNMENT, move_weights_to_huge_pages


class TwoLayers(nnx.Module):
    def __init__(self, dtype):
        rngs = nnx.Rngs(0)
        self.first = nnx.Linear(768, 2048, dtype=dtype, param_dtype=dtype, rngs=rngs)  # 3 MiB in bfloat16
        self.second = nnx.Linear(2048, 96, dtype=dtype, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.second(jax.nn.relu(self.first(x)))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_weights_move_into_one_aligned_arena_without_changing_results(dtype):
    assert jax.device_count() == 1 and jax.default_backend() == "cpu"
    model = TwoLayers(dtype)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 768)), dtype)
    before_values = [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(model))]
    before_out = np.asarray(nnx.jit(lambda m, x: m(x))(model, x))
    old_leaves = jax.tree.leaves(nnx.state(model))
    moved = move_weights_to_huge_pages(model)
    leaves = jax.tree.leaves(nnx.state(model))
    total = sum(-(-leaf.nbytes // ALIGNMENT) * ALIGNMENT for leaf in leaves)
    assert moved == total
    pointers = sorted(leaf.unsafe_buffer_pointer() for leaf in leaves)
    assert all(p % ALIGNMENT == 0 for p in pointers)
    assert pointers[-1] - pointers[0] < total  # one arena, laid end to end
    assert not any(new is old for new, old in zip(leaves, old_leaves))
    for leaf, value in zip(leaves, before_values):
        np.testing.assert_array_equal(np.asarray(leaf), value)
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m(x))(model, x)), before_out)


def test_small_models_stay_where_they_are():
    """Under one huge page of weights there is nothing to gain: nothing moves."""
    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    before = model.kernel.get_value()
    assert move_weights_to_huge_pages(model) == 0
    assert model.kernel.get_value() is before
