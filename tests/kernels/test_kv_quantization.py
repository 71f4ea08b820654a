"""Quantized KV pages (int8 / float8_e4m3, a float32 scale per token-head): the quantizer's error bound, the
reference on quantized pages against float math on the pages they stand for and within a quantization
tolerance of the float pages, every attention implementation and KV writer against the reference (sinks,
windows and soft-caps included), the page movers' byte layout, and the real CUDA / TPU lowerings."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice, AbstractMesh

from pallas_kernels import ragged_paged_attention, write_kv_pages
from pallas_kernels.paged_attention import cpu, pallas_gpu, pallas_tpu, reference
from pallas_kernels.paged_attention.kv_quantization import (
    QuantizedPages,
    dequantize,
    from_page_bytes,
    page_bytes,
    quantize,
    storage_dtype,
)
from tests.kernels.steps import TOLERANCE, assert_matches_on_real_tokens, ragged_step

KV_DTYPES = ("int8", "float8_e4m3")
# |error| of an attention output over float pages, relative to the output's largest magnitude: int8 keeps
# about 8 bits per value, e4m3 about 4 (3 mantissa bits)
QUANTIZATION_TOLERANCE = {"int8": 0.02, "float8_e4m3": 0.12}


def quantized(pages, kv_dtype: str) -> QuantizedPages:
    return QuantizedPages(*quantize(pages, storage_dtype(kv_dtype)))


def quantized_step(seed, page_size, head_dim, groups, dtype, query_block, kv_dtype):
    """ragged_step's inputs with both pools quantized, and the float pools they came from."""
    q, k_pages, v_pages, *rest = ragged_step(
        np.random.default_rng(seed), page_size, head_dim, groups, dtype, query_block
    )
    return (q, quantized(k_pages, kv_dtype), quantized(v_pages, kv_dtype), *rest), (k_pages, v_pages)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_quantize_error_is_bounded_per_token_head(kv_dtype):
    x = (
        np.random.default_rng(0).standard_normal((40, 3, 32)).astype(np.float32)
        * np.array([1e-3, 1.0, 50.0])[None, :, None]
    )
    x[5, 1] = 0.0  # an all-zero row: scale 0, values 0
    values, scales = quantize(jnp.asarray(x), storage_dtype(kv_dtype))
    assert values.dtype == storage_dtype(kv_dtype) and scales.shape == (40, 3) and scales.dtype == jnp.float32
    absmax = np.abs(x).max(-1)
    largest = 127.0 if kv_dtype == "int8" else 448.0
    np.testing.assert_allclose(np.asarray(scales), absmax / largest, rtol=1e-6)
    error = np.abs(np.asarray(dequantize(values, scales)) - x)
    # int8: half a step; e4m3: half an ulp of 3 mantissa bits, relative (and subnormal steps near 0)
    bound = absmax[..., None] / 254 if kv_dtype == "int8" else np.abs(x) / 16 + absmax[..., None] * 2.0**-9 / 448
    assert np.all(error <= bound * 1.001 + 1e-12)
    assert np.all(np.asarray(dequantize(values, scales))[5, 1] == 0.0)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("query_block", [1, 8])
def test_reference_reads_quantized_pages_as_their_values(kv_dtype, query_block):
    """Exactly the float math on the dequantized pages, and within a quantization tolerance of the originals."""
    args, (k_float, v_float) = quantized_step(1, 8, 32, 2, jnp.float32, query_block, kv_dtype)
    q, k_pages, v_pages, *rest = args
    got = reference.ragged_paged_attention(*args, query_block=query_block)
    as_float = [dequantize(pages.data, pages.scales) for pages in (k_pages, v_pages)]
    exact = reference.ragged_paged_attention(q, *as_float, *rest, query_block=query_block)
    assert_matches_on_real_tokens(got, exact, args[5], 1e-5)
    original = reference.ragged_paged_attention(q, k_float, v_float, *rest, query_block=query_block)
    error = np.abs(np.asarray(got) - np.asarray(original)).max() / np.abs(np.asarray(original)).max()
    assert 0 < error <= QUANTIZATION_TOLERANCE[kv_dtype], f"{kv_dtype}: relative error {error}"


KERNELS = {
    "cpu": cpu.ragged_paged_attention,
    "pallas_gpu": pallas_gpu.ragged_paged_attention,  # interpret mode off a GPU
    "pallas_tpu": pallas_tpu.ragged_paged_attention,  # Pallas' TPU interpret mode off a TPU
}
# (page_size, head_dim, groups, dtype, query_block, options)
GRID = [
    (8, 32, 2, jnp.float32, 1, {}),
    (4, 16, 1, jnp.float32, 8, {"sliding_window": 6}),
    (8, 32, 4, jnp.bfloat16, 8, {"logits_soft_cap": 5.0}),
    (16, 16, 2, jnp.float16, 1, {"sliding_window": 5, "sinks": True}),
]


# The C++ kernel over the whole grid; the interpret-mode Pallas kernels (slow: Python per program, every TPU
# DMA emulated) over the grid's cases split between the formats
CASES = [("cpu", kv_dtype, *case) for kv_dtype in KV_DTYPES for case in GRID]
CASES += [("pallas_gpu", KV_DTYPES[index % 2], *case) for index, case in enumerate(GRID)]
CASES += [("pallas_gpu", KV_DTYPES[(index + 1) % 2], *case) for index, case in enumerate(GRID[2:])]
CASES += [("pallas_tpu", "int8", *GRID[3]), ("pallas_tpu", "float8_e4m3", *GRID[2])]


@pytest.mark.parametrize("kernel,kv_dtype,page_size,head_dim,groups,dtype,query_block,options", CASES)
def test_kernels_on_quantized_pages_match_reference(
    kernel, kv_dtype, page_size, head_dim, groups, dtype, query_block, options
):
    if kernel == "cpu" and not cpu.available():
        pytest.fail("the C++ CPU kernels could not be built")
    if kernel == "pallas_tpu" and dtype == jnp.float16:
        dtype = jnp.bfloat16  # Mosaic has no float16 matmuls
    args, _ = quantized_step(page_size + groups, page_size, head_dim, groups, dtype, query_block, kv_dtype)
    options = dict(options, query_block=query_block)
    if options.pop("sinks", False):
        options["sinks"] = jnp.asarray(np.random.default_rng(2).standard_normal(args[0].shape[1]), jnp.float32)
    expected = reference.ragged_paged_attention(*args, **options)
    got = KERNELS[kernel](*args, **options)
    assert got.dtype == expected.dtype == dtype and got.shape == expected.shape
    assert_matches_on_real_tokens(got, expected, args[5], TOLERANCE[jnp.dtype(dtype)])


def test_cpu_quantized_key_ranges_split_over_threads():
    """One long sequence decoding: the C++ kernel cuts its keys into ranges, each widening its own tiles."""
    args, _ = quantized_step(11, 4, 16, 2, jnp.float32, 1, "int8")
    q, k_pages, v_pages = args[:3]
    pages = jnp.asarray(np.random.default_rng(0).permutation(np.arange(1, 64))[:50], jnp.int32)
    long_args = (q[:1], k_pages, v_pages, pages[None], jnp.zeros((1,), jnp.int32), jnp.asarray([199]))
    expected = reference.ragged_paged_attention(*long_args, query_block=1)
    np.testing.assert_allclose(
        np.asarray(cpu.ragged_paged_attention(*long_args, query_block=1)), np.asarray(expected), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("impl", ["cpu", "pallas"])
def test_writers_store_what_the_reference_stores(impl, kv_dtype):
    """This step's rows quantized into their slots, values and scales, by every KV writer (in place)."""
    args, _ = quantized_step(3, 8, 32, 2, jnp.bfloat16, 1, kv_dtype)
    k_pages, v_pages = args[1], args[2]
    rng = np.random.default_rng(4)
    k, v = (jnp.asarray(rng.standard_normal((6, 2, 32)) * 3, jnp.bfloat16) for _ in range(2))
    kv_indices = jnp.asarray([9, 17, 130, 0, 0, 255], jnp.int32)  # two padding writes to the reserved page
    expected = reference.write_kv_pages(k_pages, v_pages, k, v, kv_indices)
    got = write_kv_pages(k_pages, v_pages, k, v, kv_indices, impl=impl)
    for want, have in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        assert want.dtype == have.dtype and want.shape == have.shape
        np.testing.assert_array_equal(np.asarray(want.astype(jnp.float32)), np.asarray(have.astype(jnp.float32)))
    row = expected[0].data[130 // 8, 130 % 8].astype(jnp.float32) * expected[0].scales[130 // 8, 130 % 8][:, None]
    np.testing.assert_allclose(np.asarray(row), np.asarray(k[2], np.float32), atol=float(jnp.abs(k[2]).max()) / 8)


@pytest.mark.parametrize("impl", ["reference", "cpu", "pallas"])
def test_dispatch_serves_quantized_pages(impl):
    args, _ = quantized_step(5, 8, 32, 2, jnp.float32, 1, "int8")
    expected = reference.ragged_paged_attention(*args, query_block=1)
    assert_matches_on_real_tokens(ragged_paged_attention(*args, query_block=1, impl=impl), expected, args[5], 1e-4)


def test_page_bytes_carry_values_and_scales_together():
    """The page movers' view of a quantized pool: [n, page_size, K, D + 4] bytes, written back bit-exactly."""
    pool = quantized(jnp.asarray(np.random.default_rng(6).standard_normal((12, 4, 2, 16)), jnp.float32), "int8")
    pages = jnp.asarray([3, 7, 1], jnp.int32)
    contents = page_bytes(pool, pages)
    assert contents.dtype == jnp.uint8 and contents.shape == (3, 4, 2, 20)
    empty = QuantizedPages(jnp.zeros_like(pool.data), jnp.zeros_like(pool.scales))
    restored = from_page_bytes(empty, pages, contents)
    for leaf, original in zip(jax.tree.leaves(restored), jax.tree.leaves(pool)):
        np.testing.assert_array_equal(np.asarray(leaf[pages]), np.asarray(original[pages]))
        assert not np.asarray(leaf[jnp.asarray([2, 4])]).any(), "only the pages asked for"


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_quantized_kernels_lower_for_gpu_and_tpu(kv_dtype):
    """The real lowerings (not interpret mode) on quantized pages: Triton for CUDA, Mosaic for a TPU v5e."""
    args, _ = quantized_step(0, 16, 128, 4, jnp.bfloat16, 1, kv_dtype)
    gpu = jax.jit(functools.partial(pallas_gpu.ragged_paged_attention, query_block=1, num_splits=2, interpret=False))
    assert "triton" in gpu.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    write = jax.jit(functools.partial(pallas_gpu.write_kv_pages, interpret=False))
    kv = jnp.ones((8, 2, 128), jnp.bfloat16)
    lowered = write.trace(args[1], args[2], kv, kv, jnp.zeros(8, jnp.int32)).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()
    tpu = jax.jit(functools.partial(pallas_tpu.ragged_paged_attention, query_block=1, interpret=False))
    v5e = AbstractMesh(
        (1,), ("x",), abstract_device=AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    )
    with jax.sharding.use_abstract_mesh(v5e):
        assert "tpu_custom_call" in tpu.trace(*args).lower(lowering_platforms=("tpu",)).as_text()


# cache.kv_dtype bfloat16 / float16 beside a float32 model: plain 16-bit pages, float32 queries and outputs
SIXTEEN_BIT = [jnp.bfloat16, jnp.float16]


def sixteen_bit_step(seed, page_dtype, query_block, head_dim=32):
    q, k_pages, v_pages, *rest = ragged_step(np.random.default_rng(seed), 8, head_dim, 2, jnp.float32, query_block)
    return (q, k_pages.astype(page_dtype), v_pages.astype(page_dtype), *rest)


@pytest.mark.parametrize("page_dtype", SIXTEEN_BIT)
@pytest.mark.parametrize("query_block", [1, 8])
def test_reference_widens_sixteen_bit_pages_beside_float32_queries(page_dtype, query_block):
    """The reference on 16-bit pages is float32 math on the pages' values (not rounded again to 16 bits)."""
    args = sixteen_bit_step(7, page_dtype, query_block)
    q, k_pages, v_pages, *rest = args
    got = reference.ragged_paged_attention(*args, query_block=query_block)
    exact = reference.ragged_paged_attention(
        q, k_pages.astype(jnp.float32), v_pages.astype(jnp.float32), *rest, query_block=query_block
    )
    assert got.dtype == jnp.float32
    assert_matches_on_real_tokens(got, exact, args[5], 1e-6)


# (kernel, pages, query_block, head_dim): float16 rows of two heads of 28 widen in vectors of 16 and 8 (56 =
# 3 x 16 + 8), of 9 in one of 16 and two values alone
SIXTEEN_BIT_CASES = [("cpu", dtype, block, 32) for dtype in SIXTEEN_BIT for block in (1, 8)]
SIXTEEN_BIT_CASES += [("cpu", jnp.float16, 1, 28), ("cpu", jnp.bfloat16, 8, 28), ("cpu", jnp.float16, 8, 9)]
SIXTEEN_BIT_CASES += [("pallas_gpu", jnp.float16, 8, 32), ("pallas_gpu", jnp.bfloat16, 1, 32)]
SIXTEEN_BIT_CASES += [("pallas_tpu", jnp.bfloat16, 1, 32)]


@pytest.mark.parametrize("kernel,page_dtype,query_block,head_dim", SIXTEEN_BIT_CASES)
def test_kernels_on_sixteen_bit_pages_beside_float32_queries_match_reference(kernel, page_dtype, query_block, head_dim):
    """The CPU kernel widens the pages and keeps float32 math (float32's tolerance); the Pallas kernels' matmuls
    run in the pages' dtype (queries and weights rounded to it: that dtype's tolerance)."""
    if kernel == "cpu" and not cpu.available():
        pytest.fail("the C++ CPU kernels could not be built")
    args = sixteen_bit_step(9, page_dtype, query_block, head_dim)
    expected = reference.ragged_paged_attention(*args, query_block=query_block)
    got = KERNELS[kernel](*args, query_block=query_block)
    assert got.dtype == jnp.float32 and got.shape == expected.shape
    tolerance = TOLERANCE[jnp.dtype(jnp.float32 if kernel == "cpu" else page_dtype)]
    assert_matches_on_real_tokens(got, expected, args[5], tolerance)


@pytest.mark.parametrize("page_dtype", SIXTEEN_BIT)
@pytest.mark.parametrize("impl", ["cpu", "pallas"])
def test_writers_round_float32_rows_into_sixteen_bit_pages(impl, page_dtype):
    args = sixteen_bit_step(3, page_dtype, 1)
    rng = np.random.default_rng(4)
    k, v = (jnp.asarray(rng.standard_normal((6, 2, 32)) * 3, jnp.float32) for _ in range(2))
    kv_indices = jnp.asarray([9, 17, 130, 0, 0, 255], jnp.int32)
    expected = reference.write_kv_pages(args[1], args[2], k, v, kv_indices)
    got = write_kv_pages(args[1], args[2], k, v, kv_indices, impl=impl)
    for want, have in zip(expected, got):
        assert want.dtype == have.dtype == page_dtype
        np.testing.assert_array_equal(np.asarray(want, np.float32), np.asarray(have, np.float32))
    np.testing.assert_array_equal(np.asarray(got[0][130 // 8, 130 % 8]), np.asarray(k[2].astype(page_dtype)))
