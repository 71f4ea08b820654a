"""Local replicas the router starts itself: `python -m jaxserve.serve` processes on free loopback ports,
each waited for until its health is SERVING. Each replica's log is a file of its own."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.client import Connection
from jaxserve.router.connection import PLAIN, replica_channel

logger = logging.getLogger("jaxserve.router")


_ports_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on, never one this process handed out before: the kernel may offer
    a just-closed port again, and replicas launched together would then try to share it."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _ports_handed_out:
            _ports_handed_out.add(port)
            return port
    raise RuntimeError("no free loopback port found")


def is_serving(address: str, timeout: float = 1.0, connection: Connection = PLAIN) -> bool:
    # a fresh channel each time: a shared one backs off after failed connects and can sleep through warm-up
    with replica_channel(address, connection) as channel:
        stub: Any = health_pb2_grpc.HealthStub(channel)  # generated without type information
        try:
            response = stub.Check(health_pb2.HealthCheckRequest(service="jaxserve.v1.Generation"), timeout=timeout)
        except grpc.RpcError:
            return False
    return response.status == health_pb2.HealthCheckResponse.SERVING


def http_port_off() -> list[str]:
    """Replicas behind a router serve gRPC only (their HTTP ports would collide)."""
    from jaxserve.server.config_file import ServerConfig

    has_http = "http_port" in {option.name for option in dataclasses.fields(ServerConfig)}
    return ["--set", "server.http_port=0"] if has_http else []


class LaunchedReplica:
    def __init__(self, index: int, model_path: str, config: str | None, overrides: tuple[str, ...], log_dir: str):
        self.index = index
        self.port = free_port()  # kept across restarts: the router knows the replica by its address
        self.address = f"127.0.0.1:{self.port}"
        self.command = [
            sys.executable,
            "-m",
            "jaxserve.serve",
            *(["--config", config] if config else []),
            "--set",
            f"model.path={model_path}",
            *[arg for item in overrides for arg in ("--set", item)],
            "--set",
            "server.host=127.0.0.1",
            "--set",
            f"server.port={self.port}",
            "--set",
            "server.metrics_port=0",
            *http_port_off(),
        ]
        self.log_path = os.path.join(log_dir, f"replica-{index}.log")
        self.process: subprocess.Popen | None = None
        self.num_starts = 0
        self.stopping = False

    def start(self) -> subprocess.Popen:
        with open(self.log_path, "ab") as log:
            self.process = process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        self.num_starts += 1
        return process

    def has_exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def log_tail(self, num_lines: int = 20) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-num_lines:])

    def stop(self, timeout: float = 30.0) -> None:
        stop_replicas([self], timeout)


def stop_replicas(replicas: list[LaunchedReplica], timeout: float) -> None:
    """SIGTERM to all at once (each drains in parallel), then SIGKILL to those still running after `timeout`."""
    for replica in replicas:
        replica.stopping = True
        if replica.process is not None and replica.process.poll() is None:
            replica.process.terminate()
    deadline = time.monotonic() + timeout
    for replica in replicas:
        if replica.process is None:
            continue
        try:
            replica.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            replica.process.kill()
            replica.process.wait()


def launch_replicas(
    num_replicas: int,
    model_path: str,
    config: str | None,
    overrides: tuple[str, ...],
    log_dir: str | None,
    timeout: float,
    roles: list[str | None] | None = None,
    connection: Connection = PLAIN,
) -> list[LaunchedReplica]:
    """Start them all at once (they warm up in parallel), then wait for each; on any failure stop all
    and raise ValueError with the failing replica's log. roles: each replica's engine.role (disaggregated)."""
    log_dir = log_dir or tempfile.mkdtemp(prefix="jaxserve-router-")
    os.makedirs(log_dir, exist_ok=True)
    role_list: list[str | None] = list(roles) if roles else [None] * num_replicas
    started = []
    replicas = [
        LaunchedReplica(index, model_path, config, overrides + ((f"engine.role={role}",) if role else ()), log_dir)
        for index, role in zip(range(num_replicas), role_list)
    ]
    for replica in replicas:
        started.append(replica.start())
    logger.info("launched %d replicas (logs in %s); waiting for them to warm up", num_replicas, log_dir)
    deadline = time.monotonic() + timeout
    try:
        for replica, process in zip(replicas, started):
            while not is_serving(replica.address, connection=connection):
                if process.poll() is not None:
                    raise ValueError(
                        f"replica {replica.index} ({replica.address}) exited with code "
                        f"{process.returncode}:\n{replica.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise ValueError(
                        f"replica {replica.index} ({replica.address}) not serving after {timeout:.0f}s "
                        f"(router.startup_timeout):\n{replica.log_tail()}"
                    )
                time.sleep(0.2)
    except BaseException:  # a failure, or SIGTERM / Ctrl-C while waiting (router/__main__.py)
        stop_replicas(replicas, timeout=5)
        raise
    return replicas


class Supervisor:
    """Starts a launched replica again, on the same port, when its process exits; the router re-adds it
    once it serves again (a fresh subscription, a fresh snapshot)."""

    def __init__(self, replicas: list[LaunchedReplica], interval: float = 0.5):
        self.replicas = replicas
        self.interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            for replica in self.replicas:
                process = replica.process
                if process is not None and replica.has_exited() and not replica.stopping and not self._stopped.is_set():
                    logger.warning(
                        "replica %d (%s) exited with code %s; starting it again",
                        replica.index,
                        replica.address,
                        process.returncode,
                    )
                    replica.start()
