"""llama.cpp's mixture-of-experts families in GGUF: deepseek2, qwen2moe and gpt-oss, as config.json fields and
Hugging Face tensor names (gguf.py calls in here; names and layouts as convert_hf_to_gguf.py b10605 writes them).

deepseek2 (DeepSeek-V2 / V2-Lite / V3, Kimi-K2): multi-head latent attention stored as llama.cpp's MQA view
(head_count_kv 1, key_length = kv_lora_rank + rope dims); the per-head sizes are key_length_mla /
value_length_mla (older files: key_length / value_length themselves). kv_b_proj is stored whole (attn_kv_b,
older converters) or split per head into attn_k_b [H, R, N] (transposed) and attn_v_b [H, V, R]; both are
joined back into kv_b_proj [H * (N + V), R]. The scoring function decides the family: sigmoid (with the
exp_probs_b correction bias) is V3's router, softmax or none V2's (llama.cpp's default for old files).
Rope lanes are not permuted: llama.cpp rotates adjacent pairs, as V2 (and V3 with rope_interleave) do.
YaRN's mscale_all_dim is written as yarn_log_multiplier / 0.1 (the converter's legacy scale); mscale is
taken equal to it, as in every released checkpoint.

qwen2moe (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention, experts stacked as ffn_*_exps, the shared expert
as ffn_*_shexp with its sigmoid gate ffn_gate_inp_shexp. A layer without ffn_gate_inp keeps a dense
ffn_gate / ffn_up / ffn_down (llama.cpp's converter cannot write one; transformers' mlp_only_layers can).
qwen3moe (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (per-head q/k norms), experts in every layer, no shared
expert; llama.cpp always renormalizes the top k (norm_topk_prob true, as every released Qwen3-MoE config says).

gpt-oss: the experts' gate and up are stored apart (the converter de-interleaves transformers'
gate_up_proj) and usually as MXFP4 blocks, which gguf.quants dequantizes; they are interleaved back into
gate_up_proj, the fused name gpt_oss.read_param reads. llama.cpp hard-codes the clamped SwiGLU's limit (7)
and alternates sliding (even) and full (odd) layers; a file may say otherwise with swiglu_clamp_exp (one
limit per layer) and attention.sliding_window_pattern (one flag per layer). YaRN is not truncated
(GptOssConfig's default; llama.cpp rounds its correction range).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

FAMILY_MODEL_TYPES = {
    "deepseek2": "deepseek_v2",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
}
SIGMOID_GATING = 2  # gguf.ExpertGatingFuncType.SIGMOID (1 is SOFTMAX)
YARN_LOG_MULTIPLIER_SCALE = 0.1  # convert_hf_to_gguf.py writes 0.1 * mscale_all_dim for deepseek2

_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_DENSE_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
LAYER_TENSORS = {  # blk.N.<name> -> model.layers.N.<name>
    "deepseek2": {
        **_NORMS,
        **_DENSE_MLP,
        "attn_q": "self_attn.q_proj",
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
    },
    "qwen2moe": {
        **_NORMS,
        **_DENSE_MLP,
        **_ATTENTION,
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    },
    "qwen3moe": {
        **_NORMS,
        **_ATTENTION,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate_inp": "mlp.gate",
    },
    "gpt-oss": {
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        **_ATTENTION,
        "ffn_gate_inp": "mlp.router",
    },
}
# stacked experts -> each expert's Hugging Face name ({expert} filled in)
EXPERT_TENSORS = {
    "deepseek2": {
        "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
        "ffn_up_exps": "mlp.experts.{expert}.up_proj",
        "ffn_down_exps": "mlp.experts.{expert}.down_proj",
    },
}
EXPERT_TENSORS["qwen2moe"] = EXPERT_TENSORS["qwen3moe"] = EXPERT_TENSORS["deepseek2"]
EXPERT_TENSORS["gpt-oss"] = {}  # read whole, through derived_tensors
_ATTENTION_REQUIRED = ("attn_norm", "ffn_norm", "attn_output")
_MOE_REQUIRED = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


class GGUFMetadata:
    """`get(key)`: the architecture's `<arch>.<key>` value or default; `tensors`: name -> tensor."""

    def __init__(self, get: Callable[..., Any], tensors: dict, path: str, architecture: str):
        self.get, self.tensors, self.path, self.architecture = get, tensors, path, architecture

    def required(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF file {self.path}: metadata lacks {self.architecture}.{key}")
        return value

    def has(self, layer: int, name: str) -> bool:
        return f"blk.{layer}.{name}.weight" in self.tensors


def yarn_scaling(meta: GGUFMetadata) -> dict[str, Any]:
    """HF's YaRN rope parameters from what llama.cpp's converter writes (rope.scaling.type yarn): the factor, the
    original context and the ramp's betas; each family adds what else it reads."""
    return dict(
        rope_type="yarn",
        factor=float(meta.required("rope.scaling.factor")),
        original_max_position_embeddings=int(meta.required("rope.scaling.original_context_length")),
        beta_fast=float(meta.get("rope.scaling.yarn_beta_fast") or 32.0),
        beta_slow=float(meta.get("rope.scaling.yarn_beta_slow") or 1.0),
    )


def family_config(architecture: str, meta: GGUFMetadata, config: dict) -> None:
    """Turn the generic config (gguf.py's) into the family's config.json, in place."""
    family = {
        "deepseek2": _deepseek2_config,
        "qwen2moe": _qwen2moe_config,
        "qwen3moe": _qwen3moe_config,
        "gpt-oss": _gpt_oss_config,
    }
    family[architecture](meta, config)
    config["architectures"] = [ARCHITECTURE_CLASSES[config["model_type"]]]


ARCHITECTURE_CLASSES = {
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def _deepseek2_config(meta: GGUFMetadata, config: dict) -> None:
    rope_dims = int(meta.required("rope.dimension_count"))
    key_length = int(meta.get("attention.key_length_mla") or meta.required("attention.key_length"))
    value_length = int(meta.get("attention.value_length_mla") or meta.required("attention.value_length"))
    v3 = int(meta.get("expert_gating_func") or 0) == SIGMOID_GATING
    num_experts = int(meta.get("expert_count") or 0)
    groups = int(meta.get("expert_group_count") or 0)
    config.update(
        model_type="deepseek_v3" if v3 else "deepseek_v2",
        intermediate_size=int(meta.required("feed_forward_length")),
        kv_lora_rank=int(meta.required("attention.kv_lora_rank")),
        q_lora_rank=int(meta.get("attention.q_lora_rank") or 0) or None,
        qk_rope_head_dim=rope_dims,
        qk_nope_head_dim=key_length - rope_dims,
        v_head_dim=value_length,
        rope_interleave=True,
        attention_bias=meta.has(0, "attn_kv_a_mqa") and "blk.0.attn_kv_a_mqa.bias" in meta.tensors,
    )
    config.pop("head_dim", None)
    config.pop("num_local_experts", None)
    if num_experts:
        config.update(
            n_routed_experts=num_experts,
            num_experts_per_tok=int(meta.required("expert_used_count")),
            moe_intermediate_size=int(meta.required("expert_feed_forward_length")),
            n_shared_experts=int(meta.get("expert_shared_count") or 0),
            first_k_dense_replace=int(meta.get("leading_dense_block_count") or 0),
            routed_scaling_factor=float(meta.get("expert_weights_scale") or 1.0),
            norm_topk_prob=bool(meta.get("expert_weights_norm") or False),
            scoring_func="sigmoid" if v3 else "softmax",
            topk_method="noaux_tc" if v3 else ("group_limited_greedy" if groups > 1 else "greedy"),
            n_group=groups or 1,
            topk_group=int(meta.get("expert_group_used_count") or groups or 1),
        )
    rope = config.pop("rope_scaling", None) or {}
    if meta.get("rope.scaling.type") == "yarn":
        # float32 on disk: 0.1 * 0.707 reads back as 0.7070000171...
        log_multiplier = float(meta.get("rope.scaling.yarn_log_multiplier") or 0.0)
        mscale_all_dim = round(log_multiplier / YARN_LOG_MULTIPLIER_SCALE, 6)
        rope = dict(yarn_scaling(meta), mscale=mscale_all_dim, mscale_all_dim=mscale_all_dim)
    config["rope_parameters"] = {"rope_type": "default", **rope, "rope_theta": config["rope_theta"]}


def _qwen2moe_config(meta: GGUFMetadata, config: dict) -> None:
    num_layers = config["num_hidden_layers"]
    config.pop("num_local_experts", None)
    config.update(
        model_type="qwen2_moe",
        intermediate_size=int(meta.get("feed_forward_length") or meta.required("expert_feed_forward_length")),
        qkv_bias=config["attention_bias"],
        num_experts=int(meta.required("expert_count")),
        num_experts_per_tok=int(meta.required("expert_used_count")),
        moe_intermediate_size=int(meta.required("expert_feed_forward_length")),
        shared_expert_intermediate_size=int(meta.get("expert_shared_feed_forward_length") or 0),
        norm_topk_prob=bool(meta.get("expert_weights_norm") or False),
        mlp_only_layers=[layer for layer in range(num_layers) if not meta.has(layer, "ffn_gate_inp")],
        decoder_sparse_step=1,
    )


def _qwen3moe_config(meta: GGUFMetadata, config: dict) -> None:
    config.pop("num_local_experts", None)
    norm = meta.get("expert_weights_norm")
    config.update(
        model_type="qwen3_moe",
        intermediate_size=int(meta.get("feed_forward_length") or meta.required("expert_feed_forward_length")),
        num_experts=int(meta.required("expert_count")),
        num_experts_per_tok=int(meta.required("expert_used_count")),
        moe_intermediate_size=int(meta.required("expert_feed_forward_length")),
        norm_topk_prob=True if norm is None else bool(norm),
    )


def _gpt_oss_config(meta: GGUFMetadata, config: dict) -> None:
    num_layers = config["num_hidden_layers"]
    pattern = meta.get("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer: sliding or not
        sliding = [bool(flag) for flag in pattern]
    else:  # llama.cpp's set_swa_pattern(2): even layers slide
        period = int(pattern or 2)
        sliding = [layer % period < period - 1 for layer in range(num_layers)]
    if len(sliding) != num_layers:
        raise ValueError(
            f"GGUF file {meta.path}: gpt-oss.attention.sliding_window_pattern names {len(sliding)} layers, "
            f"the model has {num_layers}"
        )
    limits = meta.get("swiglu_clamp_exp")
    limits = [float(limit) for limit in limits] if isinstance(limits, list) else [7.0]
    if len(set(limits)) != 1 or limits[0] <= 0:
        raise ValueError(
            f"GGUF file {meta.path}: gpt-oss.swiglu_clamp_exp must be one positive limit for every layer, got {limits}"
        )
    rope: dict[str, Any] = dict(rope_type="default", rope_theta=config["rope_theta"])
    if meta.get("rope.scaling.type") == "yarn":
        rope.update(yarn_scaling(meta), truncate=False)
    config.pop("rope_scaling", None)
    config.update(
        model_type="gpt_oss",
        intermediate_size=int(meta.required("expert_feed_forward_length")),
        num_local_experts=int(meta.required("expert_count")),
        num_experts_per_tok=int(meta.required("expert_used_count")),
        sliding_window=int(meta.required("attention.sliding_window")),
        layer_types=["sliding_attention" if flag else "full_attention" for flag in sliding],
        swiglu_limit=limits[0],
        attention_bias=True,
        rope_parameters=rope,
    )


def missing_layer_tensor(architecture: str, meta: GGUFMetadata, layer: int) -> str | None:
    """The first tensor layer `layer` lacks (blk.N.<name>), or None."""
    required: list[str | tuple[str, ...]] = list(_ATTENTION_REQUIRED)
    if architecture == "deepseek2":
        required += ["attn_kv_a_mqa", "attn_kv_a_norm", ("attn_q", "attn_q_b"), ("attn_kv_b", "attn_k_b")]
        if meta.has(layer, "attn_q_b"):
            required += ["attn_q_a", "attn_q_a_norm"]
        if meta.has(layer, "attn_k_b"):
            required.append("attn_v_b")
        dense = layer < int(meta.get("leading_dense_block_count") or 0) or not meta.get("expert_count")
        required += list(_DENSE_MLP) if dense else list(_MOE_REQUIRED)
    elif architecture == "qwen2moe":
        required += ["attn_q", "attn_k", "attn_v"]
        moe = meta.has(layer, "ffn_gate_inp")
        required += list(_MOE_REQUIRED) if moe else list(_DENSE_MLP)
        if moe and meta.get("expert_shared_feed_forward_length"):
            required += ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp"]
    elif architecture == "qwen3moe":
        required += ["attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", *_MOE_REQUIRED]
    else:  # gpt-oss
        required = ["attn_norm", "post_attention_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_sinks"]
        required += list(_MOE_REQUIRED)
    for names in required:
        names = (names,) if isinstance(names, str) else names
        if not any(meta.has(layer, name) for name in names):
            return f"blk.{layer}.{names[0]}.weight"
    return None


Read = Callable[[str], np.ndarray]  # GGUF tensor name -> its float32 values


def derived_tensors(architecture: str, tensors: dict) -> dict[str, Callable[[Read], np.ndarray]]:
    """Hugging Face tensors assembled from several GGUF ones: HF name -> how to build it."""
    derived: dict[str, Callable[[Read], np.ndarray]] = {}
    layers = sorted({int(name.split(".")[1]) for name in tensors if name.startswith("blk.")})
    for layer in layers:
        blk, hf = f"blk.{layer}.", f"model.layers.{layer}."
        if architecture == "deepseek2" and blk + "attn_k_b.weight" in tensors:
            derived[hf + "self_attn.kv_b_proj.weight"] = lambda read, blk=blk: join_kv_b(
                read(blk + "attn_k_b.weight"), read(blk + "attn_v_b.weight")
            )
        if architecture == "deepseek2" and blk + "exp_probs_b.bias" in tensors:
            derived[hf + "mlp.gate.e_score_correction_bias"] = lambda read, blk=blk: read(blk + "exp_probs_b.bias")
        if architecture == "gpt-oss" and blk + "attn_sinks.weight" in tensors:  # transformers' sinks have no .weight
            derived[hf + "self_attn.sinks"] = lambda read, blk=blk: read(blk + "attn_sinks.weight")
        if architecture != "gpt-oss" or blk + "ffn_gate_exps.weight" not in tensors:
            continue
        experts = hf + "mlp.experts."
        derived[experts + "gate_up_proj"] = lambda read, blk=blk: interleave_columns(
            read(blk + "ffn_gate_exps.weight").swapaxes(1, 2), read(blk + "ffn_up_exps.weight").swapaxes(1, 2)
        )
        derived[experts + "down_proj"] = lambda read, blk=blk: read(blk + "ffn_down_exps.weight").swapaxes(1, 2)
        if blk + "ffn_gate_exps.bias" in tensors:
            derived[experts + "gate_up_proj_bias"] = lambda read, blk=blk: interleave_columns(
                read(blk + "ffn_gate_exps.bias"), read(blk + "ffn_up_exps.bias")
            )
            derived[experts + "down_proj_bias"] = lambda read, blk=blk: read(blk + "ffn_down_exps.bias")
    return derived


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """attn_k_b [H, R, N] (transposed per head) and attn_v_b [H, V, R] -> kv_b_proj's weight [H * (N + V), R]."""
    joined = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)  # [H, N + V, R]
    return joined.reshape(-1, joined.shape[-1])


def interleave_columns(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[..., F] each -> [..., 2F] with the gate at even columns and up at odd ones (transformers' gate_up_proj)."""
    return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])
