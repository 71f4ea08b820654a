"""GPT-OSS's attention sinks in every implementation: one logit per query head joins each softmax's
denominator, with a sliding window and without, in decode steps and prefill chunks, across pages."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice, AbstractMesh

from pallas_kernels import ragged_paged_attention
from pallas_kernels.paged_attention import cpu, pallas_gpu, pallas_tpu, reference
from tests.kernels.steps import TOLERANCE, assert_matches_on_real_tokens, ragged_step


def sink_step(seed, page_size, head_dim, groups, dtype, query_block, sink_scale=2.0):
    """ragged_step with sharpened queries and random sinks [H] (float32, as the model keeps them)."""
    rng = np.random.default_rng(seed)
    q, *rest = ragged_step(rng, page_size, head_dim, groups, dtype, query_block)
    sinks = jnp.asarray(sink_scale * rng.standard_normal(q.shape[1]) + 1.0, jnp.float32)
    return ((q * 2).astype(dtype), *rest), sinks


def dense_reference(args, sinks, sliding_window):
    """float64 softmax over [scores, sink] per head, the sink's column dropped (as transformers' GPT-OSS)."""
    q, k_pages, v_pages, page_table, token_seq_ids, positions = (np.asarray(a, np.float64) for a in args)
    sinks = np.asarray(sinks, np.float64)
    num_tokens, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    out = np.zeros_like(q)
    for t in range(num_tokens):
        position = int(positions[t])
        if position < 0:
            continue
        pages = page_table[int(token_seq_ids[t])].astype(int)
        keys = np.arange(position + 1)
        if sliding_window:
            keys = keys[keys > position - sliding_window]
        rows = pages[keys // page_size] * page_size + keys % page_size
        heads = np.arange(num_heads) // (num_heads // num_kv_heads)
        k = k_pages.reshape(-1, num_kv_heads, head_dim)[rows][:, heads]  # [L, H, D]
        v = v_pages.reshape(-1, num_kv_heads, head_dim)[rows][:, heads]
        scores = np.einsum("hd,lhd->hl", q[t], k) / np.sqrt(head_dim)
        combined = np.concatenate([scores, sinks[:, None]], axis=1)
        probs = np.exp(combined - combined.max(-1, keepdims=True))
        probs = probs / probs.sum(-1, keepdims=True)
        out[t] = np.einsum("hl,lhd->hd", probs[:, :-1], v)
    return out


@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("query_block", [1, 8])
def test_reference_sinks_match_dense_math(sliding_window, query_block):
    args, sinks = sink_step(3, 4, 16, 2, jnp.float32, query_block)
    got = reference.ragged_paged_attention(*args, query_block=query_block, sliding_window=sliding_window, sinks=sinks)
    assert_matches_on_real_tokens(got, dense_reference(args, sinks, sliding_window), args[5], 2e-5)
    plain = reference.ragged_paged_attention(*args, query_block=query_block, sliding_window=sliding_window)
    assert not np.allclose(np.asarray(got), np.asarray(plain), atol=1e-3), "the sinks change the output"


def test_reference_large_sinks_stay_finite():
    """A sink far above every score takes nearly all the weight: outputs near zero, not inf or NaN."""
    args, _ = sink_step(4, 8, 16, 2, jnp.float32, 1)
    sinks = jnp.full((args[0].shape[1],), 200.0, jnp.float32)
    got = np.asarray(reference.ragged_paged_attention(*args, query_block=1, sinks=sinks))
    assert np.all(np.isfinite(got)) and np.abs(got).max() < 1e-6


KERNELS = {
    "cpu": cpu.ragged_paged_attention,
    "pallas_gpu": pallas_gpu.ragged_paged_attention,  # interpret mode off a GPU
    "pallas_tpu": pallas_tpu.ragged_paged_attention,  # Pallas' TPU interpret mode off a TPU
}
# (page_size, head_dim, groups, dtype, query_block, sliding_window)
GRID = [
    (8, 64, 2, jnp.float32, 1, None),
    (4, 32, 1, jnp.float32, 8, 6),
    (8, 64, 4, jnp.bfloat16, 8, None),
    (16, 32, 2, jnp.float16, 1, 5),
]


# TPU interpret mode emulates every DMA and is slow: a decode step with a window and a bf16 prefill chunk
CASES = [(kernel, case) for kernel in ("cpu", "pallas_gpu") for case in GRID] + [
    ("pallas_tpu", GRID[3]),
    ("pallas_tpu", GRID[2]),
]


@pytest.mark.parametrize("kernel,case", CASES)
def test_kernels_sinks_match_reference(kernel, case):
    page_size, head_dim, groups, dtype, query_block, sliding_window = case
    if kernel == "cpu" and not cpu.available():
        pytest.fail("the C++ CPU kernels could not be built")
    if kernel == "pallas_tpu" and dtype == jnp.float16:
        dtype = jnp.bfloat16  # Mosaic has no float16 matmuls
    args, sinks = sink_step(page_size + groups, page_size, head_dim, groups, dtype, query_block)
    options = dict(query_block=query_block, sliding_window=sliding_window, sinks=sinks)
    expected = reference.ragged_paged_attention(*args, **options)
    got = KERNELS[kernel](*args, **options)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert_matches_on_real_tokens(got, expected, args[5], TOLERANCE[jnp.dtype(dtype)])


def test_cpu_sinks_with_key_ranges_split_over_threads():
    """One long sequence decoding: the C++ kernel cuts its keys into ranges and merges their softmax states,
    the sink joining once."""
    args, sinks = sink_step(11, 4, 16, 2, jnp.float32, 1)
    q, k_pages, v_pages, page_table, _, _ = args
    length = 200  # 50 pages of 4: several tiles of 64 keys
    pages = jnp.asarray(np.random.default_rng(0).permutation(np.arange(1, 64))[:50], jnp.int32)
    long_args = (q[:1], k_pages, v_pages, pages[None], jnp.zeros((1,), jnp.int32), jnp.asarray([length - 1]))
    expected = reference.ragged_paged_attention(*long_args, query_block=1, sinks=sinks)
    got = cpu.ragged_paged_attention(*long_args, query_block=1, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [3])
def test_gpu_context_splits_count_the_sink_once(num_splits):
    args, sinks = sink_step(num_splits, 8, 64, 4, jnp.float32, 1)
    options = dict(query_block=1, sliding_window=20, sinks=sinks)
    expected = reference.ragged_paged_attention(*args, **options)
    got = pallas_gpu.ragged_paged_attention(*args, **options, num_splits=num_splits)
    assert_matches_on_real_tokens(got, expected, args[5], TOLERANCE[jnp.dtype(jnp.float32)])


@pytest.mark.parametrize("impl", ["reference", "cpu", "pallas"])
def test_dispatch_passes_the_sinks_through(impl):
    args, sinks = sink_step(1, 8, 32, 2, jnp.float32, 1)
    got = ragged_paged_attention(*args, query_block=1, sinks=sinks, impl=impl)
    expected = reference.ragged_paged_attention(*args, query_block=1, sinks=sinks)
    assert_matches_on_real_tokens(got, expected, args[5], 1e-4)
    plain = reference.ragged_paged_attention(*args, query_block=1)
    assert not np.allclose(np.asarray(got), np.asarray(plain), atol=1e-3)


@pytest.mark.parametrize("dtype,query_block,num_splits", [(jnp.bfloat16, 1, 2), (jnp.float32, 8, 1)])
def test_sinks_lower_for_gpu_and_tpu(dtype, query_block, num_splits):
    """The real lowerings (not interpret mode) with sinks and a window: Triton for CUDA, Mosaic for a TPU v5e."""
    args, sinks = sink_step(0, 16, 64, 4, dtype, query_block)
    options = dict(query_block=query_block, sliding_window=24, interpret=False)
    gpu = jax.jit(functools.partial(pallas_gpu.ragged_paged_attention, num_splits=num_splits, **options))
    assert "triton" in gpu.trace(*args, sinks=sinks).lower(lowering_platforms=("cuda",)).as_text()
    tpu = jax.jit(functools.partial(pallas_tpu.ragged_paged_attention, **options))
    v5e = AbstractMesh(
        (1,), ("x",), abstract_device=AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    )
    with jax.sharding.use_abstract_mesh(v5e):
        assert "tpu_custom_call" in tpu.trace(*args, sinks=sinks).lower(lowering_platforms=("tpu",)).as_text()
