"""Greedy outputs and first-token logprobs against Hugging Face transformers (tests/support/make_fixtures.py)."""

import pytest

from jaxserve import LLM, SamplingParams
from tests.support.fixtures import MODEL_NAMES, SMALL_ENGINE, expected, fixture_dir
from tests.support.hf_parity import check_against_hf


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_greedy_and_logprobs_match_transformers(name):
    check_against_hf(LLM(fixture_dir(name), **SMALL_ENGINE), name)


def test_small_chunks_and_pages_match_transformers():
    # 16-token prefill chunks and 8-token pages: every long prompt is chunked and spans many pages.
    llm = LLM(fixture_dir("mixtral"), **{**SMALL_ENGINE, "max_num_batched_tokens": 16, "page_size": 8})
    check_against_hf(llm, "mixtral")


def test_text_prompts_are_tokenized_like_the_fixtures(llama_llm):
    for prompt in expected("llama_gqa")["prompts"]:
        if prompt["text"] is not None:
            assert llama_llm.get_tokenizer().encode(prompt["text"]) == prompt["token_ids"]
            output = llama_llm.generate(prompt["text"], SamplingParams(max_tokens=24, temperature=0.0))[0]
            assert output.outputs[0].token_ids == prompt["greedy_token_ids"]


def test_auto_dtype_loads_bf16_checkpoint_as_bf16():
    llm = LLM(fixture_dir("llama_bf16"), **{**SMALL_ENGINE, "dtype": "auto"})
    assert llm.stats()["dtype"] == "bfloat16"
    prompts = expected("llama_bf16")["prompts"]
    outputs = llm.generate([p["token_ids"] for p in prompts], SamplingParams(max_tokens=4, temperature=0.0))
    # bf16 math drifts from the float32 reference, but the first greedy token should mostly agree.
    agree = sum(o.outputs[0].token_ids[0] == p["greedy_token_ids"][0] for o, p in zip(outputs, prompts))
    assert agree >= len(prompts) - 2


@pytest.mark.parametrize("name", ["llama_mqa_odd", "mixtral"])
def test_pallas_attention_matches_transformers(name):
    llm = LLM(fixture_dir(name), **{**SMALL_ENGINE, "attention_impl": "pallas"})
    assert llm.stats()["attention_impl"] == "pallas"
    check_against_hf(llm, name)


def test_reference_attention_matches_transformers():
    llm = LLM(fixture_dir("llama_gqa"), **{**SMALL_ENGINE, "attention_impl": "reference"})
    assert llm.stats()["attention_impl"] == "reference"
    check_against_hf(llm, "llama_gqa")
