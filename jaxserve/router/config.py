"""The router's YAML config, every key checked (a malformed one is a ValueError naming the key):

model:    {path: PATH | default | tiny-random}   the replicas' model: the router tokenizes with its
                                                  tokenizer and refuses a replica serving another
router:   {host, port, http_port, metrics_port, mode, policy, blind_window, heartbeat, health_interval,
           startup_timeout, max_in_flight, max_resends, resend_wait, tool_call_parser, reasoning_parser,
           drain_timeout,
           tls: {cert, key, client_ca}, api_keys: FILE        the router's own ports, as server.tls / server.api_keys
           replica_tls: {ca, cert, key}, replica_api_key: FILE}  how it reaches replicas that require them
replicas: [HOST:PORT, ...]                        replicas already running (mode colocated); or
prefill_replicas: [HOST:PORT, ...]                mode disaggregated: replicas with engine.role prefill
decode_replicas: [HOST:PORT, ...]                 ... and with engine.role decode; or
launch:   {num_replicas, num_prefill_replicas, num_decode_replicas, config, set: [KEY=VALUE, ...], log_dir,
           restart}                               local `python -m jaxserve.serve` processes the router
                                                  starts on free ports (config: their serve config); in
                                                  mode disaggregated with engine.role set for each pool
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.config_sections import build_section, read_sections
from jaxserve.config_types import check_field_types
from jaxserve.router.connection import ReplicaTLS
from jaxserve.router.policy import POLICIES
from jaxserve.server.config_file import TLSConfig
from jaxserve.server.reasoning_parsers import PARSER_NAMES as REASONING_PARSER_NAMES
from jaxserve.server.tool_parsers import PARSER_NAMES

MODES = ("colocated", "disaggregated")
ROUTER_SECTIONS = ("model", "router", "replicas", "prefill_replicas", "decode_replicas", "launch")


@dataclass(frozen=True)
class RouterSection:
    host: str = "127.0.0.1"
    port: int = 50050
    http_port: int = 0  # the OpenAI-compatible HTTP API in front of the replicas; 0: none
    metrics_port: int = 0  # 0: no metrics endpoint
    mode: str = "colocated"  # colocated | disaggregated (a prefill pool hands each prompt's KV to a decode pool)
    policy: str = "prefix"  # prefix | round_robin | least_load | session
    blind_window: float = 2.0  # seconds a page routed but not yet stored counts as cached there
    heartbeat: float = 0.5  # seconds; a replica silent for 10 heartbeats is taken out
    health_interval: float = 1.0  # seconds between health checks of each replica
    startup_timeout: float = 300.0  # seconds to wait for every replica at start-up (warm-up included)
    max_in_flight: int = 1024  # streams forwarded at once; beyond, RESOURCE_EXHAUSTED
    max_resends: int = 3  # times a request that has not streamed a token is sent to another replica
    # mode disaggregated: seconds a request whose decode replica failed waits for one to be up again
    resend_wait: float = 60.0
    drain_timeout: float = 30.0  # seconds SIGTERM waits for the streams in flight (new ones: UNAVAILABLE / 503)
    # How the HTTP API (and a disaggregated Chat) reads tool calls out of replies, as server.tool_call_parser:
    # hermes | llama3_json | mistral | auto (told from the router tokenizer's chat template).
    tool_call_parser: str = "auto"
    # How the HTTP API (and a disaggregated Chat) splits a reply's reasoning from its content, as
    # server.reasoning_parser: gpt_oss | deepseek_r1 | qwen3 | none | auto (gpt_oss for GPT-OSS checkpoints).
    reasoning_parser: str = "auto"
    # The router's gRPC, HTTP and metrics ports: the same keys and checks as server.tls and server.api_keys.
    tls: TLSConfig | None = None
    api_keys: str | None = None  # a file of keys, one a line; clients must send 'authorization: Bearer KEY'
    replica_tls: ReplicaTLS | None = None  # replicas serving server.tls: the CA that signed them (and mTLS)
    replica_api_key: str | None = None  # replicas with server.api_keys: a file whose first key line is sent

    def __post_init__(self):
        self._check_connection_options()
        check_field_types(self, "router")
        if self.mode not in MODES:
            raise ValueError(f"router.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.tool_call_parser not in PARSER_NAMES:
            raise ValueError(
                f"router.tool_call_parser must be one of {', '.join(PARSER_NAMES)}, got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser not in REASONING_PARSER_NAMES:
            raise ValueError(
                f"router.reasoning_parser must be one of {', '.join(REASONING_PARSER_NAMES)}, got {self.reasoning_parser!r}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"router.policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("port", "http_port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"router.{name} must be a port number, got {getattr(self, name)!r}")
        for name in ("heartbeat", "health_interval", "startup_timeout", "resend_wait"):
            if not getattr(self, name) > 0:
                raise ValueError(f"router.{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.max_in_flight < 1:
            raise ValueError(f"router.max_in_flight must be >= 1, got {self.max_in_flight}")

    def _check_connection_options(self) -> None:
        try:
            object.__setattr__(self, "tls", TLSConfig.parse(self.tls))
        except ValueError:
            raise ValueError(
                f"router.tls must be a mapping with cert, key and optionally client_ca, got {self.tls!r}"
            ) from None
        object.__setattr__(self, "replica_tls", ReplicaTLS.parse(self.replica_tls))
        for name in ("api_keys", "replica_api_key"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"router.{name} must be a file name, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class LaunchSection:
    num_replicas: int = 0  # mode colocated
    num_prefill_replicas: int = 0  # mode disaggregated
    num_decode_replicas: int = 0
    config: str | None = None  # the replicas' serve config; their ports are chosen here
    set: tuple[str, ...] = ()  # overrides for every replica, as `jaxserve.serve --set`
    log_dir: str | None = None  # where each replica's log goes; default: a temporary directory
    restart: bool = True  # start a replica whose process exits again, on the same port

    def __post_init__(self):
        for name in ("num_replicas", "num_prefill_replicas", "num_decode_replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"launch.{name} must be a positive integer, got {value!r}")
        if isinstance(self.set, str) or not all(isinstance(item, str) and "=" in item for item in self.set):
            raise ValueError(f"launch.set must be a list of KEY=VALUE strings, got {self.set!r}")
        object.__setattr__(self, "set", tuple(self.set))
        if not isinstance(self.restart, bool):
            raise ValueError(f"launch.restart must be true or false, got {self.restart!r}")
        check_field_types(self, "launch")


def parse_address(address) -> str:
    """HOST:PORT (IPv6 in brackets) or a ValueError saying what is wrong."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"a replica address must be HOST:PORT, got {address!r}")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a replica address must be HOST:PORT with a port in 1..65535, got {address!r}")
    return address


@dataclass(frozen=True)
class RouterConfig:
    model_path: str
    router: RouterSection = field(default_factory=RouterSection)
    replicas: tuple[str, ...] = ()
    launch: LaunchSection | None = None
    prefill_replicas: tuple[str, ...] = ()
    decode_replicas: tuple[str, ...] = ()

    def __post_init__(self):
        if self.router.mode == "disaggregated":
            self._check_disaggregated()
        else:
            if self.prefill_replicas or self.decode_replicas:
                raise ValueError("prefill_replicas and decode_replicas need router.mode: disaggregated")
            if bool(self.replicas) == (self.launch is not None):
                raise ValueError("the router config needs exactly one of replicas (a list of HOST:PORT) and launch")
            if self.launch is not None and (
                self.launch.num_replicas < 1 or self.launch.num_prefill_replicas or self.launch.num_decode_replicas
            ):
                raise ValueError(
                    f"launch.num_replicas must be a positive integer, got {self.launch.num_replicas!r} "
                    f"(num_prefill_replicas and num_decode_replicas: router.mode disaggregated)"
                )
        addresses = self.replicas + self.prefill_replicas + self.decode_replicas
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"replicas lists an address twice: {list(addresses)}")

    def _check_disaggregated(self) -> None:
        if self.replicas:
            raise ValueError("router.mode disaggregated takes prefill_replicas and decode_replicas, not replicas")
        listed = bool(self.prefill_replicas) or bool(self.decode_replicas)
        if listed == (self.launch is not None):
            raise ValueError(
                "router.mode disaggregated needs exactly one of prefill_replicas + decode_replicas and launch"
            )
        if listed and not (self.prefill_replicas and self.decode_replicas):
            raise ValueError("router.mode disaggregated needs at least one of each: prefill_replicas, decode_replicas")
        launch = self.launch
        if launch is not None and (
            launch.num_replicas or launch.num_prefill_replicas < 1 or launch.num_decode_replicas < 1
        ):
            raise ValueError(
                "router.mode disaggregated launches num_prefill_replicas >= 1 and num_decode_replicas "
                ">= 1 (not num_replicas)"
            )

    @property
    def all_replicas(self) -> tuple[str, ...]:
        """Every replica address listed, of either pool."""
        return self.replicas + self.prefill_replicas + self.decode_replicas


def parse_config(tree) -> RouterConfig:
    if not isinstance(tree, dict):
        raise ValueError("a router config must be a mapping of sections (model, router, replicas or launch)")
    unknown = sorted(set(tree) - set(ROUTER_SECTIONS))
    if unknown:
        raise ValueError(
            f"unknown config section {unknown[0]!r}; expected model, router, replicas "
            f"(or prefill_replicas and decode_replicas) or launch"
        )
    model = tree.get("model") or {}
    if not isinstance(model, dict) or set(model) - {"path"} or not isinstance(model.get("path"), str):
        raise ValueError("the router config needs model.path (the replicas' model), and nothing else under model")
    lists = {}
    for name in ("replicas", "prefill_replicas", "decode_replicas"):
        addresses = tree.get(name) or []
        if not isinstance(addresses, list):
            raise ValueError(f"{name} must be a list of HOST:PORT, got {addresses!r}")
        lists[name] = tuple(parse_address(address) for address in addresses)
    launch = tree.get("launch")
    return RouterConfig(
        model_path=model["path"],
        router=build_section(RouterSection, "router", tree.get("router")),
        launch=build_section(LaunchSection, "launch", launch) if launch is not None else None,
        **lists,
    )


def load_router_config(path: str, overrides: list[str] | tuple[str, ...] = ()) -> RouterConfig:
    """overrides: SECTION.KEY=VALUE (YAML values), as jaxserve.serve's --set."""
    return parse_config(read_sections(path, overrides, ROUTER_SECTIONS))
