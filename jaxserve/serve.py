"""`python -m jaxserve.serve [--config FILE] [--set section.key=value ...]`: the gRPC server.

Without a config it serves the embedded default model. The gRPC port opens first, with health
NOT_SERVING while the engine warms up, then SERVING. SIGTERM (or Ctrl-C) drains: new requests
get UNAVAILABLE, in-flight ones finish (up to server.drain_timeout), and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from jaxserve.server.config_file import ServeConfig, load_config
from jaxserve.engine import Engine
from jaxserve.proto import jaxserve_pb2_grpc
from jaxserve.server.engine_loop import EngineLoop
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.service import GenerationService

logger = logging.getLogger("jaxserve.serve")
SERVICE_NAME = "jaxserve.v1.Generation"


class Server:
    def __init__(self, config: ServeConfig):
        self.config = config
        self.metrics = ServerMetrics()
        self.health = health.HealthServicer()
        self.service = GenerationService(config.model.path)
        max_workers = config.engine.max_num_seqs + config.server.max_queued_requests + 16
        self.grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
        jaxserve_pb2_grpc.add_GenerationServicer_to_server(self.service, self.grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        address = f"{config.server.host}:{config.server.port}"
        try:
            self.port = self.grpc_server.add_insecure_port(address)
        except RuntimeError as error:
            raise ValueError(f"cannot listen on {address}: {error}") from None
        if self.port == 0:
            raise ValueError(f"cannot listen on {address}")
        self.loop: EngineLoop | None = None
        self.stopped = threading.Event()

    def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def start(self) -> None:
        """Open the ports, then warm the engine up (health NOT_SERVING meanwhile), then serve."""
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.grpc_server.start()
        if self.config.server.metrics_port:
            try:
                start_http_server(self.config.server.metrics_port, addr=self.config.server.host,
                                  registry=self.metrics.registry)
            except OSError as error:
                self.grpc_server.stop(grace=None)
                raise ValueError(f"cannot serve metrics on port {self.config.server.metrics_port}: {error}") from None
        logger.info("listening on %s:%d; warming up", self.config.server.host, self.port)
        engine = Engine.from_model(self.config.model_dir(), self.config.engine)
        self.loop = EngineLoop(engine, self.metrics, self.config.server.max_queued_requests)
        self.service.loop = self.loop
        self.metrics.observe_engine(engine.stats())
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        logger.info("serving (%d executables, warm-up %.1fs)", len(engine.runner.executables),
                    engine.runner.warmup_seconds)

    def drain_and_stop(self) -> None:
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.loop is not None:
            self.loop.begin_drain()
            if not self.loop.wait_until_idle(self.config.server.drain_timeout):
                logger.warning("drain timeout: %d requests still in flight", self.loop.num_in_flight)
        self.grpc_server.stop(grace=2).wait()
        if self.loop is not None:
            self.loop.stop()
        self.stopped.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a YAML config (see configs/); default: the embedded model")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set server.port=50052")
    args = parser.parse_args(argv)
    # force: libraries imported earlier (orbax, via absl) may have claimed the root logger already
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    stop_requested = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop_requested.set())
    try:
        server = Server(load_config(args.config, args.overrides))
        server.start()
    except ValueError as error:
        print(f"jaxserve.serve: {error}", file=sys.stderr)
        return 2
    stop_requested.wait()
    logger.info("stopping: draining in-flight requests")
    server.drain_and_stop()
    logger.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
