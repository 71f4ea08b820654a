"""Frozen, validated configuration: the model (read from a Hugging Face config.json) and the engine."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral")
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
DTYPE_NAMES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


def canonical_dtype(name: str) -> str:
    key = str(name).removeprefix("torch.")
    if key not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of float32, bfloat16, float16 or 'auto'")
    return DTYPE_NAMES[key]


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are stretched for long contexts (HF's rope_scaling / rope_parameters)."""

    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope scaling type {self.rope_type!r}; supported: default, linear, llama3")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family decoder; Mixtral when num_experts > 0."""

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
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    num_experts: int = 0
    num_experts_per_token: int = 0
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str = "float32"

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unknown model type {self.model_type!r} in config.json; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"config.json: unsupported hidden_act {self.hidden_act!r}")
        if self.num_experts and not 0 < self.num_experts_per_token <= self.num_experts:
            raise ValueError(
                f"config.json: num_experts_per_tok ({self.num_experts_per_token}) must be in "
                f"[1, num_local_experts={self.num_experts}]")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_query_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, hf: dict) -> "ModelConfig":
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unknown model type {model_type!r} in config.json; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        try:
            hidden_size = int(hf["hidden_size"])
            num_heads = int(hf["num_attention_heads"])
            vocab_size = int(hf["vocab_size"])
            num_layers = int(hf["num_hidden_layers"])
            intermediate_size = int(hf["intermediate_size"])
        except KeyError as missing:
            raise ValueError(f"config.json is missing required key {missing}") from None
        head_dim = hf.get("head_dim") or hidden_size // num_heads
        # transformers 5 nests rope settings in rope_parameters; older configs use rope_theta + rope_scaling.
        rope = dict(hf.get("rope_parameters") or {})
        legacy_scaling = hf.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling_source = rope if rope.get("rope_type", "default") != "default" else legacy_scaling
        rope_scaling = RopeScaling()
        if scaling_source:
            rope_type = scaling_source.get("rope_type", scaling_source.get("type", "default"))
            rope_scaling = RopeScaling(
                rope_type=rope_type,
                factor=float(scaling_source.get("factor", 1.0)),
                low_freq_factor=float(scaling_source.get("low_freq_factor", 1.0)),
                high_freq_factor=float(scaling_source.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(scaling_source.get("original_max_position_embeddings", 8192)),
            )
        eos = hf.get("eos_token_id")
        eos_token_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        checkpoint_dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        num_experts = int(hf.get("num_local_experts", 0)) if model_type == "mixtral" else 0
        sliding_window = hf.get("sliding_window")
        if model_type == "mistral" and hf.get("use_sliding_window") is False:
            sliding_window = None
        return cls(
            model_type=model_type,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            hidden_act=hf.get("hidden_act", "silu"),
            num_experts=num_experts,
            num_experts_per_token=int(hf.get("num_experts_per_tok", 2)) if num_experts else 0,
            sliding_window=int(sliding_window) if sliding_window else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
            checkpoint_dtype=canonical_dtype(checkpoint_dtype),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str) -> "ModelConfig":
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


def _powers_of(base: int, start: int, limit: int) -> tuple[int, ...]:
    """start, start*base, ... capped by (and always ending with) limit."""
    sizes, size = [], start
    while size < limit:
        sizes.append(size)
        size *= base
    sizes.append(limit)
    return tuple(sizes)


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes the engine's memory and compiled executables."""

    dtype: str = "auto"
    attention_impl: str = "auto"  # auto | reference | cpu | pallas (see pallas_kernels)
    tensor_parallel_size: int = 1  # Megatron-style: heads and MLP columns split over this many devices
    data_parallel_size: int = 1  # device groups that each run attention for their own sequences and pages
    enable_expert_parallel: bool = False  # MoE experts split over all data x tensor devices
    # Tokens routed per expert ([layers][experts] JSON, e.g. llm.stats()["expert_tokens"] of an earlier
    # run): experts are placed at start-up so that device loads even out (expert parallelism only).
    expert_load_profile: str | None = None
    # Every this many engine steps, move experts by the load routed since the last move (0: never).
    expert_rebalance_interval: int = 0
    page_size: int = 16
    enable_prefix_caching: bool = True
    swap_space: float = 0.0  # GiB of host memory for evicted prefix pages (needs prefix caching)
    session_ttl: float = 300.0  # seconds a session's pages are kept in preference to others
    num_pages: int | None = None
    kv_cache_memory_gib: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_logprobs: int = 20
    seed: int = 0
    # Shapes entering jit; derived from the limits above when not given.
    decode_seq_buckets: tuple[int, ...] | None = None
    prefill_token_buckets: tuple[int, ...] | None = None
    page_buckets: tuple[int, ...] | None = None
    # Prefill chunks of different sequences start on multiples of this, so attention works block by block.
    prefill_query_block: int = 16
    compilation_cache_dir: str | None = "default"
    show_progress: bool = True

    def __post_init__(self):
        if self.dtype != "auto":
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        positive = ("page_size", "max_num_seqs", "max_num_batched_tokens", "prefill_query_block", "tensor_parallel_size",
                    "data_parallel_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.expert_rebalance_interval < 0:
            raise ValueError(f"expert_rebalance_interval must be >= 0, got {self.expert_rebalance_interval}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (one page is reserved), got {self.num_pages}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.data_parallel_size > 1 and self.swap_space:
            raise ValueError("swap_space (the host tier) is not available with data_parallel_size > 1 yet")
        if self.swap_space < 0 or self.session_ttl < 0:
            raise ValueError("swap_space and session_ttl must be >= 0")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.max_num_batched_tokens % self.prefill_query_block:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be a multiple of "
                f"prefill_query_block ({self.prefill_query_block})")
        for name in ("decode_seq_buckets", "prefill_token_buckets", "page_buckets"):
            buckets = getattr(self, name)
            if buckets is not None:
                buckets = tuple(sorted(set(int(b) for b in buckets)))
                if not buckets or buckets[0] < 1:
                    raise ValueError(f"{name} must be positive sizes, got {buckets}")
                object.__setattr__(self, name, buckets)
        if self.prefill_token_buckets and any(b % self.prefill_query_block for b in self.prefill_token_buckets):
            raise ValueError(f"prefill_token_buckets must be multiples of prefill_query_block ({self.prefill_query_block})")


@dataclass(frozen=True)
class Buckets:
    """The fixed set of shapes the step functions are compiled for."""

    decode_seqs: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    pages_per_seq: tuple[int, ...]

    @classmethod
    def derive(cls, engine: EngineConfig, max_model_len: int) -> "Buckets":
        max_pages = math.ceil(max_model_len / engine.page_size)
        decode = engine.decode_seq_buckets or _powers_of(4, 1, engine.max_num_seqs)
        prefill = engine.prefill_token_buckets or _powers_of(
            4, min(4 * engine.prefill_query_block, engine.max_num_batched_tokens), engine.max_num_batched_tokens)
        # Attention walks pages only up to each step's longest context, so a wider page table costs a
        # few bytes, not compute: one page bucket by default keeps warm-up short.
        pages = engine.page_buckets or (max_pages,)
        if decode[-1] < engine.max_num_seqs:
            raise ValueError(f"decode_seq_buckets must reach max_num_seqs ({engine.max_num_seqs})")
        if prefill[-1] < engine.max_num_batched_tokens:
            raise ValueError(f"prefill_token_buckets must reach max_num_batched_tokens ({engine.max_num_batched_tokens})")
        if pages[-1] < max_pages:
            raise ValueError(f"page_buckets must reach {max_pages} pages (max_model_len / page_size)")
        return cls(decode_seqs=tuple(decode), prefill_tokens=tuple(prefill), pages_per_seq=tuple(pages))

    @staticmethod
    def fit(size: int, buckets: tuple[int, ...]) -> int:
        for bucket in buckets:
            if size <= bucket:
                return bucket
        raise ValueError(f"size {size} exceeds the largest bucket {buckets[-1]}")
