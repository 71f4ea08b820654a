"""Gemma 3's multimodal checkpoints (model_type gemma3, Gemma3ForConditionalGeneration: gemma-3-4b/12b/27b-it):
the language model is a Gemma 3 text model described by config.json's text_config, which the released configs
write sparsely (gemma-3-4b-it's names five keys), so transformers' Gemma3TextConfig defaults fill the rest.
jaxserve serves that text model; the vision tower and projector are not loaded (loading/multimodal.py).
Plain Python: the router reads configs without JAX.
"""

from __future__ import annotations

# transformers' Gemma3TextConfig defaults, for the keys a multimodal config's text_config leaves out
TEXT_DEFAULTS = dict(
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131_072,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    sliding_window_pattern=6,
    bos_token_id=2,
    eos_token_id=1,
    tie_word_embeddings=True,
)
# what the outer config says for the whole model, and the text model inherits
INHERITED = ("bos_token_id", "eos_token_id", "tie_word_embeddings", "dtype", "torch_dtype")


def gemma3_text_config(hf: dict) -> dict:
    """The gemma3_text config.json dict of a gemma3 (multimodal) one."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("config.json: model_type gemma3 (Gemma3ForConditionalGeneration) needs a text_config object")
    inherited = {key: hf[key] for key in INHERITED if hf.get(key) is not None}
    return {**TEXT_DEFAULTS, **inherited, **text, "model_type": "gemma3_text"}
