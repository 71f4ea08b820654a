"""GGUF files of the committed DeepSeek, Qwen2-MoE, Qwen3-MoE and GPT-OSS fixtures, named and laid out as llama.cpp's
convert_hf_to_gguf.py (b10605) writes them (learned by running it on these fixtures).

deepseek2: kv_b_proj split per head into attn_k_b [H, R, N] (transposed) and attn_v_b [H, V, R], or kept
whole as attn_kv_b with the older key_length / value_length meaning (split_kv_b=False); experts stacked;
exp_probs_b.bias for V3's correction bias; the expert_gating_func a released config's scoring_func gives
(sigmoid for V3); no output.weight when tied. qwen2moe: ffn_*_shexp and ffn_gate_inp_shexp; a layer of
mlp_only_layers keeps ffn_gate / ffn_up / ffn_down. gpt-oss: gate_up_proj de-interleaved into
ffn_gate_exps / ffn_up_exps (biases alike), every expert tensor transposed to [E, out, in], optionally as
MXFP4; the clamp limit and layer pattern written only where they differ from llama.cpp's built-in ones.
"""

from __future__ import annotations

import json
import os

import numpy as np
from gguf import ExpertGatingFuncType, GGUFWriter, RopeScalingType
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize
from safetensors.numpy import load_file

from tests.support.fixtures import fixture_dir
from tests.support.gguf_files import GLOBAL_NAMES, add_sentencepiece_vocab

ARCHITECTURES = {
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "gpt_oss": "gpt-oss",
}
COMMON = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
}
LAYER_NAMES = {
    "deepseek2": {
        **COMMON,
        "self_attn.q_a_proj": "attn_q_a",
        "self_attn.q_a_layernorm": "attn_q_a_norm",
        "self_attn.q_b_proj": "attn_q_b",
        "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
        "self_attn.kv_a_layernorm": "attn_kv_a_norm",
        "self_attn.kv_b_proj": "attn_kv_b",
        "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
        "mlp.shared_experts.up_proj": "ffn_up_shexp",
        "mlp.shared_experts.down_proj": "ffn_down_shexp",
    },
    "qwen2moe": {
        **COMMON,
        "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
        "mlp.shared_expert.up_proj": "ffn_up_shexp",
        "mlp.shared_expert.down_proj": "ffn_down_shexp",
        "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    },
    "qwen3moe": {**COMMON, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"},
    "gpt-oss": {
        **COMMON,
        "post_attention_layernorm": "post_attention_norm",
        "mlp.router": "ffn_gate_inp",
    },
}


def family_tensors(config: dict, weights: dict[str, np.ndarray], architecture: str, split_kv_b: bool) -> dict:
    names = LAYER_NAMES[architecture]
    tensors, experts = {}, {}
    for name, value in weights.items():
        value = np.asarray(value, np.float32)
        if name in GLOBAL_NAMES:
            if not (name == "lm_head.weight" and config.get("tie_word_embeddings")):
                tensors[GLOBAL_NAMES[name]] = value
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}."
        if rest == "self_attn.sinks":
            tensors[blk + "attn_sinks.weight"] = value
        elif rest == "mlp.gate.e_score_correction_bias":
            tensors[blk + "exp_probs_b.bias"] = value
        elif rest.startswith("mlp.experts.") and architecture == "gpt-oss":
            kind = rest.removeprefix("mlp.experts.")
            if kind.startswith("gate_up_proj"):
                value = value if kind.endswith("bias") else value.swapaxes(1, 2)  # [E, 2F, X]
                suffix = "bias" if kind.endswith("bias") else "weight"
                gate, up = value[:, 0::2], value[:, 1::2]  # interleaved along 2F
                tensors[blk + f"ffn_gate_exps.{suffix}"] = np.ascontiguousarray(gate)
                tensors[blk + f"ffn_up_exps.{suffix}"] = np.ascontiguousarray(up)
            elif kind == "down_proj":
                tensors[blk + "ffn_down_exps.weight"] = np.ascontiguousarray(value.swapaxes(1, 2))
            else:
                tensors[blk + "ffn_down_exps.bias"] = value
        elif rest.startswith("mlp.experts."):  # mlp.experts.E.gate_proj.weight
            expert, kind = rest.split(".")[2:4]
            experts.setdefault((layer, kind), {})[int(expert)] = value
        elif rest == "self_attn.kv_b_proj.weight" and split_kv_b:
            heads, nope, v_dim = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
            kv_b = value.reshape(heads, nope + v_dim, -1)
            tensors[blk + "attn_k_b.weight"] = np.ascontiguousarray(kv_b[:, :nope].swapaxes(1, 2))
            tensors[blk + "attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, nope:])
        else:
            module, suffix = rest.rsplit(".", 1)
            tensors[blk + names[module] + "." + suffix] = value
    for (layer, kind), by_expert in experts.items():
        gguf_kind = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}[kind]
        tensors[f"blk.{layer}.{gguf_kind}.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return tensors


def write_family_gguf(
    name: str, path: str, split_kv_b: bool = True, expert_type: T = T.F32, drop: tuple[str, ...] = ()
) -> str:
    """The fixture `name` as a GGUF file at path. expert_type: the stacked experts' type where their rows allow
    it (MXFP4: 32-wide blocks); drop: tensors left out (to check they are asked for)."""
    directory = fixture_dir(name)
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    architecture = ARCHITECTURES[config["model_type"]]
    weights = load_file(os.path.join(directory, "model.safetensors"))
    writer = GGUFWriter(path, architecture)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        if architecture == "gpt-oss":
            writer.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast", 32.0)))
            writer.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow", 1.0)))
        elif rope.get("mscale_all_dim") is not None:
            writer.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))
    experts = config.get("n_routed_experts") or config.get("num_experts") or config.get("num_local_experts")
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    family = {
        "deepseek2": _deepseek2_metadata,
        "qwen2moe": _qwen2moe_metadata,
        "qwen3moe": _qwen3moe_metadata,
        "gpt-oss": _gpt_oss_metadata,
    }
    family[architecture](writer, config, split_kv_b)
    add_sentencepiece_vocab(writer, os.path.join(directory, "tokenizer.model"), "")
    for tensor_name, value in family_tensors(config, weights, architecture, split_kv_b).items():
        if tensor_name in drop:
            continue
        if expert_type != T.F32 and "_exps.weight" in tensor_name and value.shape[-1] % 32 == 0:
            writer.add_tensor(tensor_name, quantize(value, expert_type), raw_dtype=expert_type)
        else:
            writer.add_tensor(tensor_name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _deepseek2_metadata(writer: GGUFWriter, config: dict, split_kv_b: bool) -> None:
    """As convert_hf_to_gguf.py's DeepseekV2Model.set_gguf_parameters (split_kv_b=False: the older converter)."""
    rank, rope_dims = config["kv_lora_rank"], config["qk_rope_head_dim"]
    writer.add_head_count_kv(1)
    writer.add_leading_dense_block_count(config.get("first_k_dense_replace") or 0)
    writer.add_vocab_size(config["vocab_size"])
    if config.get("q_lora_rank"):
        writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(rank)
    if split_kv_b:
        writer.add_key_length(rank + rope_dims)
        writer.add_value_length(rank)
        writer.add_key_length_mla(config["qk_nope_head_dim"] + rope_dims)
        writer.add_value_length_mla(config["v_head_dim"])
    else:
        writer.add_key_length(config["qk_nope_head_dim"] + rope_dims)
        writer.add_value_length(config["v_head_dim"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config.get("n_shared_experts") or 0)
    writer.add_expert_weights_scale(float(config.get("routed_scaling_factor", 1.0)))
    if config.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    if config.get("n_group"):
        writer.add_expert_group_count(config["n_group"])
        writer.add_expert_group_used_count(config["topk_group"])
    if config["model_type"] == "deepseek_v3":  # released V3 configs say scoring_func: sigmoid
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    writer.add_rope_dimension_count(rope_dims)


def _qwen2moe_metadata(writer: GGUFWriter, config: dict, _split_kv_b: bool) -> None:
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def _qwen3moe_metadata(writer: GGUFWriter, config: dict, _split_kv_b: bool) -> None:
    """As Qwen3MoeModel (Qwen2MoeModel's): no key for norm_topk_prob (llama.cpp always renormalizes)."""
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])


def _gpt_oss_metadata(writer: GGUFWriter, config: dict, _split_kv_b: bool) -> None:
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    layers = range(config["num_hidden_layers"])
    sliding = [kind == "sliding_attention" for kind in config["layer_types"]]
    if sliding != [layer % 2 == 0 for layer in layers]:
        writer.add_sliding_window_pattern(sliding)
    if config["swiglu_limit"] != 7.0:
        writer.add_swiglu_clamp_exp([float(config["swiglu_limit"])] * len(layers))
