"""The latent (MLA) paged-attention kernels: the reference against dense attention written out per sequence,
and the Pallas kernel (interpret mode) against the reference, over page sizes, query blocks, odd widths,
padding tokens and dtypes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice, AbstractMesh

from pallas_kernels.paged_attention import latent, latent_pallas, latent_pallas_tpu, latent_reference

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def make_case(rng, *, num_heads, half, page_size, query_block, lengths, new_tokens, dtype):
    """Sequences with `lengths` tokens cached in random pages, each adding `new_tokens` (a decode step when
    1): the step's entries are written with write_latent_pages, then attended. Each sequence's query tokens
    fill whole blocks; the last block of each is padded (position -1) where new_tokens does not divide."""
    pages_per_seq = -(-max(lengths) // page_size) + 1
    num_pages = 1 + len(lengths) * pages_per_seq
    page_ids = rng.permutation(np.arange(1, num_pages)).reshape(len(lengths), pages_per_seq).astype(np.int32)
    width = 2 * half - 1  # an odd entry: the last lane of the value pool is padding
    first = np.zeros((num_pages, page_size, 1, half), np.float32)
    second = np.zeros((num_pages, page_size, 1, half), np.float32)
    history = []
    for seq, length in enumerate(lengths):
        entries = rng.standard_normal((length - new_tokens, width)).astype(np.float32)
        history.append(entries)
        for position, entry in enumerate(entries):
            page, offset = page_ids[seq, position // page_size], position % page_size
            padded = np.pad(entry, (0, 2 * half - width))
            first[page, offset, 0], second[page, offset, 0] = padded[:half], padded[half:]
    blocks_per_seq = -(-new_tokens // query_block)
    positions, seq_ids, kv_indices = [], [], []
    for seq, length in enumerate(lengths):
        for slot in range(blocks_per_seq * query_block):
            position = length - new_tokens + slot if slot < new_tokens else -1
            positions.append(position)
            seq_ids.append(seq)
            kv_indices.append(
                page_ids[seq, position // page_size] * page_size + position % page_size if position >= 0 else 0
            )
    num_tokens = len(positions)
    q = rng.standard_normal((num_tokens, num_heads, 2 * half)).astype(np.float32)
    q[:, :, width:] = 0.0  # the model's queries are zero where entries are padded
    new_entries = rng.standard_normal((num_tokens, 1, width)).astype(np.float32)
    arrays = dict(
        q=jnp.asarray(q, dtype),
        entries=jnp.asarray(new_entries, dtype),
        first=jnp.asarray(first, dtype),
        second=jnp.asarray(second, dtype),
        page_table=jnp.asarray(page_ids),
        token_seq_ids=jnp.asarray(seq_ids, jnp.int32),
        positions=jnp.asarray(positions, jnp.int32),
        kv_indices=jnp.asarray(kv_indices, jnp.int32),
    )
    return arrays, history, width


def dense_latent_attention(arrays, history, width, scale):
    """Each token against its sequence's entries up to its position, written out: softmax(scale q.e) @ e."""
    q = np.asarray(arrays["q"], np.float32)
    positions, seq_ids = np.asarray(arrays["positions"]), np.asarray(arrays["token_seq_ids"])
    new_entries = np.asarray(arrays["entries"], np.float32)[:, 0]
    out = np.zeros_like(q)
    for t, (position, seq) in enumerate(zip(positions, seq_ids)):
        if position < 0:
            continue
        step = [u for u in range(len(positions)) if seq_ids[u] == seq and 0 <= positions[u] <= position]
        entries = np.concatenate(
            [np.asarray(history[seq], np.float32), new_entries[sorted(step, key=lambda u: positions[u])]]
        )
        entries = np.pad(entries, ((0, 0), (0, q.shape[-1] - width)))
        scores = scale * q[t] @ entries.T  # [H, L]
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out[t] = (weights / weights.sum(-1, keepdims=True)) @ entries
    return out


def attend(module, arrays, query_block, scale):
    first, second = latent_reference.write_latent_pages(
        arrays["first"], arrays["second"], arrays["entries"], arrays["kv_indices"]
    )
    out = module.ragged_paged_latent_attention(
        arrays["q"],
        first,
        second,
        arrays["page_table"],
        arrays["token_seq_ids"],
        arrays["positions"],
        query_block=query_block,
        scale=scale,
    )
    return np.asarray(out, np.float32)


CASES = [
    # heads, half, page_size, query_block, lengths, new tokens
    (4, 9, 4, 1, (7, 1, 13), 1),  # decode
    (3, 12, 8, 4, (21, 6), 6),  # prefill chunks with a padded block
    (2, 5, 16, 2, (40,), 3),  # a span of several pages
]


@pytest.mark.parametrize("heads, half, page_size, query_block, lengths, new_tokens", CASES)
def test_reference_equals_dense_latent_attention(heads, half, page_size, query_block, lengths, new_tokens):
    rng = np.random.default_rng(heads * 100 + half)
    arrays, history, width = make_case(
        rng,
        num_heads=heads,
        half=half,
        page_size=page_size,
        query_block=query_block,
        lengths=lengths,
        new_tokens=new_tokens,
        dtype=jnp.float32,
    )
    scale = 0.37
    got = attend(latent_reference, arrays, query_block, scale)
    np.testing.assert_allclose(got, dense_latent_attention(arrays, history, width, scale), atol=2e-5, rtol=1e-5)
    padding = np.asarray(arrays["positions"]) < 0
    assert not got[padding].any(), "padding tokens come out as zeros"


@pytest.mark.parametrize(
    "module, dtype",
    [(latent_pallas, jnp.float32), (latent_pallas, jnp.bfloat16), (latent_pallas_tpu, jnp.float32)],
    ids=["triton-f32", "triton-bf16", "mosaic-f32"],
)
@pytest.mark.parametrize("heads, half, page_size, query_block, lengths, new_tokens", CASES)
def test_pallas_equals_reference(heads, half, page_size, query_block, lengths, new_tokens, module, dtype):
    rng = np.random.default_rng(heads * 7 + page_size)
    arrays, _, _ = make_case(
        rng,
        num_heads=heads,
        half=half,
        page_size=page_size,
        query_block=query_block,
        lengths=lengths,
        new_tokens=new_tokens,
        dtype=dtype,
    )
    expected = attend(latent_reference, arrays, query_block, 0.21)
    got = attend(module, arrays, query_block, 0.21)
    np.testing.assert_allclose(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("impl", ["reference", "cpu", "pallas"])
def test_dispatch_writes_halves_and_attends(impl):
    rng = np.random.default_rng(5)
    arrays, history, width = make_case(
        rng, num_heads=2, half=6, page_size=4, query_block=1, lengths=(9, 3), new_tokens=1, dtype=jnp.float32
    )
    expected_first, expected_second = latent_reference.write_latent_pages(
        arrays["first"], arrays["second"], arrays["entries"], arrays["kv_indices"]
    )
    expected_first, expected_second = np.asarray(expected_first), np.asarray(expected_second)
    first, second = latent.write_latent_pages(  # the C++ writer updates (donated) pools in place
        arrays["first"], arrays["second"], arrays["entries"], arrays["kv_indices"], impl=impl
    )
    np.testing.assert_array_equal(np.asarray(first), expected_first)
    np.testing.assert_array_equal(np.asarray(second), expected_second)
    out = latent.ragged_paged_latent_attention(
        arrays["q"],
        first,
        second,
        arrays["page_table"],
        arrays["token_seq_ids"],
        arrays["positions"],
        query_block=1,
        scale=0.5,
        impl=impl,
    )
    expected = dense_latent_attention(arrays, history, width, 0.5)
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=1e-5)


def test_latent_attention_refuses_several_cache_heads():
    q = jnp.zeros((2, 2, 8))
    pages = jnp.zeros((3, 4, 2, 4))
    with pytest.raises(ValueError, match="one cache head"):
        latent_reference.ragged_paged_latent_attention(
            q,
            pages,
            pages,
            jnp.zeros((2, 2), jnp.int32),
            jnp.zeros(2, jnp.int32),
            jnp.zeros(2, jnp.int32),
            query_block=1,
            scale=1.0,
        )


def test_lane_chunks_are_powers_of_two_covering_the_row():
    assert latent_pallas.lane_chunks(288) == ((0, 256), (256, 32))
    assert latent_pallas.lane_chunks(12) == ((0, 8), (8, 4))
    assert latent_pallas.lane_chunks(64) == ((0, 64),)


@pytest.mark.parametrize("half, heads, query_block", [(288, 16, 1), (12, 3, 4)])
def test_pallas_latent_kernels_lower_for_gpu_and_tpu(half, heads, query_block):
    """The real (not interpret-mode) lowerings, run on this CPU machine: Triton for CUDA and Mosaic for a TPU
    v5e, with DeepSeek's entry halves (288 lanes: not a power of two) and odd head counts."""
    num_tokens = 2 * query_block
    args = (
        jnp.zeros((num_tokens, heads, 2 * half), jnp.bfloat16),
        jnp.zeros((9, 16, 1, half), jnp.bfloat16),
        jnp.zeros((9, 16, 1, half), jnp.bfloat16),
        jnp.zeros((2, 4), jnp.int32),
        jnp.repeat(jnp.arange(2, dtype=jnp.int32), query_block),
        jnp.zeros(num_tokens, jnp.int32),
    )
    kernel = jax.jit(
        functools.partial(
            latent_pallas.ragged_paged_latent_attention, query_block=query_block, scale=0.1, interpret=False
        )
    )
    assert "triton" in kernel.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    tpu = jax.jit(
        functools.partial(
            latent_pallas_tpu.ragged_paged_latent_attention, query_block=query_block, scale=0.1, interpret=False
        )
    )
    v5e = AbstractMesh(
        (1,), ("x",), abstract_device=AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    )
    with jax.sharding.use_abstract_mesh(v5e):
        assert "tpu_custom_call" in tpu.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
