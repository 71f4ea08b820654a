"""transformers' YaRN rope frequencies for a few configs (tests/fixtures/gpt_oss_yarn_frequencies.json, read by
tests/models/test_gpt_oss_config.py): `make_fixtures.py yarn` records them."""

from __future__ import annotations

import json
import os

import transformers

# YaRN configs as checkpoints write them (GPT-OSS; DeepSeek-V3 and V2-Lite with mscale; Qwen-style partial rotary;
# an odd head with a short pretraining length, so the ramp spans several lanes), keyed by a name
YARN_CASES = {
    "gpt_oss": dict(
        head_dim=64,
        max_position_embeddings=131072,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=4096,
        ),
    ),
    "deepseek_v3": dict(
        head_dim=64,
        max_position_embeddings=163840,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
            original_max_position_embeddings=4096,
        ),
    ),
    "deepseek_v2_lite": dict(
        head_dim=64,
        max_position_embeddings=163840,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            mscale=0.707,
            mscale_all_dim=0.707,
            original_max_position_embeddings=4096,
        ),
    ),
    "partial_rotary": dict(
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=1e6,
            factor=4.0,
            partial_rotary_factor=0.5,
            original_max_position_embeddings=32768,
        ),
    ),
    "odd_short": dict(
        head_dim=12,
        max_position_embeddings=512,
        original_max_position_embeddings=64,
        rope_parameters=dict(rope_type="yarn", rope_theta=500.0, factor=8.0, beta_fast=8, beta_slow=2),
    ),
}
YARN_FILE = "gpt_oss_yarn_frequencies.json"  # in the fixtures directory


def record_yarn(out: str) -> None:
    """transformers' YaRN inverse frequencies and attention factor for each of YARN_CASES, in out/YARN_FILE."""
    records = {}
    for name, overrides in YARN_CASES.items():
        hf = dict(
            model_type="llama",
            vocab_size=8,
            hidden_size=64,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=1,
            **json.loads(json.dumps(overrides)),
        )
        config = transformers.LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"})
        inv_freq, attention_factor = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](config, None)
        records[name] = dict(config=hf, inv_freq=inv_freq.tolist(), attention_factor=float(attention_factor))
    with open(os.path.join(out, YARN_FILE), "w") as f:
        json.dump(dict(transformers_version=transformers.__version__, cases=records), f, indent=1)
