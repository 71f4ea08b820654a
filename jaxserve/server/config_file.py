"""YAML config files: one section per concern (model, engine, server), every key checked.

    model:  {path: PATH | default, dtype: auto}
    engine: {any EngineConfig field but dtype}
    server: {host, port, http_port, metrics_port, chat_template, max_queued_requests, drain_timeout,
             stream_idle_timeout, max_message_bytes, tls: {cert, key, client_ca}, api_keys: FILE, and the caps
             max_prompt_bytes, max_stop_strings, max_stop_string_bytes, max_stop_token_ids, max_id_length}
    distributed: {coordinator_address, num_processes, process_id, local_device_ids, num_cpu_devices, peer_timeout,
                  hash_check_interval, initialization_timeout}   (several processes: jaxserve/distributed)

`--set section.key=value` overrides (the value is read as YAML). `path: default` is SmolLM2-135M-Instruct
(fetched on first use), `path: tiny-random` a small random-weight model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import yaml

from jaxserve.config import EngineConfig
from jaxserve.distributed.config import DistributedConfig


@dataclass(frozen=True)
class ModelSection:
    path: str = "default"
    dtype: str = "auto"


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
        return cls(**{name: str(path) if path is not None else None for name, path in value.items()})


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

    def __post_init__(self):
        object.__setattr__(self, "tls", TLSConfig.parse(self.tls))
        object.__setattr__(self, "http_port", self.http_port or 0)
        for name in ("port", "http_port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"server.{name} must be a port number, got {getattr(self, name)}")
        if self.max_queued_requests < 1 or self.drain_timeout < 0:
            raise ValueError("server.max_queued_requests must be >= 1 and server.drain_timeout >= 0")
        if not self.stream_idle_timeout > 0:
            raise ValueError(f"server.stream_idle_timeout must be > 0 seconds, got {self.stream_idle_timeout}")
        if self.max_message_bytes is not None and self.max_message_bytes < 1024:
            raise ValueError(f"server.max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        caps = ("max_stop_strings", "max_stop_string_bytes", "max_stop_token_ids", "max_id_length")
        for name in caps + (("max_prompt_bytes",) if self.max_prompt_bytes is not None else ()):
            if getattr(self, name) < 0:
                raise ValueError(f"server.{name} must be >= 0, got {getattr(self, name)}")

    def request_caps(self) -> dict:
        """The per-request caps, as keyword arguments of RequestLimits.for_engine."""
        names = ("max_prompt_bytes", "max_stop_strings", "max_stop_string_bytes", "max_stop_token_ids", "max_id_length")
        return {name: getattr(self, name) for name in names}


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
                self.engine.max_model_len or DEFAULT_MAX_MODEL_LEN_CAP, **self.server.request_caps()
            )
            object.__setattr__(self, "server", dataclasses.replace(self.server, max_message_bytes=limit))

    def model_dir(self) -> str:
        from jaxserve.loading.default_model import resolve_model_path

        return resolve_model_path(self.model.path)


SECTIONS = {"model": ModelSection, "engine": EngineConfig, "server": ServerConfig, "distributed": DistributedConfig}


def _set(tree: dict, dotted_key: str, value) -> None:
    section, _, key = dotted_key.partition(".")
    if section not in SECTIONS or not key or "." in key:
        raise ValueError(
            f"unknown config key {dotted_key!r}; keys look like section.name, sections: {', '.join(SECTIONS)}"
        )
    tree.setdefault(section, {})[key] = value


def parse_override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"--set expects KEY=VALUE, got {text!r}")
    return key.strip(), yaml.safe_load(value)


def read_yaml(path: str) -> object:
    """A config file's YAML (an empty file is {}); a missing or malformed file is a ValueError naming it."""
    try:
        with open(path) as f:
            return yaml.safe_load(f) or {}
    except OSError as error:
        raise ValueError(f"cannot read config file {path}: {error}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"malformed YAML in {path}: {error}") from None


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> ServeConfig:
    tree: dict = {}
    if path is not None:
        loaded = read_yaml(path)
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {path} must hold a mapping of sections")
        for section, values in loaded.items():
            if section not in SECTIONS:
                raise ValueError(f"unknown config section {section!r} in {path}; expected {', '.join(SECTIONS)}")
            if not isinstance(values, dict):
                raise ValueError(f"config section {section!r} must be a mapping")
            tree.setdefault(section, {})  # an empty `distributed:` section still means several processes
            for key, value in values.items():
                _set(tree, f"{section}.{key}", value)
    for override in overrides:
        _set(tree, *parse_override(override))
    built = {}
    for section, cls in SECTIONS.items():
        if section == "distributed" and section not in tree:
            continue  # one process
        values = dict(tree.get(section, {}))
        known = {f.name for f in dataclasses.fields(cls)} - ({"dtype"} if cls is EngineConfig else set())
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown config key {section}.{unknown[0]}")
        if cls is EngineConfig:
            values["dtype"] = tree.get("model", {}).get("dtype", "auto")
            for name in ("decode_seq_buckets", "prefill_token_buckets", "page_buckets"):
                if values.get(name) is not None:
                    values[name] = tuple(values[name])
        try:
            built[section] = cls(**values)
        except TypeError as error:
            raise ValueError(f"config section {section!r}: {error}") from None
    return ServeConfig(**built)
