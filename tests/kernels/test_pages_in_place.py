"""The page pool is read and written in place: a step's cost follows the context it attends to, never
the size of the pool."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import pallas_gpu, pallas_tpu
from tests.kernels.steps import ragged_step


def _consumers(function, args, names):
    """The primitives that consume each of the named inputs inside a jitted function's jaxpr."""
    closed = jax.make_jaxpr(function)(*args)
    (outer,) = closed.jaxpr.eqns  # the jit
    inner = outer.params["jaxpr"].jaxpr
    inputs = dict(zip(names, inner.invars))
    return {name: [eqn.primitive.name for eqn in inner.eqns if any(v is var for v in eqn.invars)]
            for name, var in inputs.items()}, inner


@pytest.mark.parametrize("kernel", [pallas_gpu, pallas_tpu])
def test_kernels_read_the_page_pool_in_place(kernel):
    """K/V pages go straight into the kernel: no gather, copy or reshape of the pool before it."""
    args = ragged_step(np.random.default_rng(0), 16, 64, 4, jnp.float32, 1)
    consumers, _ = _consumers(lambda *a: kernel.ragged_paged_attention(*a, query_block=1), args,
                              ["q", "k_pages", "v_pages"])
    assert consumers["k_pages"] == ["pallas_call"] and consumers["v_pages"] == ["pallas_call"]


def test_write_kernel_updates_pages_in_place():
    pages = jnp.zeros((4, 8, 2, 64))
    k = jnp.ones((8, 2, 64))
    consumers, inner = _consumers(pallas_gpu.write_kv_pages, (pages, pages, k, k, jnp.zeros(8, jnp.int32)),
                                  ["k_pages", "v_pages"])
    assert consumers == {"k_pages": ["pallas_call"], "v_pages": ["pallas_call"]}
    (call,) = [eqn for eqn in inner.eqns if eqn.primitive.name == "pallas_call"]
    assert dict(call.params["input_output_aliases"]) == {3: 0, 4: 1}  # outputs alias the donated pages
