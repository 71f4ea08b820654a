"""GPT-OSS's config as the Hub writes it, and YaRN rope against transformers' own frequencies
(tests/fixtures/gpt_oss_yarn_frequencies.json, recorded by tests/support/make_fixtures.py yarn)."""

import json
import os

import numpy as np
import pytest

from jaxserve.models import ModelConfig
from jaxserve.models.layers import rope_attention_factor, rope_inverse_frequencies
from tests.support.fixtures import FIXTURES

with open(os.path.join(FIXTURES, "gpt_oss_yarn_frequencies.json")) as f:
    YARN_CASES = json.load(f)["cases"]


@pytest.mark.parametrize("name", sorted(YARN_CASES))
def test_yarn_frequencies_match_transformers(name):
    case = YARN_CASES[name]
    config = ModelConfig.from_hf_dict(case["config"])
    theta, scaling = config.layer_rope(0)
    assert scaling.rope_type == "yarn"
    found = rope_inverse_frequencies(config.rotary_dim, theta, scaling, config.context_length)
    np.testing.assert_allclose(found, np.asarray(case["inv_freq"], np.float32), rtol=2e-7, atol=0)
    assert rope_attention_factor(scaling) == pytest.approx(case["attention_factor"], rel=1e-12)


def test_yarn_keeps_mscale_for_deepseek_and_reads_outer_original_length():
    deepseek = ModelConfig.from_hf_dict(YARN_CASES["deepseek_v3"]["config"]).rope_scaling
    assert (deepseek.mscale, deepseek.mscale_all_dim, deepseek.truncate) == (1.0, 1.0, True)
    odd = ModelConfig.from_hf_dict(YARN_CASES["odd_short"]["config"]).rope_scaling
    assert odd.original_max_position_embeddings == 64 and (odd.beta_fast, odd.beta_slow) == (8.0, 2.0)


# openai/gpt-oss-20b's config.json (transformers 4.55's layout: rope_scaling beside rope_theta)
GPT_OSS_20B = dict(
    model_type="gpt_oss",
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    experts_per_token=4,
    sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 12,
    attention_bias=True,
    rope_theta=150000,
    rope_scaling=dict(
        beta_fast=32.0,
        beta_slow=1.0,
        factor=32.0,
        original_max_position_embeddings=4096,
        rope_type="yarn",
        truncate=False,
    ),
    max_position_embeddings=131072,
    rms_norm_eps=1e-05,
    swiglu_limit=7.0,
    tie_word_embeddings=False,
    eos_token_id=200002,
    pad_token_id=199999,
)


def test_gpt_oss_20b_config():
    config = ModelConfig.from_hf_dict(GPT_OSS_20B)
    assert config.attention_sinks and config.attention_bias and config.attention_output_bias
    assert (config.num_experts, config.num_experts_per_token, config.expert_intermediate_size) == (32, 4, 2880)
    assert config.router_bias and config.expert_biases and config.normalize_expert_weights
    assert (config.swiglu_alpha, config.swiglu_limit) == (1.702, 7.0)
    assert [config.layer_sliding_window(layer) for layer in range(4)] == [128, None, 128, None]
    theta, scaling = config.layer_rope(1)  # full and sliding layers share the one YaRN rope
    assert theta == 150000.0 and scaling.rope_type == "yarn" and not scaling.truncate
    assert scaling.attention_factor == pytest.approx(0.1 * np.log(32.0) + 1.0)


def test_gpt_oss_defaults_as_transformers():
    """Without rope settings, layer_types or a window: GptOssConfig's YaRN, 128-token window, sliding first."""
    bare = {
        k: v for k, v in GPT_OSS_20B.items() if k not in ("rope_scaling", "rope_theta", "layer_types", "sliding_window")
    }
    config = ModelConfig.from_hf_dict({**bare, "num_hidden_layers": 3})
    assert config.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert config.sliding_window == 128 and config.rope_theta == 150000.0
    assert (config.rope_scaling.factor, config.rope_scaling.original_max_position_embeddings) == (32.0, 4096)
    with pytest.raises(ValueError, match="swiglu_limit"):
        ModelConfig.from_hf_dict({**GPT_OSS_20B, "swiglu_limit": 0})


def test_gpt_oss_explicit_plain_rope_is_not_the_default_yarn():
    """A rope block that names plain rope (transformers 5's save_pretrained writes `rope_parameters` so) is plain
    rope, as transformers serves it; the YaRN default fills only a config with no rope block at all."""
    bare = {k: v for k, v in GPT_OSS_20B.items() if k not in ("rope_scaling", "rope_theta")}
    plain = ModelConfig.from_hf_dict({**bare, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    assert plain.rope_theta == 10000.0 and plain.rope_scaling.rope_type == "default"
    assert plain.rope_scaling.attention_factor == 1.0
    legacy = ModelConfig.from_hf_dict({**bare, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert legacy.rope_scaling.rope_type == "linear" and legacy.rope_theta == 5e5
    defaulted = ModelConfig.from_hf_dict({**bare, "rope_theta": 5e5, "rope_parameters": None})
    assert defaulted.rope_scaling.rope_type == "yarn" and defaulted.rope_theta == 5e5
