"""The router's OpenAI HTTP API in front of a stand-in replica (tests/support/fake_replica.py): replica
refusals answer the HTTP status their gRPC code stands for, with OpenAI's error body, streamed or not; the
replica's system_fingerprint comes through; and the whole router process, HTTP API included, runs
without importing JAX."""

import json
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest

from jaxserve.router.config import parse_config
from jaxserve.router.launcher import free_port
from jaxserve.router.server import RouterServer
from tests.support.fake_replica import SYSTEM_FINGERPRINT, FakeReplica
from tests.support.fixtures import fixture_dir

MODEL = fixture_dir("llama_gqa")


@pytest.fixture(scope="module")
def routed():
    replica = FakeReplica(MODEL).start()
    router = RouterServer(
        parse_config(
            {
                "model": {"path": MODEL},
                "router": {"port": 0, "http_port": free_port(), "heartbeat": 0.2, "startup_timeout": 30},
                "replicas": [replica.address],
            }
        )
    )
    try:
        router.start()
        yield replica, router
    finally:
        router.stop()
        replica.stop()


def post(router, body: dict, timeout: float = 30.0) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{router.http_server.port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_a_completion_carries_the_replicas_system_fingerprint(routed):
    replica, router = routed
    replica.refusal = None
    status, text = post(router, {"prompt": [1, 2, 3], "max_tokens": 2})
    assert status == 200, text
    body = json.loads(text)
    assert body["system_fingerprint"] == SYSTEM_FINGERPRINT
    assert body["choices"][0]["text"] == "ab"


def test_a_long_prompt_with_truncate_prompt_tokens_reaches_the_replica_truncated(routed):
    """truncate_prompt_tokens over the router (max_model_len 128): a text prompt longer than that, over HTTP, and
    token ids, over gRPC, are accepted and forwarded as their last k tokens (the router checked, counted and
    routed the untruncated prompt: the text was refused as more than max_model_len)."""
    from jaxserve.client import Client

    replica, router = routed
    replica.refusal = None
    text = " ".join(f"word{number}" for number in range(200))
    status, answer = post(router, {"prompt": text, "max_tokens": 2, "truncate_prompt_tokens": 7})
    assert status == 200, answer
    tokenizer = router.http_loop.engine.tokenizer
    assert list(replica.received[-1].token_ids) == tokenizer.encode(text)[-7:]
    long = [5 + number % 300 for number in range(300)]
    client = Client(f"127.0.0.1:{router.port}")
    try:
        client.generate(long, max_tokens=2, truncate_prompt_tokens=9)
    finally:
        client.close()
    assert list(replica.received[-1].token_ids) == long[-9:]


@pytest.mark.parametrize(
    "code, status, error_type",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "BadRequestError"),
        (grpc.StatusCode.NOT_FOUND, 404, "NotFoundError"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "TooManyRequestsError"),
        (grpc.StatusCode.UNAUTHENTICATED, 401, "UnauthorizedError"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "GatewayTimeoutError"),
        (grpc.StatusCode.FAILED_PRECONDITION, 400, "BadRequestError"),
    ],
)
def test_a_replicas_refusal_answers_its_http_status(routed, code, status, error_type):
    replica, router = routed
    replica.refusal = (code, "the replica says no")
    try:
        answered, text = post(router, {"prompt": [1, 2, 3], "max_tokens": 2})
        assert answered == status, text
        error = json.loads(text)["error"]
        assert error["code"] == status and error["type"] == error_type
        assert "the replica says no" in error["message"]
        # streamed, the response has begun before the replica refuses: the error event carries the status
        answered, text = post(router, {"prompt": [1, 2, 3], "max_tokens": 2, "stream": True})
        assert answered == 200
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == status and events[-1]["error"]["type"] == error_type
    finally:
        replica.refusal = None


NO_JAX_SCRIPT = """
import json, sys, urllib.request
import jaxserve.router.__main__
from jaxserve.client import Client
from jaxserve.router.config import parse_config
from jaxserve.router.launcher import free_port
from jaxserve.router.server import RouterServer
from tests.support.fake_replica import FakeReplica
model = sys.argv[1]
replica = FakeReplica(model).start()
config = {"model": {"path": model}, "router": {"port": 0, "http_port": free_port(), "metrics_port": free_port()},
          "replicas": [replica.address]}
router = RouterServer(parse_config(config))
router.start()
try:
    assert Client(f"127.0.0.1:{router.port}").generate([1, 2, 3], max_tokens=2).token_ids == [5, 6]
    request = urllib.request.Request(f"http://127.0.0.1:{router.http_server.port}/v1/completions",
        json.dumps({"prompt": "hello there", "max_tokens": 2}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:  # tokenized by the router
        assert json.loads(response.read())["choices"][0]["text"] == "ab"
finally:
    router.stop()
    replica.stop()
loaded = sorted(name for name in sys.modules if name.split(".")[0] in ("jax", "jaxlib", "flax"))
print("JAX MODULES:", loaded)
sys.exit(1 if loaded else 0)
"""


def test_the_router_process_imports_no_jax():
    """Imports the router's entry point, starts its gRPC, HTTP and metrics servers over a replica, serves a
    completion through each API (the HTTP one tokenizes text): jax, jaxlib and flax must never load."""
    result = subprocess.run([sys.executable, "-c", NO_JAX_SCRIPT, MODEL], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "JAX MODULES: []" in result.stdout
