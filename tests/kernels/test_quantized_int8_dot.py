"""The CPU quantized matmul's int8-activation kernel (cpu_quantized_int8_dot.cc, the default), against a numpy
model of its arithmetic written here from llama.cpp's definition (x quantized per 32 k within each weight
group: d = max|x| / 127 in float32, q = round(x / d) ties away from zero as C's roundf; exact integer dot
per chunk; float(sum) * d16 * scale (+ s16 * min) summed over chunks, where d16 and s16 = d * sum(q_x) are
rounded to float16 as ggml's q8_0 / q8_1 blocks store them), on every instruction path this
CPU runs; and against the dequantized float product within the bound the activations' rounding allows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_library
from pallas_kernels.matmul import choose_matmul, quantized_cpu
from pallas_kernels.matmul.quantized import QuantizedWeight
from tests.kernels.row_invariance import assert_rows_as_alone
from tests.kernels.test_quantized_matmul import LAYOUTS, numpy_dequantize, random_weight, row_invariance_weights

FLOAT32_EPS = float(np.finfo(np.float32).eps)


def round_away(v: np.ndarray) -> np.ndarray:
    """C's roundf: to the nearest integer, halves away from zero (numpy's round takes halves to even)."""
    whole = np.trunc(v)
    return whole + np.where(np.abs(v - whole) >= 0.5, np.sign(v), 0)


def chunks(depth: int, group: int):
    """(group index, k0, k1) of each activation chunk: 32 k at a time within each group."""
    for g0 in range(0, depth, group):
        for k0 in range(g0, g0 + group, 32):
            yield g0 // group, k0, min(k0 + 32, g0 + group)


def quantize_rows(x: np.ndarray, k0: int, k1: int):
    """ggml's quantize_row_q8_0_ref on x[:, k0:k1], float32 throughout: (q int64 [M, k1 - k0], d float32 [M])."""
    part = np.asarray(x, np.float32)[:, k0:k1]
    d = (np.max(np.abs(part), axis=1) / np.float32(127)).astype(np.float32)
    inverse = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    return round_away((part * inverse[:, None]).astype(np.float32)).astype(np.int64), d


def as_half_blocks(q: np.ndarray, d: np.ndarray):
    """(d, s = d * sum(q)) as ggml's q8_0 / q8_1 blocks store them, in float16, for the products."""
    s = (d * q.sum(axis=1).astype(np.float32)).astype(np.float32)
    return d.astype(np.float16).astype(np.float64), s.astype(np.float16).astype(np.float64)


def signed_integers(weight: QuantizedWeight) -> np.ndarray:
    """The integers q [K, N] of w = q * scale (+ min): 4-bit without mins less its offset 8."""
    values = np.asarray(weight.values)
    if weight.bits == 8:
        return values.astype(np.int64)
    q = np.empty((2 * values.shape[0], values.shape[1]), np.int64)
    q[0::2], q[1::2] = values & 0xF, values >> 4
    return q if weight.mins is not None else q - 8


def int8_activation_model(x: np.ndarray, weight: QuantizedWeight):
    """The kernel's arithmetic in float64 from exact integer sums: (result [M, N], the sum of its terms' sizes
    [M, N], the number of chunks): the kernel's float32 rounds each term a few times and adds them up."""
    q = signed_integers(weight)
    depth = q.shape[0]
    group = depth // weight.scales.shape[0]
    scales = np.asarray(weight.scales, np.float64)
    mins = None if weight.mins is None else np.asarray(weight.mins, np.float64)
    result = np.zeros((x.shape[0], q.shape[1]))
    size = np.zeros_like(result)
    count = 0
    for g, k0, k1 in chunks(depth, group):
        xq, d = quantize_rows(x, k0, k1)
        d, s = as_half_blocks(xq, d)
        term = (xq @ q[k0:k1]) * d[:, None] * scales[g]
        result += term
        size += np.abs(term)
        if mins is not None:
            min_term = s[:, None] * mins[g]
            result += min_term
            size += np.abs(min_term)
        count += 1
    return result, size, count


def assert_matches_model(got, x, weight):
    expected, size, count = int8_activation_model(x, weight)
    # float32 rounding: a few roundings per term (d * scale, the product, the min's) and one per chunk added
    bound = (count + 6) * FLOAT32_EPS * size + 1e-30
    error = np.abs(np.asarray(got, np.float64) - expected)
    assert np.all(error <= bound), f"max error / bound {np.max(error / bound):.2f}"


def rounding_bound(x: np.ndarray, weight: QuantizedWeight) -> np.ndarray:
    """How far the int8-activation product may lie from the dequantized float one: each x differs from
    d * round(x / d) by at most d / 2 = max|x of its chunk| / 254, and from d16 * round(x / d) by at most
    2^-11 d * 127 more (d16: d rounded to float16; s16 likewise), times |w| summed over the chunk."""
    dense = np.abs(numpy_dequantize(weight))
    bound = np.zeros((x.shape[0], dense.shape[1]))
    for _, k0, k1 in chunks(dense.shape[0], dense.shape[0] // weight.scales.shape[0]):
        amax = np.max(np.abs(x[:, k0:k1].astype(np.float64)), axis=1)
        bound += (amax / 254 * (1 + 2 * 254 * 2.0**-11))[:, None] * dense[k0:k1].sum(axis=0)[None, :]
    return bound


@pytest.mark.parametrize("depth,columns,bits,group,scale_dtype,with_mins", LAYOUTS)
def test_int8_dot_matches_the_integer_model_and_stays_within_the_rounding_bound(
    depth, columns, bits, group, scale_dtype, with_mins
):
    rng = np.random.default_rng(depth + columns)
    weight = random_weight(rng, depth, columns, bits, group, scale_dtype, with_mins)
    kernel = jax.jit(quantized_cpu.quantized_matmul)
    for num_rows in (1, 9):  # one walk of 1 row; a walk of 8 rows, then one of 1
        x = rng.standard_normal((num_rows, depth)).astype(np.float32)
        got = np.asarray(kernel(jnp.asarray(x), weight))
        assert got.dtype == np.float32 and got.shape == (num_rows, columns)
        assert_matches_model(got, x, weight)
        dense = x.astype(np.float64) @ numpy_dequantize(weight)
        assert np.all(np.abs(got - dense) <= rounding_bound(x, weight) * (1 + 1e-5) + 1e-5)


def test_every_path_computes_the_integer_sums_exactly():
    """Scales of 1 and chunks whose largest |x| is 127 (d = 1): the result is the integer product itself, on each
    path; halves round away from zero (0.5 -> 1, -2.5 -> -3, as roundf; numpy's round gives 0 and -2)."""
    rng = np.random.default_rng(11)
    depth = 70  # per-channel int8: chunks of 32, 32 and 6 (4 by the vector steps, 2 one by one)
    x = rng.integers(-120, 121, (5, depth)).astype(np.float32) + rng.choice([0.0, 0.5, -0.5], (5, depth))
    x[:, [0, 32, 64]] = 127.0  # each chunk's extreme
    x[0, 1:4] = [0.5, 1.5, -2.5]
    q8 = rng.integers(-128, 128, (depth, 131)).astype(np.int8)
    int8 = QuantizedWeight(jnp.asarray(q8), jnp.ones((1, 131), jnp.float32), None, bits=8, group_size=depth)
    nibbles = rng.integers(0, 256, (32, 67)).astype(np.uint8)
    int4 = QuantizedWeight(jnp.asarray(nibbles), jnp.ones((2, 67), jnp.float32), None, bits=4, group_size=32)
    x = np.tile(x, (14, 1))  # 70 rows: a 64-row block, then 6 (a prefill chunk's rows in one call)
    x4 = x[:, :64].copy()
    x_ints = round_away(x).astype(np.int64)
    assert x_ints[0, 1:4].tolist() == [1, 2, -3]
    for path in cpu_library.runnable_paths():
        call = jax.jit(lambda x, ws, path=path: quantized_cpu.quantized_matmuls(x, ws, path=path))
        (got8,) = call(jnp.asarray(x), (int8,))
        np.testing.assert_array_equal(np.asarray(got8), (x_ints @ q8.astype(np.int64)).astype(np.float32))
        (got4,) = call(jnp.asarray(x4), (int4,))
        np.testing.assert_array_equal(np.asarray(got4), (x_ints[:, :64] @ signed_integers(int4)).astype(np.float32))


def test_a_row_that_is_not_finite_leaves_the_others_alone():
    """inf and NaN in one row's chunks (a chunk's values past whole vectors too: depth 70): no crash on any path, and
    every other row of the call is the bits of its call alone."""
    rng = np.random.default_rng(12)
    depth = 70
    weights = (random_weight(rng, depth, 67, 8, depth, jnp.float32, False),)
    x = rng.standard_normal((4, depth)).astype(np.float32)
    x[1, [0, 5, 40, 69]] = [np.inf, np.nan, -np.inf, np.nan]
    for path in cpu_library.runnable_paths():
        call = jax.jit(lambda x, ws, path=path: quantized_cpu.quantized_matmuls(x, ws, path=path))
        (together,) = call(jnp.asarray(x), weights)
        for row in (0, 2, 3):
            (alone,) = call(jnp.asarray(x[row : row + 1]), weights)
            np.testing.assert_array_equal(np.asarray(together)[row], np.asarray(alone)[0])


def test_one_int8_call_serves_mixed_weights_on_every_instruction_path():
    """A layer's weights joined in one call (int8 and 4-bit, with and without mins, groups of 16 to K, scale
    widths mixed), at 1, 2, 5 and 20 rows, on each path this CPU runs (AVX-512 VNNI or maddubs, AVX2 maddubs,
    portable), against the integer model."""
    rng = np.random.default_rng(7)
    depth = 96
    weights = (
        random_weight(rng, depth, 83, 8, 32, jnp.float16, False),  # Q8_0, N not a multiple of a tile
        random_weight(rng, depth, 64, 4, 32, jnp.float16, True),  # Q4_1 / Q4_K
        random_weight(rng, depth, 30, 8, 16, jnp.float32, True),  # Q5_K / Q6_K-like: chunks of 16
        random_weight(rng, depth, 150, 4, 96, jnp.bfloat16, False),  # one group of three chunks
        random_weight(rng, depth, 17, 8, 96, jnp.float32, False),  # int8 per channel
    )
    for path in cpu_library.runnable_paths():
        call = jax.jit(lambda x, ws, path=path: quantized_cpu.quantized_matmuls(x, ws, path=path))
        for num_rows in (1, 2, 5, 20):  # 1 and 2 rows: whole chunks' sums in registers
            x = rng.standard_normal((num_rows, depth)).astype(np.float32)
            x[0, :32] = 0.0  # a chunk of zeros: d = 0, its sums 0
            for got, weight in zip(call(jnp.asarray(x), weights), weights, strict=True):
                assert_matches_model(np.asarray(got), x, weight)


def test_decode_calls_are_cut_per_call_and_repeat_bit_for_bit():
    """A call of up to 64 rows is planned as a whole: its weights' bytes in order, cut into one contiguous run per
    worker, so that a weight is split along K only where a run ends inside it (here inside the first weight of
    the small call, and inside a column block of the head-wide weight, 3 blocks at one row, 18 at eight), and
    each piece prefetches the start of the next. Against the integer model on every path; the same call again
    gives the same bits (the cut depends on the shapes and the workers, never on timing or the rows)."""
    rng = np.random.default_rng(12)
    depth = 256
    small = (
        random_weight(rng, depth, 200, 4, 32, jnp.float16, False),
        random_weight(rng, depth, 64, 4, 32, jnp.float16, True),
        random_weight(rng, depth, 64, 8, 32, jnp.float16, False),
    )
    head = random_weight(rng, depth, 9000, 8, 32, jnp.float16, False)
    for path in cpu_library.runnable_paths():
        call = jax.jit(lambda x, ws, path=path: quantized_cpu.quantized_matmuls(x, ws, path=path))
        for num_rows in (1, 2, 8):
            x = rng.standard_normal((num_rows, depth)).astype(np.float32)
            for weights in (small, (*small, head)):
                first = [np.asarray(got) for got in call(jnp.asarray(x), weights)]
                for got, weight in zip(first, weights, strict=True):
                    assert_matches_model(got, x, weight)
                for _ in range(3):
                    for again, got in zip(call(jnp.asarray(x), weights), first, strict=True):
                        np.testing.assert_array_equal(np.asarray(again), got)


def test_a_row_sums_alike_in_calls_of_any_decode_or_verify_size():
    """Speculation's greedy identity rests on it (tests/kernels/row_invariance.py): a verify step computes k + 1
    rows of a sequence (up to 64 rows over a batch) where a decode step computed one, and with int8 activations
    a 1e-6 difference in the order K is summed flips near-ties (session 15: the default model's Q4_1 file, 3 of
    4 outputs changed with ngram speculation). So a call of up to 64 rows is cut along K where a one-row call
    is, whatever the rows (cpu_call_plan.h's SplitColumns): rows 0 and M // 2 of an M-row call are the bits of
    the one-row call, on every path, with the cut inside a small weight and inside the head-wide one. (Main
    before session 16: 618 of 9000 columns differed at 2 rows.)"""
    rng = np.random.default_rng(15)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    for path in cpu_library.runnable_paths():
        call = jax.jit(lambda x, ws, path=path: quantized_cpu.quantized_matmuls(x, ws, path=path))
        for weights in row_invariance_weights(rng):
            assert_rows_as_alone(
                lambda rows, ws=weights, call=call: call(jnp.asarray(x[rows]), ws), f"{path}, {len(weights)}"
            )


@pytest.mark.parametrize("compute_dtype", [jnp.bfloat16, jnp.float16])
def test_int8_dot_takes_16_bit_rows(compute_dtype):
    rng = np.random.default_rng(1)
    weight = random_weight(rng, 64, 90, 4, 32, jnp.float16, True, compute_dtype=str(jnp.dtype(compute_dtype)))
    x = jnp.asarray(rng.standard_normal((4, 64)), compute_dtype)
    got = jax.jit(quantized_cpu.quantized_matmul)(x, weight)
    assert_matches_model(np.asarray(got), np.asarray(x, np.float32), weight)


def test_the_activations_option_picks_the_plans_kernel():
    weight = random_weight(np.random.default_rng(2), 64, 40, 8, 32, jnp.float16, False)
    rows = jnp.ones((1, 64), jnp.float32)

    def target_in_hlo(plan) -> str:
        text = jax.jit(lambda x, w: plan(x, w)).lower(rows, weight).as_text()
        assert quantized_cpu.QUANTIZED_TARGET in text
        return "float" if quantized_cpu.target(None, "float") in text else "int8"

    assert target_in_hlo(choose_matmul("cpu", 1)) == "int8"  # the default
    assert target_in_hlo(choose_matmul("cpu", 1, "int8")) == "int8"
    assert target_in_hlo(choose_matmul("cpu", 1, "float")) == "float"
    for platform in ("cpu", "gpu"):  # refused wherever the plan is chosen, naming the option
        with pytest.raises(ValueError, match="quantized_activations"):
            choose_matmul(platform, 1, "fp8")
    with pytest.raises(ValueError, match="quantized_activations"):
        quantized_cpu.quantized_matmul(rows, weight, activations="fp8")


@pytest.mark.parametrize(
    "depth,columns,bits,group,scale_dtype,with_mins",
    [
        (96, 200, 8, 32, jnp.float16, False),  # Q8_0
        (64, 90, 4, 32, jnp.float16, False),  # Q4_0
        (128, 70, 4, 64, jnp.bfloat16, True),  # 4-bit with mins, groups of 64
        (256, 33, 8, 128, jnp.float32, True),  # groups of 128 (four chunks), N under a tile
        (70, 150, 8, 70, jnp.float32, False),  # int8 per channel: chunks 32, 32, 6
    ],
)
def test_prefill_rows_past_64_match_the_integer_model(depth, columns, bits, group, scale_dtype, with_mins):
    """A prefill chunk's rows in one call (blocks of 64 rows, x quantized once): 65 (a block and one row), 130
    and 200 (a last block of 2 and of 8 rows), on every path this CPU runs."""
    rng = np.random.default_rng(depth + 3 * columns)
    weight = random_weight(rng, depth, columns, bits, group, scale_dtype, with_mins)
    for path in cpu_library.runnable_paths():
        kernel = jax.jit(lambda x, w, path=path: quantized_cpu.quantized_matmul(x, w, path=path))
        for num_rows in (65, 130, 200):
            x = rng.standard_normal((num_rows, depth)).astype(np.float32)
            x[num_rows - 1, :] = 0.0  # a row of zeros in the last block: d = 0
            got = np.asarray(kernel(jnp.asarray(x), weight))
            assert got.shape == (num_rows, columns)
            assert_matches_model(got, x, weight)


def test_prefill_rows_are_computed_as_their_64_row_blocks_alone():
    """Where neither call splits K among the threads (4096 columns: enough items for up to 32 threads), each row
    of a 192-row call equals, bit for bit, the same row in a prefill call of fewer of its 64-row blocks (65 and
    128 rows): the greedy tokens of a prefill do not depend on how many rows its chunk had. 16-bit rows too
    (widened per row). (64 rows or fewer are decode and verify calls, cut along K as one row is: a one-row
    call splits this weight's K between two workers, so their rows may differ from a prefill's in the last
    bits.)"""
    rng = np.random.default_rng(5)
    weight = random_weight(rng, 96, 4096, 4, 32, jnp.float16, True)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(rng.standard_normal((192, 96)), dtype)
        whole = np.asarray(jax.jit(quantized_cpu.quantized_matmul)(x, weight))
        for r0, r1 in ((0, 65), (64, 192)):
            block = np.asarray(jax.jit(quantized_cpu.quantized_matmul)(x[r0:r1], weight))
            np.testing.assert_array_equal(whole[r0:r1], block)


def test_the_int8_plan_sends_prefill_chunks_to_the_kernel_and_the_float_plan_does_not():
    weight = random_weight(np.random.default_rng(4), 64, 40, 4, 32, jnp.float16, False)

    def kernel_in_hlo(plan, num_rows: int) -> bool:
        rows = jnp.ones((num_rows, 64), jnp.float32)
        return quantized_cpu.QUANTIZED_TARGET in jax.jit(lambda x, w: plan(x, w)).lower(rows, weight).as_text()

    int8_plan, float_plan = choose_matmul("cpu", 1, "int8"), choose_matmul("cpu", 1, "float")
    # both take any rows, 64 a call (row_blocks.py: a prefill chunk's row is the bits a decode row's is)
    assert kernel_in_hlo(int8_plan, 512) and kernel_in_hlo(int8_plan, quantized_cpu.PREFILL_MAX_ROWS + 1)
    assert kernel_in_hlo(float_plan, 64) and kernel_in_hlo(float_plan, 65)
    with pytest.raises(ValueError, match="at most 64 rows"):
        quantized_cpu.quantized_matmul(jnp.ones((65, 64), jnp.float32), weight, activations="float")
