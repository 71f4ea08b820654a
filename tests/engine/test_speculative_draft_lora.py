"""A self-draft (the target's int8 copy) serves LoRA adapters with the target: every adapter loads into the
draft's slots too, so a row with an adapter is proposed for by the adapted draft. Greedy outputs equal PEFT's
(the fixtures of tests/lora), and adapter rows accept most proposals (a draft of the base weights proposes
the base model's tokens, which the adapted target rejects); loading and unloading compile nothing."""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams
from tests.lora.support import ADAPTER_NAMES, BASE_MODEL, LORA_ENGINE, adapter_dir, expected

PROMPTS = expected()["prompts"]
MAX_TOKENS = len(expected()["base_greedy_token_ids"][0])
SELF_INT8 = {
    "method": "draft",
    "draft_quantization": "int8",
    "num_speculative_tokens": 3,
    "speculative_adaptive": False,
}


ADAPTERS = ADAPTER_NAMES[:2]  # two slots: the fewest LoRA branch sizes to compile, in the target and the draft
ENGINE = {
    **LORA_ENGINE,
    "lora": dict(adapters={name: adapter_dir(name) for name in ADAPTERS}, max_adapters=2, max_rank=8),
}


@pytest.fixture(scope="module")
def llm():
    return LLM(BASE_MODEL, **ENGINE, speculative=SELF_INT8)


def test_adapter_rows_match_peft_and_accept_the_adapted_drafts_proposals(llm):
    cases = [(adapter, index) for index in range(0, len(PROMPTS), 2) for adapter in ADAPTERS]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, lora=adapter) for adapter, _ in cases]
    outputs = llm.generate([PROMPTS[index] for _, index in cases], params)
    for (adapter, index), output in zip(cases, outputs):
        assert output.outputs[0].token_ids == expected()["greedy_token_ids"][adapter][index], (adapter, index)
    stats = llm.stats()
    assert stats["speculative_num_draft_tokens"] > 30
    assert stats["speculative_acceptance_rate"] > 0.6, stats["speculative_acceptance_rate"]
    assert stats["num_compiles_after_warmup"] == 0


def test_adapters_load_and_unload_in_the_drafts_slots_too(llm):
    engine = llm.engine
    draft = engine.speculation.proposer.lora
    assert sorted(draft.adapters) == sorted(ADAPTERS)
    engine.unload_lora(ADAPTER_NAMES[0])
    assert ADAPTER_NAMES[0] not in draft.adapters
    loaded = engine.load_lora("again", adapter_dir(ADAPTER_NAMES[0]))
    assert draft.adapters["again"].slot == loaded.slot
    output = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, lora="again"))[0]
    assert output.outputs[0].token_ids == expected()["greedy_token_ids"][ADAPTER_NAMES[0]][1]
    assert output.outputs[0].num_accepted_draft_tokens > 0
    assert llm.stats()["num_compiles_after_warmup"] == 0
