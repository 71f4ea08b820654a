"""The router's YAML config, every key checked (a malformed one is a ValueError naming the key):

    model:    {path: PATH | default | tiny-random}   the replicas' model: the router tokenizes with its
                                                      tokenizer and refuses a replica serving another
    router:   {host, port, http_port, metrics_port, policy, blind_window, heartbeat, health_interval, startup_timeout,
               max_in_flight, max_resends}
    replicas: [HOST:PORT, ...]                        replicas already running; or
    launch:   {num_replicas, config, set: [KEY=VALUE, ...], log_dir, restart}
                                                      local `python -m jaxserve.serve` processes the router
                                                      starts on free ports (config: their serve config)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from jaxserve.router.policy import POLICIES
from jaxserve.server.config_file import parse_override, read_yaml

KIND_NAMES = {int: "an integer", float: "a number", str: "a string"}


@dataclass(frozen=True)
class RouterSection:
    host: str = "127.0.0.1"
    port: int = 50050
    http_port: int = 0  # the OpenAI-compatible HTTP API in front of the replicas; 0: none
    metrics_port: int = 0  # 0: no metrics endpoint
    policy: str = "prefix"  # prefix | round_robin | least_load | session
    blind_window: float = 2.0  # seconds a page routed but not yet stored counts as cached there
    heartbeat: float = 0.5  # seconds; a replica silent for 10 heartbeats is taken out
    health_interval: float = 1.0  # seconds between health checks of each replica
    startup_timeout: float = 300.0  # seconds to wait for every replica at start-up (warm-up included)
    max_in_flight: int = 1024  # streams forwarded at once; beyond, RESOURCE_EXHAUSTED
    max_resends: int = 3  # times a request that has not streamed a token is sent to another replica

    def __post_init__(self):
        for option in dataclasses.fields(self):
            value, default = getattr(self, option.name), option.default
            kind = int if isinstance(default, int) else float if isinstance(default, float) else str
            if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
                raise ValueError(f"router.{option.name} must be {KIND_NAMES[kind]}, got {value!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"router.policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("port", "http_port", "metrics_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"router.{name} must be a port number, got {getattr(self, name)!r}")
        for name in ("heartbeat", "health_interval", "startup_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"router.{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.blind_window < 0 or self.max_in_flight < 1 or self.max_resends < 0:
            raise ValueError("router.blind_window and router.max_resends must be >= 0, router.max_in_flight >= 1")


@dataclass(frozen=True)
class LaunchSection:
    num_replicas: int
    config: str | None = None  # the replicas' serve config; their ports are chosen here
    set: tuple[str, ...] = ()  # overrides for every replica, as `jaxserve.serve --set`
    log_dir: str | None = None  # where each replica's log goes; default: a temporary directory
    restart: bool = True  # start a replica whose process exits again, on the same port

    def __post_init__(self):
        if not isinstance(self.num_replicas, int) or self.num_replicas < 1:
            raise ValueError(f"launch.num_replicas must be a positive integer, got {self.num_replicas!r}")
        if isinstance(self.set, str) or not all(isinstance(item, str) and "=" in item for item in self.set):
            raise ValueError(f"launch.set must be a list of KEY=VALUE strings, got {self.set!r}")
        object.__setattr__(self, "set", tuple(self.set))
        if not isinstance(self.restart, bool):
            raise ValueError(f"launch.restart must be true or false, got {self.restart!r}")


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

    def __post_init__(self):
        if bool(self.replicas) == (self.launch is not None):
            raise ValueError("the router config needs exactly one of replicas (a list of HOST:PORT) and launch")
        if len(set(self.replicas)) != len(self.replicas):
            raise ValueError(f"replicas lists an address twice: {list(self.replicas)}")


def _section(cls, name: str, values):
    if not isinstance(values, dict):
        raise ValueError(f"config section {name!r} must be a mapping, got {values!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown config key {name}.{unknown[0]}; known: {', '.join(sorted(known))}")
    try:
        return cls(**values)
    except TypeError as error:
        raise ValueError(f"config section {name!r}: {error}") from None


def parse_config(tree) -> RouterConfig:
    if not isinstance(tree, dict):
        raise ValueError("a router config must be a mapping of sections (model, router, replicas or launch)")
    unknown = sorted(set(tree) - {"model", "router", "replicas", "launch"})
    if unknown:
        raise ValueError(f"unknown config section {unknown[0]!r}; expected model, router, replicas or launch")
    model = tree.get("model") or {}
    if not isinstance(model, dict) or set(model) - {"path"} or not isinstance(model.get("path"), str):
        raise ValueError("the router config needs model.path (the replicas' model), and nothing else under model")
    replicas = tree.get("replicas") or []
    if not isinstance(replicas, list):
        raise ValueError(f"replicas must be a list of HOST:PORT, got {replicas!r}")
    launch = tree.get("launch")
    return RouterConfig(model_path=model["path"], router=_section(RouterSection, "router", tree.get("router") or {}),
                        replicas=tuple(parse_address(address) for address in replicas),
                        launch=_section(LaunchSection, "launch", launch) if launch is not None else None)


def load_router_config(path: str, overrides: list[str] | tuple[str, ...] = ()) -> RouterConfig:
    """overrides: SECTION.KEY=VALUE (YAML values), as jaxserve.serve's --set."""
    tree = read_yaml(path)
    for override in overrides:
        key, value = parse_override(override)
        section, _, name = key.partition(".")
        if not name or not isinstance(tree, dict) or not isinstance(tree.get(section, {}), dict):
            raise ValueError(f"--set expects SECTION.KEY=VALUE for a mapping section, got {override!r}")
        tree.setdefault(section, {})[name] = value
    return parse_config(tree)
