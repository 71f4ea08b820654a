"""Overlapped steps (the host plans step N+1 while step N runs) change no output: the same tokens, text,
logprobs and finish reasons as stepping in turn, never a token more, and no compile after warm-up,
under stops, preemption, prefix-cache flushes, aborts, n > 1 and seeded sampling."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.support.fixtures import DERIVED_BUCKETS, SMALL_ENGINE, fixture_dir


def _engines(**options):
    # the derived decode buckets (1, 4, 8): a step planned while the last runs often changes shape
    return {
        overlap: LLM(fixture_dir("llama_gqa"), **{**DERIVED_BUCKETS, **options, "overlap_steps": overlap})
        for overlap in (False, True)
    }


def _workload(seed: int, num_requests: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 300, size=int(rng.integers(2, 50))).tolist() for _ in range(num_requests)]
    params = []
    for i in range(num_requests):
        temperature = 0.0 if i % 3 else 0.8
        params.append(
            SamplingParams(
                temperature=temperature,
                seed=1000 + i,
                max_tokens=int(rng.integers(1, 40)),
                stop_token_ids=[7, 11, 23],
                logprobs=2 if i % 4 == 0 else None,
                n=2 if i % 5 == 0 else 1,
                stop=["e", "an"] if i % 3 == 1 else None,
            )
        )
    return prompts, params


def _summary(results):
    return [[(o.token_ids, o.finish_reason, o.text) for o in r.outputs] for r in results]


def _assert_logprobs_close(results, expected):
    """Equal up to float noise: preemption may recompute a prompt in a differently shaped batch."""
    for result, reference in zip(results, expected):
        for output, reference_output in zip(result.outputs, reference.outputs):
            for got, want in zip(output.logprobs or [], reference_output.logprobs or []):
                assert got.keys() == want.keys()
                assert np.allclose([got[t] for t in want], list(want.values()), atol=1e-4)


@pytest.mark.parametrize(
    "options",
    [
        dict(num_pages=256, page_size=8),  # roomy: stops, lengths, n > 1, logprobs, seeded sampling
        dict(num_pages=24, page_size=4),  # tight: sequences get preempted and recomputed
        dict(num_pages=256, page_size=4, max_num_batched_tokens=16, prefill_query_block=4),  # long chunked prefills
    ],
    ids=["roomy", "preempting", "chunked"],
)
def test_outputs_equal_with_and_without_overlap(options):
    engines = _engines(**options)
    prompts, params = _workload(0, 14)
    results = {overlap: llm.generate(prompts, params) for overlap, llm in engines.items()}
    assert _summary(results[True]) == _summary(results[False])
    _assert_logprobs_close(results[True], results[False])
    for result, p in zip(results[True], params):
        for output in result.outputs:
            assert len(output.token_ids) <= p.max_tokens
            assert output.finish_reason in ("stop", "length")
    for llm in engines.values():
        stats = llm.stats()
        assert stats["num_compiles_after_warmup"] == 0
        assert stats["kv_pages_free"] == stats["kv_pages_total"]  # nothing held (cached pages are free to take)
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert all(
            not s._free_buffer_entries or len(s._free_buffer_entries) == s.max_num_seqs for s in llm.engine.schedulers
        )
    if options["num_pages"] == 24:
        assert engines[True].stats()["num_preemptions"] > 0
    assert engines[True].stats()["overlap_steps"] is True


def test_multi_turn_reuses_pages_flushed_under_overlap():
    """A reply that ends on a page boundary is flushed by the step already in flight; the next turn
    finds the whole conversation cached either way."""
    engines = _engines(num_pages=128, page_size=4)
    prompt = list(range(3, 15))  # 12 tokens: 3 pages
    hits = {}
    for overlap, llm in engines.items():
        first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
        follow_up = prompt + first.outputs[0].token_ids + [40, 41, 42]
        second = llm.generate([follow_up], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
        hits[overlap] = (first.outputs[0].token_ids, second.outputs[0].token_ids, second.num_cached_tokens)
    assert hits[True] == hits[False]
    assert hits[True][2] == 16  # prompt and reply: four whole pages


def test_abort_while_a_step_is_in_flight_frees_everything():
    llm = LLM(fixture_dir("llama_gqa"), **{**DERIVED_BUCKETS, "num_pages": 64, "page_size": 4})
    engine = llm.engine
    engine.add_request("a", list(range(3, 20)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.add_request("b", list(range(5, 12)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    outputs = {}
    for _ in range(3):  # with decode chains (engine/decode_chain.py) "b" may finish in these
        for output in engine.step():
            outputs[output.request_id] = output
    assert engine.has_step_in_flight
    engine.abort_request("a")
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            outputs[output.request_id] = output
    assert not engine.has_unfinished_requests()
    assert "a" not in outputs or not outputs["a"].finished
    assert len(outputs["b"].outputs[0].token_ids) == 5
    reference = LLM(
        fixture_dir("llama_gqa"), **{**DERIVED_BUCKETS, "num_pages": 64, "page_size": 4, "overlap_steps": False}
    )
    expected = reference.generate([list(range(5, 12))], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert outputs["b"].outputs[0].token_ids == expected[0].outputs[0].token_ids
    scheduler = engine.schedulers[0]
    assert not scheduler.running and not scheduler.waiting
    assert len(scheduler._free_buffer_entries) == scheduler.max_num_seqs
    assert scheduler.allocator.num_free_pages == scheduler.allocator.num_usable_pages


def test_stats_report_host_time_and_device_idle_time():
    llm = LLM(fixture_dir("llama_gqa"), **SMALL_ENGINE)
    llm.generate([[3, 4, 5, 6]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    stats = llm.stats()
    assert stats["host_seconds_per_step"] > 0
    assert stats["device_idle_seconds_per_step"] >= 0
