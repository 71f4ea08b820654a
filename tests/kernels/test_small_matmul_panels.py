"""The CPU small matmul over [K, N] weights stored in column panels (panels.py, cpu_matmul_panels.h; issue 29):
numpy's products on every instruction path, dtype and row count (the one-row walk of G panels, the 2-8 row tiles
with their groups, the packed passes above 8 rows, a last panel cut short), each row the same bits as its one-row
call (issue 26's invariant, as the [K, N] walks keep it; bfloat16 above 8 rows on AMX tiles: alike among calls of
more than 8 rows), panels beside [K, N] weights in one call, and XLA's
reference over the panels as they lie."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_library
from pallas_kernels.matmul import cpu, panels, reference
from tests.kernels.row_invariance import assert_rows_as_alone

# (rows, depth, columns): N not a multiple of the panel (a last panel cut short) or of a one-row block (128 on
# avx512), K odd and past a tile's block of panel rows (64); 4100 columns: many blocks, cut by the runs.
SHAPES = [(1, 96, 4100), (1, 37, 50), (2, 45, 33), (3, 130, 70), (5, 70, 100), (7, 45, 29), (8, 67, 130)]
SHAPES += [(9, 33, 777), (13, 24, 70), (64, 65, 130), (256, 131, 61)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("path", cpu_library.runnable_paths())
def test_panels_match_numpy_on_each_path(path):
    rng = np.random.default_rng(29)
    for dtype in DTYPES:
        for rows, depth, columns in SHAPES:
            x = jnp.asarray(rng.standard_normal((rows, depth)), dtype)
            weights = [jnp.asarray(rng.standard_normal((depth, n)), dtype) for n in (columns, 24)]
            got = cpu.small_matmuls(x, [panels.to_panels(w) for w in weights], path=path)
            for result, w in zip(got, weights, strict=True):
                want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
                assert result.shape == want.shape and result.dtype == jnp.float32
                tolerance = 1e-4 if dtype == jnp.float32 else 2e-2
                np.testing.assert_allclose(
                    np.asarray(result),
                    want,
                    rtol=tolerance,
                    atol=tolerance * np.sqrt(depth),
                    err_msg=f"{path} {jnp.dtype(dtype)} {rows}x{depth}x{columns}",
                )


@pytest.mark.parametrize("path", cpu_library.runnable_paths())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("normed", [False, True])
def test_a_row_in_panels_is_the_same_bits_in_calls_of_any_size(path, dtype, normed):
    rng = np.random.default_rng(26)
    depth = 301
    x = jnp.asarray(rng.standard_normal((256, depth)) * 2.0, dtype)
    weights = [panels.to_panels(jnp.asarray(rng.standard_normal((depth, n)) * 0.05, dtype)) for n in (200, 61, 3000)]
    scale = jnp.asarray(1.0 + 0.1 * rng.standard_normal(depth), dtype)

    def call(indices):
        rows = x[np.asarray(indices)]
        if normed:
            return cpu.small_matmuls_normed(rows, scale, 1e-5, weights, path=path)
        return cpu.small_matmuls(rows, weights, path=path)

    row_counts = (2, 3, 5, 8, 9, 16, 64, 100, 256)
    if dtype == jnp.bfloat16 and cpu.amx_tiles(path):
        # above a walk's 8 rows AMX tiles add in their own order (cpu_matmul_amx.h): each row is then the same bits
        # in every call of more than 8 rows (a prefill chunk's row is a batched decode row's)
        row_counts = (2, 3, 5, 8)
        assert_rows_alike_above_walks(call, f"{path} bfloat16 panels on AMX tiles")
    assert_rows_as_alone(call, f"{path} {jnp.dtype(dtype)} panels", row_counts=row_counts)


def assert_rows_alike_above_walks(call, label: str) -> None:
    widest = [np.asarray(result) for result in call(np.arange(256))]
    for num_rows in (9, 16, 17, 33, 64, 100):
        for i, (got, want) in enumerate(zip(call(np.arange(num_rows)), widest, strict=True)):
            np.testing.assert_array_equal(np.asarray(got), want[:num_rows], err_msg=f"{label}: {num_rows} rows, {i}")


def test_panels_beside_plain_weights_in_one_call():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 40)), jnp.float32)
    plain = jnp.asarray(rng.standard_normal((40, 70)), jnp.float32)
    paneled = jnp.asarray(rng.standard_normal((40, 33)), jnp.float32)
    mixed = cpu.small_matmuls(x, [plain, panels.to_panels(paneled), plain])
    alone = cpu.small_matmuls(x, [plain]) + cpu.small_matmuls(x, [panels.to_panels(paneled)])
    np.testing.assert_array_equal(np.asarray(mixed[0]), np.asarray(alone[0]))
    np.testing.assert_array_equal(np.asarray(mixed[1]), np.asarray(alone[1]))
    np.testing.assert_array_equal(np.asarray(mixed[2]), np.asarray(alone[0]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_reference_contracts_panels_as_they_lie(dtype):
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((37, 50)), dtype)
    weight = panels.to_panels(w)
    assert weight.shape == (37, 50) and weight.dtype == dtype and weight.panels.shape == (4, 37, 16)
    np.testing.assert_array_equal(np.asarray(weight.matrix()), np.asarray(w))
    x = jnp.asarray(rng.standard_normal((3, 37)), dtype)
    np.testing.assert_allclose(
        np.asarray(reference.matmul(x, weight)), np.asarray(reference.matmul(x, w)), rtol=1e-5, atol=1e-5
    )


def test_the_reference_takes_no_rows():
    weight = panels.to_panels(jnp.ones((16, 20), jnp.float32))
    assert reference.matmul(jnp.ones((0, 16), jnp.float32), weight).shape == (0, 20)


def test_panels_are_refused_where_they_cannot_serve():
    x = jnp.ones((2, 16), jnp.float32)
    weight = panels.to_panels(jnp.ones((16, 20), jnp.float32))
    with pytest.raises(ValueError, match="cannot be contracted transposed"):
        cpu.small_matmuls(x, [weight], transposed=True)
    with pytest.raises(ValueError, match="cannot be contracted transposed"):
        reference.matmul(x, weight, transposed=True)
    with pytest.raises(TypeError, match="read whole"):
        weight[0]
    import jax

    # panels of another width than the kernel's reach it as a clear error, not as wrong numbers
    bad = panels.ColumnPanels(jnp.ones((5, 16, 4), jnp.float32), 20)
    with pytest.raises(Exception, match="panels must be"):
        jax.block_until_ready(cpu.small_matmuls(x, [bad]))
