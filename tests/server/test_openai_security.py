"""The HTTP API under server.tls (mutual) and server.api_keys, as the gRPC port is: HTTPS with a client
certificate the CA signed and a key; plaintext, unknown certificates and missing keys refused."""

import ssl
import urllib.error

import openai
import pytest

from jaxserve.client import Connection
from tests.support.certificates import make_certificates
from tests.support.openai_harness import base_url, error_of, http
from tests.support.server_harness import ServerProcess

API_KEY = "tls-key-5c2e"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SMALL = {"model": "llama_gqa", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0.0}


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    return make_certificates(tmp_path_factory.mktemp("certificates"))


def tls_context(certificates, name: str | None = "client") -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certificates / "ca.pem"))
    if name is not None:
        context.load_cert_chain(str(certificates / f"{name}.pem"), str(certificates / f"{name}.key"))
    return context


@pytest.fixture(scope="module")
def server(tmp_path_factory, certificates):
    directory = tmp_path_factory.mktemp("openai-tls")
    (directory / "keys").write_text(API_KEY + "\n")
    tls = {
        "cert": str(certificates / "server.pem"),
        "key": str(certificates / "server.key"),
        "client_ca": str(certificates / "ca.pem"),
    }
    read = lambda name: (certificates / name).read_bytes()  # noqa: E731
    connection = Connection(
        api_key=API_KEY,
        root_certificates=read("ca.pem"),
        private_key=read("client.key"),
        certificate_chain=read("client.pem"),
    )
    process = ServerProcess(
        directory,
        engine={"max_num_seqs": 2},
        server={"tls": tls, "api_keys": str(directory / "keys")},
        connection=connection,
    )
    process.wait_until_serving()
    yield process
    assert process.stop() == 0


def test_https_with_a_client_certificate_and_a_key(server, certificates):
    context = tls_context(certificates)
    with openai.OpenAI(
        base_url=base_url(server, "https") + "/v1",
        api_key=API_KEY,
        max_retries=0,
        http_client=openai.DefaultHttpxClient(verify=context),
    ) as client:
        assert client.completions.create(**SMALL).choices[0].finish_reason == "length"
    status, _, body = http(server, "POST", "/v1/completions", SMALL, scheme="https", context=context)
    assert status == 401 and error_of(body)["code"] == "invalid_api_key"
    assert http(server, "GET", "/health", scheme="https", context=context)[0] == 200


@pytest.mark.parametrize("scheme,certificate", [("http", None), ("https", None), ("https", "rogue-client")])
def test_plaintext_and_unknown_certificates_are_refused(server, certificates, scheme, certificate):
    context = tls_context(certificates, certificate) if scheme == "https" else None
    with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError, OSError)):
        status, _, _ = http(server, "POST", "/v1/completions", SMALL, AUTH, scheme=scheme, context=context, timeout=10)
        assert status != 200  # a plaintext request to a TLS port gets no HTTP answer at all
