"""The CPU small matmul's instruction paths (issue #29): each path this CPU runs is built on its own (its
flags part of the build's cache key), says which path it was compiled for, and matches numpy in float32,
bfloat16 and float16, plain and transposed, at odd shapes and every row count up to the kernel's limit
(the few-row walk, the register tiles, their remainders). JAXSERVE_CPU_KERNEL_PATH forces a path; an
unknown one, or one this CPU cannot run, is refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_library
from pallas_kernels.matmul import _bfloat16_max_rows, cpu

# (rows, depth, columns): K and N not multiples of any vector width; 1-8 rows take the few-row walk
# (AVX-512) and more the register tiles with their remainders; 4100 columns span two wide blocks. One or two
# rows of a transposed weight read it as several streams (a tail of K under a vector).
SHAPES = [(1, 96, 4100), (1, 37, 50), (2, 45, 33), (3, 17, 70), (4, 19, 40), (7, 40, 391), (9, 33, 777)]
SHAPES += [(13, 24, 70), (64, 65, 130)]
# 3-8 rows: register tiles over blocks of 32 weight rows (K past one block, odd: a bfloat16 pair with a
# zero), remainder columns (a partial group of 32 for bfloat16 pairs), and transposed weights read as
# several streams with rows left over.
SHAPES += [(5, 70, 100), (6, 33, 47), (8, 67, 130)]
# 7-8 rows on avx2: two groups of rows over each strip (and over each block of the head's streams), strips
# of one vector and single columns left over ([K, N]); rows of the head left over from the streams.
SHAPES += [(8, 70, 60), (7, 45, 29)]
# bfloat16 on AVX-512 BF16 above 8 rows ([K, N]) or 4 rows ([N, K]): pairs along K (an odd K pads a zero),
# 1-4 vectors of rows against a transposed weight, the last one part padding.
SHAPES += [(20, 37, 99), (40, 31, 200)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _expected(x, w, transposed):
    wide_w = np.asarray(w, np.float64)
    return np.asarray(x, np.float64) @ (wide_w.T if transposed else wide_w)


@pytest.mark.parametrize("path", cpu_library.runnable_paths())
def test_each_path_matches_numpy(path):
    assert cpu.kernel_path(path) == path  # the library reports the path its compiler flags selected
    rng = np.random.default_rng(0)
    for dtype in DTYPES:
        for transposed in (False, True):
            for rows, depth, columns in SHAPES:
                x = jnp.asarray(rng.standard_normal((rows, depth)), dtype)
                # several weights in one call, of different widths (a layer's q, k and v)
                shapes = [(c, depth) if transposed else (depth, c) for c in (columns, 24)]
                weights = [jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes]
                got = cpu.small_matmuls(x, weights, transposed=transposed, path=path)
                for result, w in zip(got, weights):
                    expected = _expected(x, w, transposed)
                    assert result.dtype == jnp.float32 and result.shape == expected.shape
                    np.testing.assert_allclose(
                        np.asarray(result), expected, rtol=1e-5, atol=1e-4 * np.sqrt(depth), err_msg=f"{path} {dtype}"
                    )


def test_paths_are_separate_builds_with_their_own_flags():
    paths = cpu_library.runnable_paths()
    assert paths[-1] == "portable"
    flags = {path: tuple(cpu_library.compile_flags(path)) for path in paths}
    assert len(set(flags.values())) == len(paths)
    if "avx2" in paths:
        assert "-mno-avx512f" in flags["avx2"]
    libraries = {path: cpu_library.load(path) for path in paths}
    assert all(library is not None for library in libraries.values())
    names = {path: library._name for path, library in libraries.items()}  # type: ignore[union-attr]
    assert len(set(names.values())) == len(paths)
    for path, name in names.items():
        assert f"cpu_kernels_{path}_" in name


def test_the_environment_forces_a_path_and_bad_ones_are_refused(monkeypatch):
    monkeypatch.setenv(cpu_library.PATH_ENV, " Portable ")
    assert cpu_library.chosen_path() == "portable"
    monkeypatch.setenv(cpu_library.PATH_ENV, "native")
    assert cpu_library.chosen_path() == cpu_library.native_path()
    monkeypatch.setenv(cpu_library.PATH_ENV, "avx1024")
    with pytest.raises(ValueError, match=f"{cpu_library.PATH_ENV}='avx1024'"):
        cpu_library.chosen_path()
    monkeypatch.delenv(cpu_library.PATH_ENV)
    assert cpu_library.chosen_path() == cpu_library.native_path()
    # an AVX2-only CPU: avx512 would fault, so it is refused; avx2 and portable run
    monkeypatch.setattr(cpu_library, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma", "f16c", "sse2"}))
    if cpu_library._is_x86():
        assert cpu_library.native_path() == "avx2" and cpu_library.runnable_paths() == ("avx2", "portable")
        with pytest.raises(ValueError, match="runs only avx2, portable"):
            cpu_library.chosen_path("avx512")


def test_bfloat16_rows_go_to_the_kernel_unless_xla_has_amx(monkeypatch):
    avx512_bf16 = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
    monkeypatch.setattr(cpu_library, "cpu_flags", lambda: avx512_bf16 | {"amx_bf16", "amx_tile"})
    monkeypatch.delenv(cpu_library.PATH_ENV, raising=False)
    if cpu_library._is_x86():
        assert _bfloat16_max_rows() == 8  # XLA's YNNPACK dots use AMX tiles
        monkeypatch.setenv(cpu_library.PATH_ENV, "avx2")  # as an AVX2-only machine routes
        assert _bfloat16_max_rows() == cpu.MATMUL_MAX_ROWS
    monkeypatch.delenv(cpu_library.PATH_ENV, raising=False)
    for flags in (avx512_bf16, avx512_bf16 - {"avx512_bf16"}):  # the kernel's vdpbf16ps tiles, or no XLA bf16
        monkeypatch.setattr(cpu_library, "cpu_flags", lambda flags=flags: flags)
        assert _bfloat16_max_rows() == cpu.MATMUL_MAX_ROWS


def test_largest_decode_bucket_in_bfloat16_matches_numpy_under_jit():
    """64 rows of bfloat16 (the kernel's limit) through a jitted call, as a decode step makes it."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((cpu.MATMUL_MAX_ROWS, 576)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((576, 192)), jnp.bfloat16)
    got = jax.jit(lambda x, w: cpu.small_matmul(x, w))(x, w)
    np.testing.assert_allclose(np.asarray(got), _expected(x, w, False), rtol=1e-5, atol=1e-4 * 24)
