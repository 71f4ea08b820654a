"""The router process: start (or find) the replicas, check each serves the router's model, follow their
page events, and serve the Generation API in front of them.

Start-up fails with a ValueError naming the problem: a replica address that does not resolve or does
not answer within router.startup_timeout, a replica serving another model. Afterwards replicas may
come and go; the router keeps nothing that the replicas do not send again on resubscription.

Its ports take the replica server's TLS and API keys (router.tls, router.api_keys, with the same code as
serve.py); it reaches replicas that require them through router.replica_tls and router.replica_api_key.
"""

from __future__ import annotations

import logging
import socket
import time
from types import SimpleNamespace

import grpc
from grpc_health.v1 import health, health_pb2

from jaxserve.client import Connection
from jaxserve.engine.fingerprint import model_fingerprint
from jaxserve.loading.model_source import open_model
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc
from jaxserve.router.config import LaunchSection, RouterConfig
from jaxserve.router.connection import replica_channel, replica_connection
from jaxserve.router.disaggregated import DisaggregatedRouterService, model_reasoning_parser
from jaxserve.router.http_api import RoutedContext, RoutedLoop
from jaxserve.router.launcher import Supervisor, launch_replicas, stop_replicas
from jaxserve.router.metrics import RouterMetrics
from jaxserve.router.policy import POLICIES
from jaxserve.router.replica import Replica, check_info
from jaxserve.router.service import RouterService
from jaxserve.server.address import host_port, is_loopback
from jaxserve.server.auth import ApiKeyInterceptor, ApiKeys, grpc_server_credentials, server_ssl_context
from jaxserve.server.limits import MIN_MESSAGE_BYTES, RequestLimits
from jaxserve.server.metrics_http import start_metrics_server, stop_metrics_server
from jaxserve.server.openai import HTTPServer, build_app
from jaxserve.server.rpc import GENERATION_SERVICE, ThreadPools, health_handler, parse

logger = logging.getLogger("jaxserve.router")
MIN_HTTP_BODY_BYTES = 64 * 1024


def first_info(address: str, fingerprint: str, timeout: float, connection: Connection) -> pb.ServerInfo:
    """The replica's ServerInfo once it answers (it may still be warming up), checked against the model."""
    host, _, port = address.rpartition(":")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port))
    except socket.gaierror as error:
        raise ValueError(f"replica {address}: unknown host {host!r} ({error.strerror})") from None
    deadline, last_error = time.monotonic() + timeout, ""
    with replica_channel(address, connection) as channel:
        stub = jaxserve_pb2_grpc.GenerationStub(channel)
        while time.monotonic() < deadline:
            try:
                info = stub.GetServerInfo(pb.ServerInfoRequest(), timeout=min(5.0, timeout), wait_for_ready=True)
                check_info(address, info, fingerprint)
                return info
            except grpc.RpcError as error:
                last_error = f"{error.code().name}: {error.details()}"
                time.sleep(0.2)
    raise ValueError(
        f"replica {address} did not answer GetServerInfo within {timeout:.0f}s (router.startup_timeout): {last_error}"
    )


def _handlers(service: RouterService, pools: ThreadPools) -> grpc.GenericRpcHandler:
    """As a replica's (server/rpc.py): a request larger than any within the limits is refused unparsed."""
    limits = service.limits

    def method(function, request_type, response_type, pool, streaming: bool, max_bytes: int | None = None):
        def handle(request_bytes, context):
            return function(parse(request_type, request_bytes, context, max_bytes), context)

        handle.experimental_thread_pool = pool
        make = grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        return make(handle, response_serializer=response_type.SerializeToString)

    generate_bytes = limits.max_generate_request_bytes
    return grpc.method_handlers_generic_handler(
        GENERATION_SERVICE,
        {
            "Generate": method(
                service.Generate, pb.GenerateRequest, pb.GenerateResponse, pools.streams, True, generate_bytes
            ),
            "Chat": method(service.Chat, pb.ChatRequest, pb.GenerateResponse, pools.streams, True, generate_bytes),
            "GetServerInfo": method(service.GetServerInfo, pb.ServerInfoRequest, pb.ServerInfo, pools.quick, False),
            "Tokenize": method(
                service.Tokenize,
                pb.TokenizeRequest,
                pb.TokenizeResponse,
                pools.tokenizer,
                False,
                limits.max_tokenize_request_bytes,
            ),
            "Detokenize": method(
                service.Detokenize,
                pb.DetokenizeRequest,
                pb.DetokenizeResponse,
                pools.tokenizer,
                False,
                limits.max_detokenize_request_bytes,
            ),
        },
    )


class RouterServer:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.metrics = RouterMetrics()
        self.launched = []
        self.supervisor: Supervisor | None = None
        self.replicas: list[Replica] = []
        self.grpc_server = None
        self.metrics_server = None
        self.http_server = None
        self.http_context = None
        self.pools = ThreadPools.for_limits(config.router.max_in_flight)
        self.port = 0
        self.service: RouterService | None = None
        self.http_loop: RoutedLoop | None = None
        self.api_keys: ApiKeys | None = None
        self.connection = Connection()  # to the replicas

    def start(self) -> None:
        """Raises ValueError (after cleaning up) when the replicas or the model are not as configured; anything
        raised while it waits (SIGTERM, Ctrl-C: see __main__) stops what it started, launched replicas too."""
        try:
            self._start()
        except BaseException:
            self.stop(replica_timeout=5.0)  # nothing has been served yet: no drain to wait for
            raise

    def _start(self) -> None:
        config, section = self.config, self.config.router
        self.connection = replica_connection(section.replica_tls, section.replica_api_key)
        if section.api_keys:
            try:
                self.api_keys = ApiKeys.from_file(section.api_keys)
            except ValueError as error:
                raise ValueError(str(error).replace("server.api_keys", "router.api_keys")) from None
        source = open_model(config.model_path)  # the tokenizer and the fingerprint; no weights are read
        fingerprint = model_fingerprint(source)
        roles = (
            self._launch(config.launch)
            if config.launch is not None
            else [None] * len(config.replicas)
            + ["prefill"] * len(config.prefill_replicas)
            + ["decode"] * len(config.decode_replicas)
        )
        addresses = [replica.address for replica in self.launched] or list(config.all_replicas)
        logger.info("waiting up to %.0fs for replicas %s", section.startup_timeout, ", ".join(addresses))
        infos = [first_info(address, fingerprint, section.startup_timeout, self.connection) for address in addresses]
        limits = RequestLimits.for_engine(min(i.max_model_len for i in infos), infos[0].vocab_size)
        self.replicas = [
            Replica(
                address,
                fingerprint,
                section.blind_window,
                section.heartbeat,
                section.health_interval,
                self.metrics,
                self.connection,
            )
            for address in addresses
        ]
        for replica in self.replicas:
            replica.start()
        if section.mode == "disaggregated":
            pools = {
                role: [r for r, r_role in zip(self.replicas, roles) if r_role == role] for role in ("prefill", "decode")
            }
            service = DisaggregatedRouterService(
                pools["prefill"],
                pools["decode"],
                POLICIES[section.policy](),
                source.tokenizer,
                limits,
                self.metrics,
                section.max_in_flight,
                section.max_resends,
                section.resend_wait,
                section.tool_call_parser,
            )
            service.reasoning = model_reasoning_parser(source, section.reasoning_parser)
        else:
            service = RouterService(
                self.replicas,
                POLICIES[section.policy](),
                source.tokenizer,
                limits,
                self.metrics,
                section.max_in_flight,
                section.max_resends,
                section.tool_call_parser,
            )
        self._serve(service)
        self.service = service  # (after _serve: its health servicer is what a drain sets NOT_SERVING)
        if section.http_port:
            self._serve_http(service, infos[0].model, limits, source.tokenizer, source.config)
        self._wait_for_replicas(min(section.startup_timeout, 60.0))
        logger.info(
            "routing %s over %d replicas (%s, %s) on %s",
            source.name,
            len(self.replicas),
            section.mode,
            section.policy,
            host_port(section.host, self.port),
        )

    def _launch(self, launch: LaunchSection) -> list[str | None]:
        """Start the configured local replicas; returns each one's role (None: colocated)."""
        config = self.config
        roles: list[str | None] = (
            [None] * launch.num_replicas
            + ["prefill"] * launch.num_prefill_replicas
            + ["decode"] * launch.num_decode_replicas
        )
        self.launched = launch_replicas(
            len(roles),
            config.model_path,
            launch.config,
            launch.set,
            launch.log_dir,
            config.router.startup_timeout,
            roles,
            self.connection,
        )
        if launch.restart:
            self.supervisor = Supervisor(self.launched)
            self.supervisor.start()
        return roles

    def _serve(self, service: RouterService) -> None:
        section = self.config.router
        self.health = health.HealthServicer()
        self.grpc_server = grpc.server(
            self.pools.default,
            handlers=[_handlers(service, self.pools), health_handler(self.health, self.pools)],
            interceptors=[ApiKeyInterceptor(self.api_keys, self.pools.quick)] if self.api_keys else [],
            # a replica's default receive limit (server.max_message_bytes): gRPC refuses a larger message
            # (RESOURCE_EXHAUSTED) unread, as a replica would
            options=[
                ("grpc.so_reuseport", 0),
                (
                    "grpc.max_receive_message_length",
                    max(MIN_MESSAGE_BYTES, 2 * service.limits.max_generate_request_bytes),
                ),
            ],
        )  # a taken port fails, never shared
        address = host_port(section.host, section.port)
        try:
            if section.tls is not None:
                self.port = self.grpc_server.add_secure_port(address, grpc_server_credentials(section.tls))
            else:
                self.port = self.grpc_server.add_insecure_port(address)
        except RuntimeError as error:
            raise ValueError(f"cannot listen on {address}: {error}") from None
        if not is_loopback(section.host) and (section.tls is None or self.api_keys is None):
            missing = [
                name for name, value in (("router.tls", section.tls), ("router.api_keys", self.api_keys)) if not value
            ]
            logger.warning("serving %s without %s: anyone who can reach it can use it", address, " and ".join(missing))
        self.grpc_server.start()
        if section.metrics_port:
            tls = server_ssl_context(section.tls) if section.tls is not None else None
            try:
                self.metrics_server = start_metrics_server(
                    section.host, section.metrics_port, self.metrics.registry, tls, self.api_keys
                )
            except OSError as error:
                raise ValueError(f"cannot serve metrics on port {section.metrics_port}: {error}") from None
        for name in ("", GENERATION_SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def _serve_http(
        self, service: RouterService, model_name: str, limits: RequestLimits, tokenizer, model_config=None
    ) -> None:
        section = self.config.router
        self.http_context = RoutedContext(self.metrics, self.replicas)
        app = build_app(
            self.http_context, self.api_keys, max(2 * limits.max_generate_request_bytes, MIN_HTTP_BODY_BYTES)
        )
        self.http_server = HTTPServer(app, section.host, section.http_port, section.tls)
        self.http_server.start()
        description = SimpleNamespace(model_name=model_name, max_model_len=limits.max_prompt_tokens)
        loop = RoutedLoop(service, description, tokenizer, model_config)  # a GenerationLoop (server/openai/loop.py)
        # no chat template of its own: the tokenizer's renders, and tells "auto" the tool-call format
        self.http_context.attach(loop, limits, None, "", section.tool_call_parser)
        self.http_context.reasoning_parser = section.reasoning_parser
        self.http_context.reasoning()  # a reasoning format the tokenizer cannot write fails start-up, not each chat
        self.http_loop = loop
        logger.info("OpenAI HTTP API on %s", host_port(section.host, self.http_server.port))

    def _wait_for_replicas(self, timeout: float) -> None:
        """Each replica's first snapshot; a slow one is routed to once it arrives."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(replica.is_up for replica in self.replicas):
            time.sleep(0.05)
        for replica in self.replicas:
            if not replica.is_up:
                logger.warning("replica %s is not up yet: %s", replica.address, replica.down_reason)

    def drain_and_stop(self) -> None:
        """Refuse new requests (gRPC UNAVAILABLE, HTTP 503, health NOT_SERVING), let the streams in flight
        finish (up to router.drain_timeout), then stop. Safe to call again, and after a failed start."""
        if self.service is not None and not self.service.draining:
            self.service.draining = True
            for name in ("", GENERATION_SERVICE):
                self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            timeout = self.config.router.drain_timeout
            if not self._wait_until_idle(timeout):
                logger.warning(
                    "router.drain_timeout (%gs) ran out with %d streams in flight; cutting them",
                    timeout,
                    self.service.num_in_flight,
                )
        self.stop()

    def _wait_until_idle(self, timeout: float) -> bool:
        """True once no stream is in flight (HTTP calls included from their admission: a relay thread may not
        have reached the service yet), False if timeout seconds pass first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.service is None or not self.service.num_in_flight:
                if self.http_loop is None or not self.http_loop.num_open:
                    return True
            time.sleep(0.05)
        return False

    def stop(self, replica_timeout: float = 30.0) -> None:
        """Safe to call again. replica_timeout: how long launched replicas get to drain before SIGKILL."""
        if self.grpc_server is not None:
            self.grpc_server.stop(grace=1).wait()
        if self.http_server is not None:
            self.http_server.stop()
        if self.http_context is not None:
            self.http_context.shutdown()
        if self.supervisor is not None:
            self.supervisor.stop()
        for replica in self.replicas:
            replica.stop()
        stop_replicas(self.launched, replica_timeout)
        if self.metrics_server is not None:
            stop_metrics_server(self.metrics_server)
        self.pools.shutdown()
