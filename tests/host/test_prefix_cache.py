"""Prefix caching: shared full pages, reuse across chat turns, eviction, and outputs unchanged by it."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve import LLM, SamplingParams
from jaxserve.device.page_copies import host_pages_to_array
from jaxserve.host.page_allocator import PageAllocator
from tests.support.fixtures import SMALL_ENGINE, fixture_dir
from tests.support.scheduling import drive, make_scheduler, make_seq

ENGINE = {**SMALL_ENGINE, "max_model_len": 256, "page_size": 8}


def shared_prefix_prompts(rng, num_groups=3, per_group=4, prefix_len=40):
    prompts = []
    for _ in range(num_groups):
        prefix = [1] + rng.integers(3, 384, size=prefix_len - 1).tolist()
        prompts += [prefix + rng.integers(3, 384, size=int(n)).tolist() for n in rng.integers(1, 20, size=per_group)]
    return prompts


@pytest.fixture(scope="module")
def cached_llm():
    return LLM(fixture_dir("llama_gqa"), **ENGINE)


@pytest.fixture(scope="module")
def uncached_llm():
    return LLM(fixture_dir("llama_gqa"), **{**ENGINE, "enable_prefix_caching": False})


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=16, temperature=0.0),
        SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=11),
    ],
)
def test_outputs_equal_with_and_without_caching(cached_llm, uncached_llm, params):
    prompts = shared_prefix_prompts(np.random.default_rng(0))
    # run twice on the cached engine: the second pass hits pages computed by the first
    first = cached_llm.generate(prompts, params)
    second = cached_llm.generate(prompts, params)
    reference = uncached_llm.generate(prompts, params)
    tokens = lambda outputs: [o.outputs[0].token_ids for o in outputs]
    assert tokens(first) == tokens(reference) == tokens(second)
    assert all(o.num_cached_tokens >= 40 // 8 * 8 for o in second)
    assert all(o.num_cached_tokens == 0 for o in reference)
    stats = cached_llm.stats()
    assert stats["prefix_cache_hit_tokens"] > 0 and 0 < stats["prefix_cache_hit_rate"] <= 1
    assert uncached_llm.stats()["prefix_cache_hit_tokens"] == 0


def test_chat_turns_reuse_the_previous_prompt_and_answer(cached_llm):
    rng = np.random.default_rng(1)
    conversation = [1] + rng.integers(3, 384, size=27).tolist()  # 28 + 12 answer tokens: 5 full pages
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    previous_length = 0
    for turn in range(4):
        output = cached_llm.generate([conversation], params)[0]
        if turn > 0:
            # every full page of the previous turn's prompt and answer, its last token's page included
            assert output.num_cached_tokens >= previous_length // 8 * 8
        answer = output.outputs[0].token_ids
        previous_length = len(conversation) + len(answer)
        conversation = conversation + answer + rng.integers(3, 384, size=7).tolist()


def test_shared_pages_are_never_written(cached_llm):
    rng = np.random.default_rng(2)
    prefix = [1] + rng.integers(3, 384, size=47).tolist()
    cached_llm.generate([prefix + [5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))
    allocator = cached_llm.engine.schedulers[0].allocator
    pages = allocator.find_cached_prefix(prefix, len(prefix)).pages
    assert len(pages) == 48 // 8
    runner = cached_llm.engine.runner
    before = [np.asarray(layer[np.asarray(pages)]) for layer in runner.kv_pages.keys + runner.kv_pages.values]
    outputs = cached_llm.generate(
        [prefix + rng.integers(3, 384, size=9).tolist() for _ in range(3)],
        SamplingParams(max_tokens=10, temperature=0.0),
    )
    assert all(o.num_cached_tokens == 48 for o in outputs)
    after = [np.asarray(layer[np.asarray(pages)]) for layer in runner.kv_pages.keys + runner.kv_pages.values]
    for old, new in zip(before, after):
        np.testing.assert_array_equal(old, new)


def test_miss_reasons_are_counted():
    allocator = PageAllocator(4, 2, enable_prefix_caching=True)  # 3 usable pages of 2 tokens
    seq_pages = allocator.allocate(2)
    key = allocator.cache_full_page(seq_pages[0], 0, (1, 2))
    allocator.cache_full_page(seq_pages[1], key, (3, 4))
    allocator.release(seq_pages)
    found = allocator.find_cached_prefix([1, 2, 3, 4, 5], 4)
    assert found.pages == seq_pages and found.miss_reason == "partial_page"
    found = allocator.find_cached_prefix([9, 9, 9], 2)
    assert found.pages == [] and found.miss_reason == "never_seen"
    allocator.allocate(3)  # takes the free page, then evicts the leaf (3, 4), then its parent
    assert allocator.stats.num_evictions == 2
    found = allocator.find_cached_prefix([1, 2, 3, 4, 5], 4)
    assert found.pages == [] and found.miss_reason == "evicted"


def test_eviction_is_least_recently_released_leaves_first():
    allocator = PageAllocator(7, 1, enable_prefix_caching=True)
    old = allocator.allocate(3)  # a three-page sequence, released first
    new = allocator.allocate(3)
    for pages, tokens in ((old, (1, 2, 3)), (new, (4, 5, 6))):
        parent = 0
        for page, token in zip(pages, tokens):
            parent = allocator.cache_full_page(page, parent, (token,))
    allocator.release(old)
    allocator.release(new)
    evicted = allocator.allocate(6)
    assert evicted == old[::-1] + new[::-1], "older sequences first, each leaf before its parent"


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 12), st.integers(1, 10), st.integers(0, 5), st.booleans()),
        min_size=1,
        max_size=10,
    ),
    st.integers(10, 30),
)
def test_random_shared_prefix_workloads_complete_without_leaks(requests, num_pages):
    """Random arrivals sharing prefixes, cancellations and preemption, with caching on."""
    scheduler = make_scheduler(num_pages=num_pages, page_size=4, max_num_seqs=3, budget=16, block=4)
    scheduler.allocator.enable_prefix_caching = True
    prefixes = [[1] * 8, [2] * 12, [3] * 5]
    pending = []
    for group, extra, max_tokens, arrival, cancel in requests:
        seq = make_seq(1, max_tokens)
        seq.prompt_token_ids = prefixes[group] + [7] * extra
        if -(-(seq.num_prompt_tokens + max_tokens) // 4) <= num_pages - 1:
            pending.append((arrival, seq, cancel))
    drive(scheduler, pending)
    assert all(count == 0 for count in scheduler.allocator.ref_counts[1:])


def test_host_tier_round_trip_is_bit_exact():
    rng = np.random.default_rng(3)
    prefix = [1] + rng.integers(3, 384, size=47).tolist()  # 6 full pages of 8
    llm = LLM(fixture_dir("llama_gqa"), **{**ENGINE, "num_pages": 16, "swap_space": 0.01})
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = llm.generate([prefix + [5, 6, 7]], params)[0]
    allocator, runner = llm.engine.schedulers[0].allocator, llm.engine.runner
    pages = allocator.find_cached_prefix(prefix, len(prefix)).pages
    saved = host_pages_to_array(runner.read_pages(pages))
    # unrelated prompts fill the 15 usable pages and evict (demote) every page of the prefix
    llm.generate([[1] + rng.integers(3, 384, size=60).tolist() for _ in range(3)], params)
    assert allocator.find_cached_prefix(prefix, len(prefix)).pages == []
    assert llm.stats()["swapped_out_pages"] >= 6 and llm.stats()["host_tier_pages"] >= 6
    again = llm.generate([prefix + [5, 6, 7]], params)[0]
    assert again.num_cached_tokens == 48 and llm.stats()["host_tier_hit_tokens"] >= 48
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    promoted = allocator.find_cached_prefix(prefix, len(prefix)).pages
    np.testing.assert_array_equal(host_pages_to_array(runner.read_pages(promoted)), saved)


def test_far_too_small_cache_gives_the_same_outputs():
    rng = np.random.default_rng(4)
    prompts = shared_prefix_prompts(rng, num_groups=3, per_group=3, prefix_len=40)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = LLM(fixture_dir("llama_gqa"), **ENGINE).generate(prompts, params)
    for swap_space in (0.0, 0.01):
        small = LLM(fixture_dir("llama_gqa"), **{**ENGINE, "num_pages": 12, "swap_space": swap_space})
        cramped = small.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in cramped] == [o.outputs[0].token_ids for o in roomy]
        stats = small.stats()
        assert stats["prefix_cache_evictions"] > 0 and stats["kv_pages_free"] == stats["kv_pages_total"]
        if swap_space:
            assert stats["host_tier_hit_tokens"] > 0


def test_session_pages_are_kept_in_preference():
    now = [0.0]
    allocator = PageAllocator(5, 1, enable_prefix_caching=True, session_ttl=10.0, clock=lambda: now[0])
    session, other = allocator.allocate(2), allocator.allocate(2)
    for pages, token in ((session, 1), (other, 2)):
        parent = 0
        for page in pages:
            parent = allocator.cache_full_page(page, parent, (token,))
    allocator.keep_for_session(session)
    allocator.release(session)  # released first: plain LRU would evict these first
    allocator.release(other)
    assert sorted(allocator.allocate(2)) == sorted(other)
    now[0] = 11.0  # the session's preference has lapsed
    assert sorted(allocator.allocate(2)) == sorted(session)


def test_swap_in_is_chosen_only_when_cheaper_than_recompute():
    from jaxserve.host.page_allocator import swap_in_is_cheaper

    # a 16-token page of a 34M-parameter model: 196 KiB to copy vs ~1 GFLOP to recompute
    assert swap_in_is_cheaper(196 * 1024, 16, 34_000_000, "cpu")
    assert swap_in_is_cheaper(2 * 2**20, 16, 8_000_000_000, "gpu")
    # a model with almost no compute per token but fat KV pages is cheaper to recompute
    assert not swap_in_is_cheaper(64 * 2**20, 16, 1000, "gpu")
