"""The CPU attention kernel computes a query row the same, bit for bit, whatever else is in its call.

Speculation's greedy identity rests on it (issue 26): a verify step attends a sequence's k + 1 tokens as one
query block where a decode step attended one token, prefill chunks come in blocks of 16, and a batch may hold
one sequence (its keys then split over the threads) or many (one thread per block). With bfloat16 activations
or int8 ones, a 1e-7 difference rounds into a different value and flips greedy near-ties (session 15: 3 of 4
outputs of the default Q4_1 model changed with ngram speculation). So a query row's output depends on its own
query, position and keys only."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_library
from pallas_kernels.paged_attention import cpu
from pallas_kernels.paged_attention.kv_quantization import QuantizedPages, quantize
from tests.kernels.steps import cdiv

PAGE_SIZE, NUM_PAGES = 16, 160


def step_layout(q_row, table_row, length, block, offset, neighbours, rng):
    """The step's (q, seq ids, positions, page table): the token at position length - 1 as row `offset` of a query
    block of `block` tokens (its other rows: the positions around it, padding before position 0), beside
    `neighbours` short one-block sequences that read pages 1-2."""
    q, seq_ids, positions = [], [], []
    for b in range(block):
        position = length - 1 - offset + b
        q.append(q_row if b == offset else rng.standard_normal(q_row.shape))
        seq_ids.append(0)
        positions.append(position if position >= 0 else -1)
    for n in range(neighbours):
        for b in range(block):
            q.append(rng.standard_normal(q_row.shape))
            seq_ids.append(1 + n)
            positions.append(3 + n + b)
    page_table = np.zeros((1 + neighbours, table_row.shape[0]), np.int32)
    page_table[0] = table_row
    page_table[1:, :2] = [1, 2]
    return (
        jnp.asarray(np.stack(q), q_row.dtype),
        jnp.asarray(seq_ids, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(page_table),
    )


def attend_one_token(case, length, block, offset, neighbours, path=None):
    """The output of the token at position length - 1, attended as row `offset` of a query block of `block`
    tokens (the block's other rows: the positions around it, or padding past the sequence's end), beside
    `neighbours` other one-block sequences."""
    (q_row, (k_pages, v_pages), page_table_row, sliding_window, soft_cap, sinks) = case
    rng = np.random.default_rng(block * 100 + offset + neighbours)
    q, seq_ids, positions, page_table = step_layout(q_row, page_table_row, length, block, offset, neighbours, rng)
    got = cpu.ragged_paged_attention(
        q,
        k_pages,
        v_pages,
        page_table,
        seq_ids,
        positions,
        query_block=block,
        sliding_window=sliding_window,
        logits_soft_cap=soft_cap,
        sinks=sinks,
        path=path,
    )
    return np.asarray(jnp.asarray(got[offset], jnp.float32))


def make_case(rng, dtype, kv_dtype, num_kv_heads, groups, head_dim, max_length, sliding_window, soft_cap, sinks):
    num_heads = num_kv_heads * groups
    shape = (NUM_PAGES, PAGE_SIZE, num_kv_heads, head_dim)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    if kv_dtype is None:
        pages = (jnp.asarray(k, dtype), jnp.asarray(v, dtype))
    else:
        pages = tuple(QuantizedPages(*quantize(jnp.asarray(x, jnp.float32), kv_dtype)) for x in (k, v))
    page_table_row = np.zeros(cdiv(max_length + 16, PAGE_SIZE) + 1, np.int32)
    used = cdiv(max_length + 16, PAGE_SIZE)
    page_table_row[:used] = rng.permutation(np.arange(3, NUM_PAGES))[:used]
    q_row = np.asarray(jnp.asarray(rng.standard_normal((num_heads, head_dim)), dtype))
    sinks = jnp.asarray(rng.standard_normal(num_heads), jnp.float32) if sinks else None
    return (q_row, pages, page_table_row, sliding_window, soft_cap, sinks)


@pytest.mark.parametrize(
    "dtype,kv_dtype,num_kv_heads,groups,head_dim,sliding_window,soft_cap,sinks",
    [
        (jnp.float32, None, 3, 3, 64, None, None, False),  # SmolLM2-135M's heads
        (jnp.bfloat16, None, 2, 4, 80, None, None, False),  # a head dim with a lane tail
        (jnp.float32, None, 4, 1, 96, 100, None, False),  # MHA, a sliding window
        (jnp.float32, None, 1, 5, 12, None, 30.0, True),  # MQA, tiny heads, soft cap, sinks
        (jnp.float16, None, 2, 2, 128, None, None, False),
        (jnp.float32, "int8", 2, 3, 64, None, None, False),  # quantized pages
        (jnp.float32, None, 1, 5, 8, None, None, False),  # a head narrower than a vector, 5 query heads a kv head
        (jnp.float32, None, 1, 4, 10, 20, None, False),
    ],
)
def test_a_query_row_computes_alike_in_any_block_and_batch(
    dtype, kv_dtype, num_kv_heads, groups, head_dim, sliding_window, soft_cap, sinks
):
    """Decode (one token), verify (a block of k + 1 with the token anywhere in it), prefill (blocks of 16),
    alone (keys split over the threads in ranges) or beside 7 other sequences (a block per thread), at lengths
    inside one tile, one key past it (a range of one key), and across the ranges that start at keys 64, 128, 256,
    512 and 1024 (cpu_kernel.cc's RangeStart): the same bits."""
    rng = np.random.default_rng(head_dim + groups)
    lengths = (37, 65, 333, 1100)
    case = make_case(
        rng, dtype, kv_dtype, num_kv_heads, groups, head_dim, max(lengths), sliding_window, soft_cap, sinks
    )
    layouts = [(1, 0, 0), (1, 0, 7), (2, 1, 0), (5, 0, 0), (5, 3, 7), (8, 7, 0), (8, 4, 2), (16, 9, 0), (16, 15, 7)]
    for path, length in itertools.product(cpu_library.runnable_paths(), lengths):
        want = attend_one_token(case, length, *layouts[0], path=path)
        assert np.all(np.isfinite(want)) and np.any(want != 0)
        for layout in layouts[1:]:
            got = attend_one_token(case, length, *layout, path=path)
            np.testing.assert_array_equal(
                got, want, err_msg=f"{path}, length {length}, (block, offset, neighbours) {layout}"
            )


def test_the_rows_match_the_reference_too():
    """The arithmetic that makes rows alike is still attention: a long lone decode row against the reference."""
    from pallas_kernels.paged_attention import reference

    rng = np.random.default_rng(3)
    case = make_case(rng, jnp.float32, None, 2, 3, 64, 1100, None, None, False)
    q_row, (k_pages, v_pages), page_table_row, *_ = case
    got = attend_one_token(case, 1100, 1, 0, 0)
    expected = reference.ragged_paged_attention(
        jnp.asarray(q_row[None]),
        k_pages,
        v_pages,
        jnp.asarray(page_table_row[None]),
        jnp.zeros((1,), jnp.int32),
        jnp.asarray([1099], jnp.int32),
        query_block=1,
    )
    np.testing.assert_allclose(got, np.asarray(expected[0]), atol=1e-5, rtol=1e-5)
    assert jax.devices()[0].platform == "cpu"


@pytest.mark.parametrize("num_heads,half,dtype", [(5, 36, jnp.float32), (16, 36, jnp.bfloat16), (3, 64, jnp.float32)])
def test_a_latent_query_row_computes_alike_in_any_block_and_batch(num_heads, half, dtype):
    """The latent (MLA) kernel too: a row's heads are spread over the threads when blocks are few, and a
    block's rows are scored four at a time, so a row sits in another group slot in a verify block than alone."""
    from pallas_kernels.paged_attention import cpu_latent

    rng = np.random.default_rng(num_heads + half)
    length, pages_per_seq = 150, cdiv(150 + 16, PAGE_SIZE) + 1
    first = jnp.asarray(rng.standard_normal((NUM_PAGES, PAGE_SIZE, 1, half)), dtype)
    second = jnp.asarray(rng.standard_normal((NUM_PAGES, PAGE_SIZE, 1, half)), dtype)
    table_row = rng.permutation(np.arange(3, NUM_PAGES))[:pages_per_seq].astype(np.int32)
    q_row = np.asarray(jnp.asarray(rng.standard_normal((num_heads, 2 * half)), dtype))

    def attend(block, offset, neighbours):
        q, seq_ids, positions, page_table = step_layout(q_row, table_row, length, block, offset, neighbours, rng)
        got = cpu_latent.ragged_paged_latent_attention(
            q,
            first,
            second,
            page_table,
            seq_ids,
            positions,
            query_block=block,
            scale=0.19,
        )
        return np.asarray(jnp.asarray(got[offset], jnp.float32))

    want = attend(1, 0, 0)
    assert np.all(np.isfinite(want)) and np.any(want != 0)
    for layout in [(1, 0, 7), (2, 1, 0), (5, 0, 0), (5, 3, 7), (8, 7, 0), (8, 4, 2), (16, 9, 0), (16, 15, 7)]:
        np.testing.assert_array_equal(attend(*layout), want, err_msg=f"(block, offset, neighbours) {layout}")


@pytest.mark.parametrize("head_dim,groups,sliding_window", [(64, 3, None), (80, 4, None), (40, 2, 50)])
def test_every_path_matches_the_reference_in_prefill_verify_and_decode_blocks(head_dim, groups, sliding_window):
    """Row invariance says nothing about the values: each instruction path's rows, taken in blocks of 16 (prefill),
    8 (a verify step) and 1 (decode), against the reference, over several tiles of keys and a lane tail."""
    from pallas_kernels.paged_attention import reference

    rng = np.random.default_rng(head_dim)
    num_kv_heads, length = 2, 200
    case = make_case(rng, jnp.float32, None, num_kv_heads, groups, head_dim, length, sliding_window, None, False)
    _, (k_pages, v_pages), page_table_row, *_ = case
    for block in (16, 8, 1):
        count = cdiv(length, block) * block
        positions = np.arange(count, dtype=np.int32)
        positions[positions >= length] = -1  # the last block's padding
        q = jnp.asarray(rng.standard_normal((count, num_kv_heads * groups, head_dim)), jnp.float32)
        args = (q, k_pages, v_pages, jnp.asarray(page_table_row[None]), jnp.zeros((count,), jnp.int32))
        expected = reference.ragged_paged_attention(
            *args, jnp.asarray(positions), query_block=block, sliding_window=sliding_window
        )
        valid = positions >= 0
        for path in cpu_library.runnable_paths():
            got = cpu.ragged_paged_attention(
                *args, jnp.asarray(positions), query_block=block, sliding_window=sliding_window, path=path
            )
            np.testing.assert_allclose(
                np.asarray(got)[valid],
                np.asarray(expected)[valid],
                atol=2e-5,
                rtol=2e-5,
                err_msg=f"{path}, block {block}",
            )
