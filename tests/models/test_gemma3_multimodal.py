"""Gemma 3 multimodal checkpoints (model_type gemma3): the text model is served (its parity with transformers'
text-only outputs runs in test_models_vs_hf.py over tests/fixtures/gemma3_multimodal), the vision tower is not
loaded, and image parts are refused by name."""

import logging
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.loading.chat_template import text_content
from jaxserve.loading.weights import CheckpointReader
from jaxserve.models.config import ModelConfig
from tests.support.fixtures import fixture_dir

# gemma-3-4b-it's config.json, as released: a sparse text_config
GEMMA3_4B_IT = dict(
    architectures=["Gemma3ForConditionalGeneration"],
    model_type="gemma3",
    boi_token_index=255999,
    eoi_token_index=256000,
    eos_token_id=[1, 106],
    image_token_index=262144,
    mm_tokens_per_image=256,
    text_config=dict(
        hidden_size=2560,
        intermediate_size=10240,
        model_type="gemma3_text",
        num_hidden_layers=34,
        rope_scaling=dict(factor=8.0, rope_type="linear"),
        sliding_window=1024,
    ),
    torch_dtype="bfloat16",
    vision_config=dict(hidden_size=1152, model_type="siglip_vision_model", num_hidden_layers=27, patch_size=14),
)


def test_a_released_multimodal_config_describes_its_text_model():
    config = ModelConfig.from_hf_dict(GEMMA3_4B_IT)
    assert config.model_type == "gemma3_text"
    assert (config.vocab_size, config.hidden_size, config.num_layers) == (262_208, 2560, 34)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (8, 4, 256)
    assert config.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    assert (config.sliding_window, config.rope_theta, config.local_rope_theta) == (1024, 1_000_000.0, 10_000.0)
    assert (config.rope_scaling.rope_type, config.rope_scaling.factor) == ("linear", 8.0)
    assert config.query_pre_attention_scalar == 256 and config.tie_word_embeddings
    assert config.eos_token_ids == (1, 106) and config.checkpoint_dtype == "bfloat16"
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_hf_dict({**GEMMA3_4B_IT, "text_config": None})


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_the_language_model_is_read_under_text_names(prefix, tmp_path, caplog):
    """transformers 5's in-memory names and 4.x's (which save_pretrained writes) both read as a text checkpoint."""
    weights = load_file(os.path.join(fixture_dir("gemma3_multimodal"), "model.safetensors"))
    text = "language_model.model."  # the fixture's own names (transformers 5.24's save_pretrained)
    renamed = {prefix + name.removeprefix(text) if name.startswith(text) else name: v for name, v in weights.items()}
    save_file(renamed, str(tmp_path / "model.safetensors"))
    with caplog.at_level(logging.INFO, logger="jaxserve.loading.multimodal"):
        reader = CheckpointReader(str(tmp_path))
    assert "serving its language model" in caplog.text and "vision_tower" in caplog.text
    text_names = [name for name in reader.aliases if name.startswith("model.")]
    assert "model.layers.2.self_attn.q_norm.weight" in reader and "model.embed_tokens.weight" in reader
    assert not any("vision" in name for name in reader.aliases)
    for name in text_names:
        original = "language_model.model." + name.removeprefix("model.")
        np.testing.assert_array_equal(reader.read(name), weights[original])


def test_image_parts_are_refused_by_name():
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert text_content(messages)[0]["content"] == "hi"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(ValueError, match=r"messages\[1\]\.content\[1\] is a 'image_url' part: only text"):
        text_content([*messages, {"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}])
