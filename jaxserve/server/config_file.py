"""YAML config files: one section per concern, every key checked (jaxserve/config_sections.py).

    model:     {path: PATH | default, dtype: auto, quantization, quantization_group_size, quantization_embedding,
                quantized_activations}
    cache:     {page_size, num_pages, kv_cache_memory_gib, enable_prefix_caching, swap_space, session_ttl}
    scheduler: {max_model_len, max_num_seqs, max_num_batched_tokens, prefill_query_block, overlap_steps,
                num_scheduler_steps, max_logprobs}
    parallel:  {tensor_parallel_size, data_parallel_size, enable_expert_parallel, expert_load_profile,
                expert_rebalance_interval, device_ids}
    compile:   {attention_impl, decode_seq_buckets, prefill_token_buckets, page_buckets, compilation_cache_dir}
    disagg:    {role, handover_timeout}
    engine:    {seed, show_progress, and any option of the sections above by its own name}
    server: {host, port, http_port, metrics_port, chat_template, max_queued_requests, drain_timeout,
             stream_idle_timeout, max_message_bytes, tls: {cert, key, client_ca}, api_keys: FILE, served_model_name,
             cors_allowed_origins, and the caps max_prompt_bytes, max_stop_strings, max_stop_string_bytes,
             max_stop_token_ids, max_id_length, max_structured_bytes, max_sampling_token_ids,
             tool_call_parser: hermes | llama3_json | mistral | auto, allocator: glibc-step | system}
    distributed: {coordinator_address, num_processes, process_id, local_device_ids, num_cpu_devices, peer_timeout,
                  hash_check_interval, initialization_timeout}   (several processes: jaxserve/distributed)

`--set section.key=value` overrides (the value is read as YAML). `path: default` is SmolLM2-135M-Instruct
(fetched on first use), `path: tiny-random` a small random-weight model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from urllib.parse import urlsplit

from jaxserve.config import ENGINE_GROUPS, EngineConfig
from jaxserve.config_sections import build_section, read_sections, section_values
from jaxserve.config_types import check_field_types
from jaxserve.distributed.config import DistributedConfig
from jaxserve.server.reasoning_parsers import PARSER_NAMES as REASONING_PARSER_NAMES
from jaxserve.server.tool_parsers import PARSER_NAMES
from jaxserve.step_allocator import ALLOCATORS

# model: -> engine
QUANTIZATION_OPTIONS = ("quantization", "quantization_group_size", "quantization_embedding", "quantized_activations")


@dataclass(frozen=True)
class ModelSection:
    path: str = "default"
    dtype: str = "auto"
    quantization: str | None = "none"  # none | int8 | int4 | auto (issue 25); null: none, as vLLM spells it
    quantization_group_size: int = 32
    quantization_embedding: str = "same"  # int4: int8 keeps the embedding and head at int8
    quantized_activations: str = "int8"  # the CPU quantized kernel's x: int8 per 32 (llama.cpp's) or float

    def __post_init__(self):
        check_field_types(self, "model")


@dataclass(frozen=True)
class TLSConfig:
    cert: str  # PEM certificate chain of the server
    key: str  # PEM private key
    client_ca: str | None = None  # PEM CA certificates: clients must present a certificate they signed (mTLS)

    @classmethod
    def parse(cls, value) -> TLSConfig | None:
        if value is None or isinstance(value, TLSConfig):
            return value
        names = set(value) if isinstance(value, dict) else set()
        if not {"cert", "key"} <= names or names - {"cert", "key", "client_ca"}:
            raise ValueError(f"server.tls must be a mapping with cert, key and optionally client_ca, got {value!r}")
        if value["cert"] is None or value["key"] is None:
            raise ValueError(f"server.tls needs the cert and key files, got {value!r}")
        client_ca = value.get("client_ca")
        return cls(str(value["cert"]), str(value["key"]), str(client_ca) if client_ca is not None else None)


RESPONSES_STORE_MAX_RESPONSES = 1000
RESPONSES_STORE_MAX_BYTES = 64 * 2**20


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # 0.0.0.0 opens the server to the network: set tls and api_keys first
    port: int = 50051
    http_port: int | None = 8000  # the OpenAI-compatible HTTP API; 0 or null: none
    metrics_port: int = 9090  # 0: no metrics endpoint
    chat_template: str | None = None  # a jinja template or a file holding one, for chats; None: the model's own
    max_queued_requests: int = 256  # beyond this many waiting requests, RESOURCE_EXHAUSTED
    drain_timeout: float = 30.0  # seconds SIGTERM waits for in-flight requests
    stream_idle_timeout: float = 30.0  # seconds a stream may wait on a client that does not read; then aborted
    # largest message received; None: twice the largest request within the caps below (>= 64 KiB)
    max_message_bytes: int | None = None
    tls: TLSConfig | None = None
    api_keys: str | None = None  # a file of keys, one a line; calls must send 'authorization: Bearer KEY'
    max_prompt_bytes: int | None = None  # UTF-8 bytes of a text prompt; None: 16 x max_model_len
    max_stop_strings: int = 64
    max_stop_string_bytes: int = 8192  # all of one request's stop strings together
    max_stop_token_ids: int = 256
    max_id_length: int = 256  # characters of a request_id or session_id
    max_structured_bytes: int = 65536  # a guided-decoding spec, the tools' JSON and bad_words together
    max_sampling_token_ids: int = 1024  # entries of logit_bias and allowed_token_ids together
    # how chat replies' tool calls are read: hermes | llama3_json | mistral | auto (told from the chat template)
    tool_call_parser: str = "auto"
    # how chat replies' reasoning is kept out of their content (returned as reasoning_content): gpt_oss |
    # none | auto (gpt_oss for GPT-OSS checkpoints)
    reasoning_parser: str = "auto"
    # The names the HTTP API answers to (vLLM's --served-model-name): one, or a list of aliases whose first
    # is the one responses carry; the checkpoint's name is accepted too. None: the checkpoint's name.
    served_model_name: str | tuple[str, ...] | None = None
    cors_allowed_origins: tuple[str, ...] = ()  # web origins allowed to call the HTTP API, or ["*"]; none: no CORS
    # The Responses API's store (store: true, previous_response_id, GET / DELETE /v1/responses/{id}): an LRU of at
    # most this many responses and bytes (their JSON with the conversations they continued), in memory. 0: none kept.
    responses_store_max_responses: int = RESPONSES_STORE_MAX_RESPONSES
    responses_store_max_bytes: int = RESPONSES_STORE_MAX_BYTES
    # glibc-step: on a CPU the process restarts once at start with glibc's allocator kept from unmapping each
    # step's temporaries (jaxserve/step_allocator.py); system: the allocator as the process was started
    allocator: str = ALLOCATORS[0]

    def __post_init__(self):
        check_field_types(self, "server")
        object.__setattr__(self, "tls", TLSConfig.parse(self.tls))
        object.__setattr__(self, "served_model_name", _served_model_names(self.served_model_name) or None)
        object.__setattr__(self, "cors_allowed_origins", _origins(self.cors_allowed_origins))
        object.__setattr__(self, "http_port", self.http_port or 0)
        for name in ("port", "http_port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"server.{name} must be a port number, got {getattr(self, name)}")
        if self.max_queued_requests < 1:
            raise ValueError(f"server.max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if not self.stream_idle_timeout > 0:
            raise ValueError(f"server.stream_idle_timeout must be > 0 seconds, got {self.stream_idle_timeout}")
        for name in ("responses_store_max_responses", "responses_store_max_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"server.{name} must be >= 0 (0: nothing stored), got {getattr(self, name)}")
        if self.max_message_bytes is not None and self.max_message_bytes < 1024:
            raise ValueError(f"server.max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.tool_call_parser not in PARSER_NAMES:
            raise ValueError(
                f"server.tool_call_parser must be one of {', '.join(PARSER_NAMES)}, got {self.tool_call_parser!r}"
            )
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"server.allocator must be one of {', '.join(ALLOCATORS)}, got {self.allocator!r}")
        if self.reasoning_parser not in REASONING_PARSER_NAMES:
            raise ValueError(
                f"server.reasoning_parser must be one of {', '.join(REASONING_PARSER_NAMES)}, "
                f"got {self.reasoning_parser!r}"
            )

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return _served_model_names(self.served_model_name)

    def request_caps(self) -> dict:
        """The per-request caps, as keyword arguments of RequestLimits.for_engine."""
        names = ("max_prompt_bytes", "max_stop_strings", "max_stop_string_bytes", "max_stop_token_ids", "max_id_length")
        names += ("max_structured_bytes", "max_sampling_token_ids")
        return {name: getattr(self, name) for name in names}


def _served_model_names(value) -> tuple[str, ...]:
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else ()
    if not names or not all(isinstance(name, str) and name.strip() for name in names):
        raise ValueError(f"server.served_model_name must be a name or a list of names, got {value!r}")
    if len(set(names)) < len(names):
        raise ValueError(f"server.served_model_name names one model twice: {list(names)}")
    return names


def _origins(value) -> tuple[str, ...]:
    """Origins as browsers send them (scheme://host[:port]: no path, no trailing slash), or "*"."""
    origins = (value,) if isinstance(value, str) else tuple(value or ())
    for origin in origins:
        parts = urlsplit(origin) if isinstance(origin, str) else None
        if origin != "*" and (parts is None or not parts.scheme or not parts.netloc or parts[2:] != ("", "", "")):
            raise ValueError(
                f"server.cors_allowed_origins: {origin!r} is not an origin like 'https://example.com:8080' or '*'"
            )
    return origins


@dataclass(frozen=True)
class ServeConfig:
    model: ModelSection
    engine: EngineConfig
    server: ServerConfig
    distributed: DistributedConfig | None = None  # None: one process

    def __post_init__(self):
        if self.server.max_message_bytes is None:
            from jaxserve.engine.builder import DEFAULT_MAX_MODEL_LEN_CAP
            from jaxserve.server.limits import default_max_message_bytes

            limit = default_max_message_bytes(
                self.engine.scheduler.max_model_len or DEFAULT_MAX_MODEL_LEN_CAP, **self.server.request_caps()
            )
            object.__setattr__(self, "server", dataclasses.replace(self.server, max_message_bytes=limit))

    def model_dir(self) -> str:
        from jaxserve.loading.default_model import resolve_model_path

        return resolve_model_path(self.model.path)


ENGINE_SECTIONS = tuple(ENGINE_GROUPS)
SECTIONS = ("model", "engine", *ENGINE_SECTIONS, "server", "distributed")


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> ServeConfig:
    tree = read_sections(path, overrides, SECTIONS, _engine_option_places)
    return ServeConfig(
        model=build_section(ModelSection, "model", tree.get("model")),
        engine=_engine_config(tree),
        server=build_section(ServerConfig, "server", tree.get("server")),
        # an empty `distributed:` section still means several processes
        distributed=build_section(DistributedConfig, "distributed", tree["distributed"])
        if "distributed" in tree
        else None,
    )


def _engine_option_places(section: str, name: str) -> tuple[str, ...]:
    """Where else an engine option may be set: `engine:` or its own group's section (so that --set
    scheduler.max_model_len replaces a preset's engine.max_model_len, and the other way round)."""
    group = EngineConfig.option_names().get(name)
    if section == "engine":
        return (group,) if group else ()
    return ("engine",) if section in ENGINE_SECTIONS and group == section else ()


def _engine_config(tree: dict) -> EngineConfig:
    """The engine's sections (cache, scheduler, ...), plus `engine:` for the options of no group (seed,
    show_progress) and, for short configs, any group's option by its own name."""
    options = section_values("engine", tree.get("engine"))
    names = EngineConfig.option_names()
    for name in sorted(options):
        if name not in names or name == "dtype":
            raise ValueError(
                f"unknown config key engine.{name}" + ("; the dtype is model.dtype" if name == "dtype" else "")
            )
    for section in ENGINE_SECTIONS:
        values = section_values(section, tree.get(section))
        for name, value in values.items():
            if names.get(name, "") != section:
                raise ValueError(f"unknown config key {section}.{name}")
            if name in options:
                raise ValueError(f"{section}.{name} and engine.{name} are the same option: set it once")
            options[name] = value
    model = section_values("model", tree.get("model"))
    try:
        quantization = {name: model[name] for name in QUANTIZATION_OPTIONS if name in model}
        return EngineConfig.from_options(dtype=model.get("dtype", "auto"), **quantization, **options)
    except TypeError as error:
        raise ValueError(f"engine config: {error}") from None
