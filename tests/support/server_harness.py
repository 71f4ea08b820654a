"""Starts a real `python -m jaxserve.serve` process on free local ports for the server tests."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
import urllib.request

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.client import Connection
from jaxserve.router.launcher import free_port  # never the same port twice in one process
from tests.support.fixtures import fixture_dir


class ServerProcess:
    """`connection` is how the harness itself calls the server (TLS files, API key) when it needs one."""

    def __init__(
        self,
        tmp_path,
        engine: dict,
        server: dict | None = None,
        model: str = "llama_gqa",
        connection: Connection | None = None,
    ):
        self.port, self.metrics_port, self.http_port = free_port(), free_port(), free_port()
        self.connection = connection or Connection()
        config = {
            "model": {"path": fixture_dir(model), "dtype": "float32"},
            "engine": {"max_model_len": 128, "max_num_batched_tokens": 64, "show_progress": False, **engine},
            "server": {
                "host": "127.0.0.1",
                "port": self.port,
                "metrics_port": self.metrics_port,
                "http_port": self.http_port,
                "drain_timeout": 20,
                **(server or {}),
            },
        }
        path = tmp_path / "server.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log_path = tmp_path / "server.log"
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.serve", "--config", str(path)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=os.getcwd(),
        )
        self.target = f"127.0.0.1:{self.port}"
        self.channel = self.new_channel()
        self.health_statuses = []

    def new_channel(self, options=()) -> grpc.Channel:
        if self.connection.uses_tls:
            return grpc.secure_channel(self.target, self.connection.credentials(), options=options)
        return grpc.insecure_channel(self.target, options=options)

    def health(self, timeout: float = 2):
        # a fresh channel each time: a shared one backs off after failed connects and can sleep
        # through the whole warm-up
        with self.new_channel() as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(health_pb2.HealthCheckRequest(service="jaxserve.v1.Generation"), timeout=timeout).status

    def wait_until_serving(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"server exited early:\n{self.read_log()}"
            try:
                status = self.health()
            except grpc.RpcError:
                time.sleep(0.05)
                continue
            if not self.health_statuses or self.health_statuses[-1] != status:
                self.health_statuses.append(status)
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.05)
        raise TimeoutError(f"server did not start:\n{self.read_log()}")

    def metrics(self, tls: ssl.SSLContext | None = None) -> str:
        scheme = "https" if tls is not None else "http"
        request = urllib.request.Request(f"{scheme}://127.0.0.1:{self.metrics_port}/metrics")
        if self.connection.api_key:
            request.add_header("Authorization", f"Bearer {self.connection.api_key}")
        with urllib.request.urlopen(request, timeout=5, context=tls) as response:
            return response.read().decode()

    def metric(self, name: str, default: float | None = None) -> float:
        for line in self.metrics().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        if default is not None:
            return default
        raise KeyError(name)

    def read_log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        code = self.process.wait(timeout=60)
        self.channel.close()
        return code
