"""A PEFT adapter of Phi-3's fused projections (qkv_proj, gate_up_proj), which the engine splits at load:
the adapter's B splits the same way (the parts share A), and greedy tokens equal PeftModel's, mixed in one
batch with the base model."""

from __future__ import annotations

import json
import os

from jaxserve import LLM, SamplingParams
from tests.lora.support import LORA_FIXTURES, adapter_dir
from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir


def test_fused_projection_adapter_matches_peft():
    with open(os.path.join(LORA_FIXTURES, "phi3_fused_r4.json")) as f:
        record = json.load(f)
    llm = LLM(
        fixture_dir("phi3"),
        lora_adapters={"fused": adapter_dir("phi3_fused_r4")},
        max_rank=4,
        **dict(SMALL_ENGINE, prefill_token_buckets=(64,)),
    )
    assert {"layers.0.self_attn.k_proj", "layers.1.mlp.up_proj"} <= set(llm.engine.parts.lora.shapes)
    prompts, base = record["prompts"], [p["greedy_token_ids"] for p in expected("phi3")["prompts"]]
    max_tokens = len(record["greedy_token_ids"][0])
    cases = [(adapter, index) for index in range(len(prompts)) for adapter in (None, "fused")]
    outputs = llm.generate(
        [prompts[index] for _, index in cases],
        [SamplingParams(max_tokens=max_tokens, temperature=0.0, lora=adapter) for adapter, _ in cases],
    )
    want = [
        base[index][:max_tokens] if adapter is None else record["greedy_token_ids"][index] for adapter, index in cases
    ]
    assert [output.outputs[0].token_ids for output in outputs] == want
