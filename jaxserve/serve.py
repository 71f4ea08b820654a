"""`python -m jaxserve.serve [--config FILE] [--set section.key=value ...]`: gRPC and the OpenAI HTTP API.

Without a config it serves the embedded default model on 127.0.0.1. The gRPC port opens first, with
health NOT_SERVING while the engine warms up, then SERVING. SIGTERM (or Ctrl-C) drains: new requests
get UNAVAILABLE (HTTP 503), in-flight ones finish (up to server.drain_timeout), and the process exits 0.
Before binding anything but loopback, set server.tls (and server.api_keys): see configs/.
With a `distributed` section every process runs this same command: process 0 serves, the others
follow its step plans (jaxserve/distributed) and open no ports.
"""

from __future__ import annotations

# ruff: noqa: E402 (the imports below come after the restart, which would otherwise pay for them twice)
import sys

from jaxserve.step_allocator import restart_with_step_allocator

# on a CPU, once, with glibc's allocator settings (server.allocator): jaxserve/step_allocator.py
if __name__ == "__main__":
    restart_with_step_allocator(server_argv=sys.argv[1:])

import argparse
import logging
import os
import threading
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2

from jaxserve.disagg.service import DisaggService
from jaxserve.distributed.runtime import ProcessGroup, RefusedOnEveryProcess, initialize
from jaxserve.engine import Engine
from jaxserve.server.address import host_port, is_loopback
from jaxserve.server.auth import ApiKeyInterceptor, ApiKeys, grpc_server_credentials, server_ssl_context
from jaxserve.server.chat_prompt import load_chat_template
from jaxserve.server.config_file import ServeConfig, load_config
from jaxserve.server.engine_loop import EngineLoop
from jaxserve.server.fingerprint import system_fingerprint
from jaxserve.server.kv_events_service import kv_events_handler
from jaxserve.server.limits import RequestLimits
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.metrics_http import start_metrics_server, stop_metrics_server
from jaxserve.server.openai import HTTPServer, ServingContext, build_app
from jaxserve.server.openai.response_store import ResponseStore
from jaxserve.server.process import StopRequested, run_until_signalled, signals_interrupt
from jaxserve.server.rpc import GENERATION_SERVICE, ThreadPools, generation_handler, health_handler
from jaxserve.server.service import GenerationService

logger = logging.getLogger("jaxserve.serve")
CUT_OFF_TIMEOUT = 5.0  # seconds past the drain timeout for the cut-off requests' calls to end
KEEPALIVE_MS = 60_000  # ping idle connections so that vanished clients' streams are cancelled and freed


class Server:
    def __init__(self, config: ServeConfig, process_group: ProcessGroup | None = None):
        """process_group: process 0's of several (jaxserve.distributed.runtime.initialize); None: one process."""
        self.process_group = process_group
        self.config = config
        server = config.server
        self.chat_template = load_chat_template(server.chat_template)  # a missing file: refused before any port opens
        self.metrics = ServerMetrics()
        self.health = health.HealthServicer()
        self.service = GenerationService()
        self.disagg = DisaggService()  # prefill/decode handover services, live on a replica with engine.role set
        self.api_keys = ApiKeys.from_file(server.api_keys) if server.api_keys else None
        self.pools = ThreadPools.for_limits(config.engine.scheduler.max_num_seqs + server.max_queued_requests)
        assert server.max_message_bytes is not None  # ServeConfig fills in the default
        # SO_REUSEPORT off: a second server on a taken port must fail to start, not silently share it.
        options = [
            ("grpc.max_receive_message_length", server.max_message_bytes),
            ("grpc.keepalive_time_ms", KEEPALIVE_MS),
            ("grpc.so_reuseport", 0),
        ]
        kv_events, self.kv_events_pool = kv_events_handler(self.service)
        interceptors: list[grpc.ServerInterceptor] = (
            [ApiKeyInterceptor(self.api_keys, self.pools.quick)] if self.api_keys else []
        )
        self.grpc_server = grpc.server(
            self.pools.default,
            handlers=[
                generation_handler(self.service, self.pools),
                kv_events,
                health_handler(self.health, self.pools),
                *self.disagg.handlers(self.pools),
            ],
            interceptors=interceptors,
            options=options,
        )
        address = host_port(server.host, server.port)
        try:
            if server.tls is not None:
                self.port = self.grpc_server.add_secure_port(address, grpc_server_credentials(server.tls))
            else:
                self.port = self.grpc_server.add_insecure_port(address)
        except RuntimeError as error:
            raise ValueError(f"cannot listen on {address}: {error}") from None
        if self.port == 0:
            raise ValueError(f"cannot listen on {address}")
        if not is_loopback(server.host) and (server.tls is None or self.api_keys is None):
            logger.warning(
                "serving %s without %s: anyone who can reach this port can use it",
                address,
                " and ".join(
                    name
                    for name, value in (("server.tls", server.tls), ("server.api_keys", self.api_keys))
                    if value is None
                ),
            )
        self.loop: EngineLoop | None = None
        self.metrics_server = None
        self.stopped = threading.Event()
        self._closed = False
        # The OpenAI HTTP API: its own event-loop thread (the gRPC server is thread-pool based), one engine loop.
        store = ResponseStore(server.responses_store_max_responses, server.responses_store_max_bytes)
        self.http_context = ServingContext(self.metrics, server.served_model_names, store)
        self.http_server = None
        try:
            if server.http_port:
                app = build_app(self.http_context, self.api_keys, server.max_message_bytes, server.cors_allowed_origins)
                self.http_server = HTTPServer(app, server.host, server.http_port, server.tls)
        except BaseException:
            self.grpc_server.stop(grace=None)  # its port is bound already: an embedder's retry needs it back
            raise

    def _set_health(self, status) -> None:
        for name in ("", GENERATION_SERVICE):
            self.health.set(name, status)

    def _start_metrics(self) -> None:
        server = self.config.server
        tls = server_ssl_context(server.tls) if server.tls is not None else None
        try:
            self.metrics_server = start_metrics_server(
                server.host, server.metrics_port, self.metrics.registry, tls, self.api_keys
            )
        except OSError as error:
            raise ValueError(f"cannot serve metrics on port {server.metrics_port}: {error}") from None

    def start(self) -> None:
        """Open the ports, then warm the engine up (health NOT_SERVING meanwhile), then serve. Whatever stops it
        (a bad model, a signal during warm-up: process.signals_interrupt) closes what it had opened first."""
        try:
            self._start()
        except BaseException:
            self._close(grace=None)
            raise

    def _start(self) -> None:
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc_server.start()
        if self.config.server.metrics_port:
            self._start_metrics()
        if self.http_server is not None:
            self.http_server.start()
            logger.info("OpenAI HTTP API on %s", host_port(self.config.server.host, self.http_server.port))
        logger.info(
            "listening on %s%s; warming up",
            host_port(self.config.server.host, self.port),
            " (TLS)" if self.config.server.tls else "",
        )
        if self.process_group is not None:
            self.process_group.on_fatal(lambda: self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))
        engine = Engine.from_model(self.config.model_dir(), self.config.engine, self.process_group)
        self.loop = EngineLoop(
            engine, self.metrics, self.config.server.max_queued_requests, self.config.server.stream_idle_timeout
        )
        info = self.loop.description
        limits = RequestLimits.for_engine(info.max_model_len, info.vocab_size, **self.config.server.request_caps())
        fingerprint = system_fingerprint(info)
        parser = self.config.server.tool_call_parser
        self.service.attach(self.loop, limits, self.chat_template, fingerprint, parser)
        self.http_context.attach(self.loop, limits, self.chat_template, fingerprint, parser)
        self.http_context.reasoning_parser = self.config.server.reasoning_parser
        self.service.reasoning_parser = self.config.server.reasoning_parser
        self.http_context.reasoning()  # a reasoning format the tokenizer cannot write fails start-up, not each chat
        self.disagg.attach(self.loop, limits)
        self.metrics.observe_engine(self.loop.stats)
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        logger.info(
            "serving %s (%d executables, warm-up %.1fs)", info.model_name, info.num_executables, info.warmup_seconds
        )

    def drain_and_stop(self) -> None:
        """Refuse new requests, let those in flight finish (up to server.drain_timeout), then stop. Safe to
        call again, and after a failed start."""
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.loop is not None and not self._closed:
            self.loop.begin_drain()
            drain_timeout = self.config.server.drain_timeout
            if not self.loop.wait_until_idle(drain_timeout):
                logger.warning("drain timeout: %d requests still in flight; ending them", self.loop.num_in_flight)
                # each ends with a reason (gRPC UNAVAILABLE, HTTP 503 or an SSE error event), not a cut connection
                message = f"the server is shutting down: server.drain_timeout ({drain_timeout:g}s) ran out"
                self.loop.cut_off_all(message, CUT_OFF_TIMEOUT)
        self._close(grace=2)
        if self.process_group is not None:
            self.process_group.shutdown()  # several processes: the followers stop too
        self.stopped.set()

    def _close(self, grace: float | None) -> None:
        """Stop the ports, the engine loop and the threads, releasing every port; once."""
        if self._closed:
            return
        self._closed = True
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc_server.stop(grace=grace).wait()
        if self.http_server is not None:
            self.http_server.stop()
        self.http_context.shutdown()
        self.disagg.stop()
        if self.loop is not None:
            self.loop.stop()
        if self.metrics_server is not None:
            stop_metrics_server(self.metrics_server)
        self.pools.shutdown()
        self.kv_events_pool.shutdown(wait=False, cancel_futures=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a YAML config (see configs/); default: the embedded model")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set server.port=50052",
    )
    args = parser.parse_args(argv)

    groups: list[ProcessGroup] = []

    def start() -> Server:
        config = load_config(args.config, args.overrides)
        group = initialize(config.distributed)
        if group is not None and not group.is_leader:
            leave_multiprocess_program(follow(config, group))
        if group is not None:
            groups.append(group)
        server = Server(config, group)
        try:
            with signals_interrupt():  # a signal during load and warm-up stops them (start closes what it opened)
                server.start()
        except StopRequested:
            logger.info("stopped while starting")  # the stop is recorded: stop() below finds nothing left to drain
        return server

    def stop(server: Server) -> None:
        logger.info("stopping: draining in-flight requests")
        server.drain_and_stop()
        logger.info("stopped")

    code = run_until_signalled("jaxserve.serve", start, stop)
    if groups and groups[0].is_multiprocess:
        leave_multiprocess_program(code)
    return code


def leave_multiprocess_program(code: int) -> NoReturn:
    """After an orderly stop of a multi-process program: flush and exit without finalizing the interpreter.
    XLA's CPU collectives (gloo) and the coordination client keep C++ threads of their own that
    finalization can catch mid-call, which aborts a process that had stopped cleanly."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def follow(config: ServeConfig, group: ProcessGroup) -> int:
    """A follower process: build the same engine as process 0, then run its plans until it stops."""
    from jaxserve.distributed.follower import run_follower

    try:
        engine = Engine.from_model(config.model_dir(), config.engine, group)
    except RefusedOnEveryProcess:  # process 0 refuses the same and stops by itself
        raise
    except Exception as error:  # process 0 must not wait for (or serve without) this process
        group.report_start_failure(str(error) if isinstance(error, ValueError) else repr(error))
        raise
    logger.info("following process 0's plans")
    run_follower(engine.parts, group)
    group.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
