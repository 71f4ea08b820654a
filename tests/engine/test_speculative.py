"""Speculative decoding (n-gram proposals verified in the compiled step) changes no output: greedy and
seeded sampled requests give the same tokens, text, logprobs and finish reasons with speculation on and
off, under stops, max_tokens, n > 1, sampling controls, penalties, preemption and overlapped steps, with
no compile after warm-up and no page held at the end."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.support.fixtures import SMALL_ENGINE, fixture_dir

# One bucket per kind keeps warm-up short; few pages of 4 tokens make the workload preempt.
ENGINE = {
    **SMALL_ENGINE,
    "decode_seq_buckets": (8,),
    "prefill_token_buckets": (64,),
    "page_size": 4,
    "num_pages": 40,
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "speculative_adaptive": False}


@pytest.fixture(scope="module")
def engines():
    return {
        "plain": LLM(fixture_dir("llama_gqa"), **ENGINE),
        "ngram": LLM(fixture_dir("llama_gqa"), **ENGINE, speculative=NGRAM),
    }


def workload(seed: int, num_requests: int):
    """Repetitive prompts (proposals that the tiny model's loops accept) and random ones, greedy and
    seeded sampled rows with stops, lengths, logprobs, n > 1 and the sampling controls."""
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for i in range(num_requests):
        if i % 2:
            prompts.append(rng.integers(3, 60, size=int(rng.integers(3, 9))).tolist() * int(rng.integers(2, 5)))
        else:
            prompts.append(rng.integers(3, 380, size=int(rng.integers(2, 30))).tolist())
        sampled = i % 3 == 0
        params.append(
            SamplingParams(
                temperature=0.9 if sampled else 0.0,
                seed=500 + i,
                max_tokens=int(rng.integers(1, 48)),
                stop_token_ids=[7, 11] if i % 4 == 1 else None,
                stop=["e", "an"] if i % 5 == 2 else None,
                logprobs=2 if i % 4 == 0 else None,
                n=2 if i % 7 == 3 else 1,
                top_k=20 if i % 6 == 0 else 0,
                top_p=0.8 if i % 9 == 0 else 1.0,
                min_p=0.05 if i % 12 == 0 else 0.0,
                presence_penalty=0.5 if i % 8 == 5 else 0.0,
                repetition_penalty=1.3 if i % 10 == 7 else 1.0,
                logit_bias={5: 3.0, 9: -100} if i % 11 == 4 else None,
                min_tokens=3 if i % 13 == 1 else 0,
            )
        )
    return prompts, params


def summary(results):
    return [[(o.token_ids, o.finish_reason, o.text) for o in r.outputs] for r in results]


def assert_logprobs_equal(results, expected):
    """To the bit: a verify row computes what a decode row does, the log-softmax included (row_log_softmax)."""
    for result, reference in zip(results, expected):
        for output, reference_output in zip(result.outputs, reference.outputs):
            assert (output.logprobs is None) == (reference_output.logprobs is None)
            assert output.logprobs == reference_output.logprobs


def assert_nothing_held(llm):
    stats = llm.stats()
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["kv_pages_free"] == stats["kv_pages_total"]  # cached pages are free to take
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    for scheduler in llm.engine.schedulers:
        assert scheduler.allocator.ref_counts[1:] == [0] * (scheduler.allocator.num_pages - 1)


def test_outputs_equal_with_and_without_speculation(engines):
    prompts, params = workload(0, 40)
    results = {name: llm.generate(prompts, params) for name, llm in engines.items()}
    assert summary(results["ngram"]) == summary(results["plain"])
    assert_logprobs_equal(results["ngram"], results["plain"])
    for result, p in zip(results["ngram"], params):
        for output in result.outputs:
            assert len(output.token_ids) <= p.max_tokens
    stats = engines["ngram"].stats()
    assert stats["speculative_num_accepted_tokens"] > 20  # proposals were verified and accepted
    assert stats["speculative_num_draft_tokens"] > stats["speculative_num_accepted_tokens"]  # and some rejected
    assert stats["num_preemptions"] > 0
    lines = stats["speculative_break_even_tokens"]  # the gate's line, measured from this run's steps
    assert lines and all(line >= 0 for line in lines.values())
    drafted = sum(o.num_draft_tokens for r in results["ngram"] for o in r.outputs)
    assert drafted == stats["speculative_num_draft_tokens"]
    for llm in engines.values():
        assert_nothing_held(llm)


def test_stop_tokens_and_max_tokens_end_a_verify_row_where_plain_decoding_ends(engines):
    """A prompt that ends in two rounds of the tiny model's own greedy loop: proposals (the loop again) are
    accepted, and a stop token or max_tokens among a verify row's tokens ends the output exactly there."""
    prompt = [40, 41, 42, 43, 44, 45] * 5
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    first = engines["plain"].generate([prompt], greedy)[0].outputs[0].token_ids
    period = next(n for n in range(1, 11) if first[:n] == first[n : 2 * n])
    prompt += first[: 2 * period]
    reference = engines["plain"].generate([prompt], greedy)[0].outputs[0].token_ids
    stop_at = next(i for i in range(2, 6) if reference[i] not in reference[:i])
    cases = {
        "stop token": (
            SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[reference[stop_at]]),
            stop_at + 1,
        ),
        "max_tokens": (SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), 3),
    }
    for case, (params, length) in cases.items():
        output = engines["ngram"].generate([prompt], params)[0].outputs[0]
        assert output.token_ids == reference[:length], case
        assert output.finish_reason == ("stop" if case == "stop token" else "length")
        assert output.num_accepted_draft_tokens > 0, case  # the end fell in a verify row
    assert_nothing_held(engines["ngram"])


def test_metrics_report_acceptance(engines):
    from prometheus_client import generate_latest

    from jaxserve.server.metrics import ServerMetrics

    stats = engines["ngram"].stats()
    metrics = ServerMetrics()
    metrics.observe_engine(stats)
    metrics.observe_engine(stats)  # registered once
    text = generate_latest(metrics.registry).decode()
    assert f"jaxserve_spec_decode_accepted_tokens {float(stats['speculative_num_accepted_tokens'])}" in text
    assert f"jaxserve_spec_decode_mean_accepted_length {stats['speculative_mean_accepted_length']}" in text


@pytest.mark.parametrize(
    "speculative, problem",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in"),
        ({"method": "ngram", "num_speculative_tokens": 16}, "num_speculative_tokens must be an integer in"),
        ({"method": "ngram", "num_speculative_tokens": -1}, r"num_speculative_tokens must be an integer in \[1, 15\]"),
        ({"method": "ngram", "speculative_max_batch_size": -3}, "speculative_max_batch_size must be >= 1"),
        ({"method": "eagle"}, "unknown speculative method"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "ngram", "speculative_max_batch_size": 0}, "speculative_max_batch_size must be >= 1"),
        (
            {"method": "ngram", "num_speculative_tokens": 8, "max_num_batched_tokens": 8, "prefill_query_block": 4},
            "exceeds max_num_batched",
        ),
        ({"method": "ngram", "role": "prefill"}, "prefill replica"),
        ({"method": "ngram", "typo": 1}, "unknown speculative option 'typo'"),
        ({"method": "ngram", "prompt_lookup_max": 4.0}, "prompt_lookup_max must be an integer"),
        ({"method": "ngram", "speculative_max_batch_size": "8"}, "speculative_max_batch_size must be an integer"),
        ({"method": "ngram", "speculative_adaptive": "no"}, "speculative_adaptive must be true or false"),
        ({"method": "draft", "draft_quantization": "int8", "draft_num_pages": 3.5}, "draft_num_pages must be"),
        ({"num_speculative_tokens": 4}, "num_speculative_tokens given without a method"),
        ({"method": "ngram", "draft_model": "/some/model"}, "apply to method draft, not 'ngram'"),
    ],
)
def test_bad_speculative_options_are_refused_at_start(speculative, problem):
    from jaxserve.config import EngineConfig

    outside = {
        k: speculative.pop(k) for k in ("max_num_batched_tokens", "prefill_query_block", "role") if k in speculative
    }
    with pytest.raises(ValueError, match=problem):
        EngineConfig.from_options(speculative=speculative, **outside)


def test_multi_token_bad_word_rows_decode_without_speculation_beside_grammar_rows_that_speculate(engines, monkeypatch):
    """A multi-token bad word's bans depend on the tokens before them (module docstring of
    engine/speculation.py): its row never proposes; a grammar row does (tests/engine/test_speculative_grammar.py);
    both run beside plain rows that do, with the outputs of speculation off. The gate's line is measured from the
    steps' wall time (host/proposal_gate.py), and the module's earlier tests may have left it above these rows'
    prior: pinned at 0 here, so that every proposal is verified."""
    from jaxserve.host.request import GuidedDecodingParams

    gate = engines["ngram"].engine.speculation.gate
    monkeypatch.setattr(gate.costs, "break_even", lambda batch_size: 0.0)

    loop = [40, 41, 42, 43, 44, 45] * 5
    prompts = [loop, loop, loop]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, guided_decoding=GuidedDecodingParams(regex="[a-z]{3,9}")),
        SamplingParams(temperature=0.0, max_tokens=12, bad_words=["reasonably long words"], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    ]
    results = {name: llm.generate(prompts, params) for name, llm in engines.items()}
    assert summary(results["ngram"]) == summary(results["plain"])
    drafted = [r.outputs[0].num_draft_tokens for r in results["ngram"]]
    assert drafted[0] > 0 and drafted[1] == 0 and drafted[2] > 0
    assert_nothing_held(engines["ngram"])


def test_a_config_file_section_turns_speculation_on(tmp_path):
    from jaxserve.server.config_file import load_config

    path = tmp_path / "serve.yaml"
    path.write_text("model:\n  path: default\nspeculative:\n  method: ngram\n  num_speculative_tokens: 3\n")
    speculative = load_config(str(path)).engine.speculative
    assert (speculative.method, speculative.num_speculative_tokens, speculative.verify_width) == ("ngram", 3, 4)
    overridden = load_config(str(path), ["speculative.prompt_lookup_max=6"]).engine.speculative
    assert overridden.prompt_lookup_max == 6
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        load_config(str(path), ["speculative.num_speculative_tokens=99"])


def test_k_defaults_to_the_methods_own():
    """Prompt lookup proposes up to 7 tokens (a verify step's cost grows far slower than its width), a
    draft model 4 (each proposal is a draft decode step), the target's own int8 copy 6 (it agrees with its
    target on most tokens: longer rounds pay); an explicit k wins."""
    from jaxserve.config import SpeculativeConfig

    ngram = SpeculativeConfig(method="ngram")
    assert (ngram.num_speculative_tokens, ngram.verify_width, ngram.prompt_lookup_min) == (7, 8, 1)
    draft = SpeculativeConfig(method="draft", draft_quantization="int4")
    assert (draft.num_speculative_tokens, draft.verify_width) == (4, 5)
    self_int8 = SpeculativeConfig(method="draft", draft_quantization="int8")
    assert (self_int8.num_speculative_tokens, self_int8.verify_width) == (6, 7)
    # another model's int8 weights say nothing of how often it agrees with the target
    assert (
        SpeculativeConfig(method="draft", draft_model="/models/small", draft_quantization="int8").num_speculative_tokens
        == 4
    )
    assert SpeculativeConfig(method="draft", draft_quantization="int8", num_speculative_tokens=3).verify_width == 4
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=2).verify_width == 3
    assert SpeculativeConfig().verify_width == 0


def test_int8_kv_keeps_logprobs_to_the_bit_with_speculation():
    """An int8 cache's quantize ops change how XLA fuses the step; its log-softmax then summed a decode row's
    vocabulary in another order than a verify row's (1-2 ulp in 3 of 40 logprobs) until the sum became
    row_log_softmax's."""
    engine = {**ENGINE, "kv_dtype": "int8", "num_pages": 64}
    prompts = [[5, 6, 7] * 7, [9, 3, 12, 40, 9, 3, 12, 40, 9, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3)
    results = {
        name: LLM(fixture_dir("llama_gqa"), **engine, **extra).generate(prompts, params)
        for name, extra in (("plain", {}), ("ngram", {"speculative": NGRAM}))
    }
    assert summary(results["ngram"]) == summary(results["plain"])
    assert_logprobs_equal(results["ngram"], results["plain"])
