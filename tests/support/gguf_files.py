"""Writing GGUF files as llama.cpp's convert_hf_to_gguf.py would, from the committed Hugging Face fixtures.

write_gguf(path, hf_config, weights, quant_types, tokenizer=...) names tensors as llama.cpp does,
permutes query/key rows for the llama architecture (the permutation jaxserve must undo), quantizes
each matrix with gguf.quants.quantize (or, for the k-quants gguf cannot quantize, writes random blocks
with sane scales: the test then compares against their dequantized values), and embeds a tokenizer
read from a sentencepiece tokenizer.model ("llama") or a tokenizer.json ("gpt2").

Gemma ("gemma2", "gemma3"): every norm weight + 1, the sandwich norms under llama.cpp's names, the
soft-caps, window and (Gemma 3) both rope bases in the metadata; query_pre_attn_scalar is not written
(GGUF has no key for it). llama.cpp's Gemma 2 converter drops lm_head; it is kept here, so an untied
fixture also checks output.weight. Phi-3 ("phi3"): the fused attn_qkv / ffn_up, rope.dimension_count,
the original context length and the LongRoPE factor tensors.
"""

from __future__ import annotations

import json
import math

import numpy as np
import sentencepiece
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, RopeScalingType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize
from sentencepiece import sentencepiece_model_pb2

LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "block_sparse_moe.gate": "ffn_gate_inp",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GEMMA_LAYER_NAMES = {
    **LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
PHI3_LAYER_NAMES = {**LAYER_NAMES, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
EXTRA_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
EXPERT_NAMES = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def permute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_tensors(hf_config: dict, weights: dict[str, np.ndarray], architecture: str) -> dict[str, np.ndarray]:
    """Hugging Face tensors under llama.cpp's names, Mixtral's experts stacked, llama's q/k rows permuted."""
    tensors, experts = {}, {}
    gemma = architecture in ("gemma2", "gemma3")
    layer_names = GEMMA_LAYER_NAMES if gemma else PHI3_LAYER_NAMES if architecture == "phi3" else LAYER_NAMES
    for name, value in weights.items():
        value = np.asarray(value, np.float32)
        if gemma and name.endswith("norm.weight"):
            value = value + 1.0
        if name in GLOBAL_NAMES or name in EXTRA_TENSORS:
            tensors[GLOBAL_NAMES.get(name, name)] = value
            continue
        _, _, layer, rest = name.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        if ".experts." in module:  # block_sparse_moe.experts.E.w1
            expert, kind = module.split(".")[2:4]
            experts.setdefault((layer, EXPERT_NAMES[kind]), {})[int(expert)] = value
            continue
        if architecture == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = hf_config["num_attention_heads"] if module.endswith("q_proj") else hf_config["num_key_value_heads"]
            value = permute_rotary_rows(value, heads)
        tensors[f"blk.{layer}.{layer_names[module]}.{suffix}"] = value
    for (layer, kind), by_expert in experts.items():
        tensors[f"blk.{layer}.{kind}.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return tensors


def llama3_rope_factors(scaling: dict, rope_theta: float, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: one divisor per rotary frequency."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelength = 2 * np.pi / freq
        if wavelength < context / high:
            factors.append(1)
        elif wavelength > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, np.float32)


def random_blocks(shape: tuple[int, ...], qtype: T, rng: np.random.Generator) -> np.ndarray:
    """Random k-quant blocks whose f16 scales are small and finite (gguf cannot quantize to these types)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block_size, type_size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.004).tobytes(), np.uint8)
    scale_bytes = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q2_K: (-4, -2), T.Q6_K: (-2,), T.Q3_K: (-2,)}.get(qtype, (0,))
    # (IQ4_NL, IQ4_XS: d first)
    for start in scale_bytes:
        blocks[..., start] = scale[0]
        blocks[..., start + 1] = scale[1]
    return blocks.reshape(*shape[:-1], -1)


def write_gguf(
    path: str,
    hf_config: dict,
    weights: dict[str, np.ndarray],
    quant_types: dict[str, T],
    architecture: str = "llama",
    tokenizer: tuple[str, str] | None = None,
    seed: int = 0,
    chat_template: str | None = None,
) -> None:
    """quant_types: GGUF tensor-name fragment -> type (first match wins; F32 otherwise; 1-D tensors stay F32).
    tokenizer: ("llama", tokenizer.model path) or ("gpt2:<pre>", tokenizer.json path)."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, architecture)
    writer.add_block_count(hf_config["num_hidden_layers"])
    writer.add_context_length(hf_config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(hf_config["hidden_size"])
    writer.add_feed_forward_length(hf_config["intermediate_size"])
    writer.add_head_count(hf_config["num_attention_heads"])
    writer.add_head_count_kv(hf_config.get("num_key_value_heads", hf_config["num_attention_heads"]))
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = hf_config.get("rope_parameters") or {}
    local_rope = rope.get("sliding_attention")
    rope = rope.get("full_attention", rope)  # Gemma 3's global layers
    writer.add_rope_freq_base(float(rope.get("rope_theta", hf_config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(hf_config.get("rms_norm_eps", 1e-6)))
    scaling = hf_config.get("rope_scaling") or (rope if rope.get("rope_type") == "llama3" else None)
    if scaling and scaling.get("rope_type") == "llama3":
        weights = {
            **weights,
            "rope_freqs.weight": llama3_rope_factors(scaling, rope.get("rope_theta", 10000.0), head_dim),
        }
    if scaling and scaling.get("rope_type") == "yarn":  # as the converter writes HF's yarn rope_scaling
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
        writer.add_rope_scaling_yarn_beta_fast(float(scaling.get("beta_fast", 32.0)))
        writer.add_rope_scaling_yarn_beta_slow(float(scaling.get("beta_slow", 1.0)))
    if architecture in ("gemma2", "gemma3"):
        weights = add_gemma_metadata(writer, hf_config, weights, architecture, rope, local_rope)
    if architecture == "phi3":
        weights = add_phi3_metadata(writer, hf_config, weights, rope, head_dim)
    if hf_config.get("num_local_experts"):
        writer.add_expert_count(hf_config["num_local_experts"])
        writer.add_expert_used_count(hf_config["num_experts_per_tok"])
    if tokenizer is not None:
        kind, source = tokenizer
        (add_sentencepiece_vocab if kind == "llama" else add_byte_level_vocab)(writer, source, kind.partition(":")[2])
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, value in gguf_tensors(hf_config, weights, architecture).items():
        qtype = next((q for fragment, q in quant_types.items() if fragment in name), T.F32) if value.ndim > 1 else T.F32
        if qtype in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS):
            writer.add_tensor(name, random_blocks(value.shape, qtype, rng), raw_dtype=qtype)
        elif qtype == T.F32:
            writer.add_tensor(name, value)
        else:
            writer.add_tensor(name, quantize(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_gemma_metadata(
    writer: GGUFWriter, hf_config: dict, weights: dict, architecture: str, rope: dict, local_rope: dict | None
) -> dict:
    """As convert_hf_to_gguf.py's Gemma2Model / Gemma3Model.set_gguf_parameters."""
    if architecture == "gemma2":
        writer.add_attn_logit_softcapping(hf_config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(hf_config["final_logit_softcapping"])
        writer.add_sliding_window(hf_config["sliding_window"])
        return weights
    if hf_config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(hf_config["final_logit_softcapping"])
    if hf_config.get("sliding_window_pattern") != 1:
        writer.add_sliding_window(hf_config["sliding_window"])
    if local_rope and "rope_theta" in local_rope:
        writer.add_rope_freq_base_swa(float(local_rope["rope_theta"]))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    return weights


def add_phi3_metadata(writer: GGUFWriter, hf_config: dict, weights: dict, rope: dict, head_dim: int) -> dict:
    """As convert_hf_to_gguf.py's Phi3MiniModel: set_gguf_parameters and generate_extra_tensors."""
    original = int(rope.get("original_max_position_embeddings") or hf_config["original_max_position_embeddings"])
    rotary_dim = (
        int(rope.get("partial_rotary_factor", 1.0) * hf_config["hidden_size"]) // hf_config["num_attention_heads"]
    )
    assert rotary_dim <= head_dim
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_dimension_count(rotary_dim)
    writer.add_sliding_window(hf_config.get("sliding_window") or 0)
    if not rope.get("long_factor"):
        return weights
    scale = hf_config["max_position_embeddings"] / original
    writer.add_rope_scaling_type(RopeScalingType.LONGROPE)
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    return {
        **weights,
        "rope_factors_long.weight": np.array(rope["long_factor"], np.float32),
        "rope_factors_short.weight": np.array(rope["short_factor"], np.float32),
    }


def add_sentencepiece_vocab(writer: GGUFWriter, model_path: str, _pre: str) -> None:
    """As convert_hf_to_gguf.py's _create_vocab_sentencepiece: pieces, scores, types, ids."""
    processor = sentencepiece.SentencePieceProcessor(model_file=model_path)
    proto = sentencepiece_model_pb2.ModelProto()  # pyright: ignore[reportAttributeAccessIssue] (generated)
    proto.ParseFromString(processor.serialized_model_proto())
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([piece.piece for piece in proto.pieces])
    writer.add_token_scores([piece.score for piece in proto.pieces])
    writer.add_token_types([int(piece.type) for piece in proto.pieces])  # sentencepiece's types are llama.cpp's
    writer.add_bos_token_id(processor.bos_id())
    writer.add_eos_token_id(processor.eos_id())
    writer.add_unk_token_id(processor.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)


def add_byte_level_vocab(writer: GGUFWriter, tokenizer_json: str, pre: str) -> None:
    with open(tokenizer_json) as f:
        spec = json.load(f)
    vocab = dict(spec["model"]["vocab"])
    specials = {token["content"] for token in spec["added_tokens"] if token["special"]}
    for token in spec["added_tokens"]:
        vocab[token["content"]] = token["id"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in specials else 1 for token in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    writer.add_bos_token_id(vocab.get("<|im_start|>", 0))
    writer.add_eos_token_id(vocab.get("<|im_end|>", 0))
    writer.add_add_bos_token(False)
