"""Decode chains (scheduler.num_scheduler_steps: k decode steps planned at once and run as one executable,
engine/decode_chain.py) change no output: the same tokens, text, logprobs and finish reasons as one step at a
time, never a token more, nothing cached from KV past a stop, no compile after warm-up, under stops,
preemption, chunked prefills, n > 1, penalties and seeded sampling; and they run only where they can."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.host.request import GuidedDecodingParams
from tests.engine.test_overlapped_steps import _assert_logprobs_close, _summary
from tests.support.fixtures import DERIVED_BUCKETS, fixture_dir


def _engines(**options):
    # the derived decode buckets (1, 4, 8): chains of 1, 4 and 8 rows, and rows that drop out mid-chain
    return {
        steps: LLM(fixture_dir("llama_gqa"), **{**DERIVED_BUCKETS, **options, "num_scheduler_steps": steps})
        for steps in (1, 4)
    }


def _workload(seed: int, num_requests: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 300, size=int(rng.integers(2, 50))).tolist() for _ in range(num_requests)]
    params = []
    for i in range(num_requests):
        params.append(
            SamplingParams(
                temperature=0.0 if i % 3 else 0.8,
                seed=1000 + i,
                max_tokens=int(rng.integers(1, 40)),
                stop_token_ids=[7, 11, 23],
                logprobs=2 if i % 4 == 0 else None,
                n=2 if i % 5 == 0 else 1,
                stop=["e", "an"] if i % 3 == 1 else None,
                repetition_penalty=1.3 if i % 7 == 3 else 1.0,
                frequency_penalty=0.5 if i % 7 == 5 else 0.0,
                min_tokens=3 if i % 6 == 2 else 0,
            )
        )
    return prompts, params


def _assert_idle(llm):
    stats = llm.stats()
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["kv_pages_free"] == stats["kv_pages_total"]  # nothing held (cached pages are free to take)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


@pytest.mark.parametrize(
    "options",
    [
        dict(num_pages=256, page_size=8),  # roomy: stops, lengths, n > 1, logprobs, penalties, seeded sampling
        dict(num_pages=24, page_size=4),  # tight: no chain while pages would run out; preemption between them
        dict(num_pages=256, page_size=4, max_num_batched_tokens=16, prefill_query_block=4),  # chunked prefills
    ],
    ids=["roomy", "tight", "chunked"],
)
def test_outputs_equal_with_and_without_chains(options):
    engines = _engines(**options)
    prompts, params = _workload(0, 14)
    results = {steps: llm.generate(prompts, params) for steps, llm in engines.items()}
    assert _summary(results[4]) == _summary(results[1])
    _assert_logprobs_close(results[4], results[1])
    for result, p in zip(results[4], params):
        for output in result.outputs:
            assert len(output.token_ids) <= p.max_tokens
    for llm in engines.values():
        _assert_idle(llm)
    assert engines[1].stats()["decode_chains"] == 0
    assert engines[4].stats()["decode_chains"] > 0  # the rows decoded in chains for a good part of the run


def test_one_stream_runs_in_chains_of_k_steps():
    llm = LLM(fixture_dir("llama_gqa"), **{**DERIVED_BUCKETS, "num_scheduler_steps": 4})
    stats = llm.stats()
    assert stats["num_scheduler_steps"] == 4
    # chains for the decode buckets of up to 8 rows (1, 4, 8 here) and each pages bucket
    runner = llm.engine.runner
    assert {shape.num_seqs for shape in runner.chain_executables} == {1, 4, 8}
    output = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=41, ignore_eos=True, temperature=0.0))
    assert len(output[0].outputs[0].token_ids) == 41
    stats = llm.stats()
    # the prompt's step samples the first token; the other 40 go 4 a chain, the last chain's rows planned
    # while the one before runs (the engine overlaps steps)
    assert stats["decode_chains"] == 10
    assert stats["num_compiles_after_warmup"] == 0


def test_a_stop_inside_a_chain_caches_only_the_stopped_sequence_s_own_kv():
    """A greedy request stops on a token in the middle of a chain; the steps after it computed KV for tokens it
    dropped. A second request extending the first's text must find only the real pages cached: its output and
    logprobs as without chains."""
    engines = _engines(num_pages=128, page_size=4)
    prompt = [187, 145, 81, 50, 208, 221, 12, 36]
    first = engines[1].generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    tokens = first[0].outputs[0].token_ids
    stop = tokens[9]  # the 10th token stops the request: mid-chain, with pages filled around it
    assert stop not in tokens[:9]
    followup = None
    outcomes = {}
    for steps, llm in engines.items():
        stopped = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop]))
        assert stopped[0].outputs[0].token_ids == tokens[:10]
        assert stopped[0].outputs[0].finish_reason == "stop"
        followup = prompt + tokens[:10] + [33, 34, 35]
        result = llm.generate([followup], SamplingParams(max_tokens=12, temperature=0.0, logprobs=3))
        outcomes[steps] = (result[0].outputs[0].token_ids, result[0].num_cached_tokens, result[0].outputs[0].logprobs)
        _assert_idle(llm)
    assert outcomes[4][:2] == outcomes[1][:2]
    assert outcomes[4][1] == len(prompt + tokens[:10]) // 4 * 4  # every full page of the first request was cached
    for got, want in zip(outcomes[4][2], outcomes[1][2]):
        assert got.keys() == want.keys()
        assert np.allclose([got[t] for t in want], list(want.values()), atol=1e-5)


def test_a_prompt_scored_in_chunks_beside_a_decoding_stream_runs_without_chains_meanwhile():
    """A max_tokens 0 request (prompt logprobs only) samples nothing, yet its prompt's chunks are planned: no
    chain may start while they last (a chain plans decodes only)."""
    engines = _engines(num_pages=256, page_size=4, max_num_batched_tokens=16, prefill_query_block=4)
    results = {}
    for steps, llm in engines.items():
        engine = llm.engine
        engine.add_request("a", [3, 4, 5], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        for _ in range(3):
            engine.step()
        engine.add_request("b", list(range(10, 70)), SamplingParams(max_tokens=0, prompt_logprobs=2))
        outputs = {}
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            for output in engine.step():
                outputs[output.request_id] = output
        assert not engine.has_unfinished_requests()
        scored = outputs["b"].prompt_logprobs
        results[steps] = (outputs["a"].outputs[0].token_ids, outputs["b"].outputs[0].token_ids, scored)
        _assert_idle(llm)
    assert results[4][:2] == results[1][:2]
    assert len(results[4][0]) == 30 and results[4][1] == []
    for got, want in zip(results[4][2][1:], results[1][2][1:]):
        assert got.keys() == want.keys()
        assert np.allclose([got[t] for t in want], list(want.values()), atol=1e-5)
    assert engines[4].stats()["decode_chains"] > 0


def test_no_chain_while_a_request_waits_or_a_grammar_reads_each_token():
    llm = LLM(fixture_dir("llama_gqa"), **{**DERIVED_BUCKETS, "num_scheduler_steps": 4})
    engine = llm.engine
    engine.add_request("a", [3, 4, 5], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt's step
    engine.add_request(
        "b",
        [6, 7, 8],
        SamplingParams(max_tokens=20, temperature=0.0, guided_decoding=GuidedDecodingParams(regex="[a-z ]{30}")),
    )
    for _ in range(60):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    # "b" ran from the step after "a"'s prompt to the end of both: its rows need each token's mask first
    assert llm.stats()["decode_chains"] == 0
    assert engine.decode_chains.shape(engine.schedulers) is None  # nobody running


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(num_scheduler_steps=0), "num_scheduler_steps must be in 1..32"),
        (dict(num_scheduler_steps=33), "num_scheduler_steps must be in 1..32"),
        (dict(num_scheduler_steps=4, disagg={"role": "prefill"}), "cannot run with disaggregated serving"),
    ],
)
def test_chains_that_cannot_run_are_refused_at_start(config, message):
    with pytest.raises(ValueError, match=message):
        LLM(fixture_dir("llama_gqa"), **{**DERIVED_BUCKETS, **config})


def test_prompt_lookup_chains_quiet_rows_with_the_outputs_of_speculation_off():
    """With prompt lookup the default (auto) still compiles chains: rows whose lookups stopped paying (quiet,
    engine/speculation.py chains_allowed) decode in chains, as with speculation off, and the outputs are
    speculation off's. The random model's replies to random prompts follow some of their lookups (verified)
    and not others (their rows turn quiet and chain)."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 300, size=int(rng.integers(8, 40))).tolist() for _ in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=int(rng.integers(20, 60)), stop_token_ids=[7]) for _ in prompts
    ]
    plain = LLM(fixture_dir("llama_gqa"), **{**DERIVED_BUCKETS, "num_scheduler_steps": 1})
    lookup = LLM(
        fixture_dir("llama_gqa"),
        **{**DERIVED_BUCKETS, "num_scheduler_steps": None},  # auto
        speculative={"method": "ngram", "num_speculative_tokens": 3, "speculative_adaptive": False},
    )
    assert lookup.stats()["num_scheduler_steps"] == 4 and lookup.engine.runner.chain_executables
    for batch in ([0], [1, 2], [3, 4, 5]):
        want = _summary(plain.generate([prompts[i] for i in batch], [params[i] for i in batch]))
        assert _summary(lookup.generate([prompts[i] for i in batch], [params[i] for i in batch])) == want
    stats = lookup.stats()
    assert stats["decode_chains"] > 0 and stats["speculative_num_verify_rows"] > 0
    _assert_idle(lookup)


def _draft_engine(**speculative):
    """llama_gqa with its int8 self-draft proposing 3 tokens and decode chains left at auto."""
    return LLM(
        fixture_dir("llama_gqa"),
        **{**DERIVED_BUCKETS, "num_scheduler_steps": None},  # auto
        speculative={"method": "draft", "draft_quantization": "int8", "num_speculative_tokens": 3, **speculative},
    )


def _assert_draft_chained_and_idle(draft):
    """The draft engine ran chains and verify steps, and left nothing behind: every draft page back, no compile."""
    stats = draft.stats()
    assert stats["decode_chains"] > 0 and stats["speculative_num_verify_rows"] > 0
    assert stats["speculative_draft_kv_pages_free"] == stats["speculative_draft_kv_pages_total"]
    assert stats["speculative_draft_num_compiles_after_warmup"] == 0
    _assert_idle(draft)


def test_a_draft_model_chains_plain_steps_where_the_policy_has_them_with_the_outputs_of_speculation_off():
    """With a draft model the default (auto) compiles chains too: steps the policy plans plain (here: more rows than
    speculative_max_batch_size) run in chains, as with speculation off; as rows finish, the rest speculate, their
    draft catching up on the tokens chained meanwhile. Outputs are speculation off's (greedy and seeded), the
    draft's pages all come back and nothing compiles after warm-up."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 300, size=int(rng.integers(4, 30))).tolist() for _ in range(5)]
    params = [
        SamplingParams(
            temperature=0.8 if i == 2 else 0.0,
            seed=77 + i,
            max_tokens=int(rng.integers(12, 48)),
            stop_token_ids=[7],
            logprobs=2 if i == 1 else None,
        )
        for i in range(len(prompts))
    ]
    plain = LLM(fixture_dir("llama_gqa"), **{**DERIVED_BUCKETS, "num_scheduler_steps": 1})
    draft = _draft_engine(
        speculative_max_batch_size=2,  # 3+ rows decode plain: in chains
        speculative_adaptive=False,  # 1-2 rows always speculate
    )
    assert draft.stats()["num_scheduler_steps"] == 4 and draft.engine.runner.chain_executables
    want = plain.generate(prompts, params)
    got = draft.generate(prompts, params)
    assert _summary(got) == _summary(want)
    _assert_logprobs_close(got, want)
    _assert_draft_chained_and_idle(draft)


@pytest.mark.parametrize("draft_kv_from_target", [True, False], ids=["pages-copied", "prefilled"])
def test_a_draft_model_chains_while_the_policy_has_plain_winning_and_catches_up_when_it_speculates_again(
    draft_kv_from_target,
):
    """The adaptive policy's verdicts, scripted (its own depend on timing): speculation on for one step, then plain for
    two, over and over, so the draft engine runs chains between its verify steps, with rows in flight when the mode
    switches. The draft catches up on the chained tokens (by copying the target's pages, or by prefill), and the
    outputs are speculation off's."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 300, size=int(rng.integers(4, 40))).tolist() for _ in range(4)]
    params = [
        SamplingParams(
            temperature=0.8 if i % 3 == 0 else 0.0,
            seed=50 + i,
            max_tokens=int(rng.integers(20, 60)),
            stop_token_ids=[7, 11],
            logprobs=2 if i == 1 else None,
            n=2 if i == 2 else 1,
        )
        for i in range(len(prompts))
    ]
    plain = LLM(fixture_dir("llama_gqa"), **{**DERIVED_BUCKETS, "num_scheduler_steps": 1})
    draft = _draft_engine(draft_kv_from_target=draft_kv_from_target)
    policy = draft.engine.speculation.policy
    verdicts = iter([True, False, False] * 1000)
    policy.speculate = lambda batch_size: 1 <= batch_size <= policy.max_batch_size and next(verdicts)
    for batch in ([0], [1, 2, 3]):
        want = plain.generate([prompts[i] for i in batch], [params[i] for i in batch])
        got = draft.generate([prompts[i] for i in batch], [params[i] for i in batch])
        assert _summary(got) == _summary(want)
        _assert_logprobs_close(got, want)
    caught_up = "speculative_draft_copied_pages" if draft_kv_from_target else "speculative_draft_prefill_steps"
    assert draft.stats()[caught_up] > 0
    _assert_draft_chained_and_idle(draft)
