"""The CPU small matmul (cpu_matmul.cc) against numpy, and the structural property it exists for: a
decode-sized dot with 16-bit weights widens no whole weight to float32 (issue #16)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.layers import SMALL_MATMUL_MAX_ROWS, project
from pallas_kernels.paged_attention import cpu

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_small_matmul_matches_numpy(dtype, transposed):
    rng = np.random.default_rng(0)
    # 4100 columns: more than one 4096-column tile, the last one partial; 70: less than one tile.
    for rows, depth, columns in [(1, 96, 4100), (3, 40, 70), (8, 17, 300), (5, 1, 9)]:
        x = jnp.asarray(rng.standard_normal((rows, depth)), dtype)
        w = jnp.asarray(rng.standard_normal((columns, depth) if transposed else (depth, columns)), dtype)
        got = jax.jit(lambda x, w: cpu.small_matmul(x, w, transposed=transposed))(x, w)
        wide_w = np.asarray(w, np.float64)
        expected = np.asarray(x, np.float64) @ (wide_w.T if transposed else wide_w)
        assert got.dtype == jnp.float32 and got.shape == expected.shape
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-4 * np.sqrt(depth))


def test_small_matmul_refuses_bad_inputs():
    x = jnp.ones((2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="small_matmul"):
        cpu.small_matmul(x, jnp.ones((8, 4), jnp.float32))  # dtypes differ
    with pytest.raises(ValueError, match="small_matmul"):
        cpu.small_matmul(jnp.ones((cpu.MATMUL_MAX_ROWS + 1, 8), jnp.bfloat16), jnp.ones((8, 4), jnp.bfloat16))
    with pytest.raises(ValueError):
        cpu.small_matmul(x, jnp.ones((8, 4), jnp.int8))  # not a dtype the kernels serve


def _widened_weights(hlo_text: str, weight_shape) -> list[str]:
    """Ops whose result is float32 of the weight's shape: XLA widening the weight before a dot."""
    dims = ",".join(map(str, weight_shape))
    return [line for line in hlo_text.splitlines() if re.search(rf"= f32\[{dims}\]", line)]


@pytest.mark.parametrize("dtype,rows", [(jnp.bfloat16, 1), (jnp.bfloat16, 4), (jnp.bfloat16, 16), (jnp.float16, 1),
                                        (jnp.float16, 16)])
def test_16_bit_projections_read_weights_as_stored(dtype, rows):
    """Decode-sized projections (the kernel) and, for bfloat16, larger ones (XLA's dot), plain and transposed."""
    assert jax.device_count() == 1 and cpu.available()
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((rows, 64)), dtype)
    for weight_shape, transposed in [((64, 96), False), ((96, 64), True)]:
        w = jnp.asarray(rng.standard_normal(weight_shape), dtype)
        fn = jax.jit(lambda x, w: project(x, w, transposed=transposed))
        hlo = fn.lower(x, w).compile().as_text()
        assert _widened_weights(hlo, weight_shape) == []
        uses_kernel = cpu.MATMUL_TARGET in hlo
        assert uses_kernel == (rows <= SMALL_MATMUL_MAX_ROWS[jnp.dtype(dtype)])
        wide_w = np.asarray(w, np.float64)
        expected = np.asarray(x, np.float64) @ (wide_w.T if transposed else wide_w)
        got = np.asarray(fn(x, w), np.float64)
        np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())


def test_the_widening_check_sees_xla_widening_a_weight():
    """The check above would catch the problem: XLA's own one-row bfloat16 dot widens the weight."""
    x, w = jnp.ones((1, 64), jnp.bfloat16), jnp.ones((64, 96), jnp.bfloat16)
    hlo = jax.jit(jnp.dot).lower(x, w).compile().as_text()
    assert _widened_weights(hlo, (64, 96))
