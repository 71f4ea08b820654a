"""Greedy tokens and first-token logprobs of an engine against the ones transformers recorded."""

import pytest

from jaxserve import LLM, SamplingParams
from tests.support.fixtures import expected

LOGPROB_TOLERANCE = 1e-3


def check_against_hf(llm: LLM, name: str) -> None:
    prompts = expected(name)["prompts"]
    outputs = llm.generate(
        [p["token_ids"] for p in prompts], SamplingParams(max_tokens=24, temperature=0.0, logprobs=8)
    )
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert output.prompt_token_ids == prompt["token_ids"]
        assert completion.token_ids == prompt["greedy_token_ids"], f"{name}: prompt of {len(prompt['token_ids'])}"
        first = completion.logprobs[0]
        for token_id, logprob in zip(prompt["first_top_token_ids"], prompt["first_top_logprobs"]):
            assert first[token_id] == pytest.approx(logprob, abs=LOGPROB_TOLERANCE)
        assert completion.finish_reason == ("length" if len(completion.token_ids) == 24 else "stop")
