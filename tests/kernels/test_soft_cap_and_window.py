"""Gemma's attention options in every implementation: the logits soft-cap and a per-layer sliding window
shorter than the contexts, across pages and in prefill chunks (query blocks starting mid-sequence)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice, AbstractMesh

from pallas_kernels import ragged_paged_attention
from pallas_kernels.paged_attention import cpu, pallas_gpu, pallas_tpu, reference
from tests.kernels.steps import TOLERANCE, assert_matches_on_real_tokens, ragged_step

SOFT_CAP = 1.5  # small enough that tanh bends most scores of the sharpened queries below


def capped_step(seed, page_size, head_dim, groups, dtype, query_block):
    """ragged_step with queries scaled up, so that scores reach where the soft-cap matters."""
    q, *rest = ragged_step(np.random.default_rng(seed), page_size, head_dim, groups, dtype, query_block)
    return (q * 4).astype(dtype), *rest


def dense_reference(args, query_block, sliding_window, soft_cap):
    """The same step as dense float64 math over each sequence's whole context."""
    q, k_pages, v_pages, page_table, token_seq_ids, positions = (np.asarray(a, np.float64) for a in args)
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
        k = k_pages.reshape(-1, num_kv_heads, head_dim)[rows]  # [L, K, D]
        v = v_pages.reshape(-1, num_kv_heads, head_dim)[rows]
        heads = np.arange(num_heads) // (num_heads // num_kv_heads)
        scores = np.einsum("hd,lhd->hl", q[t], k[:, heads]) / np.sqrt(head_dim)
        if soft_cap:
            scores = soft_cap * np.tanh(scores / soft_cap)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[t] = np.einsum("hl,lhd->hd", probs, v[:, heads])
    return out


@pytest.mark.parametrize("sliding_window,soft_cap", [(None, SOFT_CAP), (6, None), (11, SOFT_CAP), (1, SOFT_CAP)])
@pytest.mark.parametrize("query_block", [1, 8])
def test_reference_soft_cap_and_window_match_dense_math(sliding_window, soft_cap, query_block):
    args = capped_step(7, 4, 16, 2, jnp.float32, query_block)
    got = reference.ragged_paged_attention(
        *args, query_block=query_block, sliding_window=sliding_window, logits_soft_cap=soft_cap
    )
    want = dense_reference(args, query_block, sliding_window, soft_cap)
    assert_matches_on_real_tokens(got, want, args[5], 2e-5)
    plain = reference.ragged_paged_attention(*args, query_block=query_block)
    assert not np.allclose(np.asarray(got), np.asarray(plain), atol=1e-3), "the options change the output"


KERNELS = {
    "cpu": cpu.ragged_paged_attention,
    "pallas_gpu": pallas_gpu.ragged_paged_attention,  # interpret mode off a GPU
    "pallas_tpu": pallas_tpu.ragged_paged_attention,  # Pallas' TPU interpret mode off a TPU
}
# (page_size, head_dim, groups, dtype, query_block, sliding_window): windows shorter than the contexts,
# longer than a page and shorter than one, with decode steps and prefill chunks
GRID = [
    (8, 64, 2, jnp.float32, 1, 13),
    (4, 32, 1, jnp.float32, 8, 6),
    (8, 64, 4, jnp.bfloat16, 8, 20),
    (16, 32, 2, jnp.float16, 1, 5),
]


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("page_size,head_dim,groups,dtype,query_block,sliding_window", GRID)
def test_kernels_soft_cap_and_window_match_reference(
    kernel, page_size, head_dim, groups, dtype, query_block, sliding_window
):
    if kernel == "cpu" and not cpu.available():
        pytest.fail("the C++ CPU kernels could not be built")
    if kernel == "pallas_tpu" and dtype == jnp.float16:
        dtype = jnp.bfloat16  # Mosaic has no float16 matmuls
    args = capped_step(page_size + groups, page_size, head_dim, groups, dtype, query_block)
    options = dict(query_block=query_block, sliding_window=sliding_window, logits_soft_cap=SOFT_CAP)
    expected = reference.ragged_paged_attention(*args, **options)
    got = KERNELS[kernel](*args, **options)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert_matches_on_real_tokens(got, expected, args[5], TOLERANCE[jnp.dtype(dtype)])


@pytest.mark.parametrize("num_splits", [2, 3])
def test_gpu_context_splits_with_soft_cap_and_window(num_splits):
    """Flash-decoding's per-split softmax states, merged outside the kernel, with both options on."""
    args = capped_step(num_splits, 8, 64, 4, jnp.float32, 1)
    options = dict(query_block=1, sliding_window=20, logits_soft_cap=SOFT_CAP)
    expected = reference.ragged_paged_attention(*args, **options)
    got = pallas_gpu.ragged_paged_attention(*args, **options, num_splits=num_splits)
    assert_matches_on_real_tokens(got, expected, args[5], TOLERANCE[jnp.dtype(jnp.float32)])


@pytest.mark.parametrize("impl", ["reference", "cpu", "pallas"])
def test_dispatch_passes_the_soft_cap_through(impl):
    args = capped_step(1, 8, 32, 2, jnp.float32, 1)
    capped = ragged_paged_attention(*args, query_block=1, logits_soft_cap=SOFT_CAP, impl=impl)
    expected = reference.ragged_paged_attention(*args, query_block=1, logits_soft_cap=SOFT_CAP)
    assert_matches_on_real_tokens(capped, expected, args[5], 1e-4)


@pytest.mark.parametrize("dtype,query_block,num_splits", [(jnp.bfloat16, 1, 2), (jnp.float32, 8, 1)])
def test_soft_cap_and_window_lower_for_gpu_and_tpu(dtype, query_block, num_splits):
    """The real lowerings (not interpret mode) with both options on: Triton for CUDA, Mosaic for a TPU v5e."""
    args = capped_step(0, 16, 128, 4, dtype, query_block)
    options = dict(query_block=query_block, sliding_window=24, logits_soft_cap=50.0, interpret=False)
    gpu = jax.jit(functools.partial(pallas_gpu.ragged_paged_attention, num_splits=num_splits, **options))
    assert "triton" in gpu.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    tpu = jax.jit(functools.partial(pallas_tpu.ragged_paged_attention, **options))
    v5e = AbstractMesh(
        (1,), ("x",), abstract_device=AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    )
    with jax.sharding.use_abstract_mesh(v5e):
        assert "tpu_custom_call" in tpu.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
