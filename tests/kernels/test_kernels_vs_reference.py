"""Every implementation against the specification: the reference against dense causal attention, and
each kernel (the C++ CPU kernels, the Pallas GPU and TPU kernels in interpret mode) against the
reference over a grid of shapes and dtypes, reading and writing pages."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention, write_kv_pages
from pallas_kernels.paged_attention import cpu, pallas_gpu, pallas_tpu, reference
from tests.kernels.steps import TOLERANCE, assert_matches_on_real_tokens, cdiv, dense_attention, pad_pages, ragged_step


@pytest.mark.parametrize("impl", ["reference", "cpu", "pallas"])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,page_size,query_block,sliding_window",
    [(4, 4, 8, 1, None), (8, 2, 16, 4, None), (6, 1, 4, 8, None), (4, 2, 8, 4, 5), (4, 2, 4, 1, 70)],
)
def test_ragged_paged_attention_matches_dense(num_heads, num_kv_heads, page_size, query_block, sliding_window, impl):
    rng = np.random.default_rng(0)
    head_dim, num_pages = 16, 80
    # (context already cached, new query tokens) per sequence: a decode, a fresh prompt, a later chunk.
    layout = [(9, 1), (0, 11), (13, 6), (0, 1)] if query_block > 1 else [(9, 1), (20, 1), (0, 1), (150, 1)]
    k_pages = jnp.zeros((num_pages, page_size, num_kv_heads, head_dim))
    v_pages = jnp.zeros_like(k_pages)
    free_pages = list(rng.permutation(np.arange(1, num_pages)))
    max_pages = 40
    page_table = np.zeros((len(layout) + 1, max_pages), np.int32)  # one padding row
    tokens_q, token_seq_ids, positions, kv_indices, expected = [], [], [], [], []
    for row, (num_cached, num_new) in enumerate(layout):
        total = num_cached + num_new
        pages = [free_pages.pop() for _ in range(cdiv(total, page_size))]
        page_table[row, : len(pages)] = pages
        q = rng.standard_normal((total, num_heads, head_dim)).astype(np.float32)
        k = rng.standard_normal((total, num_kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((total, num_kv_heads, head_dim)).astype(np.float32)
        slots = np.array([pages[p // page_size] * page_size + p % page_size for p in range(total)], np.int32)
        # the cached context is written by earlier steps, the new tokens by this one (below)
        k_pages, v_pages = write_kv_pages(k_pages, v_pages, k[:num_cached], v[:num_cached], slots[:num_cached])
        padded = cdiv(num_new, query_block) * query_block
        pad = padded - num_new
        tokens_q.append(np.concatenate([q[num_cached:], np.zeros((pad, num_heads, head_dim), np.float32)]))
        token_seq_ids += [row] * padded
        positions += list(range(num_cached, total)) + [-1] * pad
        kv_indices += list(slots[num_cached:]) + [0] * pad
        new_k = np.concatenate([k[num_cached:], np.zeros((pad, num_kv_heads, head_dim), np.float32)])
        new_v = np.concatenate([v[num_cached:], np.zeros((pad, num_kv_heads, head_dim), np.float32)])
        expected.append((len(positions) - padded, num_new, dense_attention(q, k, v, sliding_window)[num_cached:]))
        tokens_q[-1] = (tokens_q[-1], new_k, new_v)
    # a whole padding block at the end
    q_all = np.concatenate([t[0] for t in tokens_q] + [np.zeros((query_block, num_heads, head_dim), np.float32)])
    k_new = np.concatenate([t[1] for t in tokens_q] + [np.zeros((query_block, num_kv_heads, head_dim), np.float32)])
    v_new = np.concatenate([t[2] for t in tokens_q] + [np.zeros((query_block, num_kv_heads, head_dim), np.float32)])
    token_seq_ids += [len(layout)] * query_block
    positions += [-1] * query_block
    kv_indices += [0] * query_block
    k_pages, v_pages = write_kv_pages(
        k_pages, v_pages, jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(kv_indices, jnp.int32), impl=impl
    )
    out = ragged_paged_attention(
        jnp.asarray(q_all),
        k_pages,
        v_pages,
        jnp.asarray(page_table),
        jnp.asarray(token_seq_ids, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        query_block=query_block,
        sliding_window=sliding_window,
        impl=impl,
    )
    out = np.asarray(out)
    assert np.all(np.isfinite(out))
    for start, num_new, want in expected:
        np.testing.assert_allclose(out[start : start + num_new], want, rtol=2e-5, atol=2e-5)


def test_bfloat16_attention_is_close_to_float32():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((4, 4, 8)).astype(np.float32)
    pages = rng.standard_normal((3, 4, 2, 8)).astype(np.float32)
    args = (jnp.asarray([[1, 2]], jnp.int32), jnp.zeros(4, jnp.int32), jnp.asarray([3, 4, 5, 6], jnp.int32))
    f32 = ragged_paged_attention(jnp.asarray(q), jnp.asarray(pages), jnp.asarray(pages), *args, query_block=4)
    bf16 = ragged_paged_attention(
        jnp.asarray(q, jnp.bfloat16),
        jnp.asarray(pages, jnp.bfloat16),
        jnp.asarray(pages, jnp.bfloat16),
        *args,
        query_block=4,
    )
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(bf16, np.float32), np.asarray(f32), atol=5e-2)


GRID = [  # (page_size, head_dim, groups, dtype, query_block): each value of each axis appears
    (8, 64, 1, jnp.float32, 1),
    (16, 128, 4, jnp.float32, 1),
    (32, 64, 8, jnp.float32, 1),
    (8, 128, 8, jnp.float32, 16),
    (16, 64, 1, jnp.float32, 16),
    (32, 128, 4, jnp.float32, 8),
    (16, 64, 4, jnp.bfloat16, 1),
    (8, 128, 1, jnp.bfloat16, 16),
    (32, 64, 8, jnp.bfloat16, 16),
]


@pytest.mark.parametrize("page_size,head_dim,groups,dtype,query_block", GRID)
def test_kernel_matches_reference(page_size, head_dim, groups, dtype, query_block):
    args = ragged_step(
        np.random.default_rng(page_size + head_dim + groups), page_size, head_dim, groups, dtype, query_block
    )
    expected = reference.ragged_paged_attention(*args, query_block=query_block)
    got = pallas_gpu.ragged_paged_attention(*args, query_block=query_block)  # interpret mode on CPU only
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert_matches_on_real_tokens(got, expected, args[5], TOLERANCE[jnp.dtype(dtype)])


@pytest.mark.parametrize(
    "num_splits,query_block,dtype,sliding_window",
    [
        (2, 1, jnp.float32, None),
        (3, 1, jnp.bfloat16, None),
        (4, 16, jnp.float32, None),
        (3, 1, jnp.float32, 20),
        (1, 16, jnp.float32, 20),
    ],
)
def test_context_splits_and_sliding_window_match_reference(num_splits, query_block, dtype, sliding_window):
    """Flash-decoding splits of the page table (3 splits do not divide the spans evenly), merged outside."""
    args = ragged_step(np.random.default_rng(num_splits), 8, 64, 4, dtype, query_block)
    expected = reference.ragged_paged_attention(*args, query_block=query_block, sliding_window=sliding_window)
    got = pallas_gpu.ragged_paged_attention(
        *args, query_block=query_block, sliding_window=sliding_window, num_splits=num_splits
    )
    assert_matches_on_real_tokens(got, expected, args[5], TOLERANCE[jnp.dtype(dtype)])


TPU_GRID = [(16, 128, 4, jnp.float32, 1), (8, 64, 1, jnp.float32, 16), (32, 64, 8, jnp.bfloat16, 16)]


@pytest.mark.parametrize("page_size,head_dim,groups,dtype,query_block", TPU_GRID)
def test_tpu_kernel_matches_reference(page_size, head_dim, groups, dtype, query_block):
    """The Mosaic kernel, in Pallas' TPU interpret mode (DMAs and semaphores emulated) off a TPU."""
    args = ragged_step(np.random.default_rng(3 * page_size + groups), page_size, head_dim, groups, dtype, query_block)
    expected = reference.ragged_paged_attention(*args, query_block=query_block)
    got = pallas_tpu.ragged_paged_attention(*args, query_block=query_block)
    assert_matches_on_real_tokens(got, expected, args[5], TOLERANCE[jnp.dtype(dtype)])


def test_tpu_kernel_double_buffering_has_no_dma_races():
    """Pallas' TPU interpreter with its happens-before race detector: the next span's DMAs land in the
    other buffer while this span is read."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    from jax.experimental.pallas import tpu as pltpu

    args = ragged_step(np.random.default_rng(5), 32, 64, 4, jnp.float32, 1)  # 2 pages a span, up to 3 spans
    got = pallas_tpu.ragged_paged_attention(*args, query_block=1, interpret=pltpu.InterpretParams(detect_races=True))
    assert interpret_pallas_call.races is not None and not interpret_pallas_call.races.races_found
    expected = reference.ragged_paged_attention(*args, query_block=1)
    assert_matches_on_real_tokens(got, expected, args[5], 1e-4)


CPU_GRID = [  # (page_size, head_dim, groups, dtype, query_block, sliding_window): 16-bit pages, float32 sums
    (8, 64, 1, jnp.bfloat16, 1, None),
    (16, 128, 4, jnp.bfloat16, 16, None),
    (32, 64, 8, jnp.bfloat16, 8, 20),
    (8, 128, 4, jnp.float16, 1, None),
    (16, 64, 8, jnp.float16, 16, 20),
    (32, 128, 1, jnp.float16, 8, None),
    (16, 64, 4, jnp.float32, 1, 20),
    (8, 64, 8, jnp.float32, 16, None),
]


@pytest.mark.parametrize("page_size,head_dim,groups,dtype,query_block,sliding_window", CPU_GRID)
def test_cpu_kernel_matches_reference(page_size, head_dim, groups, dtype, query_block, sliding_window):
    args = ragged_step(np.random.default_rng(page_size + groups), page_size, head_dim, groups, dtype, query_block)
    expected = reference.ragged_paged_attention(*args, query_block=query_block, sliding_window=sliding_window)
    got = cpu.ragged_paged_attention(*args, query_block=query_block, sliding_window=sliding_window)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert_matches_on_real_tokens(got, expected, args[5], TOLERANCE[jnp.dtype(dtype)])


@pytest.mark.parametrize(
    "kernel,dtype",
    [
        (pallas_gpu, jnp.float32),
        (pallas_gpu, jnp.bfloat16),
        (cpu, jnp.float32),
        (cpu, jnp.bfloat16),
        (cpu, jnp.float16),
    ],
    ids=lambda value: value.__name__.rsplit(".", 1)[-1],
)
def test_write_kernel_matches_reference_scatter(kernel, dtype):
    rng = np.random.default_rng(7)
    pages = jnp.asarray(rng.standard_normal((12, 8, 2, 64)), dtype)
    k = jnp.asarray(rng.standard_normal((24, 2, 64)), jnp.float32)
    v = k * 3
    # real tokens spread over pages (one ending mid-page), then padding tokens all aimed at reserved slot 0
    kv_indices = jnp.asarray(list(range(8, 21)) + [40, 41, 95] + [0] * 8, jnp.int32)
    expected = reference.write_kv_pages(pages, pages + 1, k, v, kv_indices)
    got = kernel.write_kv_pages(jnp.array(pages), jnp.array(pages) + 1, k, v, kv_indices)
    for want, have in zip(expected, got):
        assert have.dtype == dtype
        np.testing.assert_array_equal(np.asarray(have[1:], np.float32), np.asarray(want[1:], np.float32))


@pytest.mark.parametrize(
    "head_dim,query_block,num_splits,dtype",
    [(12, 1, 1, jnp.float32), (12, 16, 1, jnp.float32), (96, 1, 3, jnp.bfloat16), (20, 8, 2, jnp.float32)],
)
def test_padded_pages_match_the_reference(head_dim, query_block, num_splits, dtype):
    """Pages wider than the head dim, written by the write kernel (zero lanes), read with the real scale."""
    args = ragged_step(np.random.default_rng(head_dim), 8, head_dim, 4, dtype, query_block)
    expected = reference.ragged_paged_attention(*args, query_block=query_block)
    width = pallas_gpu.cache_head_dim(head_dim, "gpu")
    q, k_pages, v_pages, page_table, token_seq_ids, positions = pad_pages(args, width)
    k_pages, v_pages = pallas_gpu.write_kv_pages(
        k_pages, v_pages, args[1][:4, 0], args[2][:4, 0], jnp.asarray([0, 1, 2, 3], jnp.int32)
    )  # reserved page 0: never read
    assert np.all(np.asarray(k_pages[0, :4, :, head_dim:], np.float32) == 0), "extra lanes written as zeros"
    got = pallas_gpu.ragged_paged_attention(
        q, k_pages, v_pages, page_table, token_seq_ids, positions, query_block=query_block, num_splits=num_splits
    )
    assert got.shape == expected.shape
    assert_matches_on_real_tokens(got, expected, positions, TOLERANCE[jnp.dtype(dtype)])


@pytest.mark.parametrize(
    "dtype,query_block,sliding_window,length",
    [
        (jnp.float32, 1, None, 700),
        (jnp.bfloat16, 1, None, 700),
        (jnp.float32, 1, 100, 700),
        (jnp.float16, 8, None, 333),
        (jnp.float32, 8, 50, 333),
        (jnp.float32, 1, None, 40),
    ],
)
def test_cpu_kernel_splits_a_lone_sequence_over_its_keys(dtype, query_block, sliding_window, length):
    """One sequence in the step (a single long decode, or one prefill chunk), next to a padding block: too
    few blocks for the threads, so the kernel cuts the sequence's keys into ranges and merges their softmax
    states. Ranges wholly outside a sliding window, or past some query rows' positions, see no key."""
    rng = np.random.default_rng(length + query_block)
    page_size, num_kv_heads, groups, head_dim, num_pages = 16, 2, 3, 64, 64
    num_new = query_block if query_block == 1 else query_block - 3  # a chunk with padding rows
    pages = cdiv(length, page_size)
    page_table = np.zeros((2, pages + 1), np.int32)
    page_table[0, :pages] = rng.permutation(np.arange(1, num_pages))[:pages]
    positions = list(range(length - num_new, length)) + [-1] * (query_block - num_new) + [-1] * query_block
    token_seq_ids = [0] * query_block + [1] * query_block
    as_dtype = lambda x: jnp.asarray(x, dtype)
    args = (
        as_dtype(rng.standard_normal((2 * query_block, num_kv_heads * groups, head_dim))),
        as_dtype(rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim))),
        as_dtype(rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim))),
        jnp.asarray(page_table),
        jnp.asarray(token_seq_ids, jnp.int32),
        jnp.asarray(positions, jnp.int32),
    )
    expected = reference.ragged_paged_attention(*args, query_block=query_block, sliding_window=sliding_window)
    got = cpu.ragged_paged_attention(*args, query_block=query_block, sliding_window=sliding_window)
    assert_matches_on_real_tokens(got, expected, args[5], TOLERANCE[jnp.dtype(dtype)])
