"""The quantized references with x rounded to int8 (pallas_kernels/matmul/int8_activations.py): rows past the
CPU kernels' 64-row limit (a prefill chunk) are computed as the int8-activation kernels compute decode rows,
for QuantizedWeight layouts (Q8_0, Q4_0, Q4_1-like, per-channel int8 at a K that is no multiple of 32, groups
of 16) and K-quants; and the rounding itself is ggml's quantize_row_q8_0 (tested against the numpy model the
int8 kernel's tests use)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from pallas_kernels.matmul import QuantizedReferenceMatmul, choose_matmul, int8_activations, kquant_cpu, quantized_cpu
from tests.kernels.test_kquant_matmul import _weight as kquant_weight
from tests.kernels.test_quantized_int8_dot import quantize_rows
from tests.kernels.test_quantized_matmul import random_weight

ROWS = 80  # past the kernels' 64: the plan sends these to the reference


def test_rows_round_as_ggmls_quantize_row_q8_0():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 80)).astype(np.float32)
    x[0, :32] = np.arange(32) - 15.5  # halves: rounded away from zero
    x[1, 32:64] = 0.0  # an all-zero chunk: d 0, q 0
    fake, chunk_sums = jax.jit(lambda x: int8_activations.fake_quantize(x, 80))(jnp.asarray(x))
    for k0, k1 in ((0, 32), (32, 64), (64, 80)):  # a per-channel group of 80: chunks 32, 32, 16
        q, d = quantize_rows(x, k0, k1)
        half_d = d.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(fake)[:, k0:k1], (q * half_d[:, None]).astype(np.float32))
    s = sum(
        (d * q.sum(axis=1).astype(np.float32)).astype(np.float16).astype(np.float64)
        for q, d in (quantize_rows(x, k0, k1) for k0, k1 in ((0, 32), (32, 64), (64, 80)))
    )
    np.testing.assert_allclose(np.asarray(chunk_sums)[:, 0], s, rtol=1e-6)


def _reference_entry(plan) -> QuantizedReferenceMatmul:
    return next(entry for entry in plan.entries if isinstance(entry, QuantizedReferenceMatmul))


def _in_kernel_sized_pieces(plan, x, weight):
    """The plan on x 40 rows at a time (the kernel's decode-sized calls)."""
    return np.concatenate([np.asarray(plan(x[i : i + 40], weight)) for i in range(0, x.shape[0], 40)])


# (K, N, bits, group, scale dtype, mins): Q8_0, Q4_0, Q4_1-like, per-channel int8 at K 80, int8 groups of 16
LAYOUTS = [
    (96, 70, 8, 32, jnp.float16, False),
    (64, 45, 4, 32, jnp.float16, False),
    (64, 33, 4, 32, jnp.float16, True),
    (80, 21, 8, 80, jnp.float32, False),
    (48, 30, 8, 16, jnp.float32, False),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_rows_compute_what_the_int8_kernel_computes(layout):
    assert quantized_cpu.available("int8"), "the CPU kernels build on this machine"
    depth, columns, bits, group, scale_dtype, with_mins = layout
    rng = np.random.default_rng(depth + columns)
    weight = random_weight(rng, depth, columns, bits, group, scale_dtype, with_mins)
    x = jnp.asarray(rng.standard_normal((ROWS, depth)), jnp.float32)
    plan = choose_matmul("cpu", 1, "int8")
    assert _reference_entry(plan).activations == "int8"
    assert _reference_entry(choose_matmul("cpu", 1, "float")).activations == "float"
    prefill = np.asarray(jax.jit(lambda x, w: plan(x, w))(x, weight))  # one 80-row call: the reference
    decode = _in_kernel_sized_pieces(jax.jit(lambda x, w: plan(x, w)), x, weight)  # the C++ kernel
    scale = np.abs(decode).max()
    np.testing.assert_allclose(prefill, decode, rtol=0, atol=2e-6 * scale)
    # the float product differs by the rounding of x: far more than the order of additions above
    float_plan = choose_matmul("cpu", 1, "float")
    assert np.abs(np.asarray(float_plan(x, weight)) - decode).max() > 100 * 2e-6 * scale


def test_prefill_rows_of_k_quants_compute_what_the_kernel_computes():
    weight, _ = kquant_weight(T.Q4_K, 40, 256, 7)
    plan = choose_matmul("cpu", 1, "int8")
    expected = "int8" if kquant_cpu.computes_int8() else "float"
    assert _reference_entry(plan).kquant_activations == expected
    x = jnp.asarray(np.random.default_rng(8).standard_normal((ROWS, 256)), jnp.float32)
    prefill = np.asarray(jax.jit(lambda x, w: plan(x, w))(x, weight))
    decode = _in_kernel_sized_pieces(jax.jit(lambda x, w: plan(x, w)), x, weight)
    np.testing.assert_allclose(prefill, decode, rtol=0, atol=2e-6 * np.abs(decode).max())


def test_an_unknown_activations_name_is_refused():
    weight = random_weight(np.random.default_rng(9), 64, 8, 8, 32, jnp.float32, False)
    with pytest.raises(ValueError, match="activations"):
        QuantizedReferenceMatmul("fp8")(jnp.ones((2, 64)), (weight,), transposed=False)
