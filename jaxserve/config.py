"""Frozen, validated configuration of the engine (the model's own is jaxserve/models/config.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def canonical_dtype(name: str) -> str:
    key = str(name).removeprefix("torch.")
    if key not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of float32, bfloat16, float16 or 'auto'")
    return DTYPE_NAMES[key]


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
    # Plan and dispatch step N+1 while step N runs on the device (the host learns N's tokens a step later;
    # outputs are the same). Off on a prefill replica, which parks each request at its first token.
    overlap_steps: bool = True
    compilation_cache_dir: str | None = "default"
    show_progress: bool = True
    # Prefill/decode disaggregation (jaxserve/disagg): "prefill" runs a request to its first token and
    # parks it, pages held, until a decode replica takes them; "decode" also admits requests that
    # arrive with their KV pages; "both" serves whole requests.
    role: str = "both"
    # Indices into jax.devices() this engine runs on (None: the first ones), so that two engines in one
    # process can use disjoint devices.
    device_ids: tuple[int, ...] | None = None
    # Seconds a prefill replica holds a request's pages for a decode replica to take (and a decode
    # replica waits for them) before freeing them; the decode side then recomputes the prompt.
    handover_timeout: float = 30.0

    def __post_init__(self):
        if self.dtype != "auto":
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        positive = (
            "page_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "prefill_query_block",
            "tensor_parallel_size",
            "data_parallel_size",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode, got {self.role!r}")
        if self.device_ids is not None:
            object.__setattr__(self, "device_ids", tuple(int(i) for i in self.device_ids))
        if not self.handover_timeout > 0:
            raise ValueError(f"handover_timeout must be > 0 seconds, got {self.handover_timeout}")
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
                f"prefill_query_block ({self.prefill_query_block})"
            )
        for name in ("decode_seq_buckets", "prefill_token_buckets", "page_buckets"):
            buckets = getattr(self, name)
            if buckets is not None:
                buckets = tuple(sorted(set(int(b) for b in buckets)))
                if not buckets or buckets[0] < 1:
                    raise ValueError(f"{name} must be positive sizes, got {buckets}")
                object.__setattr__(self, name, buckets)
        if self.prefill_token_buckets and any(b % self.prefill_query_block for b in self.prefill_token_buckets):
            raise ValueError(
                f"prefill_token_buckets must be multiples of prefill_query_block ({self.prefill_query_block})"
            )


@dataclass(frozen=True)
class Buckets:
    """The fixed set of shapes the step functions are compiled for."""

    decode_seqs: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    pages_per_seq: tuple[int, ...]

    @classmethod
    def derive(cls, engine: EngineConfig, max_model_len: int) -> Buckets:
        max_pages = math.ceil(max_model_len / engine.page_size)
        decode = engine.decode_seq_buckets or _powers_of(4, 1, engine.max_num_seqs)
        prefill = engine.prefill_token_buckets or _powers_of(
            4, min(4 * engine.prefill_query_block, engine.max_num_batched_tokens), engine.max_num_batched_tokens
        )
        # Attention walks pages only up to each step's longest context, so a wider page table costs a
        # few bytes, not compute: one page bucket by default keeps warm-up short.
        pages = engine.page_buckets or (max_pages,)
        if decode[-1] < engine.max_num_seqs:
            raise ValueError(f"decode_seq_buckets must reach max_num_seqs ({engine.max_num_seqs})")
        if prefill[-1] < engine.max_num_batched_tokens:
            raise ValueError(
                f"prefill_token_buckets must reach max_num_batched_tokens ({engine.max_num_batched_tokens})"
            )
        if pages[-1] < max_pages:
            raise ValueError(f"page_buckets must reach {max_pages} pages (max_model_len / page_size)")
        return cls(decode_seqs=tuple(decode), prefill_tokens=tuple(prefill), pages_per_seq=tuple(pages))

    @staticmethod
    def fit(size: int, buckets: tuple[int, ...]) -> int:
        for bucket in buckets:
            if size <= bucket:
                return bucket
        raise ValueError(f"size {size} exceeds the largest bucket {buckets[-1]}")
