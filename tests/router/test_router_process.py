"""The router as a process and behind TLS: SIGTERM or Ctrl-C while it waits for replicas at start-up stops
it at once with exit 0, and stops the replicas it launched; router.tls and router.api_keys guard its gRPC
and HTTP ports as server.tls and server.api_keys guard a replica's, and router.replica_tls with
router.replica_api_key reach a replica that requires both. Every wait is bounded; every process is ended."""

import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
import yaml

from jaxserve.client import Client, Connection
from jaxserve.router.config import parse_config
from jaxserve.router.launcher import free_port
from jaxserve.router.server import RouterServer
from jaxserve.server.config_file import TLSConfig
from tests.support.certificates import make_certificates
from tests.support.fake_replica import FakeReplica
from tests.support.fixtures import fixture_dir

MODEL = fixture_dir("llama_gqa")
STOP_WITHIN = 15.0  # seconds from the signal to the router's exit (launched replicas get 5 s, then SIGKILL)


def start_router(tmp_path, config: dict) -> tuple[subprocess.Popen, object]:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    log = open(tmp_path / "router.log", "w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.router", "--config", str(path)], stdout=log, stderr=subprocess.STDOUT
    )
    return process, log


def wait_for_log(process, log, text: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log.seek(0)
        if text in log.read():
            return
        assert process.poll() is None, f"the router exited early:\n{log_text(log)}"
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} in the router's log within {timeout}s:\n{log_text(log)}")


def log_text(log) -> str:
    log.seek(0)
    return log.read()[-4000:]


def children(pid: int) -> list[int]:
    """Processes whose parent is pid (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_waiting_for_listed_replicas_stops_the_router_at_once(tmp_path, signum):
    silent = f"127.0.0.1:{free_port()}"  # nobody listens: the router would wait router.startup_timeout
    process, log = start_router(
        tmp_path, {"model": {"path": MODEL}, "router": {"port": 0, "startup_timeout": 300}, "replicas": [silent]}
    )
    try:
        wait_for_log(process, log, "waiting up to 300s for replicas")
        time.sleep(0.5)  # well inside the wait for GetServerInfo
        sent_at = time.monotonic()
        process.send_signal(signum)
        assert process.wait(timeout=STOP_WITHIN) == 0, log_text(log)
        assert time.monotonic() - sent_at < STOP_WITHIN
        assert "stopped while starting" in log_text(log)
    finally:
        process.kill()
        process.wait()
        log.close()


def test_sigterm_while_launched_replicas_warm_up_stops_them_too(tmp_path):
    engine = ["model.dtype=float32", "engine.max_model_len=128", "engine.show_progress=false"]
    process, log = start_router(
        tmp_path,
        {
            "model": {"path": MODEL},
            "router": {"port": 0, "startup_timeout": 300},
            "launch": {"num_replicas": 1, "set": engine, "log_dir": str(tmp_path / "replicas")},
        },
    )
    replicas = []
    try:
        wait_for_log(process, log, "launched 1 replicas")
        replicas = children(process.pid)
        assert replicas, "the router launched no replica process"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=STOP_WITHIN) == 0, log_text(log)
        assert not any(is_running(pid) for pid in replicas)
    finally:
        process.kill()
        process.wait()
        for pid in replicas:
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("certificates"))


def test_tls_and_api_keys_on_both_sides_of_the_router(tmp_path, certificates):
    """The replica requires mutual TLS and a key; so does the router, with keys of its own."""
    pem = lambda name: str(certificates / name)  # noqa: E731
    tls = TLSConfig(pem("server.pem"), pem("server.key"), pem("ca.pem"))
    replica = FakeReplica(MODEL, tls=tls, api_keys=["replica-key"]).start()
    (tmp_path / "replica-key").write_text("# the router's key to the replicas\nreplica-key\n")
    (tmp_path / "router-keys").write_text("router-key\n")
    router_section = {
        "port": 0,
        "http_port": free_port(),
        "heartbeat": 0.2,
        "startup_timeout": 30,
        "tls": {"cert": pem("server.pem"), "key": pem("server.key"), "client_ca": pem("ca.pem")},
        "api_keys": str(tmp_path / "router-keys"),
        "replica_tls": {"ca": pem("ca.pem"), "cert": pem("client.pem"), "key": pem("client.key")},
        "replica_api_key": str(tmp_path / "replica-key"),
    }
    router = RouterServer(
        parse_config({"model": {"path": MODEL}, "router": router_section, "replicas": [replica.address]})
    )
    try:
        router.start()
        read = lambda name: (certificates / name).read_bytes()  # noqa: E731
        mutual = dict(
            root_certificates=read("ca.pem"), private_key=read("client.key"), certificate_chain=read("client.pem")
        )
        target = f"127.0.0.1:{router.port}"
        client = Client(target, Connection(api_key="router-key", **mutual))
        assert client.generate([1, 2, 3], max_tokens=2).token_ids == [5, 6]
        client.close()
        stranger = Client(target, Connection(api_key="replica-key", **mutual))  # the replica's key is not the router's
        with pytest.raises(grpc.RpcError) as refused:
            stranger.generate([1, 2, 3], max_tokens=2)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stranger.close()
        context = ssl.create_default_context(cafile=pem("ca.pem"))
        context.load_cert_chain(pem("client.pem"), pem("client.key"))
        url = f"https://127.0.0.1:{router.http_server.port}/v1/completions"
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
        for key, status in (("router-key", 200), ("wrong", 401)):
            request = urllib.request.Request(
                url, body, {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
            )
            try:
                with urllib.request.urlopen(request, timeout=30, context=context) as response:
                    assert (response.status, json.loads(response.read())["choices"][0]["text"]) == (status, "ab")
            except urllib.error.HTTPError as error:
                assert error.code == status
    finally:
        router.stop()
    plain = parse_config(
        {"model": {"path": MODEL}, "router": {"port": 0, "startup_timeout": 3}, "replicas": [replica.address]}
    )
    try:  # without the replica's credentials the router cannot start: a clear error, not a hang
        with pytest.raises(ValueError, match="did not answer GetServerInfo"):
            RouterServer(plain).start()
    finally:
        replica.stop()


def test_unreadable_connection_files_are_clear_errors(tmp_path):
    config = {"model": {"path": MODEL}, "replicas": ["127.0.0.1:1"]}
    with pytest.raises(ValueError, match="router.replica_tls must be a mapping with ca"):
        parse_config({**config, "router": {"replica_tls": {"cert": "c.pem"}}})
    with pytest.raises(ValueError, match="router.tls must be a mapping"):
        parse_config({**config, "router": {"tls": {"cert": "c.pem"}}})
    missing = parse_config({**config, "router": {"replica_api_key": str(tmp_path / "none")}})
    with pytest.raises(ValueError, match="cannot read router.replica_api_key"):
        RouterServer(missing).start()
