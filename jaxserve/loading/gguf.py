"""llama.cpp's GGUF files: the architecture from the metadata, the weights dequantized under Hugging Face names.

    GGUFFile(path)          parse and check everything up front (metadata, architecture, every tensor's
                            type and extent), so a bad file fails before anything is loaded
      .hf_config()          the config.json dict that ModelConfig.from_hf_dict reads
      .tensor_reader()      `hf_name in reader`, `reader.read(hf_name)`: float32 numpy arrays in the layout
                            a safetensors checkpoint would hold, for loading.weights

llama.cpp's converter permutes the query and key rows of llama-architecture models (its rotary
embedding pairs adjacent dimensions, Hugging Face's pairs the two halves); reading undoes that.
Mixtral is "llama" with experts in GGUF; its stacked expert tensors are served per expert.
Llama 3.1's rotary scaling is read back from its rope_freqs tensor (gguf_rope.py). The embedded
tokenizer is read by gguf_tokenizer.py.

Gemma 2 / 3: the converter stores every norm weight with Gemma's unit offset added (llama.cpp's
RMSNorm multiplies by the weight alone); reading subtracts it again. GGUF has no query_pre_attn_scalar:
llama.cpp scales scores by head_dim's -1/2 power, or by hidden / heads for the 27B models, and so does
the config written here. Gemma 3's local layers take rope.freq_base_swa (10k unless given), unscaled.
Phi-3 keeps its fused attn_qkv and ffn_up (gate rows, then up) under Hugging Face's fused names; its
LongRoPE factors are the rope_factors_long / rope_factors_short tensors.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from jaxserve.loading import gguf_families
from jaxserve.loading.gguf_metadata import GGUFMetadataReader
from jaxserve.loading.gguf_rope import llama3_rope_scaling

logger = logging.getLogger(__name__)
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)

MODEL_TYPES = {  # GGUF architecture -> HF model_type
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    **gguf_families.FAMILY_MODEL_TYPES,
}
ARCHITECTURE_CLASSES = {  # HF model_type -> config.json architectures
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    **gguf_families.ARCHITECTURE_CLASSES,
}
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's 27B: scores scaled by (hidden / heads) ** -1/2
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {  # blk.N.<name> -> model.layers.N.<name>
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "block_sparse_moe.gate",
}
GEMMA_LAYER_TENSORS = {
    **LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
PHI3_LAYER_TENSORS = {**LAYER_TENSORS, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
EXPERT_TENSORS = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}  # stacked -> Mixtral's names
REQUIRED_LAYER_TENSORS = ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output")
FAMILY_LAYER_TENSORS = {  # required instead of the above, and the MLP's
    "gemma2": (*REQUIRED_LAYER_TENSORS, "post_attention_norm", "post_ffw_norm", "ffn_gate", "ffn_up", "ffn_down"),
    "gemma3": (
        *REQUIRED_LAYER_TENSORS,
        "post_attention_norm",
        "post_ffw_norm",
        "attn_q_norm",
        "attn_k_norm",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ),
    "phi3": ("attn_norm", "ffn_norm", "attn_qkv", "attn_output", "ffn_up", "ffn_down"),
}


def layer_tensor_names(architecture: str) -> dict[str, str]:
    """blk.N.<name> -> model.layers.N.<name> for one GGUF architecture."""
    if architecture in GEMMA_ARCHITECTURES:
        return GEMMA_LAYER_TENSORS
    if architecture in gguf_families.LAYER_TENSORS:
        return gguf_families.LAYER_TENSORS[architecture]
    return PHI3_LAYER_TENSORS if architecture == "phi3" else LAYER_TENSORS


def find_gguf_file(path: str) -> str | None:
    """path itself when it is a .gguf file, or the one .gguf file in directory path; None otherwise."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(name for name in os.listdir(path) if name.endswith(".gguf"))
    if len(found) > 1:
        raise ValueError(f"{path!r} holds several GGUF files ({', '.join(found)}); name the one to load")
    return os.path.join(path, found[0]) if found else None


class GGUFFile:
    def __init__(self, path: str):
        self.path = path
        try:
            self.reader = GGUFMetadataReader(path)
            # contents() decodes every value; an array's elements decode lazily otherwise, and late failures are
            # what this constructor exists to rule out.
            self.metadata = {key: field.contents() for key, field in self.reader.fields.items()}
            self.metadata.update(self.reader.arrays)
        except Exception as error:  # the reader raises ValueError, IndexError, struct errors... for a bad file
            raise ValueError(f"malformed GGUF file {path}: {type(error).__name__}: {error}") from None
        self.reader.fields.clear()  # decoded above: numpy views are not kept beside the values
        self.tensors = {tensor.name: tensor for tensor in self.reader.tensors}
        architecture = self.metadata.get("general.architecture")
        if architecture is None or architecture not in MODEL_TYPES:
            raise ValueError(
                f"GGUF file {path}: architecture {architecture!r} is not supported "
                f"(supported: {', '.join(MODEL_TYPES)})"
            )
        self.architecture = architecture
        for tensor in self.reader.tensors:
            if not can_dequantize(tensor.tensor_type):
                raise ValueError(
                    f"GGUF file {path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which "
                    f"the gguf package cannot dequantize"
                )

    def _get(self, key: str, default=None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def hf_config(self) -> dict:
        try:
            hidden_size = int(self._get("embedding_length"))
            num_heads = int(self._get("attention.head_count"))
            num_layers = int(self._get("block_count"))
            intermediate_size = int(self._get("expert_feed_forward_length") or self._get("feed_forward_length"))
        except TypeError:
            raise ValueError(
                f"GGUF file {self.path}: metadata lacks the model's sizes ({self.architecture}."
                f"embedding_length, attention.head_count, block_count, feed_forward_length)"
            ) from None
        num_experts = int(self._get("expert_count") or 0)
        model_type = "mixtral" if self.architecture == "llama" and num_experts else MODEL_TYPES[self.architecture]
        if "token_embd.weight" not in self.tensors:
            raise ValueError(f"GGUF file {self.path} has no token_embd.weight tensor")
        config: dict[str, Any] = dict(
            architectures=[ARCHITECTURE_CLASSES[model_type]],
            model_type=model_type,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(self._get("attention.head_count_kv") or num_heads),
            head_dim=int(self._get("attention.key_length") or hidden_size // num_heads),
            vocab_size=int(self.tensors["token_embd.weight"].data.shape[0]),
            max_position_embeddings=int(self._get("context_length") or 2048),
            rms_norm_eps=float(self._get("attention.layer_norm_rms_epsilon") or 1e-6),
            rope_theta=float(self._get("rope.freq_base") or 10000.0),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            mlp_bias="blk.0.ffn_up.bias" in self.tensors,  # Llama's; the converter writes them when trained
            bos_token_id=self.metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.metadata.get("tokenizer.ggml.eos_token_id"),
            torch_dtype=self.checkpoint_dtype(),
        )
        if self._get("rope.scaling.type") == "linear":
            config["rope_scaling"] = dict(rope_type="linear", factor=float(self._get("rope.scaling.factor")))
        if self._get("rope.scaling.type") == "yarn":  # as llama.cpp's converter writes HF's rope_scaling yarn
            config["rope_scaling"] = gguf_families.yarn_scaling(self._family_metadata())
            if self._get("rope.scaling.yarn_attn_factor") is not None:
                config["rope_scaling"]["attention_factor"] = float(self._get("rope.scaling.yarn_attn_factor"))
        if "rope_freqs.weight" in self.tensors:  # Llama 3.1's scaling, stored as per-frequency divisors
            tensor = self.tensors["rope_freqs.weight"]
            try:
                scaling = llama3_rope_scaling(
                    dequantize(tensor.data, tensor.tensor_type),
                    config["rope_theta"],
                    int(self._get("rope.dimension_count") or config["head_dim"]),
                )
            except ValueError as error:
                raise ValueError(f"GGUF file {self.path}: {error}") from None
            if scaling is not None:
                config["rope_scaling"] = scaling
        if num_experts:
            config.update(num_local_experts=num_experts, num_experts_per_tok=int(self._get("expert_used_count")))
        if self.architecture in GEMMA_ARCHITECTURES:
            self._add_gemma_config(config)
        elif self.architecture == "phi3":
            self._add_phi3_config(config)
        elif self.architecture in gguf_families.FAMILY_MODEL_TYPES:
            gguf_families.family_config(self.architecture, self._family_metadata(), config)
        self._check_layers(num_layers, num_experts)
        return config

    def _add_gemma_config(self, config: dict) -> None:
        num_layers, head_dim = config["num_hidden_layers"], config["head_dim"]
        is_27b = num_layers == GEMMA_27B_LAYERS[self.architecture]
        window = self._get("attention.sliding_window", 4096 if self.architecture == "gemma2" else 0)
        pattern = self._get("attention.sliding_window_pattern", 2 if self.architecture == "gemma2" else 6)
        if isinstance(pattern, list):  # one flag per layer: sliding or not
            sliding = [bool(flag) for flag in pattern]
        else:  # as llama.cpp's set_swa_pattern: the last layer of every `pattern` is global; 0: none is
            sliding = [int(pattern) == 0 or (layer + 1) % int(pattern) != 0 for layer in range(num_layers)]
        if len(sliding) != num_layers:
            raise ValueError(
                f"GGUF file {self.path}: {self.architecture}.attention.sliding_window_pattern names "
                f"{len(sliding)} layers, the model has {num_layers}"
            )
        config.update(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=config["hidden_size"] // config["num_attention_heads"] if is_27b else head_dim,
            final_logit_softcapping=float(self._get("final_logit_softcapping") or 0) or None,
            sliding_window=int(window) or None,
            layer_types=["sliding_attention" if window and is_sliding else "full_attention" for is_sliding in sliding],
        )
        if self.architecture == "gemma2":
            config["attn_logit_softcapping"] = float(self._get("attn_logit_softcapping") or 0) or None
            return
        full: dict[str, Any] = dict(rope_type="default", rope_theta=config["rope_theta"])
        if "rope_scaling" in config:
            full.update(config.pop("rope_scaling"))
        local = dict(rope_type="default", rope_theta=float(self._get("rope.freq_base_swa") or 10000.0))
        config["rope_parameters"] = dict(full_attention=full, sliding_attention=local)

    def _add_phi3_config(self, config: dict) -> None:
        rotary_dim = int(self._get("rope.dimension_count") or config["head_dim"])
        original = int(self._get("rope.scaling.original_context_length") or config["max_position_embeddings"])
        rope: dict[str, Any] = dict(
            rope_type="default",
            rope_theta=config["rope_theta"],
            partial_rotary_factor=rotary_dim / config["head_dim"],
        )
        factors = {}
        for kind in ("long", "short"):
            tensor = self.tensors.get(f"rope_factors_{kind}.weight")
            if tensor is not None:
                factors[f"{kind}_factor"] = dequantize(tensor.data, tensor.tensor_type).reshape(-1).tolist()
        if factors:
            if len(factors) != 2:
                raise ValueError(f"GGUF file {self.path} has one of rope_factors_long / rope_factors_short only")
            # the attention factor is left to transformers' default, the value the converter writes
            rope.update(rope_type="longrope", original_max_position_embeddings=original, **factors)
        config.pop("rope_scaling", None)
        config.update(
            rope_parameters=rope,
            original_max_position_embeddings=original,
            sliding_window=int(self._get("attention.sliding_window") or 0) or None,
        )

    def _family_metadata(self) -> gguf_families.GGUFMetadata:
        return gguf_families.GGUFMetadata(self._get, self.tensors, self.path, self.architecture)

    def _check_layers(self, num_layers: int, num_experts: int) -> None:
        if self.architecture in gguf_families.FAMILY_MODEL_TYPES:
            for layer in range(num_layers):
                missing = gguf_families.missing_layer_tensor(self.architecture, self._family_metadata(), layer)
                if missing is not None:
                    raise ValueError(f"GGUF file {self.path} lacks tensor {missing}")
            return
        mlp = ("ffn_gate_inp", *EXPERT_TENSORS) if num_experts else ("ffn_gate", "ffn_up", "ffn_down")
        required = FAMILY_LAYER_TENSORS.get(self.architecture, REQUIRED_LAYER_TENSORS + mlp)
        for layer in range(num_layers):
            for name in required:
                if f"blk.{layer}.{name}.weight" not in self.tensors:
                    raise ValueError(f"GGUF file {self.path} lacks tensor blk.{layer}.{name}.weight")

    def checkpoint_dtype(self) -> str:
        """The dtype a Hugging Face checkpoint of these weights would have: float16 / bfloat16 files keep theirs;
        quantized weights dequantize exactly to float32 (as llama.cpp and transformers compute them)."""
        matrix_types = {t.tensor_type for t in self.reader.tensors if len(t.shape) > 1}
        for dtype, name in ((GGMLQuantizationType.F16, "float16"), (GGMLQuantizationType.BF16, "bfloat16")):
            if matrix_types == {dtype}:
                return name
        return "float32"

    def tensor_reader(self) -> GGUFTensorReader:
        return GGUFTensorReader(self)


@functools.cache
def can_dequantize(qtype: GGMLQuantizationType) -> bool:
    """Whether gguf.quants dequantizes this type (F32, F16, BF16, the Q*, K and IQ quants; not the integer
    or intermediate types): asked of the package itself, on one block of zeros."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's permute(): per head, rows (pair, half) -> (half, pair)."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(
            f"{rows} rows do not split into {num_heads} heads of rotary pairs (a tensor of the wrong shape)"
        )
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def read_dequantized(path: str, tensor, chunk_bytes: int = 16 << 20) -> np.ndarray:
    """One tensor's float32 values, read from the file in chunks of rows and dequantized chunk by chunk.

    Not through the reader's memory map: pages read through it stay resident (and count as this
    process's memory) as long as the map lives, a second copy of the weights by the end of loading.
    Chunks keep dequantization's temporaries (several times their output) small beside the result.
    """
    raw = tensor.data  # the memory-mapped view; only its dtype and shape are used
    row_width = raw.shape[-1]
    rows = raw.size // row_width
    row_bytes = row_width * raw.dtype.itemsize
    step = max(1, chunk_bytes // row_bytes)
    values: np.ndarray | None = None
    with open(path, "rb") as f:
        for start in range(0, rows, step):
            count = min(step, rows - start)
            f.seek(tensor.data_offset + start * row_bytes)
            block = np.fromfile(f, dtype=raw.dtype, count=count * row_width).reshape(count, row_width)
            chunk = dequantize(block, tensor.tensor_type)
            if values is None:
                values = np.empty((rows, chunk.shape[-1]), np.float32)
            values[start : start + count] = chunk
    assert values is not None, f"GGUF tensor {tensor.name} has no rows"
    return values.reshape(*raw.shape[:-1], values.shape[-1])


class GGUFTensorReader:
    """The checkpoint-reader interface of loading.weights over a GGUF file."""

    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf
        self.names: dict[str, tuple[str, int | None]] = {}  # HF name -> (GGUF name, expert index or None)
        layer_tensors = layer_tensor_names(gguf.architecture)
        expert_tensors = gguf_families.EXPERT_TENSORS.get(gguf.architecture)
        for name, tensor in gguf.tensors.items():
            if name in GLOBAL_TENSORS:
                self.names[GLOBAL_TENSORS[name]] = (name, None)
                continue
            parts = name.split(".")  # blk.N.<tensor>.<weight|bias>
            if len(parts) != 4 or parts[0] != "blk":
                continue
            prefix = f"model.layers.{parts[1]}."
            if parts[2] in layer_tensors:
                self.names[prefix + layer_tensors[parts[2]] + "." + parts[3]] = (name, None)
            elif expert_tensors is not None:  # the family's own per-expert names
                for expert in range(tensor.data.shape[0]) if parts[2] in expert_tensors else ():
                    hf_name = f"{prefix}{expert_tensors[parts[2]].format(expert=expert)}.{parts[3]}"
                    self.names[hf_name] = (name, expert)
            elif parts[2] in EXPERT_TENSORS:
                for expert in range(tensor.data.shape[0]):
                    hf_name = f"{prefix}block_sparse_moe.experts.{expert}.{EXPERT_TENSORS[parts[2]]}.{parts[3]}"
                    self.names[hf_name] = (name, expert)
        # HF name -> how to build it from other GGUF tensors (deepseek2's kv_b_proj, gpt-oss' fused experts)
        self.derived = gguf_families.derived_tensors(gguf.architecture, gguf.tensors)
        config = gguf.hf_config()
        self.rotary_heads = {}
        if gguf.architecture == "llama":
            self.rotary_heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        # (GGUF name, dequantized): the expert tensors are read once per expert
        self._cached: tuple[str, np.ndarray] | None = None

    def __contains__(self, hf_name: str) -> bool:
        return hf_name in self.names or hf_name in self.derived

    def read(self, hf_name: str) -> np.ndarray:
        if hf_name in self.derived:  # gpt-oss reads gate_up_proj twice (gate, then up columns): kept once
            if self._cached is None or self._cached[0] != hf_name:
                values = self.derived[hf_name](lambda name: read_dequantized(self.gguf.path, self.gguf.tensors[name]))
                self._cached = (hf_name, values)
            return self._cached[1]
        if hf_name not in self.names:
            raise ValueError(f"GGUF file {self.gguf.path} has no tensor for {hf_name!r}")
        name, expert = self.names[hf_name]
        if self._cached is not None and self._cached[0] == name:
            values = self._cached[1]
        else:
            values = read_dequantized(self.gguf.path, self.gguf.tensors[name])
            # Only a stack of experts is read again (once per expert); anything else is not kept.
            self._cached = (name, values) if expert is not None else None
        if expert is not None:
            values = values[expert]
        projection = hf_name.split(".")[-2]
        if projection in self.rotary_heads:
            try:
                values = unpermute_rotary_rows(values, self.rotary_heads[projection])
            except ValueError as error:
                raise ValueError(f"GGUF file {self.gguf.path}: tensor {name}: {error}") from None
        if self.gguf.architecture in GEMMA_ARCHITECTURES and name.endswith("norm.weight"):
            values = values - 1.0  # the converter's unit offset, which jaxserve's Gemma norms add themselves
        return values

    def read_blocks(self, hf_name: str):
        """The tensor's quantized blocks as a stand-in for its float values (quantize_gguf.Blocks: read when
        asked, without a float copy), for a family's read_param to lay out as it lays out float tensors; None
        where its type has no quantized layout (or it is assembled from several tensors): it then dequantizes."""
        from jaxserve.loading.quantize_gguf import LAYOUTS, Blocks, has_quantized_layout

        if hf_name in self.derived:
            return None
        if hf_name not in self.names:
            raise ValueError(f"GGUF file {self.gguf.path} has no tensor for {hf_name!r}")
        name, expert = self.names[hf_name]
        tensor = self.gguf.tensors[name]
        if not has_quantized_layout(tensor.tensor_type) or len(tensor.data.shape) != (2 if expert is None else 3):
            if tensor.tensor_type not in FLOAT_TYPES:
                logger.info("GGUF tensor %s (%s) has no quantized layout: dequantized", name, tensor.tensor_type.name)
            return None
        num_rows, row_bytes = tensor.data.shape[-2:]  # [(X,) N, bytes per row] uint8
        offset = tensor.data_offset + (expert or 0) * num_rows * row_bytes  # expert e's rows of a stack
        rotary_heads = self.rotary_heads.get(hf_name.split(".")[-2])
        block_bytes, block_values = LAYOUTS[tensor.tensor_type][:2]

        def raw() -> np.ndarray:
            with open(self.gguf.path, "rb") as f:
                f.seek(offset)
                rows = np.fromfile(f, dtype=np.uint8, count=num_rows * row_bytes).reshape(num_rows, row_bytes)
            if rotary_heads is None:
                return rows
            try:
                return unpermute_rotary_rows(rows, rotary_heads)
            except ValueError as error:
                raise ValueError(f"GGUF file {self.gguf.path}: tensor {name}: {error}") from None

        depth = row_bytes // block_bytes * block_values
        return Blocks(raw, lambda: self.read(hf_name), tensor.tensor_type, num_rows, depth)
