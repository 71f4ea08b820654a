"""The Pallas (Triton) quantized matmul for decode rows on a GPU (pallas_kernels/matmul/quantized_gpu.py): in
interpret mode against the layout's numpy definition for every layout (int8 per channel and in groups, 4-bit
with offset 8 and with mins, float16 / bfloat16 / float32 scales), one row and several (padded for the matmul
units), K split or not; its real Triton lowering for CUDA; what it refuses; and the
plan that routes a GPU's quantized decode projections to it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul import QuantizedPallasMatmul, QuantizedReferenceMatmul, choose_matmul, quantized_gpu
from tests.kernels.test_quantized_matmul import numpy_dequantize, random_weight

LAYOUTS = {  # bits, group (0: per channel), scales' dtype, mins
    "int8_per_channel": (8, 0, jnp.float32, False),
    "q8_0": (8, 32, jnp.float16, False),
    "q4_0": (4, 32, jnp.float16, False),
    "int4_g64_bf16": (4, 64, jnp.bfloat16, False),
    "q4_1": (4, 32, jnp.float16, True),
}


def weight_of(layout: str, depth: int, columns: int, seed: int = 0):
    bits, group, scale_dtype, mins = LAYOUTS[layout]
    return random_weight(np.random.default_rng(seed), depth, columns, bits, group or depth, scale_dtype, mins)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("num_rows, num_splits", [(1, None), (1, 2), (5, 2), (16, None), (37, 4)])
def test_kernel_matches_the_layouts_definition(layout, num_rows, num_splits):
    depth, columns = 512, 96  # 96 columns: blocks of 32
    weight = weight_of(layout, depth, columns)
    rows = jnp.asarray(np.random.default_rng(1).standard_normal((num_rows, depth)), jnp.float32)
    if layout == "int8_per_channel" and num_splits:
        num_splits = 2  # two steps of 256 rows
    got = np.asarray(quantized_gpu.quantized_matmul(rows, weight, num_splits=num_splits))
    want = np.asarray(rows, np.float64) @ numpy_dequantize(weight)
    assert got.shape == (num_rows, columns)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize(
    "bits, depth, group, mins, num_splits, rows_dtype",
    [
        (8, 96, 96, False, None, jnp.float32),  # per channel, K = 3 blocks of 32
        (4, 448, 32, False, 2, jnp.float32),  # Q4_0, 7 groups a split (steps not a power of two)
        (4, 448, 32, True, 7, jnp.float32),  # Q4_1, one group a split
        (4, 32, 32, True, None, jnp.float32),  # Q4_1 with K = 32: one group, with mins (applied per group)
        (8, 64, 64, True, None, jnp.float32),  # int8 with mins, one group
        (4, 256, 32, True, None, jnp.float16),  # float16 rows
    ],
)
def test_odd_depths_one_group_with_mins_and_float16_rows(bits, depth, group, mins, num_splits, rows_dtype):
    weight = random_weight(np.random.default_rng(7), depth, 48, bits, group, jnp.float16, mins)
    rows = jnp.asarray(np.random.default_rng(8).standard_normal((3, depth)), rows_dtype)
    got = np.asarray(quantized_gpu.quantized_matmul(rows, weight, num_splits=num_splits))
    want = np.asarray(rows, np.float64) @ numpy_dequantize(weight)
    tolerance = 2e-5 if rows_dtype == jnp.float32 else 1e-4
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * np.abs(want).max())


def test_bfloat16_rows_as_the_reference_computes_them():
    """A bfloat16 model's rows: the same products as the XLA reference's group sums, to float32 rounding."""
    weight = weight_of("q4_0", 256, 64, seed=2)
    rows = jnp.asarray(np.random.default_rng(3).standard_normal((3, 256)), jnp.bfloat16)
    got = np.asarray(quantized_gpu.quantized_matmul(rows, weight))
    want = np.asarray(QuantizedReferenceMatmul()(rows, (weight,), transposed=False)[0])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("layout", ["int8_per_channel", "q4_0", "q4_1"])
@pytest.mark.parametrize("num_rows", [1, 8])
def test_kernel_lowers_with_triton_for_cuda(layout, num_rows):
    weight = weight_of(layout, 512, 128)
    rows = jnp.zeros((num_rows, 512), jnp.bfloat16)
    call = jax.jit(lambda rows, weight: quantized_gpu.quantized_matmul(rows, weight, num_splits=2, interpret=False))
    assert "triton" in call.trace(rows, weight).lower(lowering_platforms=("cuda",)).as_text()


def test_sizes_the_kernel_cannot_take_are_refused_and_left_to_the_reference():
    rows = jnp.ones((2, 96), jnp.float32)
    odd_columns = random_weight(np.random.default_rng(0), 96, 24, 8, 96, jnp.float32, False)
    odd_groups = random_weight(np.random.default_rng(0), 96, 32, 4, 48, jnp.float16, False)
    assert "N = 24" in quantized_gpu.supported(odd_columns, 2)
    assert "groups of 48" in quantized_gpu.supported(odd_groups, 2)
    assert "65 rows" in quantized_gpu.supported(weight_of("q4_0", 64, 32), 65)
    one_wide_group_with_mins = random_weight(np.random.default_rng(0), 512, 32, 4, 512, jnp.float16, True)
    assert "groups of 512" in quantized_gpu.supported(one_wide_group_with_mins, 2)
    with pytest.raises(ValueError, match="do not contract"):
        quantized_gpu.quantized_matmul(jnp.ones((2, 128), jnp.float32), weight_of("q4_0", 64, 32))
    with pytest.raises(ValueError, match="block_columns 64 does not divide N = 96"):
        quantized_gpu.quantized_matmul(rows, weight_of("q4_0", 96, 96), block_columns=64)
    with pytest.raises(ValueError, match="N = 24"):
        quantized_gpu.quantized_matmul(rows, odd_columns)
    for weight in (odd_columns, odd_groups):  # the plan's entry serves them through XLA's dots
        got = QuantizedPallasMatmul()(rows, (weight,), transposed=False)[0]
        np.testing.assert_allclose(got, np.asarray(rows, np.float64) @ numpy_dequantize(weight), rtol=1e-5)


def test_one_gpus_plan_sends_quantized_decode_rows_to_the_kernel():
    entries = choose_matmul("gpu", 1).entries
    assert isinstance(entries[0], QuantizedPallasMatmul)
    weight = weight_of("q4_0", 64, 32)
    assert entries[0].serves(64, (weight,)) and not entries[0].serves(65, (weight,))
    assert not entries[0].serves(1, (jnp.ones((64, 32)),))  # float weights: the float entries
    int8 = weight_of("int8_per_channel", 64, 32)
    # measured: one row of int8 is faster by XLA's dot; 4-bit at any rows and int8 from two rows by the kernel
    assert not quantized_gpu.preferred(int8, 1) and quantized_gpu.preferred(int8, 2)
    assert quantized_gpu.preferred(weight, 1) and not quantized_gpu.preferred(weight, 65)
    assert not any(isinstance(entry, QuantizedPallasMatmul) for entry in choose_matmul("gpu", 2).entries)
    assert not any(isinstance(entry, QuantizedPallasMatmul) for entry in choose_matmul("cpu", 1).entries)


def test_default_splits_fill_the_cores_and_divide_the_steps():
    assert quantized_gpu.default_num_splits(column_blocks=32, steps=16, cores=132) == 8
    assert quantized_gpu.default_num_splits(column_blocks=7, steps=28, cores=132) == 28
    assert quantized_gpu.default_num_splits(column_blocks=1000, steps=16, cores=132) == 1
    assert quantized_gpu.default_num_splits(column_blocks=32, steps=7, cores=132) == 7
    assert quantized_gpu.default_num_splits(column_blocks=32, steps=16, cores=0) == 1


@pytest.mark.parametrize("layout", ["int8_per_channel", "q4_1"])
def test_knobs_change_the_schedule_not_the_sums(layout):
    """Other column blocks, splits and programs a core: the same products as the layout's definition."""
    weight = weight_of(layout, 1024, 128, seed=5)
    rows = jnp.asarray(np.random.default_rng(6).standard_normal((1, 1024)), jnp.float32)
    want = np.asarray(rows, np.float64) @ numpy_dequantize(weight)
    for options in (dict(block_columns=32, programs_per_core=16), dict(block_columns=64, num_splits=2)):
        got = np.asarray(quantized_gpu.quantized_matmul(rows, weight, **options))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
