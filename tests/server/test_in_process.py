"""A Server used inside another program (embedders, tests): stopped, or failing to start, it gives back every
port it opened and stops its threads, so that the same ports can be served again at once."""

import socket
import threading

import pytest

from jaxserve.router.launcher import free_port
from jaxserve.serve import Server
from jaxserve.server.address import bare_host, host_port, is_loopback
from jaxserve.server.config_file import load_config
from tests.support.fixtures import fixture_dir


def config(model_path: str, *extra: str):
    ports = free_port(), free_port(), free_port()
    overrides = [
        f"model.path={model_path}",
        "model.dtype=float32",
        "engine.max_model_len=64",
        "engine.max_num_seqs=2",
        "engine.max_num_batched_tokens=32",
        "engine.show_progress=false",
        f"server.port={ports[0]}",
        f"server.http_port={ports[1]}",
        f"server.metrics_port={ports[2]}",
        *extra,
    ]
    return load_config(None, overrides), ports


def assert_free(ports) -> None:
    for port in ports:
        with socket.socket() as probe:  # no SO_REUSEADDR: a port still listening fails here
            probe.bind(("127.0.0.1", port))


def server_threads() -> set[str]:
    prefixes = ("jaxserve-http", "jaxserve-metrics", "jaxserve-engine")
    return {thread.name for thread in threading.enumerate() if thread.name.startswith(prefixes)}


def test_a_failed_start_releases_its_ports():
    before = server_threads()
    serve_config, ports = config("/nonexistent/model")
    server = Server(serve_config)
    with pytest.raises(ValueError, match="does not exist"):
        server.start()
    assert_free(ports)
    assert server_threads() == before
    server.drain_and_stop()  # and stopping it anyway is harmless


def test_a_stopped_server_releases_its_ports():
    serve_config, ports = config(fixture_dir("llama_gqa"))
    server = Server(serve_config)
    server.start()
    server.drain_and_stop()
    assert_free(ports)  # the metrics port stayed bound (shutdown without server_close)


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_ipv6_hosts_with_or_without_brackets(host, caplog):
    assert is_loopback(host) and host_port(host, 1) == "[::1]:1" and bare_host(host) == "::1"
    serve_config, ports = config("/nonexistent/model", f'server.host="{host}"')
    server = Server(serve_config)  # gRPC and HTTP bind here, the metrics port in start: before the model fails
    with pytest.raises(ValueError, match="does not exist"):
        server.start()
    assert "anyone who can reach" not in caplog.text  # ::1 is loopback
    for port in ports:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", port))
