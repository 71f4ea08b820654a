"""The CPU small matmul's rows do not depend on the call's other rows (issue 26's invariant: greedy outputs are
identical with speculative decoding on and off). A verify step runs k + 1 rows of a sequence (S * (k + 1) over a
batch, up to 64) through every projection where a decode step ran one; a 1e-6 difference in the order a row's K
terms are summed, amplified by bfloat16 rounding or int8 activations, flips greedy near-ties. So every row of a
call of M <= 64 rows is the same bits as the 1-row call of that row: the cuts of K and the order of each output's
sums depend on the shapes, the dtype and the workers, never on M (cpu_matmul.cc, "Row invariance")."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_library
from pallas_kernels.matmul import cpu

ROW_COUNTS = (2, 3, 5, 8, 9, 16, 40, 64, 100, 256)
DEPTH = 301  # not a multiple of any vector width, odd (a bfloat16 pair with a zero)
WIDTHS = (200, 64, 9000)  # several weights in one call (q, k, v); 9000: several column blocks


def _rows_checked(num_rows: int) -> tuple[int, ...]:
    return (0, num_rows // 2, num_rows - 1)  # row 0, a middle row and the last (a remainder group's)


@pytest.mark.parametrize("path", cpu_library.runnable_paths())
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("variant", ["plain", "transposed", "normed"])
def test_a_row_is_the_same_bits_in_calls_of_any_decode_or_verify_size(path, dtype, variant):
    rng = np.random.default_rng(26)
    transposed = variant == "transposed"
    x = jnp.asarray(rng.standard_normal((max(ROW_COUNTS), DEPTH)) * 2.0, dtype)
    shapes = [(n, DEPTH) if transposed else (DEPTH, n) for n in WIDTHS]
    weights = [jnp.asarray(rng.standard_normal(shape) * 0.05, dtype) for shape in shapes]
    scale = jnp.asarray(1.0 + 0.1 * rng.standard_normal(DEPTH), dtype)

    def call(rows):
        if variant == "normed":
            return [np.asarray(out) for out in cpu.small_matmuls_normed(rows, scale, 1e-5, weights, path=path)]
        return [np.asarray(out) for out in cpu.small_matmuls(rows, weights, transposed=transposed, path=path)]

    # bfloat16 above 8 rows on AMX tiles adds in the tiles' order (cpu_matmul_amx.h): verify rows go 8 a call there
    row_counts = [n for n in ROW_COUNTS if n <= 8] if dtype == jnp.bfloat16 and cpu.amx_tiles(path) else ROW_COUNTS
    needed = sorted({row for num_rows in row_counts for row in _rows_checked(num_rows)})
    alone = {row: call(x[row : row + 1]) for row in needed}
    for num_rows in row_counts:
        together = call(x[:num_rows])
        for row in _rows_checked(num_rows):
            for width, got, want in zip(WIDTHS, together, alone[row], strict=True):
                np.testing.assert_array_equal(
                    got[row],
                    want[0],
                    err_msg=f"{path} {jnp.dtype(dtype)} {variant}: row {row} of {num_rows}, N {width}",
                )


def _run_native_rows_check(tmp_path, flags: list[str]) -> str:
    """native/small_matmul_rows.cc built with `flags` and run: its output (the mismatches, if any)."""
    import os
    import shutil
    import subprocess

    import jax

    compiler = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    assert compiler is not None, "no C++ compiler: the kernels themselves need one"
    here = os.path.dirname(__file__)
    binary = str(tmp_path / "small_matmul_rows")
    source = os.path.join(here, "native", "small_matmul_rows.cc")
    includes = ["-I", cpu_library.HERE, "-I", jax.ffi.include_dir()]
    command = [compiler, "-O3", *flags, "-fopenmp-simd", "-std=c++17", "-fno-math-errno", "-fno-trapping-math"]
    subprocess.run([*command, *includes, source, "-o", binary], check=True, capture_output=True)
    result = subprocess.run([binary], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
    return result.stdout


@pytest.mark.skipif("avx512_bf16" not in cpu_library.cpu_flags(), reason="no AVX-512 BF16 on this CPU")
def test_the_bfloat16_pairs_build_too(tmp_path):
    """The vdpbf16ps tiles (cpu_matmul_bf16_pairs.h) are the avx512 path's bfloat16 code on AVX-512 BF16 CPUs
    without AMX only; built here with JAXSERVE_BF16_PAIRS_WITH_AMX wherever the CPU has the instruction, through
    native/small_matmul_rows.cc (the same check: rows 0, M / 2 and M - 1 of 2-256 rows against 1-row calls)."""
    output = _run_native_rows_check(tmp_path, [*cpu_library.compile_flags("avx512"), "-DJAXSERVE_BF16_PAIRS_WITH_AMX"])
    assert output.startswith("pairs: 1"), output


@pytest.mark.parametrize("sweep", [0, 1])
def test_the_one_row_sweep_build_and_the_tiles_alike(tmp_path, sweep):
    """The float32 one-row walk is a sweep of whole weight rows on AMD CPUs and register tiles elsewhere
    (JAXSERVE_ONE_ROW_SWEEP, cpu_matmul_few_rows.h): both builds, on any CPU, give every row of 2-256-row calls the
    bits of its 1-row call."""
    flags = [f for f in cpu_library.compile_flags(cpu_library.native_path()) if "ONE_ROW_SWEEP" not in f]
    output = _run_native_rows_check(tmp_path, [*flags, "-DROWS_FLOAT32", f"-DJAXSERVE_ONE_ROW_SWEEP={sweep}"])
    assert f"one-row sweep: {sweep}" in output.splitlines()[0], output
    assert "0 mismatching results" in output, output
