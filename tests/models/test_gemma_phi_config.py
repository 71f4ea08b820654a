"""Gemma 2/3 and Phi-3 configs as the Hub writes them (transformers 4's layouts; the fixtures hold 5's), and
LongRoPE's factors chosen once by the engine's max_model_len."""

import math

import numpy as np
import pytest

from jaxserve.models import ModelConfig
from jaxserve.models.layers import rope_inverse_frequencies

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)


def test_gemma3_transformers4_config_has_local_and_global_ropes():
    config = ModelConfig.from_hf_dict(
        dict(
            BASE,
            model_type="gemma3_text",
            num_hidden_layers=8,
            head_dim=8,
            sliding_window=512,
            sliding_window_pattern=6,
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            query_pre_attn_scalar=8,
        )
    )
    assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention",) + ("sliding_attention",) * 2
    assert config.layer_rope(0)[0] == 10_000.0 and config.layer_rope(0)[1].rope_type == "default"
    theta, scaling = config.layer_rope(5)
    assert theta == 1_000_000.0 and scaling.rope_type == "linear" and scaling.factor == 8.0
    assert config.tie_word_embeddings and config.qk_norm and config.norm_unit_offset and config.sandwich_norms
    assert config.hidden_act == "gelu_pytorch_tanh" and config.attention_logit_soft_cap is None
    assert config.layer_sliding_window(0) == 512 and config.layer_sliding_window(5) is None


def test_gemma2_alternates_layers_and_soft_caps():
    config = ModelConfig.from_hf_dict(
        dict(
            BASE,
            model_type="gemma2",
            num_hidden_layers=4,
            sliding_window=4096,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            hidden_activation="gelu_pytorch_tanh",
        )
    )
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert config.attention_logit_soft_cap == 50.0 and config.final_logit_soft_cap == 30.0
    assert config.query_pre_attention_scalar == 256  # transformers' default


def test_phi3_su_rope_partial_rotary_and_the_attention_factor():
    short, long = [1.0, 1.5, 2.0], [4.0, 8.0, 16.0]
    config = ModelConfig.from_hf_dict(
        dict(
            BASE,
            model_type="phi3",
            num_hidden_layers=2,
            max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            partial_rotary_factor=0.75,
            rope_scaling={"type": "su", "short_factor": short, "long_factor": long},
        )
    )
    scaling = config.rope_scaling
    assert config.rotary_dim == 6 and scaling.rope_type == "longrope"
    assert scaling.factor == 32.0
    assert scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    exponents = np.arange(0, 6, 2) / 6
    for context_length, factors in ((None, short), (4096, short), (4097, long)):
        got = rope_inverse_frequencies(6, config.rope_theta, scaling, context_length)
        np.testing.assert_allclose(got, 1 / (np.asarray(factors) * 10000.0**exponents), rtol=1e-6)
    assert config.with_context_length(8192).context_length == 8192


@pytest.mark.parametrize("model_type", ["gemma", "phi", "phimoe"])
def test_other_families_keep_the_clear_error(model_type):
    with pytest.raises(ValueError, match="unknown model type"):
        ModelConfig.from_hf_dict(dict(BASE, model_type=model_type, num_hidden_layers=2))


def test_a_multimodal_gemma3_config_without_its_text_config_is_refused():
    # gemma3 (Gemma3ForConditionalGeneration) serves its text_config; a flat config has none to serve
    with pytest.raises(ValueError, match="needs a text_config"):
        ModelConfig.from_hf_dict(dict(BASE, model_type="gemma3", num_hidden_layers=2))
