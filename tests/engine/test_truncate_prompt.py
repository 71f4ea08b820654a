"""vLLM's truncate_prompt_tokens: a request uses only its prompt's last k tokens (-1: the last max_model_len),
whether the prompt is text or token ids; values other than None, -1 and 1 .. max_model_len are refused."""

import pytest

from jaxserve import SamplingParams


def test_a_truncated_prompt_generates_as_its_last_tokens_alone(llama_llm):
    ids = [1, 275, 240, 302, 123, 94, 304, 336, 40, 41, 42, 43, 44]
    greedy = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
    (alone,) = llama_llm.generate([ids[-6:]], SamplingParams(**greedy))
    cut = llama_llm.generate([ids, ids[-6:], ids[-3:]], SamplingParams(**greedy, truncate_prompt_tokens=6))
    assert cut[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert cut[0].prompt_token_ids == ids[-6:] and cut[1].prompt_token_ids == ids[-6:]
    assert cut[2].prompt_token_ids == ids[-3:]  # shorter than k: whole
    text = "def forward(self, x): return x * 2 + 1"
    (whole,) = llama_llm.generate([text], SamplingParams(**greedy))
    (last,) = llama_llm.generate([text], SamplingParams(**greedy, truncate_prompt_tokens=4))
    assert last.prompt_token_ids == whole.prompt_token_ids[-4:]
    max_model_len = llama_llm.engine.parts.max_model_len
    long = (ids * (max_model_len // len(ids) + 2))[: max_model_len + 20]
    (kept,) = llama_llm.generate([long], SamplingParams(max_tokens=1, truncate_prompt_tokens=max_model_len - 1))
    assert kept.prompt_token_ids == long[-(max_model_len - 1) :]
    assert llama_llm.stats()["num_compiles_after_warmup"] == 0


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "4"])
def test_values_other_than_minus_one_and_positive_integers_are_refused(value):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=value)


def test_more_than_max_model_len_is_refused_and_minus_one_is_max_model_len(llama_llm):
    max_model_len = llama_llm.engine.parts.max_model_len
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llama_llm.generate([[1, 2, 3]], SamplingParams(truncate_prompt_tokens=max_model_len + 1))
    long = list(range(3, 3 + max_model_len + 5))
    with pytest.raises(ValueError, match="max_model_len"):  # all of max_model_len: no room left to generate
        llama_llm.generate([long], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))
    (scored,) = llama_llm.generate([long], SamplingParams(max_tokens=0, truncate_prompt_tokens=-1))
    assert scored.prompt_token_ids == long[-max_model_len:]
