"""The C++ CPU latent (MLA) attention kernel (cpu_latent.py) against latent_reference, in ragged steps that mix
prefill chunks and decode rows, over several pages and key tiles per sequence, odd head counts, entry halves
whose width is no multiple of 16 (V3's 288 lanes at tiny scale: 36), query blocks > 1 and padding tokens,
in float32 and bfloat16."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import cpu_latent, latent, latent_reference

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def mixed_step(rng, *, num_heads, half, page_size, query_block, lengths, new_tokens, dtype):
    """Sequences of `lengths` tokens whose last new_tokens[s] are this step's queries (1: a decode row,
    more: a prefill chunk), every entry already in randomly placed pages; each sequence's queries fill
    whole blocks, padded with position -1. The page table has a spare page per sequence (never read)."""
    pages_per_seq = -(-max(lengths) // page_size) + 1
    num_pages = 1 + len(lengths) * pages_per_seq
    page_ids = rng.permutation(np.arange(1, num_pages)).reshape(len(lengths), pages_per_seq).astype(np.int32)
    first = rng.standard_normal((num_pages, page_size, 1, half)).astype(np.float32)  # unused rows: noise
    second = rng.standard_normal((num_pages, page_size, 1, half)).astype(np.float32)
    positions, seq_ids = [], []
    for seq, (length, new) in enumerate(zip(lengths, new_tokens)):
        for slot in range(-(-new // query_block) * query_block):
            positions.append(length - new + slot if slot < new else -1)
            seq_ids.append(seq)
    q = rng.standard_normal((len(positions), num_heads, 2 * half)).astype(np.float32)
    arrays = (q, first, second, page_ids, np.asarray(seq_ids, np.int32), np.asarray(positions, np.int32))
    return tuple(jnp.asarray(a, dtype) if i < 3 else jnp.asarray(a) for i, a in enumerate(arrays))


CASES = [
    # heads, half, page_size, query_block, lengths, new tokens
    (5, 36, 4, 4, (30, 9, 70, 3), (7, 1, 1, 3)),  # prefill chunks and decode rows; 70 keys: two tiles
    (3, 36, 8, 1, (100, 5, 17), (1, 1, 1)),  # decode
    (7, 36, 16, 1, (150,), (1,)),  # one sequence decoding: its heads spread over the threads
    (1, 5, 2, 8, (20, 133), (20, 13)),  # a first chunk from position 0, one head, tiny odd halves
]


@functools.cache
def jitted(module):
    return jax.jit(module.ragged_paged_latent_attention, static_argnames=("query_block", "scale"))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads, half, page_size, query_block, lengths, new_tokens", CASES)
def test_cpu_latent_kernel_equals_reference(heads, half, page_size, query_block, lengths, new_tokens, dtype):
    rng = np.random.default_rng(heads * 31 + half + page_size)
    args = mixed_step(
        rng,
        num_heads=heads,
        half=half,
        page_size=page_size,
        query_block=query_block,
        lengths=lengths,
        new_tokens=new_tokens,
        dtype=dtype,
    )
    scale = 0.19
    expected = np.asarray(jitted(latent_reference)(*args, query_block=query_block, scale=scale), np.float32)
    got = jitted(cpu_latent)(*args, query_block=query_block, scale=scale)
    assert got.dtype == dtype and got.shape == args[0].shape
    got = np.asarray(got, np.float32)
    np.testing.assert_allclose(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    padding = np.asarray(args[5]) < 0
    assert padding.any() == (query_block > 1 and any(n % query_block for n in new_tokens))
    assert not got[padding].any(), "padding tokens come out as zeros"


def test_cpu_impl_dispatches_to_the_kernel(monkeypatch):
    """latent.py's impl='cpu' runs the C++ kernel (not the reference) when q and the pools share a dtype."""
    calls = []
    kernel = cpu_latent.ragged_paged_latent_attention
    monkeypatch.setattr(cpu_latent, "ragged_paged_latent_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    args = mixed_step(
        np.random.default_rng(1),
        num_heads=2,
        half=6,
        page_size=4,
        query_block=1,
        lengths=(9, 3),
        new_tokens=(1, 1),
        dtype=jnp.float32,
    )
    out = latent.ragged_paged_latent_attention(*args, query_block=1, scale=0.5, impl="cpu")
    expected = latent_reference.ragged_paged_latent_attention(*args, query_block=1, scale=0.5)
    assert calls, "impl='cpu' ran the reference"
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=2e-5, rtol=1e-5)


def test_cpu_latent_kernel_refuses_mismatched_inputs():
    q = jnp.zeros((2, 2, 8), jnp.float32)
    pages = jnp.zeros((3, 4, 1, 4), jnp.float32)
    table, ids = jnp.zeros((2, 2), jnp.int32), jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match="one of"):
        cpu_latent.ragged_paged_latent_attention(
            q.astype(jnp.bfloat16), pages, pages, table, ids, ids, query_block=1, scale=1.0
        )
    with pytest.raises(ValueError, match="one cache head"):
        cpu_latent.ragged_paged_latent_attention(
            q, pages[..., :3], pages[..., :3], table, ids, ids, query_block=1, scale=1.0
        )
    with pytest.raises(ValueError, match="query_block"):
        cpu_latent.ragged_paged_latent_attention(q, pages, pages, table, ids, ids, query_block=4, scale=1.0)


def test_deepseek_fixture_served_by_the_cpu_kernel_equals_transformers(monkeypatch):
    """End to end: a transformers-written DeepSeek-V2-Lite fixture with attention_impl='cpu' traces the C++
    latent kernel and keeps transformers' greedy tokens and logprobs, with no compiles after warm-up."""
    from jaxserve import LLM
    from tests.support.fixtures import SMALL_ENGINE, fixture_dir
    from tests.support.hf_parity import check_against_hf

    traced = []
    kernel = cpu_latent.ragged_paged_latent_attention
    monkeypatch.setattr(
        cpu_latent, "ragged_paged_latent_attention", lambda *a, **k: traced.append(1) or kernel(*a, **k)
    )
    llm = LLM(fixture_dir("deepseek_v2_lite"), **{**SMALL_ENGINE, "attention_impl": "cpu"})
    assert llm.stats()["attention_impl"] == "cpu" and traced
    check_against_hf(llm, "deepseek_v2_lite")
    assert llm.stats()["num_compiles_after_warmup"] == 0
