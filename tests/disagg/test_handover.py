"""Prefill on one engine, decode on another, in one process: outputs equal the colocated engine's, only
the pages the decode side lacks travel, and no page is leaked on either side."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.device.page_copies import handover_chunk_sizes
from jaxserve.disagg.handover import DisaggregatedPair, HandoverStats
from jaxserve.models.kv_pages import KVPages
from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def pair():
    prefill = LLM(fixture_dir("llama_gqa"), role="prefill", **SMALL_ENGINE).engine
    decode = LLM(fixture_dir("llama_gqa"), role="decode", **SMALL_ENGINE).engine
    return DisaggregatedPair(prefill, decode)


@pytest.fixture(scope="module")
def one_slot_decode():
    """A decode engine with one slot, shared by both ways of handling a full decode side."""
    return LLM(fixture_dir("llama_gqa"), role="decode", **{**SMALL_ENGINE, "max_num_seqs": 1}).engine


def all_pages_free(engine):
    stats = engine.stats()
    return stats["kv_pages_free"] == stats["kv_pages_total"]


def page_bytes(engine):
    config = engine.model_config
    return KVPages.bytes_per_page(
        config.num_layers,
        engine.config.cache.page_size,
        config.num_kv_heads,
        engine.runner.kv_pages.keys[0].shape[-1],
        engine.runner.kv_pages.keys[0].dtype,
    )


def test_greedy_outputs_equal_colocated(pair, llama_llm):
    prompts = [p["token_ids"] for p in expected("llama_gqa")["prompts"]]
    colocated = llama_llm.generate(prompts, GREEDY)
    disaggregated = pair.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in disaggregated] == [o.outputs[0].token_ids for o in colocated]
    assert [o.outputs[0].text for o in disaggregated] == [o.outputs[0].text for o in colocated]
    assert pair.stats.num_handovers == sum(1 for o in colocated if len(o.outputs[0].token_ids) > 1)
    assert all_pages_free(pair.prefill_engine) and all_pages_free(pair.decode_engine)
    assert not pair.prefill_engine.handovers.parked and not pair.decode_engine.handovers.reservations
    # the page copies compiled at warm-up: handing over (any page count) compiles nothing
    assert [e.runner.num_compiles_after_warmup for e in (pair.prefill_engine, pair.decode_engine)] == [0, 0]


def test_only_missing_pages_travel(pair, llama_llm):
    rng = np.random.default_rng(7)
    shared = [1] + rng.integers(3, 384, size=31).tolist()  # two full pages of 16
    warm, prompt = shared + rng.integers(3, 384, size=5).tolist(), shared + rng.integers(3, 384, size=20).tolist()
    pair.decode_engine.add_request("warm", warm, GREEDY)  # the decode side computes the shared prefix itself
    while pair.decode_engine.has_unfinished_requests():
        pair.decode_engine.step()
    before = HandoverStats(**vars(pair.stats))
    [output] = pair.generate([prompt], GREEDY)
    assert output.outputs[0].token_ids == llama_llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    # 52 prompt tokens fill 4 pages; the decode side holds the first 2, so pages 3 and 4 travel
    assert pair.stats.num_pages_moved - before.num_pages_moved == 2
    assert pair.stats.num_pages_reused - before.num_pages_reused == 2
    assert pair.stats.bytes_moved - before.bytes_moved == 2 * page_bytes(pair.decode_engine)
    assert output.num_cached_tokens == 32
    assert all_pages_free(pair.prefill_engine) and all_pages_free(pair.decode_engine)


def test_timeouts_and_cancels_free_pages(pair):
    prefill, decode = pair.prefill_engine, pair.decode_engine
    prompt = list(range(3, 40))
    prefill.add_request("slow", prompt, GREEDY)
    while "slow" not in prefill.handovers.parked:
        prefill.step()
    reservation = decode.handovers.reserve("slow", prompt, GREEDY)
    assert reservation is not None and not all_pages_free(decode) and not all_pages_free(prefill)
    prefill.handovers.parked["slow"].deadline = decode.handovers.reservations["slow"].deadline = 0.0
    assert prefill.handovers.expire() == ["slow"] and decode.handovers.expire() == ["slow"]
    assert all_pages_free(prefill) and all_pages_free(decode)
    assert not prefill.has_request("slow")


def test_decode_side_recomputes_when_prefill_is_lost(pair, llama_llm):
    prompt = list(range(5, 60))
    reservation = pair.decode_engine.handovers.reserve("lost", prompt, GREEDY)
    assert reservation is not None
    pair.decode_engine.handovers.recompute("lost", prompt, GREEDY)
    outputs = {}
    while pair.decode_engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in pair.decode_engine.step())
    assert outputs["lost"].outputs[0].token_ids == llama_llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert all_pages_free(pair.decode_engine)


@pytest.mark.parametrize("num_pages, sizes", [(0, []), (1, [1]), (2, [2]), (7, [4, 2, 1]), (13, [8, 4, 1]), (16, [16])])
def test_handover_chunks_are_powers_of_two_without_padding(num_pages, sizes):
    assert handover_chunk_sizes(num_pages) == sizes


def test_seeded_sampling_continues_as_colocated(pair, llama_llm):
    """The decode side draws later tokens from the prefill side's sampling seed: a seeded sampled request
    is the same disaggregated as colocated."""
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    prompts = [p["token_ids"] for p in expected("llama_gqa")["prompts"][:3]]
    disaggregated = pair.generate(prompts, sampled)
    colocated = llama_llm.generate(prompts, sampled)
    assert [o.outputs[0].token_ids for o in disaggregated] == [o.outputs[0].token_ids for o in colocated]


def test_chunked_copies_move_exactly_the_pages(pair):  # last: it overwrites free decode pages
    prefill, decode = pair.prefill_engine, pair.decode_engine
    source, target = [3, 9, 4, 12, 5, 6, 7], [20, 21, 22, 23, 24, 25, 26]
    chunks = prefill.runner.gather_pages(source)
    assert [chunk.shape[1] for chunk in chunks] == [4, 2, 1]
    assert sum(chunk.nbytes for chunk in chunks) == len(source) * page_bytes(prefill)
    decode.runner.scatter_pages(target, chunks)
    moved = np.concatenate([np.asarray(chunk) for chunk in decode.runner.gather_pages(target)], axis=1)
    layers = prefill.runner.kv_pages.keys + prefill.runner.kv_pages.values
    original = np.stack([np.asarray(layer)[source] for layer in layers])
    np.testing.assert_array_equal(moved, original)
    with pytest.raises(ValueError, match="7 pages to write"):
        decode.runner.scatter_pages(target, chunks[:2])
    assert prefill.runner.num_compiles_after_warmup == decode.runner.num_compiles_after_warmup == 0


@pytest.mark.parametrize("when_decode_full", ["queue", "prefill_here"])
def test_a_full_decode_side_queues_the_handover_or_prefills_and_counts_it(
    pair, one_slot_decode, llama_llm, when_decode_full
):
    """One decode slot for four requests: queued, every request is handed over once the slot frees;
    otherwise the decode side prefills the ones that found it full, and says how many. (The module pair's
    prefill engine, whose pages test_chunked_copies_move_exactly_the_pages only read.)"""
    prefill, decode = pair.prefill_engine, one_slot_decode
    local_before = decode.stats()["handover_local_prefills"]
    full_pair = DisaggregatedPair(prefill, decode, when_decode_full=when_decode_full)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [p["token_ids"] for p in expected("llama_gqa")["prompts"][:4]]
    outputs = full_pair.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == [
        o.outputs[0].token_ids for o in llama_llm.generate(prompts, params)
    ]
    local = decode.stats()["handover_local_prefills"] - local_before
    assert full_pair.stats.num_handovers + local == 4
    assert local == 0 if when_decode_full == "queue" else local > 0
    assert all_pages_free(prefill) and all_pages_free(decode) and not decode.handovers.queued
