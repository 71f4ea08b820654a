"""The CPU small matmul (pallas_kernels/matmul/cpu_matmul.cc) against numpy, and the structural property
it exists for: a decode-sized dot with 16-bit weights widens no whole weight to float32 (issue #16)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.layers import project
from pallas_kernels.matmul import choose_matmul, cpu, small_matmul_entry

# What the engine's builder chooses on this one-device CPU process: the kernel for decode-sized rows.
CPU_PLAN = choose_matmul("cpu", 1)
# Rows the kernel serves by dtype here (bfloat16 on AMX CPUs: every row count on the library's AMX tiles, else 8)
KERNEL_ROWS = dict(small_matmul_entry().max_rows)

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _assert_is_product(got, x, w, transposed):
    """got is float32 x @ w (w.T when transposed), as numpy computes it in float64 from the same values."""
    wide_w = np.asarray(w, np.float64)
    expected = np.asarray(x, np.float64) @ (wide_w.T if transposed else wide_w)
    assert got.dtype == jnp.float32 and got.shape == expected.shape
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-4 * np.sqrt(x.shape[1]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_small_matmul_matches_numpy(dtype, transposed):
    rng = np.random.default_rng(0)
    # 4100 columns: more than one 4096-column block, the last one partial; 70: less than one block; 8 rows
    # of 1000 columns: blocks of 512 (accumulators sized to L1), the last partial; 13 rows: a group of 8 and 5;
    # one row of 333 transposed outputs: two halves and an odd row out, K's tail past the vectors.
    cases = [(1, 96, 4100), (1, 41, 333), (3, 40, 70), (8, 17, 300), (5, 1, 9), (8, 40, 1000), (13, 24, 70)]
    for rows, depth, columns in cases:
        x = jnp.asarray(rng.standard_normal((rows, depth)), dtype)
        w = jnp.asarray(rng.standard_normal((columns, depth) if transposed else (depth, columns)), dtype)
        got = jax.jit(lambda x, w: cpu.small_matmul(x, w, transposed=transposed))(x, w)
        _assert_is_product(got, x, w, transposed)


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


@pytest.mark.parametrize(
    "dtype,rows", [(jnp.bfloat16, 1), (jnp.bfloat16, 4), (jnp.bfloat16, 16), (jnp.float16, 1), (jnp.float16, 16)]
)
def test_16_bit_projections_read_weights_as_stored(dtype, rows):
    """Decode-sized projections (the kernel) and, for bfloat16, larger ones (XLA's dot), plain and transposed."""
    assert jax.device_count() == 1 and cpu.available()
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((rows, 64)), dtype)
    for weight_shape, transposed in [((64, 96), False), ((96, 64), True)]:
        w = jnp.asarray(rng.standard_normal(weight_shape), dtype)
        fn = jax.jit(lambda x, w, transposed=transposed: project(x, w, matmul=CPU_PLAN, transposed=transposed))
        hlo = fn.lower(x, w).compile().as_text()
        assert _widened_weights(hlo, weight_shape) == []
        uses_kernel = cpu.MATMUL_TARGET in hlo
        assert uses_kernel == (rows <= KERNEL_ROWS[str(jnp.dtype(dtype))])
        wide_w = np.asarray(w, np.float64)
        expected = np.asarray(x, np.float64) @ (wide_w.T if transposed else wide_w)
        got = np.asarray(fn(x, w), np.float64)
        np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())


def test_the_widening_check_sees_xla_widening_a_weight():
    """The check above would catch the problem: XLA's own one-row bfloat16 dot widens the weight."""
    x, w = jnp.ones((1, 64), jnp.bfloat16), jnp.ones((64, 96), jnp.bfloat16)
    hlo = jax.jit(jnp.dot).lower(x, w).compile().as_text()
    assert _widened_weights(hlo, (64, 96))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_several_weights_in_one_call_match_numpy(dtype, transposed):
    """A layer's q, k and v (or gate and up) in one call: each result as its own product, for weights of
    different widths whose work items the threads share across the weights' boundaries."""
    rng = np.random.default_rng(2)
    rows, depth = 3, 72
    x = jnp.asarray(rng.standard_normal((rows, depth)), dtype)
    widths = (96, 24, 4100)
    weights = [jnp.asarray(rng.standard_normal((n, depth) if transposed else (depth, n)), dtype) for n in widths]
    got = jax.jit(lambda x, *ws: cpu.small_matmuls(x, ws, transposed=transposed))(x, *weights)
    assert len(got) == len(weights)
    for result, w in zip(got, weights):
        _assert_is_product(result, x, w, transposed)


def test_several_weights_refuse_mismatched_depth_or_dtype():
    x = jnp.ones((1, 8), jnp.float32)
    with pytest.raises(ValueError, match="small_matmul"):
        cpu.small_matmuls(x, (jnp.ones((8, 4), jnp.float32), jnp.ones((9, 4), jnp.float32)))
    with pytest.raises(ValueError, match="small_matmul"):
        cpu.small_matmuls(x, (jnp.ones((8, 4), jnp.float32), jnp.ones((8, 4), jnp.bfloat16)))
    with pytest.raises(ValueError, match="at least one"):
        cpu.small_matmuls(x, ())


@pytest.mark.parametrize(
    "dtype,rows",
    [(jnp.float32, 1), (jnp.float32, 8), (jnp.float32, 9), (jnp.bfloat16, 1), (jnp.bfloat16, 8), (jnp.bfloat16, 9)],
)
def test_project_many_is_each_linear_and_one_call_where_the_kernel_serves(dtype, rows):
    """project_many (q, k, v; gate, up) gives each Linear's own result, biases included, and makes one
    kernel call for all of them where the kernel serves that many rows."""
    from flax import nnx

    from jaxserve.models.layers import linear, project_many

    rngs = nnx.Rngs(0)
    linears = [
        linear(48, n, ("embed", "heads"), bias=bias, dtype=dtype, matmul=CPU_PLAN, rngs=rngs)
        for n, bias in [(48, True), (16, False), (16, True)]
    ]
    for module in linears:
        if module.bias is not None:
            module.bias[...] = jnp.asarray(np.random.default_rng(3).standard_normal(module.bias.shape), dtype)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((rows, 48)), dtype)
    fused = nnx.jit(lambda x: project_many(x, linears))
    got = fused(x)
    expected = [module(x) for module in linears]
    for a, b in zip(got, expected):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)
    hlo = jax.jit(lambda x: project_many(x, linears)).lower(x).compile().as_text()
    calls = hlo.count(f'custom_call_target="{cpu.MATMUL_TARGET}"')
    assert calls == (1 if rows <= KERNEL_ROWS[str(jnp.dtype(dtype))] else 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_results_do_not_depend_on_how_the_threads_ran(dtype):
    """A weight too narrow for column blocks alone is split along K; the parts are summed in a fixed
    order, so repeated calls agree to the last bit (serving gives a request the same logprobs)."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((3, 576)), dtype)
    weights = (jnp.asarray(rng.standard_normal((576, 576)), dtype), jnp.asarray(rng.standard_normal((576, 192)), dtype))
    fn = jax.jit(lambda x, *ws: cpu.small_matmuls(x, ws))
    first = [np.asarray(y) for y in fn(x, *weights)]
    for _ in range(30):
        for a, b in zip(fn(x, *weights), first):
            np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("depth", [576, 100])
def test_the_norm_inside_the_call_is_the_models_norm(dtype, depth):
    """small_matmuls_normed(x, scale) by an identity weight returns the normalized rows themselves: the model's
    RMSNorm(x) up to the order of the sum of squares (float32: within 2 ulps; 16-bit: the rounded rows equal, or
    where the float32 value sat on a rounding boundary one ulp apart), for a depth that is a multiple of 32 and
    one that is not; a scale of the wrong size is refused."""
    from jaxserve.models.layers import RMSNorm

    rng = np.random.default_rng(6)
    norm = RMSNorm(depth, 1e-5, dtype)
    norm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, depth), dtype)
    x = jnp.asarray(3 * rng.standard_normal((5, depth)), dtype)
    identity = jnp.eye(depth, dtype=dtype)
    (got,) = jax.jit(lambda x, s, w: cpu.small_matmuls_normed(x, s, 1e-5, (w,)))(x, norm.weight[...], identity)
    expected = np.asarray(jax.jit(norm)(x), np.float32)
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(got), expected, rtol=2.5e-7, atol=0)
    else:
        assert np.mean(np.asarray(got) == expected) > 0.99
        one_ulp = 2.0**-7 if dtype == jnp.bfloat16 else 2.0**-10
        np.testing.assert_allclose(np.asarray(got), expected, rtol=one_ulp, atol=0)
    with pytest.raises(ValueError, match="scale"):
        cpu.small_matmuls_normed(x, norm.weight[...][:-1], 1e-5, (identity,))


@pytest.mark.parametrize("dtype,rows", [(jnp.float32, 1), (jnp.bfloat16, 1), (jnp.bfloat16, 9)])
def test_project_many_takes_the_norm_into_the_kernels_call(dtype, rows):
    """project_many(x, linears, norm) gives project_many(norm(x), linears); where the kernel serves the rows
    the norm runs inside its one call (no XLA reduction left in the program), elsewhere norm(x) comes first."""
    from flax import nnx

    from jaxserve.models.layers import RMSNorm, linear, project_many

    rngs = nnx.Rngs(0)
    linears = [linear(64, n, ("embed", "heads"), bias=False, dtype=dtype, matmul=CPU_PLAN, rngs=rngs) for n in (64, 16)]
    norm = RMSNorm(64, 1e-6, dtype)
    norm.weight[...] = jnp.asarray(np.random.default_rng(7).uniform(0.5, 1.5, 64), dtype)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((rows, 64)), dtype)
    got = nnx.jit(lambda x: project_many(x, linears, norm))(x)
    expected = nnx.jit(lambda x: project_many(norm(x), linears))(x)
    for a, b in zip(got, expected):
        tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tolerance, atol=tolerance)
    hlo = jax.jit(lambda x: project_many(x, linears, norm)).lower(x).compile().as_text() or ""
    served = rows <= KERNEL_ROWS[str(jnp.dtype(dtype))]
    assert hlo.count(f'custom_call_target="{cpu.NORMED_TARGET}"') == (1 if served else 0)
    assert (cpu.MATMUL_TARGET in hlo) == served  # else the norm, then XLA's dots


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gated_activation_inside_the_call_is_the_models(dtype):
    """small_matmuls_gated(gate, up) by a one-element identity weight returns silu(gate) * up as the model's
    gated_activation computes and rounds it, one value a row: over gates from 1e-3 to 90 in magnitude, with the
    edges (exp's overflow and underflow, +-inf, NaN): float32 within 2 ulps, 16-bit values equal or one ulp apart
    where the float32 sat on a rounding boundary (the kernel's exp is not XLA's by construction; on the machine
    it was written on they agreed to the bit, session 51). A -0 comes out +0 (the product's sum starts at +0)."""
    from jaxserve.models.layers import gated_activation

    rng = np.random.default_rng(9)
    magnitudes = np.exp(rng.uniform(np.log(1e-3), np.log(90.0), 240)) * rng.choice([-1.0, 1.0], 240)
    edges = [-100.0, -88.8, -87.0, 88.8, 100.0, np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-30, -5.5, 30.0, -30.0, 1.0, -1.0]
    gate = jnp.asarray(np.concatenate([magnitudes, edges])[:, None], jnp.float32)
    up = jnp.asarray(rng.uniform(-2, 2, (gate.shape[0], 1)), jnp.float32)
    one = jnp.ones((1, 1), dtype)
    (got,) = jax.jit(lambda g, u, w: cpu.small_matmuls_gated(g, u, (w,)))(gate, up, one)
    expected = np.asarray(gated_activation(jax.nn.silu, gate.astype(dtype), up.astype(dtype)), np.float32) + 0.0
    got = np.asarray(got)
    assert np.array_equal(np.isnan(got), np.isnan(expected))
    finite = ~np.isnan(expected)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got[finite], expected[finite], rtol=2.5e-7, atol=1e-37)
    else:
        assert np.mean(got[finite] == expected[finite]) > 0.98
        one_ulp = 2.0**-7 if dtype == jnp.bfloat16 else 2.0**-10
        np.testing.assert_allclose(got[finite], expected[finite], rtol=one_ulp, atol=1e-37)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 37])
def test_a_gated_row_is_its_one_row_calls_and_the_product_numpys(dtype, width):
    """Rows of a many-row gated call are the bits of their one-row calls (a verify or batched row is a decode row;
    a width that is no multiple of the vector lanes goes through the same lanes from a padded tail), and the
    result is the product of the gated rows, as numpy computes it from them; gate and up must match, float32."""
    from jaxserve.models.layers import gated_activation

    rng = np.random.default_rng(10)
    gate = jnp.asarray(3 * rng.standard_normal((12, width)), jnp.float32)
    up = jnp.asarray(rng.standard_normal((12, width)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((width, 24)) / np.sqrt(width), dtype)
    call = jax.jit(lambda g, u, w: cpu.small_matmuls_gated(g, u, (w,))[0])
    many = np.asarray(call(gate, up, w))
    for r in (0, 5, 11):
        np.testing.assert_array_equal(np.asarray(call(gate[r : r + 1], up[r : r + 1], w))[0], many[r])
    _assert_is_product(many, gated_activation(jax.nn.silu, gate.astype(dtype), up.astype(dtype)), w, False)
    with pytest.raises(ValueError, match="gate and up"):
        cpu.small_matmuls_gated(gate, up[:, :-1], (w,))
    with pytest.raises(ValueError, match="gate and up"):
        cpu.small_matmuls_gated(gate.astype(jnp.bfloat16), up, (w,))


@pytest.mark.parametrize(
    "dtype,rows,activation",
    [(jnp.float32, 1, "silu"), (jnp.bfloat16, 9, "silu"), (jnp.float32, 3, "gelu_pytorch_tanh")],
)
def test_the_mlp_takes_its_activation_into_the_down_projections_call(dtype, rows, activation):
    """An MLP on the CPU plan runs gate and up in one call (the norm in it) and silu(gate) * up inside the down
    projection's call: no XLA op between the calls, the same values as the MLP on the reference plan's path
    (project_many, gated_activation, down_proj); an activation the kernel does not compute stays in XLA."""
    from flax import nnx

    from jaxserve.models.config import ModelConfig
    from jaxserve.models.layers import MLP, RMSNorm

    config = ModelConfig(
        model_type="llama",
        vocab_size=32,
        hidden_size=64,
        intermediate_size=96,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        hidden_act=activation,
    )
    mlp = MLP(config, dtype, CPU_PLAN, nnx.Rngs(0))
    norm = RMSNorm(64, 1e-6, dtype)
    norm.weight[...] = jnp.asarray(np.random.default_rng(11).uniform(0.5, 1.5, 64), dtype)
    x = jnp.asarray(np.random.default_rng(12).standard_normal((rows, 64)), dtype)
    got = nnx.jit(lambda x: mlp(x, norm))(x)
    mlp_xla = MLP(config, dtype, choose_matmul("tpu", 1), nnx.Rngs(0))  # the reference plan, same params
    expected = nnx.jit(lambda x: mlp_xla(norm(x)))(x)
    tolerance = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(expected, np.float32), rtol=tolerance, atol=tolerance
    )
    hlo = jax.jit(lambda x: mlp(x, norm)).lower(x).compile().as_text() or ""
    fused = activation in cpu.GATED_ACTIVATIONS
    assert hlo.count(f'custom_call_target="{cpu.GATED_TARGET}"') == (1 if fused else 0)
    assert hlo.count(f'custom_call_target="{cpu.NORMED_TARGET}"') == 1
    if fused:
        assert "exponential" not in hlo  # silu's exp is the kernel's, no XLA fusion left between the calls
