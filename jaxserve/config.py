"""Frozen, validated configuration of the engine (the model's own is jaxserve/models/config.py)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields, replace

from jaxserve.config_types import check_field_types
from jaxserve.vllm_names import from_vllm_names

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


QUANTIZATION_FORMATS = ("none", "int8", "int4", "auto")  # as jaxserve/loading/quantize.py's FORMATS
INT4_GROUP_SIZES = (32, 64, 128)  # quantization_group_size: rows of K per int4 scale
# What the CPU quantized matmul does with x (pallas_kernels/matmul/quantized_cpu.py's KERNELS): int8 rounds each
# row per 32 values as llama.cpp does (integer dots), float keeps it (the dequantized product, slower)
QUANTIZED_ACTIVATIONS = ("int8", "float")
# as pallas_kernels/paged_attention/kv_quantization.py's
KV_DTYPES = ("auto", "bfloat16", "float16", "int8", "float8_e4m3")


def sixteen_bit_cache_problem(kv_dtype: str, dtype: str) -> str | None:
    """Why cache.kv_dtype cannot serve a model computing in `dtype` (a canonical name), or None: a 16-bit float
    cache halves a float32 model's; beside a 16-bit model only its own type (auto) makes sense."""
    if kv_dtype not in ("bfloat16", "float16") or dtype in ("float32", kv_dtype):
        return None
    return (
        f"cache.kv_dtype={kv_dtype!r} with model dtype {dtype}: a 16-bit float cache halves a float32 model's; this "
        "model's cache is 16-bit already (cache.kv_dtype='auto'; int8 / float8_e4m3 halve it again)"
    )


def kv_cache_problem(kv_dtype: str, dtype: str, latent_attention: bool) -> str | None:
    """Why cache.kv_dtype cannot serve a model computing in `dtype` (a canonical name), or None: a model of
    multi-head latent attention keeps its latent cache in its own dtype; a 16-bit float cache is for float32
    models (sixteen_bit_cache_problem)."""
    if kv_dtype != "auto" and latent_attention:
        return (
            f"cache.kv_dtype={kv_dtype!r} is not served for multi-head latent attention (DeepSeek MLA) models: "
            "their latent cache stays in the model dtype; use cache.kv_dtype='auto'"
        )
    return sixteen_bit_cache_problem(kv_dtype, dtype)


def canonical_dtype(name: str) -> str:
    key = str(name).removeprefix("torch.")
    if key not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of float32, bfloat16, float16 or 'auto'")
    return DTYPE_NAMES[key]


def _padding_ladder(start: int, limit: int) -> tuple[int, ...]:
    """start, 2, 3, 4, 6, 8, 12, ... times start (powers of two, and from 2 * start the 1.5x between them),
    capped by (and always ending with) limit: past 2 * start, at most a third of a bucket is padding.
    Prefill on a CPU costs in proportion to its bucket (SmolLM2-135M F32, 2 threads, under load: 64 / 128
    / 192 / 256 tokens 192 / 341 / 479 / 647 ms), and powers of 4 made a 160-190-token prompt pay for 256."""
    sizes, power = [], start
    while power < limit:
        sizes.append(power)
        if power >= 2 * start and power * 3 // 2 < limit:
            sizes.append(power * 3 // 2)
        power *= 2
    sizes.append(limit)
    return tuple(sizes)


def _powers_of(base: int, start: int, limit: int) -> tuple[int, ...]:
    """start, start*base, ... capped by (and always ending with) limit."""
    sizes, size = [], start
    while size < limit:
        sizes.append(size)
        size *= base
    sizes.append(limit)
    return tuple(sizes)


def _require_positive(group: object, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(group, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(group, name)}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: page geometry, how many pages, and what is kept once a request ends."""

    page_size: int = 16
    num_pages: int | None = None  # None: from kv_cache_memory_gib, else what the device has free
    kv_cache_memory_gib: float | None = None
    enable_prefix_caching: bool = True
    swap_space: float = 0.0  # GiB of host memory for evicted prefix pages (needs prefix caching)
    session_ttl: float = 300.0  # seconds a session's pages are kept in preference to others
    # auto: pages in the model's dtype; bfloat16 / float16: a float32 model's pages in 16 bits (half the bytes,
    # llama.cpp's default cache type); int8 / float8_e4m3: one byte per value plus a float32 scale per token and
    # KV head (pallas_kernels/paged_attention/kv_quantization.py), about twice the pages per GiB of 16-bit ones
    kv_dtype: str = "auto"

    def __post_init__(self):
        check_field_types(self, "cache")
        _require_positive(self, ("page_size",))
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"unknown cache.kv_dtype {self.kv_dtype!r}; expected one of {KV_DTYPES}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (one page is reserved), got {self.num_pages}")
        if self.kv_cache_memory_gib is not None and not self.kv_cache_memory_gib > 0:
            raise ValueError(f"cache.kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib!r}")
        if self.swap_space and not self.enable_prefix_caching:
            # the host tier only ever receives evicted prefix-cache pages: without the cache it would stay empty
            raise ValueError(
                "cache.swap_space (a host tier for evicted prefix-cache pages) needs enable_prefix_caching: "
                "set swap_space to 0 or turn prefix caching on"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """What one step may hold: sequences, tokens, context length, and how steps follow each other."""

    max_model_len: int | None = None  # None: the model's own limit, capped (engine/builder.py)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # Prefill chunks of different sequences start on multiples of this, so attention works block by block.
    prefill_query_block: int = 16
    # Plan and dispatch step N+1 while step N runs on the device (the host learns N's tokens a step later;
    # outputs are the same). Off on a prefill replica, which parks each request at its first token.
    overlap_steps: bool = True
    # Decode steps planned at once and run as one executable while every running sequence only decodes (vLLM's
    # multi-step scheduling; engine/decode_chain.py): the host's per-step work is paid once per chain. 1: off;
    # None: 4 on a CPU engine that can chain (one process, not disaggregated), 1 elsewhere.
    num_scheduler_steps: int | None = None
    max_logprobs: int = 20
    # Biased tokens one request may name (logit_bias, bad words, and EOS and stop tokens for min_tokens):
    # the width of the step's per-row bias inputs.
    max_bias_entries: int = 256

    def __post_init__(self):
        check_field_types(self, "scheduler")
        _require_positive(self, ("max_num_seqs", "max_num_batched_tokens", "prefill_query_block", "max_bias_entries"))
        if self.num_scheduler_steps is not None and not 1 <= self.num_scheduler_steps <= 32:
            raise ValueError(
                f"scheduler.num_scheduler_steps must be in 1..32 (or unset: auto), got {self.num_scheduler_steps}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens % self.prefill_query_block:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be a multiple of "
                f"prefill_query_block ({self.prefill_query_block})"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """The devices and how the model is split over them."""

    tensor_parallel_size: int = 1  # Megatron-style: heads and MLP columns split over this many devices
    data_parallel_size: int = 1  # device groups that each run attention for their own sequences and pages
    enable_expert_parallel: bool = False  # MoE experts split over all data x tensor devices
    # Tokens routed per expert ([layers][experts] JSON, e.g. llm.stats()["expert_tokens"] of an earlier
    # run): experts are placed at start-up so that device loads even out (expert parallelism only).
    expert_load_profile: str | None = None
    # Every this many engine steps, move experts by the load routed since the last move (0: never).
    expert_rebalance_interval: int = 0
    # Indices into jax.devices() this engine runs on (None: the first ones), so that two engines in one
    # process can use disjoint devices.
    device_ids: tuple[int, ...] | None = None

    def __post_init__(self):
        check_field_types(self, "parallel")
        _require_positive(self, ("tensor_parallel_size", "data_parallel_size"))
        if self.device_ids is not None:
            object.__setattr__(self, "device_ids", tuple(int(i) for i in self.device_ids))


# pallas_kernels.paged_attention.ATTENTION_IMPLS, named here too so that a config is checked without JAX (a test
# keeps the two alike)
ATTENTION_IMPLS = ("auto", "reference", "cpu", "pallas")


@dataclass(frozen=True)
class CompileConfig:
    """What is compiled: the attention kernel and the shapes entering jit (derived from the scheduler's
    limits when not given, see Buckets)."""

    attention_impl: str = "auto"  # auto | reference | cpu | pallas (see pallas_kernels)
    decode_seq_buckets: tuple[int, ...] | None = None
    prefill_token_buckets: tuple[int, ...] | None = None
    page_buckets: tuple[int, ...] | None = None
    compilation_cache_dir: str | None = "default"

    def __post_init__(self):
        check_field_types(self, "compile")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"compile.attention_impl must be one of {', '.join(ATTENTION_IMPLS)}, got {self.attention_impl!r}"
            )
        for name in ("decode_seq_buckets", "prefill_token_buckets", "page_buckets"):
            buckets = getattr(self, name)
            if buckets is not None:
                buckets = tuple(sorted({int(b) for b in buckets}))
                if not buckets or buckets[0] < 1:
                    raise ValueError(f"{name} must be positive sizes, got {buckets}")
                object.__setattr__(self, name, buckets)


class EngineRole(enum.StrEnum):
    """What a replica does with a request (jaxserve/disagg)."""

    BOTH = "both"  # the whole request
    PREFILL = "prefill"  # to its first token, then its pages wait for a decode replica
    DECODE = "decode"  # whole requests, and those that arrive prefilled with their pages


@dataclass(frozen=True)
class DisaggConfig:
    """Prefill/decode disaggregation (jaxserve/disagg): "prefill" runs a request to its first token and
    parks it, pages held, until a decode replica takes them; "decode" also admits requests that arrive
    with their KV pages; "both" serves whole requests."""

    role: EngineRole = EngineRole.BOTH
    # Seconds a prefill replica holds a request's pages for a decode replica to take (and a decode
    # replica waits for them) before freeing them; the decode side then recomputes the prompt.
    handover_timeout: float = 30.0
    # A decode replica without a free sequence slot when a prefilled request arrives: "queue" waits for
    # one (the prefill replica holds the pages meanwhile); "prefill_here" recomputes the prompt locally.
    when_decode_full: str = "queue"

    def __post_init__(self):
        check_field_types(self, "disagg")
        if self.role not in tuple(EngineRole):
            raise ValueError(f"role must be both, prefill or decode, got {self.role!r}")
        object.__setattr__(self, "role", EngineRole(self.role))
        if not self.handover_timeout > 0:
            raise ValueError(f"handover_timeout must be > 0 seconds, got {self.handover_timeout}")
        if self.when_decode_full not in ("queue", "prefill_here"):
            raise ValueError(f"when_decode_full must be queue or prefill_here, got {self.when_decode_full!r}")


SPECULATIVE_METHODS = ("ngram", "draft")
MAX_SPECULATIVE_TOKENS = 15  # a verify row is k + 1 tokens: one query block of the verify step
# k when the config names none. Prompt lookup proposes for free and a verify step's cost grows far slower
# than its width on a CPU (8 tokens ~1.6 plain steps, 5 tokens ~1.4: docs/notes/speculative.md), so ngram
# rows propose up to 7; a draft model pays a decode step per proposed token, so it proposes 4.
DEFAULT_SPECULATIVE_TOKENS = {"ngram": 7, "draft": 4}
# ... except the target's own int8 copy (draft_model self, draft_quantization int8), which agrees with its
# target on ~95% of chat tokens and ~99% of code (SmolLM2-135M, teacher-forced): its rounds are mostly taken
# whole, so longer ones pay. Float32 target, chat, in one process alternating (docs/notes/speculative.md,
# session 53): k = 6 1.50-1.53x of plain against k = 4's 1.45x (session 52: 1.40x vs 1.32x); k = 8 1.20x.
SELF_INT8_DRAFT_TOKENS = 6


def default_speculative_tokens(method: str, draft_model: str = "self", draft_quantization: str = "none") -> int:
    """The k a speculative config gets when it names none (DEFAULT_SPECULATIVE_TOKENS, SELF_INT8_DRAFT_TOKENS)."""
    if method == "draft" and draft_model == "self" and draft_quantization == "int8":
        return SELF_INT8_DRAFT_TOKENS
    return DEFAULT_SPECULATIVE_TOKENS[method]


# SpeculativeConfig's, of options only draft reads
DRAFT_DEFAULTS = {"draft_model": "self", "draft_quantization": "none", "draft_kv_from_target": None}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/speculation.py): a decode row with proposed tokens becomes a
    (k + 1)-token chunk that the target model verifies in one step; greedy and sampled outputs keep the
    target's distribution. `method: ngram` proposes by prompt lookup over the sequence's own tokens;
    `method: draft` by a draft model's greedy tokens (engine/draft_proposer.py): `draft_model` (a model
    source, or "self": the target's own) loaded with `draft_quantization` (self-speculation: its int4 or
    int8 copy)."""

    method: str | None = None  # None: off
    # k: proposed tokens per verify row at most (None: default_speculative_tokens, the method's own)
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int = 1  # the shortest suffix n-gram that may match earlier tokens
    prompt_lookup_max: int = 4  # the longest, tried first
    # Verify steps are compiled up to this many rows; larger batches decode without speculation.
    speculative_max_batch_size: int = 8
    # Per batch size, speculate only while measured tokens/s beat plain (overlapped) decoding; False:
    # speculate whenever a row has a proposal (tests, benchmarks).
    speculative_adaptive: bool = True
    # method draft: the draft's model source (an HF directory, a GGUF file, a model name) or "self" (the
    # target's own source), its weights' quantization (none, int8, int4, auto) and its own KV pages (None:
    # enough for speculative_max_batch_size sequences of max_model_len tokens)
    draft_model: str = "self"
    draft_quantization: str = "none"
    draft_num_pages: int | None = None
    # method draft: a row the draft lacks many tokens of (a new prompt, a preempted or backed-off row) takes the
    # target's KV of those tokens, copied page by page, instead of the draft prefilling them (None: where the
    # draft is the target at another precision: draft_model self, or a model of the target's own architecture
    # and cache layout on one device; True: required, refused at start where the caches differ; False: never)
    draft_kv_from_target: bool | None = None

    def __post_init__(self):
        # (the two counts' own checks below name their whole ranges: the generic one would say only ">= 0")
        check_field_types(self, "speculative", signed=("num_speculative_tokens", "speculative_max_batch_size"))
        if self.method is None:
            set_fields = [
                name for name in ("num_speculative_tokens", "draft_num_pages") if getattr(self, name) is not None
            ]
            set_fields += [name for name, default in DRAFT_DEFAULTS.items() if getattr(self, name) != default]
            if set_fields:
                raise ValueError(
                    f"speculative {', '.join(set_fields)} given without a method: speculation stays off unless "
                    f"method is one of {SPECULATIVE_METHODS}"
                )
            return
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; expected one of {SPECULATIVE_METHODS}")
        if self.num_speculative_tokens is None:
            k = default_speculative_tokens(self.method, self.draft_model, self.draft_quantization)
            object.__setattr__(self, "num_speculative_tokens", k)
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        drafts_only = [name for name, default in DRAFT_DEFAULTS.items() if getattr(self, name) != default]
        if self.method != "draft" and drafts_only:
            raise ValueError(f"{', '.join(drafts_only)} apply to method draft, not {self.method!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) and prompt_lookup_max ({self.prompt_lookup_max}) "
                "must satisfy 1 <= min <= max"
            )
        _require_positive(self, ("speculative_max_batch_size",))
        if self.method == "draft":
            self._check_draft()

    def _check_draft(self) -> None:
        if not isinstance(self.draft_model, str) or not self.draft_model:
            raise ValueError(f"draft_model must name a model source or 'self', got {self.draft_model!r}")
        if self.draft_quantization not in QUANTIZATION_FORMATS:
            raise ValueError(
                f"unknown draft_quantization {self.draft_quantization!r}; known: {list(QUANTIZATION_FORMATS)}"
            )
        if self.draft_model == "self" and self.draft_quantization in ("none", "auto"):
            raise ValueError(
                "a draft that is the target itself (draft_model: self) needs draft_quantization int8 or int4: "
                "the same weights would cost as much as the target and propose nothing it would not decode "
                "(on a CPU: int8 for a float32 target, which accepts more of its proposals than int4 does; int4 for "
                "a 16-bit one)"
            )
        pages = self.draft_num_pages
        if pages is not None and (isinstance(pages, bool) or not isinstance(pages, int) or pages < 2):
            raise ValueError(f"draft_num_pages must be at least 2, got {self.draft_num_pages!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def verify_width(self) -> int:
        """Tokens per verify row: the newest token and k proposals (0 when off)."""
        return self.num_speculative_tokens + 1 if self.num_speculative_tokens and self.enabled else 0


LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA serving (jaxserve/lora): PEFT adapters over the base model, each request naming one.
    The device holds max_adapters slots of rank max_rank for every projection in target_modules; adapters
    load and unload at run time without recompiling."""

    adapters: dict | None = None  # {name: PEFT adapter directory}, loaded at start-up
    max_adapters: int | None = None  # slots; None: as many as `adapters` names (0: LoRA off)
    max_rank: int = 64  # the slot rank: adapters of rank up to this load
    target_modules: tuple[str, ...] = LORA_TARGET_MODULES  # projections given slots (every decoder layer)
    # MoE models: slots on the routed experts' gate/up/down too (where target_modules name them); each
    # holds every expert's A and B, num_experts times a dense projection's slot bytes
    routed_experts: bool = True

    def __post_init__(self):
        check_field_types(self, "lora")
        adapters = dict(self.adapters or {})
        if any(not isinstance(name, str) or not name or not isinstance(path, str) for name, path in adapters.items()):
            raise ValueError(f"lora adapters must map names to adapter directories, got {self.adapters!r}")
        object.__setattr__(self, "adapters", adapters)
        if self.max_adapters is None:
            object.__setattr__(self, "max_adapters", len(adapters))
        if not isinstance(self.max_adapters, int) or self.max_adapters < len(adapters):
            raise ValueError(
                f"max_adapters ({self.max_adapters}) must be an integer >= the {len(adapters)} adapters to load"
            )
        if isinstance(self.max_rank, bool) or not isinstance(self.max_rank, int) or self.max_rank < 1:
            raise ValueError(f"max_rank must be a positive integer, got {self.max_rank!r}")
        targets = (self.target_modules,) if isinstance(self.target_modules, str) else tuple(self.target_modules)
        unknown = sorted(set(targets) - set(LORA_TARGET_MODULES))
        if unknown or not targets:
            raise ValueError(f"lora target_modules must be among {LORA_TARGET_MODULES}, got {list(targets)}")
        object.__setattr__(self, "target_modules", targets)

    @property
    def enabled(self) -> bool:
        return bool(self.max_adapters)


ENGINE_GROUPS: dict[str, type] = {
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "compile": CompileConfig,
    "disagg": DisaggConfig,
    "speculative": SpeculativeConfig,
    "lora": LoraConfig,
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes the engine's memory and compiled executables, grouped by concern.

    `EngineConfig.from_options(page_size=32, max_num_seqs=8)` takes any field of any group by its own
    name (the names are unique), as `LLM(model, **options)` and a config file's `engine:` section do."""

    dtype: str = "auto"
    # Projections' weights (issue 25, jaxserve/loading/quantize.py): none | int8 | int4 | auto (the checkpoint's)
    quantization: str | None = "none"  # None (vLLM's spelling of the default) is read as "none"
    quantization_group_size: int = 32  # int4: rows of K per scale (32, 64 or 128)
    quantization_embedding: str = "same"  # int4: "int8" keeps the embedding and head at int8 (llama.cpp's Q4_0)
    quantized_activations: str = "int8"  # CPU kernel for quantized weights: x as int8 per 32 (llama.cpp) or float
    seed: int = 0
    show_progress: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self):
        check_field_types(self, "engine", signed=("seed",))
        if self.dtype != "auto":
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.quantization is None:  # vLLM's default spelling: the engine's default
            object.__setattr__(self, "quantization", "none")
        if self.quantization not in QUANTIZATION_FORMATS:
            raise ValueError(
                f"unknown quantization {self.quantization!r} (option quantization); known: {list(QUANTIZATION_FORMATS)}"
            )
        if self.quantization_group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"quantization_group_size must be one of {list(INT4_GROUP_SIZES)}, got {self.quantization_group_size!r}"
            )
        if self.quantization_embedding not in ("same", "int8"):
            raise ValueError(f"quantization_embedding must be same or int8, got {self.quantization_embedding!r}")
        if self.quantized_activations not in QUANTIZED_ACTIVATIONS:
            raise ValueError(
                f"unknown quantized_activations {self.quantized_activations!r}; expected one of {QUANTIZED_ACTIVATIONS}"
            )
        for name, group_type in ENGINE_GROUPS.items():
            group = getattr(self, name)
            if isinstance(group, dict):
                object.__setattr__(self, name, _build_group(group_type, group, name))
            elif not isinstance(group, group_type):
                raise ValueError(f"{name} must be a {group_type.__name__} or a mapping, got {type(group).__name__}")
        if self.parallel.data_parallel_size > 1 and self.cache.swap_space:
            raise ValueError("swap_space (the host tier) is not available with data_parallel_size > 1 yet")
        if self.speculative.enabled:
            self._check_speculative()
        if self.dtype != "auto" and (problem := sixteen_bit_cache_problem(self.cache.kv_dtype, self.dtype)):
            raise ValueError(problem)  # before anything loads (a checkpoint's own dtype is checked once known)
        block = self.scheduler.prefill_query_block
        if self.compile.prefill_token_buckets and any(b % block for b in self.compile.prefill_token_buckets):
            raise ValueError(f"prefill_token_buckets must be multiples of prefill_query_block ({block})")

    def _check_speculative(self) -> None:
        """Paths that cannot take speculation, refused at start."""
        if self.disagg.role == EngineRole.PREFILL:
            raise ValueError("speculative decoding on a prefill replica (disagg role prefill) has nothing to decode")
        if self.speculative.verify_width > self.scheduler.max_num_batched_tokens:
            raise ValueError(
                f"num_speculative_tokens + 1 ({self.speculative.verify_width}) exceeds max_num_batched_tokens "
                f"({self.scheduler.max_num_batched_tokens})"
            )

    @classmethod
    def option_names(cls) -> dict[str, str | None]:
        """Every option's flat name -> its group (None: a field of EngineConfig itself)."""
        names: dict[str, str | None] = {f.name: None for f in fields(cls) if f.name not in ENGINE_GROUPS}
        for group, group_type in ENGINE_GROUPS.items():
            names.update({f.name: group for f in fields(group_type)})
        return names

    @classmethod
    def from_options(cls, **options) -> EngineConfig:
        """A config from flat option names (a group may also be given whole, by its name), or vLLM's names
        for the same things (jaxserve/vllm_names.py)."""
        names = cls.option_names()
        options = from_vllm_names(options, set(names) | set(ENGINE_GROUPS))
        unknown = sorted(set(options) - set(names) - set(ENGINE_GROUPS))
        if unknown:
            raise ValueError(f"unknown engine options {unknown}; known: {sorted(names)}")
        top: dict = {}
        grouped: dict[str, dict] = {group: {} for group in ENGINE_GROUPS}
        for name, value in options.items():
            if name in ENGINE_GROUPS:
                top[name] = value
            elif names[name] is None:
                top[name] = value
            else:
                grouped[names[name]][name] = value  # type: ignore[index]
        for group, values in grouped.items():
            if values:
                if group in top:
                    raise ValueError(f"engine options {sorted(values)} repeat what the {group} group sets")
                top[group] = values
        return cls(**top)

    def with_options(self, **options) -> EngineConfig:
        """A copy with some options changed, by their flat names."""
        names = self.option_names()
        changes: dict = {}
        for name, value in options.items():
            group = names.get(name, "")
            if group == "":
                raise ValueError(f"unknown engine option {name!r}")
            if group is None:
                changes[name] = value
            else:
                base = changes.get(group, getattr(self, group))
                changes[group] = replace(base, **{name: value})
        return replace(self, **changes)


def _build_group(group_type: type, values: dict, group: str):
    known = {f.name for f in fields(group_type)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {group} option {unknown[0]!r}; known: {sorted(known)}")
    return group_type(**values)


@dataclass(frozen=True)
class Buckets:
    """The fixed set of shapes the step functions are compiled for."""

    decode_seqs: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    pages_per_seq: tuple[int, ...]
    verify_seqs: tuple[int, ...] = ()  # rows of a speculative verify step (empty: speculation off)
    verify_width: int = 0  # tokens per verify row: k + 1
    # tokens per row of a draft model's catch-up decode steps (its last proposal and the target's next token
    # in one step: engine/draft_proposer.py); 0: none
    catch_up_width: int = 0

    @classmethod
    def derive(cls, engine: EngineConfig, max_model_len: int) -> Buckets:
        scheduler, compiled = engine.scheduler, engine.compile
        max_pages = math.ceil(max_model_len / engine.cache.page_size)
        decode = compiled.decode_seq_buckets or _powers_of(4, 1, scheduler.max_num_seqs)
        prefill = compiled.prefill_token_buckets or _padding_ladder(
            min(4 * scheduler.prefill_query_block, scheduler.max_num_batched_tokens),
            scheduler.max_num_batched_tokens,
        )
        # Attention walks pages only up to each step's longest context, so a wider page table costs a
        # few bytes, not compute: one page bucket by default keeps warm-up short.
        pages = compiled.page_buckets or (max_pages,)
        if decode[-1] < scheduler.max_num_seqs:
            raise ValueError(f"decode_seq_buckets must reach max_num_seqs ({scheduler.max_num_seqs})")
        if prefill[-1] < scheduler.max_num_batched_tokens:
            raise ValueError(
                f"prefill_token_buckets must reach max_num_batched_tokens ({scheduler.max_num_batched_tokens})"
            )
        if pages[-1] < max_pages:
            raise ValueError(f"page_buckets must reach {max_pages} pages (max_model_len / page_size)")
        speculative = engine.speculative
        verify = ()
        if speculative.enabled:
            cap = min(speculative.speculative_max_batch_size, scheduler.max_num_seqs)
            verify = tuple(b for b in decode if b < cap) + (cap,)
        return cls(
            decode_seqs=tuple(decode),
            prefill_tokens=tuple(prefill),
            pages_per_seq=tuple(pages),
            verify_seqs=verify,
            verify_width=speculative.verify_width,
        )

    @staticmethod
    def fit(size: int, buckets: tuple[int, ...]) -> int:
        for bucket in buckets:
            if size <= bucket:
                return bucket
        raise ValueError(f"size {size} exceeds the largest bucket {buckets[-1]}")
