"""The RMS norm inside the int8-activation quantized kernel's call (quantized_cpu.quantized_matmuls_normed, issue 25):
the rows it normalizes are the float kernel's normed rows (cpu_rms_norm.h, one norm for both), quantized and
multiplied as any x; project_many hands a layer's norm to it where the plan's int8 kernel serves the weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve.models.layers import RMSNorm, linear, project_many
from pallas_kernels import cpu_library
from pallas_kernels.matmul import choose_matmul, cpu, quantized_cpu, quantized_tiles
from tests.kernels.row_invariance import assert_rows_as_alone
from tests.kernels.test_quantized_matmul import random_weight


def layer_weights(rng, depth: int) -> tuple:
    """A layer's joined weights as a GGUF file mixes them: tiled Q4_0 and Q8_0, a Q4_1 kept [K, N] (N not a
    multiple of a tile), a bfloat16-scaled 4-bit of groups of 128."""
    tiled = (
        random_weight(rng, depth, 128, 4, 32, jnp.float16, False),
        random_weight(rng, depth, 64, 8, 32, jnp.float16, False),
    )
    return (
        *(quantized_tiles.to_tiles(w) for w in tiled),
        random_weight(rng, depth, 83, 4, 32, jnp.float16, True),
        random_weight(rng, depth, 40, 4, 128, jnp.bfloat16, False),
    )


def kernel_normed_rows(x, scale, eps: float):
    """RMSNorm(x) as the kernels compute it (the float kernel's normed call through an identity weight), in x's dtype."""
    identity = jnp.eye(x.shape[1], dtype=x.dtype)
    (rows,) = jax.jit(lambda x, s, w: cpu.small_matmuls_normed(x, s, eps, (w,)))(x, scale, identity)
    return rows.astype(x.dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_the_normed_call_is_the_call_on_the_kernels_normed_rows(dtype):
    """Bit for bit, on every instruction path this CPU runs, at 1, 3, 8 and 70 rows (a prefill chunk's blocks): the
    normed call equals the plain call on the rows the float kernel's norm gives; and near the call on the model's own
    RMSNorm (XLA's sum order: an int8 rounding may flip)."""
    rng = np.random.default_rng(3)
    depth, eps = 256, 1e-5
    weights = layer_weights(rng, depth)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, depth), dtype)
    norm = RMSNorm(depth, eps, dtype)
    norm.weight[...] = scale
    for path in cpu_library.runnable_paths():
        normed_call = jax.jit(
            lambda x, s, ws, path=path: quantized_cpu.quantized_matmuls_normed(x, s, eps, ws, path=path)
        )
        plain_call = jax.jit(lambda x, ws, path=path: quantized_cpu.quantized_matmuls(x, ws, path=path))
        for num_rows in (1, 3, 8, 70):
            x = jnp.asarray(3 * rng.standard_normal((num_rows, depth)), dtype)
            got = normed_call(x, scale, weights)
            want = plain_call(kernel_normed_rows(x, scale, eps), weights)
            near = plain_call(jax.jit(norm)(x), weights)
            for a, b, c in zip(got, want, near, strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
                size = float(np.max(np.abs(np.asarray(c))))
                np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=0, atol=0.05 * size)


def test_a_row_is_the_bits_of_its_one_row_call():
    """Row invariance (speculation's greedy identity): each row of the plan entry's normed call of 2-70 rows (64 rows a
    kernel call, as the engine's prefill chunks) is the one-row call's bits."""
    rng = np.random.default_rng(8)
    depth = 256
    weights = layer_weights(rng, depth)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, depth), jnp.float32)
    x = jnp.asarray(3 * rng.standard_normal((70, depth)), jnp.float32)
    entry = quantized_cpu.QuantizedSmallMatmul(quantized_cpu.PREFILL_MAX_ROWS)
    call = jax.jit(lambda x, s, ws: entry.normed(x, s, 1e-5, ws))
    assert_rows_as_alone(lambda rows: call(x[rows], scale, weights), "normed int8", (2, 5, 8, 9, 64, 70))


def test_a_scale_that_does_not_fit_is_refused():
    rng = np.random.default_rng(4)
    weights = layer_weights(rng, 128)
    x = jnp.ones((2, 128), jnp.float32)
    with pytest.raises(ValueError, match="norm's scale"):
        quantized_cpu.quantized_matmuls_normed(x, jnp.ones((127,), jnp.float32), 1e-6, weights)
    with pytest.raises(ValueError, match="norm's scale"):
        quantized_cpu.quantized_matmuls_normed(x, jnp.ones((128,), jnp.bfloat16), 1e-6, weights)
    float_entry = quantized_cpu.QuantizedSmallMatmul(64, activations="float")
    assert not float_entry.takes_norm
    with pytest.raises(ValueError, match="takes no norm"):
        float_entry.normed(x, jnp.ones((128,), jnp.float32), 1e-6, weights)


@pytest.mark.parametrize("activations", ["int8", "float"])
def test_project_many_takes_the_norm_into_the_int8_kernels_call(activations):
    """project_many(x, linears, norm) with quantized kernels gives project_many(norm(x), linears) up to int8
    rounding; with the int8 kernel the norm runs inside its one call (none of it left to XLA), with the float-activation
    kernel (which has no norm) norm(x) comes first."""
    depth = 128
    rng = np.random.default_rng(5)
    plan = choose_matmul("cpu", 1, quantized_activations=activations)
    rngs = nnx.Rngs(0)
    linears = []
    for columns in (128, 64):
        module = linear(depth, columns, ("embed", "heads"), bias=False, dtype=jnp.float32, matmul=plan, rngs=rngs)
        weight = random_weight(rng, depth, columns, 4, 32, jnp.float16, False)
        module.kernel = nnx.Param(quantized_tiles.to_tiles(weight) if activations == "int8" else weight)
        linears.append(module)
    norm = RMSNorm(depth, 1e-6, jnp.float32)
    norm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, depth), jnp.float32)
    x = jnp.asarray(rng.standard_normal((1, depth)), jnp.float32)
    got = nnx.jit(lambda x: project_many(x, linears, norm))(x)
    expected = nnx.jit(lambda x: project_many(norm(x), linears))(x)
    for a, b in zip(got, expected, strict=True):
        size = float(np.max(np.abs(np.asarray(b))))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=0.05 * size)
    hlo = nnx.jit(lambda x: project_many(x, linears, norm)).lower(x).compile().as_text() or ""
    takes_norm = activations == "int8"
    assert (f'custom_call_target="{quantized_cpu.NORMED_TARGET}"' in hlo) == takes_norm
    assert ("rsqrt" in hlo) != takes_norm  # the norm in XLA only where the kernel has none
