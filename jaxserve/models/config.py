"""The architecture of a model, read from a Hugging Face config.json as transformers reads it.

One `ModelConfig` describes every supported family: Llama, Mistral and Qwen2/Qwen3 are the same
decoder with different attention details (biases, per-head q/k norms, which layers slide their
window); Mixtral, Qwen3-MoE and Qwen2-MoE swap the MLP for a sparse mixture of experts (Qwen2-MoE's
adds a gated shared expert, and may keep dense MLPs in some layers). Gemma 2 and 3 add
(1 + weight) norms around both halves of each layer, a scaled embedding, soft-capped logits and
local layers with their own rope base; Phi-3 fuses projections (split at load, phi3.py) and
stretches its rope with LongRoPE over part of each head.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any

from jaxserve.config import canonical_dtype
from jaxserve.models.deepseek_config import DEEPSEEK_MODEL_TYPES, deepseek_fields
from jaxserve.models.gemma3_config import gemma3_text_config
from jaxserve.models.gpt_oss_config import GPT_OSS_MODEL_TYPES, gpt_oss_fields, with_default_rope

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen2_moe",
    "gemma2",
    "gemma3_text",
    "gemma3",  # multimodal: its text model is served (gemma3_config.py)
    "phi3",
    *DEEPSEEK_MODEL_TYPES,
    *GPT_OSS_MODEL_TYPES,
)
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched for long contexts (HF's rope_scaling / rope_parameters)."""

    rope_type: str = "default"  # default | linear | llama3 | longrope | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # LongRoPE (Phi-3): per-frequency divisors [rotary dim / 2] for contexts up to and beyond
    # original_max_position_embeddings, and the factor cos and sin are scaled by
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    # YaRN (GPT-OSS, DeepSeek): frequencies blend from extrapolated (fast, beta_fast rotations) to interpolated
    # (slow, beta_slow) over a ramp, truncated to whole lanes unless truncate is off; attention_factor scales cos
    # and sin (derived from factor, or mscale / mscale_all_dim, when the config omits it). mscale_all_dim is
    # kept for DeepSeek's attention, which also rescales its softmax by it.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float = 0.0
    mscale_all_dim: float = 0.0

    def __post_init__(self):
        if self.rope_type not in ("default", "linear", "llama3", "longrope", "yarn"):
            raise ValueError(
                f"unsupported rope scaling type {self.rope_type!r}; supported: default, linear, llama3, "
                "longrope (su), yarn"
            )
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")
        if self.rope_type == "longrope" and not (self.short_factor and len(self.short_factor) == len(self.long_factor)):
            raise ValueError("longrope scaling needs short_factor and long_factor lists of one length")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer; its MLPs are sparse mixtures of experts when num_experts > 0."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # on the q, k and v projections
    attention_output_bias: bool = False  # on o_proj (Qwen2 has the first without this one)
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each query and key head before rope
    mlp_bias: bool = False
    hidden_act: str = "silu"
    num_experts: int = 0
    num_experts_per_token: int = 0
    expert_intermediate_size: int = 0  # each expert's MLP width (Mixtral: intermediate_size)
    normalize_expert_weights: bool = True  # the top k router probabilities rescaled to sum to 1
    # Qwen2-MoE: an MLP of this width beside the routed experts, scaled by sigmoid(shared_expert_gate(x));
    # 0: none
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model whose MLP is dense (intermediate_size)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()  # per layer, full or sliding attention; default: every layer alike
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str = "float32"
    # Gemma: embeddings times sqrt(hidden_size); norms scale by (1 + weight) and also wrap the attention's
    # output and both sides of the MLP (sandwich norms); scores and final logits soft-capped
    scale_embeddings: bool = False
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    attention_logit_soft_cap: float | None = None
    final_logit_soft_cap: float | None = None
    query_pre_attention_scalar: float | None = None  # scores scale by its -1/2 power instead of head_dim's
    local_rope_theta: float | None = None  # Gemma 3: sliding layers' rope base (unscaled); None: rope_theta
    rotary_dim: int = 0  # lanes of each head that rope rotates (Phi partial_rotary_factor); 0: head_dim
    # The engine's max_model_len (set by the engine builder, with_context_length): LongRoPE picks its long
    # factors once when this exceeds original_max_position_embeddings, so cached keys keep their rope
    context_length: int | None = None
    # DeepSeek's multi-head latent attention (mla.py; 0: none): keys and values come from a latent of
    # kv_lora_rank lanes plus one rope key of qk_rope_head_dim lanes shared by every head, which is what
    # the cache holds; queries go through a q_lora_rank bottleneck where set. V2 rotates lane pairs.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # Qwen2-MoE gates its shared expert by sigmoid(shared_expert_gate(x)); DeepSeek adds its shared experts as they are
    shared_expert_gated: bool = True
    # DeepSeek routing (grouped_routing.py): softmax or sigmoid scores; experts split in num_expert_groups
    # groups ranked by their best score ("max") or two best ("top2_sum"), only the best
    # num_expert_groups_kept compete; a per-expert bias shifts the choice (not the weights); the chosen
    # weights are multiplied by routed_scaling_factor
    expert_scoring: str = "softmax"
    expert_group_scoring: str = "none"
    num_expert_groups: int = 1
    num_expert_groups_kept: int = 1
    routed_scaling_factor: float = 1.0
    expert_score_correction_bias: bool = False
    # GPT-OSS (gpt_oss_config.py): a learned sink logit per query head in every attention softmax; a bias on
    # the router and on each expert's projections; experts gate with a clamped SwiGLU where swiglu_limit > 0
    attention_sinks: bool = False
    router_bias: bool = False
    expert_biases: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 0.0

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unknown model type {self.model_type!r} in config.json; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rotary_dim:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"config.json: rotary dims must be even and at most head_dim, got {self.rotary_dim}")
        factors = self.rope_scaling.short_factor
        if factors and len(factors) != self.rotary_dim // 2:
            raise ValueError(f"config.json: longrope factors must number rotary dims / 2, got {len(factors)}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"config.json: unsupported hidden_act {self.hidden_act!r}")
        if self.num_experts and not 0 < self.num_experts_per_token <= self.num_experts:
            raise ValueError(
                f"config.json: num_experts_per_tok ({self.num_experts_per_token}) must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        if not set(self.dense_layers) <= set(range(self.num_layers)):
            raise ValueError(
                f"config.json: dense MLP layers {list(self.dense_layers)} outside 0..{self.num_layers - 1}"
            )
        if self.num_experts and not self.expert_intermediate_size:
            object.__setattr__(self, "expert_intermediate_size", self.intermediate_size)
        if not self.layer_types:
            every = "sliding_attention" if self.sliding_window else "full_attention"
            object.__setattr__(self, "layer_types", (every,) * self.num_layers)
        if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(
                f"config.json: layer_types must be {self.num_layers} of {', '.join(LAYER_TYPES)}, "
                f"got {list(self.layer_types)}"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers

    @property
    def is_latent_attention(self) -> bool:
        """DeepSeek's MLA: the cache holds a latent and a rope key per token, not keys and values per head."""
        return self.kv_lora_rank > 0

    @property
    def kv_cache_head_dim(self) -> int:
        """Lanes per token and cache head of each of the key and value page pools. MLA's one entry
        [latent | rope key] (kv_lora_rank + qk_rope_head_dim, rounded up to even) is cut in two halves, one
        per pool, so that both pools keep one shape and every page copy moves them as any model's."""
        if self.is_latent_attention:
            return -(-(self.kv_lora_rank + self.qk_rope_head_dim) // 2)
        return self.head_dim

    @property
    def num_moe_layers(self) -> int:
        """Layers with experts: the rows of expert-load counts and profiles."""
        return sum(self.layer_is_moe(layer) for layer in range(self.num_layers))

    def layer_sliding_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def layer_rope(self, layer: int) -> tuple[float, RopeScaling]:
        """(theta, scaling) of a layer's rotary embedding: Gemma 3's sliding layers have their own base."""
        if self.local_rope_theta is not None and self.layer_types[layer] == "sliding_attention":
            return self.local_rope_theta, RopeScaling()
        return self.rope_theta, self.rope_scaling

    def with_context_length(self, max_model_len: int) -> ModelConfig:
        """The config an engine of this max_model_len builds its model from (LongRoPE's factors depend on it)."""
        return dataclasses.replace(self, context_length=max_model_len)

    def logical_axis_sizes(self) -> dict[str, int]:
        """How many independent units each logical axis of the params has: a split must not cut a head."""
        return {
            "heads": self.num_heads,
            "kv_heads": self.num_kv_heads,
            "mlp": self.intermediate_size,
            "expert_mlp": self.expert_intermediate_size,
            "shared_expert_mlp": self.shared_expert_intermediate_size or 1,
            "vocab": self.vocab_size,
            "embed": self.hidden_size,
            "head_dim": self.head_dim,
            "expert": self.num_experts or 1,
        }

    @classmethod
    def from_hf_dict(cls, hf: dict) -> ModelConfig:
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unknown model type {model_type!r} in config.json; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type == "gemma3":
            hf = gemma3_text_config(hf)
            model_type = hf["model_type"]
        try:
            hidden_size = int(hf["hidden_size"])
            num_heads = int(hf["num_attention_heads"])
            sizes = dict(
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
            )
        except KeyError as missing:
            raise ValueError(f"config.json is missing required key {missing}") from None
        if model_type in GPT_OSS_MODEL_TYPES:
            hf = with_default_rope(hf)
        eos = hf.get("eos_token_id")
        fields: dict[str, Any] = dict(
            model_type=model_type,
            **sizes,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            **_rope_fields(hf),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            **_attention_fields(model_type, hf, sizes["num_layers"]),
            mlp_bias=bool(hf.get("mlp_bias", False)) if model_type == "llama" else False,
            hidden_act=hf.get("hidden_act", "silu"),
            **_expert_fields(model_type, hf),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            checkpoint_dtype=canonical_dtype(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
        )
        fields.update(_family_fields(model_type, hf, fields))
        if model_type in DEEPSEEK_MODEL_TYPES:
            fields.update(deepseek_fields(model_type, hf))
        if model_type in GPT_OSS_MODEL_TYPES:
            fields.update(gpt_oss_fields(hf, sizes["num_layers"]))
        return cls(**fields)

    @classmethod
    def from_model_dir(cls, model_dir: str) -> ModelConfig:
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"no config.json in model directory {model_dir!r}")
        try:
            with open(path) as f:
                hf = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"malformed config.json in {model_dir!r}: {error}") from None
        if not isinstance(hf, dict):
            raise ValueError(f"malformed config.json in {model_dir!r}: expected a JSON object")
        generation_path = os.path.join(model_dir, "generation_config.json")
        config = cls.from_hf_dict(hf)
        if os.path.isfile(generation_path):
            # generation_config.json is what HF generate() stops on; it may list several EOS ids.
            try:
                with open(generation_path) as f:
                    eos = json.load(f).get("eos_token_id")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                eos = None
            if eos is not None:
                config = dataclasses.replace(config, eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,))
        return config


def _rope_fields(hf: dict) -> dict:
    # transformers 5 nests rope settings in rope_parameters; older configs use rope_theta + rope_scaling.
    rope = dict(hf.get("rope_parameters") or {})
    scaling_source = rope if rope.get("rope_type", "default") != "default" else hf.get("rope_scaling") or {}
    return dict(
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling=_rope_scaling(scaling_source, hf),
    )


def _rope_scaling(source: dict, hf: dict) -> RopeScaling:
    """One rope_scaling (or rope_parameters) dict as transformers reads it."""
    if not source:
        return RopeScaling()
    rope_type = source.get("rope_type", source.get("type", "default"))
    if rope_type in ("su", "longrope"):
        # As transformers: the pretraining length config.json keeps outside the dict wins; the factor defaults
        # to how far max_position_embeddings stretches it, and sets cos and sin's scale unless given.
        original = int(
            hf.get("original_max_position_embeddings")
            or source.get("original_max_position_embeddings")
            or hf.get("max_position_embeddings", 2048)
        )
        factor = float(source.get("factor") or int(hf.get("max_position_embeddings", 2048)) / original)
        attention_factor = source.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return RopeScaling(
            rope_type="longrope",
            factor=factor,
            original_max_position_embeddings=original,
            short_factor=tuple(float(f) for f in source.get("short_factor") or ()),
            long_factor=tuple(float(f) for f in source.get("long_factor") or ()),
            attention_factor=float(attention_factor),
        )
    if rope_type == "yarn":
        return _yarn_scaling(source, hf)
    return RopeScaling(
        rope_type=rope_type,
        factor=float(source.get("factor", 1.0)),
        low_freq_factor=float(source.get("low_freq_factor", 1.0)),
        high_freq_factor=float(source.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(source.get("original_max_position_embeddings", 8192)),
    )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude correction for a context stretched `factor` times (HF's get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_scaling(source: dict, hf: dict) -> RopeScaling:
    """As transformers' _compute_yarn_parameters: a pretraining length kept outside the dict wins; a missing
    factor is how far max_position_embeddings stretches it; a missing attention_factor comes from mscale and
    mscale_all_dim where both are set, else from the factor alone."""
    original = int(
        hf.get("original_max_position_embeddings")
        or source.get("original_max_position_embeddings")
        or hf.get("max_position_embeddings", 2048)
    )
    factor = source.get("factor")
    factor = float(factor) if factor is not None else int(hf.get("max_position_embeddings", 2048)) / original
    mscale, mscale_all_dim = float(source.get("mscale") or 0.0), float(source.get("mscale_all_dim") or 0.0)
    attention_factor = source.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return RopeScaling(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=float(attention_factor),
        beta_fast=float(source.get("beta_fast") or 32.0),
        beta_slow=float(source.get("beta_slow") or 1.0),
        truncate=bool(source.get("truncate", True)),
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
    )


def _family_fields(model_type: str, hf: dict, fields: dict[str, Any]) -> dict:
    """What Gemma and Phi-3 read differently from the Llama family (overriding the common fields)."""
    rope = hf.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    family: dict[str, object] = dict(rotary_dim=int(fields["head_dim"] * float(partial)))
    if model_type not in GEMMA_MODEL_TYPES:
        return family
    num_layers = fields["num_layers"]
    # Gemma 2 alternates sliding and global layers; Gemma 3 has sliding_window_pattern - 1 sliding per global.
    pattern = 2 if model_type == "gemma2" else int(hf.get("sliding_window_pattern", 6))
    window = hf.get("sliding_window")
    family.update(
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        sliding_window=int(window) if window else None,
        layer_types=tuple(
            hf.get("layer_types")
            or ("sliding_attention" if (layer + 1) % pattern else "full_attention" for layer in range(num_layers))
        ),
        scale_embeddings=True,
        norm_unit_offset=True,
        sandwich_norms=True,
        query_pre_attention_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        final_logit_soft_cap=hf.get("final_logit_softcapping"),
    )
    if model_type == "gemma2":  # transformers' Gemma 3 attention never soft-caps its scores
        family["attention_logit_soft_cap"] = hf.get("attn_logit_softcapping")
        return family
    family["qk_norm"] = True
    if "full_attention" in rope or "sliding_attention" in rope:  # transformers 5: one rope per layer type
        full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
        family.update(
            rope_theta=float(full.get("rope_theta", hf.get("rope_theta", 1_000_000.0))),
            rope_scaling=_rope_scaling(full if full.get("rope_type", "default") != "default" else {}, hf),
            local_rope_theta=float(local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0))),
        )
    else:
        family.update(
            rope_theta=float(hf.get("rope_theta", 1_000_000.0)),
            local_rope_theta=float(hf.get("rope_local_base_freq", 10_000.0)),
        )
    return family


def _attention_fields(model_type: str, hf: dict, num_layers: int) -> dict:
    """Biases, q/k norms and sliding windows, each family as its transformers attention reads them."""
    bias = bool(hf.get("attention_bias", False))
    fields: dict[str, object] = dict(
        attention_bias=bias, attention_output_bias=bias, qk_norm=model_type in ("qwen3", "qwen3_moe")
    )
    if model_type == "qwen2":  # q/k/v biases hard-wired on, o_proj's off
        fields.update(attention_bias=True, attention_output_bias=False)
    if model_type == "qwen2_moe":
        fields.update(attention_bias=bool(hf.get("qkv_bias", True)), attention_output_bias=False)
    window = hf.get("sliding_window") if model_type != "llama" else None
    # Qwen's windows are off unless use_sliding_window says so; Mistral's only when it says not.
    if model_type.startswith("qwen") and not hf.get("use_sliding_window", False):
        window = None
    if model_type == "mistral" and hf.get("use_sliding_window") is False:
        window = None
    fields["sliding_window"] = int(window) if window else None
    if model_type in ("qwen2", "qwen3"):
        # Only layers from max_window_layers on slide, unless config.json lists each layer's type.
        first_sliding = int(hf.get("max_window_layers", 28))
        fields["layer_types"] = tuple(
            hf.get("layer_types")
            or (
                "sliding_attention" if window and layer >= first_sliding else "full_attention"
                for layer in range(num_layers)
            )
        )
    if model_type == "qwen2_moe":
        # As transformers' Qwen2MoeConfig: without layer_types, even-numbered layers below max_window_layers slide.
        below = int(hf.get("max_window_layers", 28))
        fields["layer_types"] = tuple(
            hf.get("layer_types")
            or (
                "sliding_attention" if window and layer % 2 == 0 and layer < below else "full_attention"
                for layer in range(num_layers)
            )
        )
    return fields


def _expert_fields(model_type: str, hf: dict) -> dict:
    # transformers >= 5 writes num_local_experts for both families, older Qwen3-MoE configs num_experts.
    if model_type == "mixtral":
        num_experts = int(hf.get("num_local_experts", hf.get("num_experts", 0)))
        return dict(
            num_experts=num_experts, num_experts_per_token=int(hf.get("num_experts_per_tok", 2)) if num_experts else 0
        )
    if model_type == "qwen3_moe":
        # Released Qwen3-MoE models put experts in every layer; expert statistics and placement assume so.
        if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1)) != 1:
            raise ValueError(
                "config.json: Qwen3-MoE with dense MLP layers between the MoE layers "
                "(mlp_only_layers, decoder_sparse_step > 1) is not supported"
            )
        return dict(
            num_experts=int(hf.get("num_local_experts", hf.get("num_experts", 128))),
            num_experts_per_token=int(hf.get("num_experts_per_tok", 8)),
            expert_intermediate_size=int(hf.get("moe_intermediate_size", 768)),
            normalize_expert_weights=bool(hf.get("norm_topk_prob", False)),
        )
    if model_type == "qwen2_moe":
        # A layer has experts unless mlp_only_layers lists it or it falls between decoder_sparse_step's.
        num_experts = int(hf.get("num_local_experts", hf.get("num_experts", 60)))
        step = int(hf.get("decoder_sparse_step", 1))
        only_mlp = set(hf.get("mlp_only_layers") or ())
        num_layers = int(hf["num_hidden_layers"])
        return dict(
            num_experts=num_experts,
            num_experts_per_token=int(hf.get("num_experts_per_tok", 4)) if num_experts else 0,
            expert_intermediate_size=int(hf.get("moe_intermediate_size", 1408)),
            normalize_expert_weights=bool(hf.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size", 5632)),
            dense_layers=tuple(
                layer for layer in range(num_layers) if layer in only_mlp or step <= 0 or (layer + 1) % step
            ),
        )
    return {}
