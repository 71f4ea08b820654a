"""Quantized weights (pallas_kernels/matmul/quantized.py): the XLA reference and the C++ CPU float-activation
kernel (engine option quantized_activations: float; the int8-activation one: test_quantized_int8_dot.py) against a
numpy dequantize-then-dot written here from the layout's definition, for every layout (int8 per channel and
in groups, 4-bit with offset 8 or with mins, float16 / bfloat16 / float32 scales) at odd sizes; the host
quantizers' rounding; and GGUF's block types re-expressed exactly (against the gguf package's own
dequantizers)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from jaxserve.loading.quantize import quantize_int4, quantize_int8
from jaxserve.loading.quantize_gguf import from_gguf_blocks
from pallas_kernels.matmul import REFERENCE_PLAN, choose_matmul, quantized, quantized_cpu
from pallas_kernels.matmul.quantized import QuantizedWeight
from tests.kernels.row_invariance import assert_rows_as_alone
from tests.support.gguf_files import random_blocks


def numpy_dequantize(weight: QuantizedWeight) -> np.ndarray:
    """float64 [K, N] from the stored arrays, by the layout's definition."""
    values = np.asarray(weight.values)
    if weight.bits == 8:
        q = values.astype(np.float64)
    else:
        q = np.empty((2 * values.shape[0], values.shape[1]))
        q[0::2], q[1::2] = values & 0xF, values >> 4
        if weight.mins is None:
            q -= 8
    depth = q.shape[0]
    group = depth // weight.scales.shape[0]
    scales = np.repeat(np.asarray(weight.scales, np.float64), group, axis=0)
    w = q * scales
    if weight.mins is not None:
        w += np.repeat(np.asarray(weight.mins, np.float64), group, axis=0)
    return w


def random_weight(rng, depth, columns, bits, group, scale_dtype, with_mins, compute_dtype="float32"):
    groups = depth // group
    if bits == 8:
        values = rng.integers(-128, 128, (depth, columns)).astype(np.int8)
    else:
        values = rng.integers(0, 256, (depth // 2, columns)).astype(np.uint8)
    scales = jnp.asarray(rng.uniform(0.001, 0.02, (groups, columns)), scale_dtype)
    mins = jnp.asarray(rng.uniform(-0.1, 0.1, (groups, columns)), scale_dtype) if with_mins else None
    return QuantizedWeight(jnp.asarray(values), scales, mins, bits=bits, group_size=group, compute_dtype=compute_dtype)


def row_invariance_weights(rng, depth: int = 256):
    """Weights of every layout the kernels take, at odd widths, in one call, and a head-wide one whose 3 column
    blocks the call's cut lands inside (a one-row call of two workers: mid-K of its middle block)."""
    small = (
        random_weight(rng, depth, 200, 4, 32, jnp.float16, False),  # Q4_0
        random_weight(rng, depth, 64, 4, 32, jnp.float16, True),  # Q4_1
        random_weight(rng, depth, 64, 8, 32, jnp.float16, False),  # Q8_0
        random_weight(rng, depth, 83, 8, 32, jnp.float16, False),  # N not a multiple of a tile
        random_weight(rng, depth, 30, 8, 16, jnp.float32, True),  # chunks of 16
        random_weight(rng, depth, 150, 4, 128, jnp.bfloat16, False),  # one group of four chunks
        random_weight(rng, depth, 17, 8, depth, jnp.float32, False),  # int8 per channel
    )
    return small, (*small, random_weight(rng, depth, 9000, 4, 32, jnp.float16, False))


# (K, N, bits, group, scale dtype, mins): int8 per channel at odd K and N, GGUF Q8_0 / Q6_K-like groups,
# 4-bit with offset 8 (Q4_0) and with mins (Q4_1, Q4_K), groups of 64 / 128 over more than one column block
LAYOUTS = [
    (17, 13, 8, 17, jnp.float32, False),
    (96, 1100, 8, 32, jnp.float16, False),
    (48, 70, 8, 16, jnp.float32, False),
    (64, 33, 8, 32, jnp.float32, True),
    (96, 45, 4, 32, jnp.float16, False),
    (64, 523, 4, 32, jnp.float16, True),
    (256, 77, 4, 64, jnp.bfloat16, False),
    (256, 600, 4, 128, jnp.float32, True),
]


@pytest.mark.parametrize("depth,columns,bits,group,scale_dtype,with_mins", LAYOUTS)
def test_quantized_matmuls_match_numpy(depth, columns, bits, group, scale_dtype, with_mins):
    rng = np.random.default_rng(depth * columns)
    weight = random_weight(rng, depth, columns, bits, group, scale_dtype, with_mins)
    expected_weight = numpy_dequantize(weight)
    np.testing.assert_allclose(np.asarray(quantized.dequantize(weight)), expected_weight, rtol=1e-6, atol=1e-7)
    assert weight.shape == (depth, columns) and weight.dtype == jnp.float32
    kernel = jax.jit(lambda x, w: quantized_cpu.quantized_matmul(x, w, activations="float"))
    reference = jax.jit(quantized.matmul)
    # the reference: 3 rows (the decode path: group sums, scaled) and 40 (dequantize, then one dot); the
    # kernel: 1 row, and 9 (a pass over the weights for 8 rows, then one for the last)
    tolerance = dict(rtol=1e-5, atol=1e-5 * np.sqrt(depth))
    for num_rows, function in ((3, reference), (40, reference), (1, kernel), (9, kernel)):
        x = rng.standard_normal((num_rows, depth)).astype(np.float32)
        got = function(jnp.asarray(x), weight)
        assert got.dtype == jnp.float32 and got.shape == (num_rows, columns)
        np.testing.assert_allclose(np.asarray(got), x.astype(np.float64) @ expected_weight, **tolerance)


@pytest.mark.parametrize("compute_dtype", [jnp.bfloat16, jnp.float16])
def test_quantized_matmuls_take_16_bit_rows(compute_dtype):
    rng = np.random.default_rng(1)
    weight = random_weight(rng, 64, 90, 4, 32, jnp.float16, True, compute_dtype=str(jnp.dtype(compute_dtype)))
    x = jnp.asarray(rng.standard_normal((4, 64)), compute_dtype)
    expected = np.asarray(x, np.float64) @ numpy_dequantize(weight)
    # the plan with the float-activation kernel: the int8 one rounds x (test_quantized_int8_dot.py)
    for plan in (REFERENCE_PLAN, choose_matmul("cpu", 1, quantized_activations="float")):
        got = jax.jit(lambda x, w, plan=plan: plan(x, w))(x, weight)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-3, atol=1e-3)


def test_the_cpu_plan_sends_decode_rows_to_the_kernel():
    weight = random_weight(np.random.default_rng(2), 64, 40, 8, 64, jnp.float32, False)
    plan = choose_matmul("cpu", 1)

    def hlo(num_rows):
        rows = jnp.ones((num_rows, 64), jnp.float32)
        return jax.jit(lambda x, w: plan(x, w)).lower(rows, weight).as_text()

    # any rows, 64 a call: a prefill chunk's row is the bits a decode row's is (row_blocks.py)
    for num_rows in (1, 64, 65, 200):
        assert hlo(num_rows).count(f"@{quantized_cpu.QUANTIZED_TARGET}(") == -(-num_rows // 64)
    assert (
        quantized_cpu.QUANTIZED_TARGET
        not in jax.jit(lambda x, w: REFERENCE_PLAN(x, w)).lower(jnp.ones((1, 64)), weight).as_text()
    )


def test_host_quantizers_round_to_the_nearest_level():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((96, 37)).astype(np.float32)
    int8 = quantize_int8(w, "float32")
    assert int8.values.dtype == np.int8 and int8.scales.shape == (1, 37) and int8.group_size == 96
    assert np.max(np.abs(numpy_dequantize(int8) - w) / np.asarray(int8.scales)) <= 0.5 + 1e-4
    assert np.all(np.max(np.abs(np.asarray(int8.values)), axis=0) == 127)  # each column's extreme uses the range
    int4 = quantize_int4(w, 32, "float32")
    assert int4.values.shape == (48, 37) and int4.scales.shape == (3, 37) and int4.scales.dtype == np.float16
    steps = np.repeat(np.abs(np.asarray(int4.scales, np.float32)), 32, axis=0)
    # Q4_0's levels run -8..7 steps: the side opposite the extreme clips at 7, a step at most from it
    assert np.max(np.abs(numpy_dequantize(int4) - w) / steps) <= 1.0 + 1e-2
    # as llama.cpp's Q4_0 of the same values (float16 d, offset 8, the extreme at -8)
    blocks = gguf_quantize(np.ascontiguousarray(w.T), T.Q4_0)
    np.testing.assert_allclose(numpy_dequantize(int4), gguf_dequantize(blocks, T.Q4_0).T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K])
def test_gguf_blocks_keep_their_values(qtype):
    """A GGUF matrix [N rows, K] re-expressed as the [K, N] layout holds exactly the gguf package's values."""
    rng = np.random.default_rng(4)
    columns, depth = 7, 512
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        raw = random_blocks((columns, depth), qtype, rng)
    else:
        raw = gguf_quantize(rng.standard_normal((columns, depth)).astype(np.float32), qtype)
    weight = from_gguf_blocks(raw, qtype, "float32")
    assert weight.shape == (depth, columns)
    expected = gguf_dequantize(raw, qtype).T
    np.testing.assert_allclose(numpy_dequantize(weight), expected, rtol=1e-6, atol=1e-7)
    stored = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(weight))
    assert stored <= 2.2 * raw.nbytes  # Q8_0 / Q4_0 / Q4_1: the file's bytes; K-quants: see docs/notes
    if qtype in (T.Q8_0, T.Q4_0, T.Q4_1):
        assert stored == raw.nbytes


def test_one_call_serves_mixed_weights_on_every_instruction_path():
    """A layer's weights joined in one call (int8 and 4-bit, with and without mins, groups of 16 to K, scale
    widths mixed as a GGUF file mixes block types), at 1, 5 and 20 rows (walks of 8 rows and the rest), on
    each path this CPU runs (AVX-512, AVX2, the portable vector types), against numpy."""
    from pallas_kernels import cpu_library

    rng = np.random.default_rng(7)
    depth = 96
    weights = (
        random_weight(rng, depth, 83, 8, 32, jnp.float16, False),  # Q8_0, N not a multiple of a vector
        random_weight(rng, depth, 64, 4, 32, jnp.float16, True),  # Q4_1 / Q4_K
        random_weight(rng, depth, 30, 8, 16, jnp.float32, True),  # Q5_K / Q6_K-like
        random_weight(rng, depth, 150, 4, 96, jnp.bfloat16, False),  # one group: Q4_0-like, a wide group
        random_weight(rng, depth, 17, 8, 96, jnp.float32, False),  # int8 per channel
    )
    expected = [numpy_dequantize(weight) for weight in weights]
    for path in cpu_library.runnable_paths():
        call = jax.jit(lambda x, ws, path=path: quantized_cpu.quantized_matmuls(x, ws, path=path, activations="float"))
        for num_rows in (1, 5, 20):
            x = rng.standard_normal((num_rows, depth)).astype(np.float32)
            for got, dense in zip(call(jnp.asarray(x), weights), expected, strict=True):
                np.testing.assert_allclose(np.asarray(got), x.astype(np.float64) @ dense, rtol=1e-5, atol=1e-4)


def test_a_row_computes_alike_in_calls_of_any_decode_or_verify_size():
    """tests/kernels/row_invariance.py's rule for the float-activation kernel (quantized_activations: float): a
    weight's parts of K are a one-row call's whatever the rows (a head-wide weight: 3 column blocks at one row,
    too few for two workers, so K in two parts; 7-18 blocks at 3-64 rows, where main kept K whole), so rows 0
    and M // 2 of an M-row call are the bits of the one-row call, on every path."""
    from pallas_kernels import cpu_library

    rng = np.random.default_rng(16)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    for path in cpu_library.runnable_paths():
        call = jax.jit(lambda x, ws, path=path: quantized_cpu.quantized_matmuls(x, ws, path=path, activations="float"))
        for weights in row_invariance_weights(rng):
            assert_rows_as_alone(
                lambda rows, ws=weights, call=call: call(jnp.asarray(x[rows]), ws), f"{path}, {len(weights)}"
            )


def test_the_plan_joins_a_layers_quantized_weights_in_one_call():
    weights = [random_weight(np.random.default_rng(3), 64, n, 8, 32, jnp.float16, False) for n in (40, 24, 24)]
    plan = choose_matmul("cpu", 1)
    text = jax.jit(lambda x, ws: plan.together(x, ws)).lower(jnp.ones((2, 64)), weights).as_text()
    assert text.count(quantized_cpu.QUANTIZED_TARGET) == 1


def test_quantized_weights_move_into_huge_pages_unchanged():
    """A quantized param's values, scales and mins go into the huge-page arena as float weights do (a decode
    step streams them), aliased by XLA without a copy, with the same products."""
    import sys

    from flax import nnx

    from jaxserve.device.huge_pages import ALIGNMENT, move_weights_to_huge_pages

    class Holder(nnx.Module):
        def __init__(self, weight):
            self.kernel = nnx.Param(weight)

    weight = random_weight(np.random.default_rng(4), 1024, 3000, 8, 32, jnp.float16, True)  # 3 MiB of int8
    holder = Holder(weight)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 1024)), jnp.float32)
    before = np.asarray(quantized_cpu.quantized_matmul(x, weight))
    moved = move_weights_to_huge_pages(holder)
    if not sys.platform.startswith("linux"):
        return
    placed = holder.kernel.get_value()
    leaves = jax.tree.leaves(placed)
    assert quantized.is_quantized(placed) and len(leaves) == 3
    assert moved == sum(-(-leaf.nbytes // ALIGNMENT) * ALIGNMENT for leaf in leaves)
    assert all(new is not old for new, old in zip(leaves, jax.tree.leaves(weight), strict=True))
    for new, old in zip(leaves, jax.tree.leaves(weight), strict=True):
        np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
    np.testing.assert_array_equal(np.asarray(quantized_cpu.quantized_matmul(x, placed)), before)
