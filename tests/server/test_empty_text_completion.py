"""/v1/completions takes an empty text prompt as vLLM does: the engine tokenizes it ([BOS] where the tokenizer adds
one); check_prompt's "set exactly one of text and token_ids" (gRPC's: an unset text is "") no longer refuses it."""

from types import SimpleNamespace

import pytest

from jaxserve.server.limits import RequestLimits
from jaxserve.server.openai.completions import checked_completion
from jaxserve.server.openai.protocol import CompletionRequest


def context():
    limits = RequestLimits.for_engine(max_model_len=64, vocab_size=384)
    return SimpleNamespace(limits=limits, ready_loop=lambda: SimpleNamespace(max_in_flight=8))


@pytest.mark.parametrize("prompt", ["", ["", "a"]])
def test_an_empty_text_prompt_reaches_the_engine(prompt):
    prompts, _, _ = checked_completion(context(), CompletionRequest(model="m", prompt=prompt, max_tokens=2), "r")  # type: ignore[arg-type]
    assert "" in prompts


def test_an_empty_token_id_prompt_is_still_refused():
    with pytest.raises(ValueError, match="a prompt is empty"):
        checked_completion(context(), CompletionRequest(model="m", prompt=[[1, 2], []], max_tokens=2), "r")  # type: ignore[arg-type]
