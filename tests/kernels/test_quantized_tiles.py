"""Quantized weights in the int8-dot kernel's tiles (pallas_kernels/matmul/quantized_tiles.py,
cpu_int8_dot_tiles.h): the layout round-trips bit for bit, the kernel computes a tiled weight's rows as the same
bits as its [K, N] form at every row count and on every instruction path, XLA's reference and the embedding
lookup read tiles, and weights without a tiled form are refused by name; GGUF Q5_0 / Q5_1 in 5-bit tiles and Q4_K /
Q5_K / Q6_K in tiles with two-level scales, within float32 rounding of the integer models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as gguf_quantize

from jaxserve.loading.quantize_gguf import from_gguf_kquant_blocks
from pallas_kernels import cpu_library
from pallas_kernels.matmul import REFERENCE_PLAN, choose_matmul, kquant, quantized, quantized_cpu, quantized_tiles
from pallas_kernels.matmul.kquant import KQuantWeight
from pallas_kernels.matmul.quantized import QuantizedWeight
from tests.kernels.test_kquant_matmul import int8_activation_model as kquant_int8_model
from tests.kernels.test_quantized_int8_dot import FLOAT32_EPS, assert_matches_model
from tests.kernels.test_quantized_matmul import random_weight
from tests.support.gguf_files import random_blocks

# (depth, columns, bits, group (0: per channel), scale dtype, mins): Q8_0, Q4_0, Q4_1, int8 per channel, int4 in
# groups of 64 and 128, 4-bit with bfloat16 scales and mins
TILEABLE = [
    (96, 128, 8, 32, jnp.float16, False),
    (64, 192, 4, 32, jnp.float16, False),
    (96, 64, 4, 32, jnp.float16, True),
    (96, 64, 8, 0, jnp.float32, False),
    (256, 128, 4, 64, jnp.bfloat16, False),
    (256, 64, 4, 128, jnp.float32, True),
    (128, 128, 4, 32, jnp.bfloat16, True),
]


def tileable_weights(rng, depth: int) -> tuple:
    """One weight of each TILEABLE layout, all of `depth` rows."""
    return tuple(
        random_weight(rng, depth, columns, bits, group or depth, dtype, mins)
        for _, columns, bits, group, dtype, mins in TILEABLE
    )


def assert_same_weight(got, want: QuantizedWeight):
    assert isinstance(got, QuantizedWeight)
    for leaf in ("values", "scales", "mins"):
        a, b = getattr(got, leaf), getattr(want, leaf)
        assert (a is None) == (b is None), leaf
        if a is not None:
            assert a.shape == b.shape and a.dtype == b.dtype, leaf
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=leaf)
    assert (got.bits, got.group_size, got.compute_dtype) == (want.bits, want.group_size, want.compute_dtype)


@pytest.mark.parametrize("depth,columns,bits,group,scale_dtype,with_mins", TILEABLE)
def test_tiles_give_the_weight_back_bit_for_bit(depth, columns, bits, group, scale_dtype, with_mins):
    rng = np.random.default_rng(depth + columns + bits)
    weight = random_weight(rng, depth, columns, bits, group or depth, scale_dtype, with_mins)
    tiled = quantized_tiles.to_tiles(weight)
    assert tiled.shape == weight.shape and tiled.dtype == weight.dtype and tiled.nbytes == weight.nbytes
    assert tiled.values.shape == (columns // 64, depth // 32, 64 * 32 * bits // 8)
    assert_same_weight(quantized.untiled(tiled), weight)
    # the same from numpy arrays (a host-side weight) and under jit (XLA's reference untiles while traced)
    host = jax.tree.map(np.asarray, weight)
    host_tiled = quantized_tiles.to_tiles(host)
    assert isinstance(host_tiled.values, np.ndarray)
    np.testing.assert_array_equal(host_tiled.values, np.asarray(tiled.values))
    assert_same_weight(jax.jit(quantized.untiled)(tiled), weight)
    # byte order: k 4q + b of column c is byte 256 q + 4 c + b of its chunk (8-bit); 4-bit: k 8p + b low nibble
    if bits == 8:
        assert int(tiled.values[0, 0, 256 * 2 + 4 * 5 + 3]) == int(weight.values[4 * 2 + 3, 5])
    else:
        q = np.asarray(quantized.integers(weight)) + (0 if with_mins else 8)
        tile = columns // 64 - 1  # (the last tile, chunk 1)
        byte = int(tiled.values[tile, 1, 256 * 3 + 4 * 7 + 2])
        column = 64 * tile + 7
        assert (byte & 15, byte >> 4) == (q[32 + 8 * 3 + 2, column], q[32 + 8 * 3 + 4 + 2, column])


def test_the_kernel_computes_tiled_weights_as_the_same_bits_at_every_row_count():
    """One call joining tiled weights of every layout with a [K, N] one that has no tiled form (N not a multiple
    of 64), at decode, verify and prefill row counts (the x86 walk takes rows four at a time and the rest as one
    block of 1-3; past 64: row blocks), on each instruction path this CPU runs: the same bits as the all-[K, N]
    call."""
    rng = np.random.default_rng(3)
    depth = 256
    weights = (*tileable_weights(rng, depth), random_weight(rng, depth, 83, 8, 32, jnp.float16, False))
    tiled = tuple(quantized_tiles.to_tiles(w) if quantized_tiles.can_tile(w) else w for w in weights)
    assert sum(quantized_tiles.is_tiled(w) for w in tiled) == len(TILEABLE)
    for path in cpu_library.runnable_paths():
        call = jax.jit(lambda x, ws, path=path: quantized_cpu.quantized_matmuls(x, ws, path=path))
        for num_rows in (1, 2, 3, 4, 5, 7, 9, 33, 64, 70):
            x = rng.standard_normal((num_rows, depth)).astype(np.float32)
            x[0, 32:64] = 0.0  # a chunk of zeros: d = 0
            want = call(jnp.asarray(x), weights)
            got = call(jnp.asarray(x), tiled)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{path}, {num_rows} rows")


def test_the_plan_serves_tiles_with_the_int8_kernel_and_the_reference_untiles_them():
    rng = np.random.default_rng(5)
    weight = random_weight(rng, 128, 128, 4, 32, jnp.float16, True)
    tiled = quantized_tiles.to_tiles(weight)
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
    int8_plan = choose_matmul("cpu", 1, "int8")
    assert int8_plan.tiles_quantized and not choose_matmul("cpu", 1, "float").tiles_quantized
    assert not choose_matmul("cpu", 2, "int8").tiles_quantized  # a sharded weight stays [K, N]
    np.testing.assert_array_equal(np.asarray(jax.jit(int8_plan)(x, tiled)), np.asarray(jax.jit(int8_plan)(x, weight)))
    np.testing.assert_array_equal(
        np.asarray(jax.jit(REFERENCE_PLAN)(x, tiled)), np.asarray(jax.jit(REFERENCE_PLAN)(x, weight))
    )
    # the float-activation kernel reads [K, N] only: a tiled weight is not its
    assert not quantized_cpu.serves_weight(tiled, "float") and quantized_cpu.serves_weight(weight, "float")
    with pytest.raises(ValueError, match="does not serve"):
        quantized_cpu.quantized_matmuls(x, (tiled,), activations="float")


@pytest.mark.parametrize("bits,with_mins", [(8, False), (4, False), (4, True)])
def test_a_tiled_tied_embedding_looks_up_the_rows_of_its_columns(bits, with_mins):
    rng = np.random.default_rng(bits)
    head = random_weight(rng, 64, 320, bits, 32, jnp.float16, with_mins)  # [E, V], the tied head
    tiled = quantized_tiles.to_tiles(head)
    ids = jnp.asarray([0, 63, 64, 319, 200, 200, 320], jnp.int32)  # (320: past V, NaN as jnp.take gives)
    want = quantized.take_columns(head, ids)
    np.testing.assert_array_equal(np.asarray(tiled.embedding_rows(ids)), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(jax.jit(tiled.embedding_rows)(ids)), np.asarray(want))
    np.testing.assert_array_equal(
        np.asarray(quantized.dequantize(tiled, jnp.float32)), np.asarray(quantized.dequantize(head, jnp.float32))
    )


def test_weights_without_a_tiled_form_are_refused_by_name():
    rng = np.random.default_rng(9)
    for weight in (
        random_weight(rng, 64, 83, 8, 32, jnp.float16, False),  # N not a multiple of 64
        random_weight(rng, 64, 64, 8, 16, jnp.float32, True),  # groups of 16: half chunks
        random_weight(rng, 70, 64, 8, 70, jnp.float32, False),  # per channel, K not whole chunks
    ):
        assert not quantized_tiles.can_tile(weight)
        with pytest.raises(ValueError, match="no tiled form"):
            quantized_tiles.to_tiles(weight)


def kquant_weight(rng, depth: int, columns: int, qtype) -> KQuantWeight:
    """A placed KQuantWeight [depth, columns]: gguf's Q5_0 / Q5_1 blocks of random values, or random K-quant blocks."""
    if qtype in (T.Q5_0, T.Q5_1):
        raw = gguf_quantize(rng.standard_normal((columns, depth)).astype(np.float32), qtype)
    else:
        raw = random_blocks((columns, depth), qtype, rng)
    return jax.tree.map(jnp.asarray, from_gguf_kquant_blocks(raw, qtype, "float32"))


def as_int8(weight: KQuantWeight) -> QuantizedWeight:
    """A Q5_0 / Q5_1 weight as the int8 QuantizedWeight of the same integers, scales (d) and mins (Q5_1's m): what
    the kernel's integer model (test_quantized_int8_dot.py) takes."""
    q = jnp.asarray(np.asarray(kquant.integers(weight)).astype(np.int8))
    mins = kquant.group_mins(weight)  # (subtracted)
    return QuantizedWeight(q, kquant.group_scales(weight), None if mins is None else -mins, bits=8, group_size=32)


# (kind, depth, columns, tiled bits, offset of the stored values): K-quants need K in whole 256-k super-blocks
KQUANT_TILES = [(T.Q5_0, 96, 192, 5, 16), (T.Q5_1, 96, 192, 5, 0), (T.Q4_K, 256, 192, 4, 0), (T.Q5_K, 256, 128, 5, 0)]
KQUANT_TILES += [(T.Q6_K, 256, 128, 6, 32)]


@pytest.mark.parametrize("qtype,depth,columns,bits,offset", KQUANT_TILES)
def test_kquants_tile_at_their_bytes_and_come_back_bit_for_bit(qtype, depth, columns, bits, offset):
    rng = np.random.default_rng(int(qtype))
    weight = kquant_weight(rng, depth, columns, qtype)
    tiled = quantized_tiles.to_tiles(weight)
    assert tiled.bits == bits and tiled.values.shape == (columns // 64, depth // 32, 64 * 32 * bits // 8)
    assert tiled.shape == weight.shape and tiled.nbytes == weight.nbytes
    assert (tiled.mins is None) == (qtype in (T.Q5_0, T.Q6_K))
    assert (tiled.super_scales is None) == (qtype in (T.Q5_0, T.Q5_1))
    for back in (quantized.untiled(tiled), jax.jit(quantized.untiled)(tiled)):
        assert isinstance(back, KQuantWeight) and back.kind == weight.kind
        for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(weight), strict=True):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    host_tiled = quantized_tiles.to_tiles(jax.tree.map(np.asarray, weight))
    np.testing.assert_array_equal(host_tiled.values, np.asarray(tiled.values))
    # byte order: the 4-bit block of the low nibbles, then (5-bit) bit 4 of k 8 p + 4 h + b of column c at bit
    # 2 p + h of byte 1024 + 4 c + b; (6-bit) its bits 4-5 at bits 2 (s % 4) of byte 1024 + 256 (s / 4) + 4 c + b,
    # s = 2 p + h
    q = np.asarray(kquant.integers(weight)) + offset
    chunk = np.asarray(tiled.values[-1, 1])  # the last tile's columns, k 32..
    for p, h, b, c in ((0, 0, 0, 0), (3, 1, 3, 63), (1, 0, 2, 7), (2, 1, 1, 40)):
        nibble = chunk[256 * p + 4 * c + b] >> (4 * h) & 15
        if bits == 5:
            nibble |= (chunk[1024 + 4 * c + b] >> (2 * p + h) & 1) << 4
        if bits == 6:
            s = 2 * p + h
            nibble |= (chunk[1024 + 256 * (s // 4) + 4 * c + b] >> (2 * (s % 4)) & 3) << 4
        assert nibble == q[32 + 8 * p + 4 * h + b, columns - 64 + c]
    # XLA's reference, the embedding lookup and dequantize read the tiles as the planes
    x = jnp.asarray(rng.standard_normal((3, depth)), jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(REFERENCE_PLAN)(x, tiled)), np.asarray(jax.jit(REFERENCE_PLAN)(x, weight))
    )
    ids = jnp.asarray([0, 63, 64, columns - 1, 100, columns], jnp.int32)  # (past N: NaN, as jnp.take gives)
    want = quantized.take_columns(weight, ids)
    np.testing.assert_array_equal(np.asarray(jax.jit(tiled.embedding_rows)(ids)), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(quantized.dequantize(tiled)), np.asarray(quantized.dequantize(weight)))


def test_the_kernel_computes_kquant_tiles_as_the_integer_model_on_every_path():
    """Q5_0, Q5_1, Q4_K, Q5_K and Q6_K tiles joined with a Q8_0 one in one call (a Q4_K_M layer's q, k and v): within
    float32 rounding of exact integer sums per chunk (the integer models of the int8 kernel, x's d and s in float16
    as ggml's q8_0 / q8_1, and of the K-quant kernel, d in float32), at decode, verify and prefill row
    counts, on each instruction path this CPU runs; up to 64 rows each row the same bits as that row alone (a
    row's result does not depend on the call's rows, whatever block of rows the walk takes it in)."""
    rng = np.random.default_rng(7)
    depth = 512
    weights = tuple(
        kquant_weight(rng, depth, columns, qtype)
        for qtype, columns in ((T.Q5_0, 192), (T.Q5_1, 64), (T.Q4_K, 128), (T.Q5_K, 64), (T.Q6_K, 128))
    )
    q8 = random_weight(rng, depth, 128, 8, 32, jnp.float16, False)
    tiled = (*(quantized_tiles.to_tiles(w) for w in weights), quantized_tiles.to_tiles(q8))
    for path in cpu_library.runnable_paths():
        call = jax.jit(lambda x, ws, path=path: quantized_cpu.quantized_matmuls(x, ws, path=path))
        for num_rows in (1, 2, 3, 5, 9, 64, 70):
            x = rng.standard_normal((num_rows, depth)).astype(np.float32)
            x[0, 32:64] = 0.0  # a chunk of zeros: d = 0
            got = call(jnp.asarray(x), tiled)
            for result, weight in zip(got[:-1], weights, strict=True):
                if weight.kind in quantized_tiles.TWO_LEVEL_KINDS:  # d in float32 (the K-quant kernel's model)
                    model, size, count = kquant_int8_model(x, weight)
                    error = np.abs(np.asarray(result, np.float64) - model)
                    assert np.all(error <= (count + 6) * FLOAT32_EPS * size + 1e-30), (path, weight.kind, num_rows)
                else:  # q8_0 / q8_1's float16 d and s, as ggml's Q5_0 / Q5_1 dots
                    assert_matches_model(result, x, as_int8(weight))
            assert_matches_model(got[-1], x, q8)
            if num_rows <= 64:  # (prefill row blocks may add K's parts in another order)
                for row in sorted({0, num_rows // 2, num_rows - 1}):
                    alone = call(jnp.asarray(x[row : row + 1]), tiled)
                    for g, a in zip(got, alone, strict=True):
                        np.testing.assert_array_equal(np.asarray(g)[row], np.asarray(a)[0], err_msg=f"{path} {row}")


def test_5_and_6_bit_tiles_sum_the_largest_products_exactly():
    """Every value the largest (31; Q6_K 63) and every x 127 (d = 1): a chunk's products reach 7874 (16002) per int16
    pair, which four pairs of nibbles summed in int16 would overflow (the avx2 path widens every two pairs; 6-bit
    every pair): the exact integer sum, each path."""
    depth = 256
    low, high = np.full((depth // 2, 64), 0xFF, np.uint8), np.full((depth // 8, 64), 0xFF, np.uint8)
    ones = jnp.ones((depth // 32, 64), jnp.float16)
    x = jnp.full((3, depth), 127.0, jnp.float32)
    weights = [KQuantWeight(jnp.asarray(low), jnp.asarray(high), None, None, ones, None, kind="q5_0")]
    weights.append(
        KQuantWeight(jnp.asarray(low), jnp.asarray(high), None, None, ones, jnp.zeros_like(ones), kind="q5_1")
    )
    top = jnp.asarray(np.full((depth // 4, 64), 0xFF, np.uint8))
    sc = jnp.ones((depth // 16, 64), jnp.int8)
    weights.append(KQuantWeight(jnp.asarray(low), top, sc, None, jnp.ones((1, 64), jnp.float16), None, kind="q6_k"))
    for weight, value in zip(weights, (31 - 16, 31, 63 - 32), strict=True):
        tiled = quantized_tiles.to_tiles(weight)
        for path in cpu_library.runnable_paths():
            got = np.asarray(quantized_cpu.quantized_matmuls(x, (tiled,), path=path)[0])
            np.testing.assert_array_equal(got, np.full((3, 64), value * 127.0 * depth), err_msg=f"{weight.kind} {path}")


def test_odd_widths_and_stacked_experts_have_no_kquant_tiles():
    rng = np.random.default_rng(13)
    q6_k = kquant_weight(rng, 256, 64, T.Q6_K)
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), q6_k)  # [2, K, N]: experts keep their planes
    for weight in (kquant_weight(rng, 64, 96, T.Q5_0), kquant_weight(rng, 256, 32, T.Q6_K), stacked):
        assert not quantized_tiles.can_tile(weight)
        with pytest.raises(ValueError, match="no tiled form"):
            quantized_tiles.to_tiles(weight)
