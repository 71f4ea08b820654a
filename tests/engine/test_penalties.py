"""Presence, frequency and repetition penalties end to end on tiny-random: they act as OpenAI and
transformers define them on a repetitive greedy output, and a penalised request's greedy tokens do not
depend on which token buffer entry it runs at, what shares its batch, overlapped steps or preemption
(the per-entry output counts and prompt bitmask kept on the device are reset and kept right)."""

import dataclasses
import json

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.host.request import GuidedDecodingParams
from tests.support.sampling_engines import ENGINE_OPTIONS, assert_idle, greedy, tiny_random_llm, token_ids
from tests.support.xla_compiles import xla_compiles

REPETITIVE = [1, 302, 123, 94, 304, 336]  # its greedy output repeats a token three times, then often
NUM_TOP = 20  # the engine's max_logprobs
GUIDED_PROMPT = "def forward(self, x):"
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    return tiny_random_llm()


def random_prompts(count, seed, length=15):
    rng = np.random.default_rng(seed)
    return [[1] + rng.integers(3, 384, size=length).tolist() for _ in range(count)]


def num_repeats(token_ids):
    return len(token_ids) - len(set(token_ids))


@pytest.mark.parametrize(
    "penalties",
    [
        dict(presence_penalty=1.0),
        dict(frequency_penalty=0.3),
        dict(presence_penalty=0.2, frequency_penalty=0.15),
        dict(repetition_penalty=1.5),
    ],
    ids=["presence", "frequency", "presence+frequency", "repetition"],
)
def test_penalties_change_a_repetitive_greedy_output_as_defined(llm, penalties):
    plain = llm.generate([REPETITIVE], greedy(40))[0].outputs[0].token_ids
    assert num_repeats(plain) >= 5
    out = llm.generate([REPETITIVE], greedy(40, logprobs=NUM_TOP, **penalties))[0].outputs[0]
    tokens = out.token_ids
    assert tokens != plain and num_repeats(tokens) < num_repeats(plain)
    # Penalties only lower the logits of tokens seen before (the output's; repetition's also the prompt's),
    # so where the outputs first part, the plain greedy token must be one of those.
    first_difference = next(i for i, (a, b) in enumerate(zip(tokens, plain)) if a != b)
    seen = set(tokens[:first_difference]) | (set(REPETITIVE) if "repetition_penalty" in penalties else set())
    assert plain[first_difference] in seen
    if "repetition_penalty" in penalties:
        return  # it scales logits, which the logprobs cannot give back
    # presence / frequency subtract from the logits, so from the model's logprobs too: each greedy token
    # must be the best of the top logprobs once its step's penalties are taken off
    presence, frequency = penalties.get("presence_penalty", 0.0), penalties.get("frequency_penalty", 0.0)
    for index, logprobs in enumerate(out.logprobs):
        before = tokens[:index]
        scores = {
            token: logprob - frequency * before.count(token) - presence * (token in before)
            for token, logprob in logprobs.items()
        }
        best = max(scores, key=scores.get)
        assert best == tokens[index], (index, scores)
        # conclusive: every token outside the top logprobs scores below the best
        assert scores[best] > sorted(logprobs.values(), reverse=True)[NUM_TOP - 1]


def penalised_requests():
    prompts = [REPETITIVE] + random_prompts(3, seed=2)
    params = [
        greedy(40, presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.3),
        greedy(40, frequency_penalty=0.5),
        greedy(40, repetition_penalty=1.6),
        greedy(40, presence_penalty=0.7, repetition_penalty=0.8),  # < 1 favours what was seen
    ]
    return prompts, params


def test_penalised_tokens_ignore_entry_batch_overlap_and_preemption(llm):
    prompts, params = penalised_requests()
    # 7 usable pages of 16 tokens: four sequences growing to 3-4 pages each must preempt one another
    cramped = LLM("tiny-random", **{**ENGINE_OPTIONS, "max_model_len": 128, "num_pages": 8})
    fresh = token_ids(cramped, prompts[:1], params[0])[0]  # alone, in an engine nothing ran in

    # Plain requests first use (and count tokens into) every token buffer entry of the shared engine.
    token_ids(llm, random_prompts(8, seed=3), greedy(30))
    resets = llm.stats()["num_penalty_resets"]
    alone = [token_ids(llm, [prompt], p)[0] for prompt, p in zip(prompts, params)]
    assert alone[0] == fresh
    assert llm.stats()["num_penalty_resets"] >= resets + len(prompts)
    assert all(len(tokens) == 40 for tokens in alone)

    # Mixed in one batch with plain requests, which the penalised rows leave as they were.
    plain_prompts = random_prompts(4, seed=4)
    plain_alone = [token_ids(llm, [prompt], greedy(24))[0] for prompt in plain_prompts]
    mixed = token_ids(
        llm,
        [p for pair in zip(plain_prompts, prompts) for p in pair],
        [p for pair in zip([greedy(24)] * 4, params) for p in pair],
    )
    assert mixed[1::2] == alone
    assert mixed[0::2] == plain_alone

    # n = 2: each greedy sequence counts its own tokens at its own entry
    twins = llm.generate([prompts[0]], dataclasses.replace(params[0], n=2))[0].outputs
    assert [twin.token_ids for twin in twins] == [alone[0]] * 2

    assert token_ids(tiny_random_llm(overlap_steps=False), prompts, params) == alone

    # Preempted and recomputed: the counts come back with the sequence, at whichever entry it resumes
    # (a guided request rides along: its matcher keeps its place through the recompute).
    guided = SamplingParams(max_tokens=80, temperature=0.0, guided_decoding=GuidedDecodingParams(json=JSON_SCHEMA))
    guided_alone = llm.generate([GUIDED_PROMPT], guided)[0].outputs[0]
    assert guided_alone.finish_reason == "stop" and json.loads(guided_alone.text)
    cramped_outputs = cramped.generate(prompts + [GUIDED_PROMPT], params + [guided])
    assert [o.outputs[0].token_ids for o in cramped_outputs[:-1]] == alone
    assert cramped_outputs[-1].outputs[0].token_ids == guided_alone.token_ids
    assert cramped.stats()["num_preemptions"] > 0
    for engine in (llm, cramped):
        assert_idle(engine)


def test_a_penalised_request_after_a_step_compiles_nothing():
    """The buffers' reset is compiled at warm-up; a jit call's cache key counts whether its arguments are committed,
    and the buffers were host arrays then while serving hands the reset the step's (committed) outputs: the first
    penalised request after a step compiled it again, which the engine's own count did not see (session 49)."""
    fresh = LLM("tiny-random", **ENGINE_OPTIONS)
    with xla_compiles() as compiles:
        for _ in range(3):  # the first round's reset follows warm-up's; the later ones follow steps
            fresh.generate([REPETITIVE, random_prompts(1, 5)[0]], [greedy(8, presence_penalty=0.5), greedy(8)])
    assert compiles == []
    assert fresh.stats()["num_compiles_after_warmup"] == 0
    assert_idle(fresh)
