"""GPT-OSS on one device against transformers beyond test_models_vs_hf.py's defaults (which runs every
fixture as it is): prompts cut into small prefill chunks over small pages, so that sliding windows and
sinks meet chunk and page boundaries, with the jax.numpy reference attention; nothing compiles after warm-up."""

from jaxserve import LLM
from tests.support.fixtures import SMALL_ENGINE, fixture_dir
from tests.support.hf_parity import check_against_hf


def test_small_chunks_and_pages_with_the_reference_attention():
    options = {**SMALL_ENGINE, "max_num_batched_tokens": 16, "page_size": 8, "attention_impl": "reference"}
    llm = LLM(fixture_dir("gpt_oss"), **options)
    check_against_hf(llm, "gpt_oss")
    assert llm.stats()["num_compiles_after_warmup"] == 0
