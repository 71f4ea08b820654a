"""Guided rows speculate (engine/speculation.py): proposals cut where the grammar refuses them, the tokens a
grammar forces proposed even where prompt lookup finds nothing, each verify position masked by the grammar
advanced through the proposals before it. Outputs, logprobs and finish reasons equal speculation off's
(greedy and seeded sampled, n > 1, overlapped steps, a draft model, a grammar that starts after a token),
replies fit their grammars, nothing compiles after warm-up and no page is held at the end."""

import json
import re

import jsonschema
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.host.request import GuidedDecodingParams
from tests.engine.test_guided_decoding import CHOICES, LARK, LARK_TEXT, REGEXES, SCHEMAS
from tests.engine.test_speculative import assert_logprobs_equal, summary
from tests.support.sampling_engines import ENGINE_OPTIONS, assert_idle

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "speculative_adaptive": False}
SELF_INT8 = {
    "method": "draft",
    "draft_quantization": "int8",
    "num_speculative_tokens": 3,
    "speculative_adaptive": False,
}
# Examples to quote: prompt lookup finds the schema's keys and values in them
PROMPT = (
    'Examples: {"name": "ada", "age": 31, "tags": ["a", "b"], "ok": true}\n'
    '{"id": 12, "kind": "circle", "center": {"x": 3, "y": -4}}\nyes-123 Paris alpha let x = 42;\nNow: '
)


OPTIONS = {**ENGINE_OPTIONS, "max_model_len": 640}  # room for the quoted examples, twice, and a JSON reply


@pytest.fixture(scope="module")
def engines():
    return {
        "plain": LLM("tiny-random", **OPTIONS),
        "ngram": LLM("tiny-random", **OPTIONS, speculative=NGRAM),
        "ngram_not_overlapped": LLM("tiny-random", **OPTIONS, speculative=NGRAM, overlap_steps=False),
        "self_int8": LLM("tiny-random", **OPTIONS, speculative=SELF_INT8),
    }


def guided(max_tokens: int, seed: int | None = None, n: int = 1, logprobs: int | None = None, **kind):
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if seed is None else 1.0,
        seed=seed,
        n=n,
        logprobs=logprobs,
        guided_decoding=GuidedDecodingParams(**kind),
    )


def workload():
    params = [guided(150, json=schema) for schema in SCHEMAS[:2]]
    params += [guided(150, seed=5, n=2, logprobs=2, json=SCHEMAS[0]), guided(150, seed=6, json=SCHEMAS[1])]
    params += [guided(40, regex=REGEXES[0]), guided(40, seed=7, regex=REGEXES[1]), guided(20, choice=CHOICES)]
    params += [guided(40, grammar=LARK), guided(40, seed=8, grammar=LARK, logprobs=1)]
    patterns = ["json"] * 4 + [REGEXES[0], REGEXES[1], None, LARK_TEXT, LARK_TEXT]
    return params, patterns


@pytest.mark.parametrize("name", ["ngram", "ngram_not_overlapped", "self_int8"])
def test_guided_rows_speculate_with_the_outputs_of_speculation_off(engines, name):
    params, patterns = workload()
    expected = engines["plain"].generate([PROMPT] * len(params), params)
    results = engines[name].generate([PROMPT] * len(params), params)
    assert summary(results) == summary(expected)
    assert_logprobs_equal(results, expected)
    for result, p, pattern in zip(results, params, patterns):
        for out in result.outputs:
            assert out.finish_reason == "stop", (out.finish_reason, out.text)
            if pattern == "json":
                jsonschema.validate(json.loads(out.text), json.loads(p.guided_decoding.json))
            elif pattern is None:
                assert out.text in CHOICES
            else:
                assert re.fullmatch(pattern, out.text), (pattern, out.text)
    # every row of a grammar that forces some tokens (JSON keys, the choice's tails, Lark's literals) proposed
    forcing = [out for result, pattern in zip(results, patterns) if pattern != REGEXES[1] for out in result.outputs]
    assert all(out.num_draft_tokens for out in forcing), [out.num_draft_tokens for out in forcing]
    accepted = sum(out.num_accepted_draft_tokens for out in forcing)
    assert accepted > sum(len(out.token_ids) for out in forcing) // 3, accepted
    assert_idle(engines[name])


def test_the_tokens_a_grammar_forces_are_proposed_where_lookup_finds_nothing(engines):
    """A prompt that quotes nothing of the reply: the schema's keys and punctuation are still proposed
    (llguidance's forced tokens), and accepted: fewer steps than tokens."""
    llm = engines["ngram"]
    params = guided(150, json=SCHEMAS[1])
    before = llm.stats()["speculative_num_verify_rows"]
    (result,) = llm.generate([[1, 275, 240]], params)
    (expected,) = engines["plain"].generate([[1, 275, 240]], params)
    out = result.outputs[0]
    assert summary([result]) == summary([expected])
    jsonschema.validate(json.loads(out.text), SCHEMAS[1])
    verify_rows = llm.stats()["speculative_num_verify_rows"] - before
    assert out.num_accepted_draft_tokens >= len(out.token_ids) // 3, (out.num_accepted_draft_tokens, len(out.token_ids))
    assert 0 < verify_rows < len(out.token_ids)
    assert_idle(llm)


@pytest.mark.parametrize("name", ["ngram", "ngram_not_overlapped"])
def test_a_grammar_after_a_token_speculates_before_and_after_it(engines, name):
    """guided_decoding_after_token (a reasoning model's </think>): the free text before the token speculates,
    a proposal stops before the token (the position after it needs the grammar's first mask), and the
    grammar's text speculates once it started; the outputs are speculation off's."""
    free = engines["plain"].generate([PROMPT * 2], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    tokens = free[0].outputs[0].token_ids
    at = next(i for i in range(4, len(tokens)) if tokens[i] not in tokens[:i])
    params = SamplingParams(
        max_tokens=120,
        temperature=0.0,
        guided_decoding=GuidedDecodingParams(json=json.dumps(SCHEMAS[1])),
        guided_decoding_after_token=tokens[at],
    )
    (expected,) = engines["plain"].generate([PROMPT * 2], params)
    (result,) = engines[name].generate([PROMPT * 2], params)
    assert summary([result]) == summary([expected])
    out = result.outputs[0]
    assert out.token_ids[: at + 1] == tokens[: at + 1] and out.finish_reason == "stop"
    jsonschema.validate(json.loads(engines[name].get_tokenizer().decode(out.token_ids[at + 1 :])), SCHEMAS[1])
    assert out.num_accepted_draft_tokens > 0
    assert_idle(engines[name])
