"""What GPT-OSS config.json files say, read as transformers' GptOssConfig reads them.

GPT-OSS alternates banded (sliding_window, 128 in the released models) and full attention layers, the
sliding ones first unless layer_types says otherwise; every attention projection has a bias and every
query head a learned sink logit; rope is YaRN (32x over a 4096-token pretraining length, untruncated)
unless the config says otherwise. Every layer is a mixture of experts: a router with a bias, a softmax
over its top k logits, and experts with biases whose gated unit is a clamped SwiGLU (swiglu_alpha,
swiglu_limit; the up projection offset by one). Plain Python: the router reads configs without JAX.
"""

from __future__ import annotations

GPT_OSS_MODEL_TYPES = ("gpt_oss",)
# transformers' GptOssConfig default, written into checkpoints that omit rope_parameters / rope_scaling
DEFAULT_ROPE = dict(
    rope_type="yarn",
    factor=32.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=4096,
)
DEFAULT_ROPE_THETA = 150000.0


def with_default_rope(hf: dict) -> dict:
    """The config.json with GptOssConfig's rope defaults (YaRN x32) where it has no rope block at all, as
    transformers fills them (rope_parameters None and no rope_scaling). A block that is there is taken as it
    is: an explicit `"rope_type": "default"` is plain rope, not the default YaRN."""
    if hf.get("rope_parameters") is not None or hf.get("rope_scaling"):
        return hf
    theta = hf.get("rope_theta", DEFAULT_ROPE_THETA)
    return {**hf, "rope_parameters": {**DEFAULT_ROPE, "rope_theta": theta}}


def gpt_oss_fields(hf: dict, num_layers: int) -> dict:
    """ModelConfig fields of a GPT-OSS checkpoint beyond the Llama-family ones (overriding them)."""
    num_experts = int(hf.get("num_local_experts", hf.get("num_experts", 128)))
    window = hf.get("sliding_window", 128)
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (layer + 1) % 2 else "full_attention" for layer in range(num_layers)
    ]
    alpha, limit = float(hf.get("swiglu_alpha", 1.702)), float(hf.get("swiglu_limit", 7.0))
    if limit <= 0:
        raise ValueError(f"config.json: swiglu_limit must be positive, got {limit}")
    return dict(
        attention_bias=bool(hf.get("attention_bias", True)),
        attention_output_bias=bool(hf.get("attention_bias", True)),
        attention_sinks=True,
        sliding_window=int(window) if window else None,
        layer_types=tuple(layer_types),
        num_experts=num_experts,
        num_experts_per_token=int(hf.get("num_experts_per_tok", 4)),
        expert_intermediate_size=int(hf["intermediate_size"]),
        # softmax over the top k router logits: the same weights as a softmax over all, renormalized
        normalize_expert_weights=True,
        router_bias=True,
        expert_biases=True,
        swiglu_alpha=alpha,
        swiglu_limit=limit,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
    )
