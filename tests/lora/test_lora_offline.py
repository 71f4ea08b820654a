"""The offline API's LoRA surface (LLM(lora_adapters=...), generate(lora=...), load_lora / unload_lora),
here on an engine that also speculates (n-gram proposals verified in their own executable, which must
apply each row's adapter as the plain steps do)."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from tests.lora.support import ADAPTER_NAMES, BASE_MODEL, adapter_dir, expected
from tests.support.fixtures import SMALL_ENGINE

PROMPTS = expected()["prompts"]
MAX_TOKENS = len(expected()["base_greedy_token_ids"][0])


@pytest.fixture(scope="module")
def llm():
    return LLM(
        BASE_MODEL,
        lora_adapters={"attn": adapter_dir("attn_r4")},
        max_adapters=2,
        max_rank=8,
        **dict(SMALL_ENGINE, decode_seq_buckets=(8,), prefill_token_buckets=(64,)),
        speculative=dict(method="ngram", num_speculative_tokens=3, speculative_adaptive=False),
    )


def test_generate_lora_argument_and_runtime_loads_match_peft(llm):
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    outputs = llm.generate(PROMPTS, greedy, lora="attn")
    assert [o.outputs[0].token_ids for o in outputs] == expected()["greedy_token_ids"]["attn_r4"]
    llm.load_lora("rslora", adapter_dir("mlp_r8_rslora"))
    mixed = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, lora=name) for name in (None, "rslora")]
    outputs = llm.generate([PROMPTS[2], PROMPTS[2]], mixed, lora="attn")  # the params' own lora wins
    assert outputs[0].outputs[0].token_ids == expected()["greedy_token_ids"]["attn_r4"][2]
    assert outputs[1].outputs[0].token_ids == expected()["greedy_token_ids"]["mlp_r8_rslora"][2]
    llm.unload_lora("rslora")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'rslora'"):
        llm.generate(PROMPTS[0], greedy, lora="rslora")
    stats = llm.stats()
    assert stats["num_compiles_after_warmup"] == 0
    assert stats["speculative_num_verify_rows"] > 0  # the verify executable ran adapter rows


def test_fixture_names():
    assert set(ADAPTER_NAMES) == {"attn_r4", "mlp_r8_rslora", "mixed_r3"}
