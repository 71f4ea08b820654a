"""A server with mutual TLS and API keys: plaintext, unknown client certificates, missing and wrong
keys are refused; health answers without a key; metrics sit behind the same TLS and keys."""

import ssl
import urllib.error

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.client import Client, Connection
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.proto import jaxserve_pb2_grpc
from tests.support.certificates import make_certificates
from tests.support.server_harness import ServerProcess

API_KEY = "test-key-4f1d"


def read(path) -> bytes:
    return path.read_bytes()


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("certificates"))


def client_connection(certificates, name: str = "client", api_key: str | None = API_KEY) -> Connection:
    return Connection(
        api_key=api_key,
        root_certificates=read(certificates / "ca.pem"),
        private_key=read(certificates / f"{name}.key"),
        certificate_chain=read(certificates / f"{name}.pem"),
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory, certificates):
    directory = tmp_path_factory.mktemp("secure")
    keys = directory / "api_keys"
    keys.write_text(f"# test keys\n{API_KEY}\nsecond-key\n")
    tls = {
        "cert": str(certificates / "server.pem"),
        "key": str(certificates / "server.key"),
        "client_ca": str(certificates / "ca.pem"),
    }
    process = ServerProcess(
        directory,
        engine={"max_num_seqs": 2},
        server={"tls": tls, "api_keys": str(keys)},
        connection=client_connection(certificates),
    )
    process.wait_until_serving()
    yield process
    assert process.stop() == 0


def info(target: str, connection: Connection) -> pb.ServerInfo:
    client = Client(target, connection)
    try:
        return client.stub.GetServerInfo(pb.ServerInfoRequest(), metadata=client.metadata, timeout=10)
    finally:
        client.close()


def refused_with(target: str, connection: Connection) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        info(target, connection)
    return error.value.code()


def test_a_known_key_over_mutual_tls_is_served(server, certificates):
    served = info(server.target, client_connection(certificates))
    assert served.model == "llama_gqa" and "/" not in served.model
    assert served.mesh == "1 cpu device"
    completion = Client(server.target, client_connection(certificates)).generate(
        [1, 2, 3], max_tokens=3, temperature=0.0
    )
    assert completion.finish_reason == "length" and len(completion.token_ids) == 3


def test_missing_or_unknown_keys_are_unauthenticated(server, certificates):
    for api_key in (None, "wrong-key", API_KEY + "x"):
        assert (
            refused_with(server.target, client_connection(certificates, api_key=api_key))
            == grpc.StatusCode.UNAUTHENTICATED
        )
    client = Client(server.target, client_connection(certificates, api_key=None))
    with pytest.raises(grpc.RpcError) as error:
        list(client.stream([1, 2, 3], max_tokens=2))
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    client.close()


def test_health_needs_no_key(server, certificates):
    with grpc.secure_channel(server.target, client_connection(certificates, api_key=None).credentials()) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_and_unknown_client_certificates_are_refused(server, certificates):
    with grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as error:
            jaxserve_pb2_grpc.GenerationStub(channel).GetServerInfo(pb.ServerInfoRequest(), timeout=5)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert refused_with(server.target, client_connection(certificates, "rogue-client")) == grpc.StatusCode.UNAVAILABLE
    no_certificate = Connection(api_key=API_KEY, root_certificates=read(certificates / "ca.pem"))
    assert refused_with(server.target, no_certificate) == grpc.StatusCode.UNAVAILABLE


def test_metrics_need_the_client_certificate_and_a_key(server, certificates):
    context = ssl.create_default_context(cafile=str(certificates / "ca.pem"))
    context.load_cert_chain(str(certificates / "client.pem"), str(certificates / "client.key"))
    assert "jaxserve_requests_total" in server.metrics(tls=context)
    server.connection = Connection()  # the harness sends no key now
    try:
        with pytest.raises(urllib.error.HTTPError) as error:
            server.metrics(tls=context)
        assert error.value.code == 401
    finally:
        server.connection = client_connection(certificates)
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        server.metrics(tls=ssl.create_default_context(cafile=str(certificates / "ca.pem")))


def test_the_client_reads_a_key_file_as_the_server_reads_server_api_keys(tmp_path, capsys):
    """--api-key-file's first line was taken as the key: a server key file opening with a # comment sent the
    comment, and an empty file raised IndexError."""
    import argparse

    from jaxserve.client import add_connection_arguments, connection_from_arguments, main
    from jaxserve.server.auth import ApiKeys

    parser = argparse.ArgumentParser()
    add_connection_arguments(parser)
    keys = tmp_path / "keys.txt"
    keys.write_text("# the replicas' keys\n\n  secret1  \nsecret2\n")
    connection = connection_from_arguments(parser.parse_args(["--api-key-file", str(keys)]))
    assert connection.api_key == "secret1" and ApiKeys.from_file(str(keys)).allows("Bearer secret1")
    for text in ("", "# only a comment\n\n"):
        keys.write_text(text)
        with pytest.raises(ValueError, match=f"--api-key-file {keys} holds no key"):
            connection_from_arguments(parser.parse_args(["--api-key-file", str(keys)]))
    assert main(["hello", "--api-key-file", str(keys)]) == 2
    assert f"jaxserve.client: --api-key-file {keys} holds no key" in capsys.readouterr().err
    assert main(["hello", "--api-key-file", str(tmp_path / "missing")]) == 2
    assert "jaxserve.client: cannot read --api-key-file" in capsys.readouterr().err
