"""Every refusal of the OpenAI HTTP API answers its status with OpenAI's error JSON, and the server goes on
serving: 503 while warming up and draining, 400 with the reason, 401, 404, 413, 429."""

import json
import signal
import time
from http.client import HTTPConnection

import openai
import pytest

from jaxserve.client import Connection
from jaxserve.server.openai.guard import JSON_EXPANSION
from tests.support.openai_harness import CHAT_TEMPLATE, error_of, http, openai_client, sse_events
from tests.support.server_harness import ServerProcess

API_KEY = "http-key-77a1"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY = 65536
SMALL = {"model": "llama_gqa", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0.0}
CHAT = {"model": "llama_gqa", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def warming(tmp_path_factory):
    """A server watched from its start: what /health and a completion answer before warm-up ends."""
    directory = tmp_path_factory.mktemp("openai-errors")
    (directory / "keys").write_text(API_KEY + "\n")
    # no compilation cache, so that warm-up lasts long enough to be seen
    process = ServerProcess(
        directory,
        engine={"max_num_seqs": 2, "compilation_cache_dir": None},
        server={
            "max_queued_requests": 1,
            "api_keys": str(directory / "keys"),
            "max_message_bytes": MAX_BODY,
            "chat_template": CHAT_TEMPLATE,
        },
        connection=Connection(api_key=API_KEY),
    )
    seen = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert process.process.poll() is None, process.read_log()
        try:
            health = http(process, "GET", "/health", timeout=5)
            completion = http(process, "POST", "/v1/completions", SMALL, AUTH, timeout=5)
        except OSError:  # not listening yet
            time.sleep(0.05)
            continue
        seen.append((health, completion))
        if health[0] == 200:
            break
        time.sleep(0.05)
    yield process, seen
    assert process.stop() == 0


@pytest.fixture(scope="module")
def server(warming):
    return warming[0]


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server, api_key=API_KEY) as client:
        yield client


def still_serving(client) -> None:
    assert client.completions.create(**SMALL).choices[0].finish_reason == "length"


def test_503_until_warm_up_ends(warming):
    _, seen = warming
    assert seen[-1][0][0] == 200
    (health_status, _, health_body), (status, _, body) = seen[0]
    assert health_status == 503 and "warming up" in error_of(health_body)["message"]
    assert status == 503 and error_of(body)["code"] == 503


@pytest.mark.parametrize(
    "path,body,reason",
    [
        ("/v1/completions", {**SMALL, "temperature": -1.0}, "temperature"),
        ("/v1/completions", {**SMALL, "prompt": [1] * 120, "max_tokens": 20}, "max_model_len"),
        ("/v1/completions", {**SMALL, "prompt": [1, 99999]}, "outside the vocabulary"),
        ("/v1/completions", {**SMALL, "top_p": 0.0}, "top_p"),
        ("/v1/completions", {**SMALL, "n": 3}, "engine.max_num_seqs"),
        ("/v1/completions", {**SMALL, "stop": ["x"] * 65}, "server.max_stop_strings"),
        ("/v1/completions", {**SMALL, "presence_penalty": 3}, "presence_penalty must be in [-2, 2]"),
        ("/v1/completions", {**SMALL, "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {**SMALL, "logprobs": 50}, "max_logprobs"),
        ("/v1/completions", {"model": "llama_gqa", "max_tokens": 2}, "prompt"),
        ("/v1/completions", {**SMALL, "prompt": [[1, 2], []]}, "a prompt is empty"),
        ("/v1/completions", {**SMALL, "prompt": "x" * 5000}, "server.max_prompt_bytes"),
        ("/v1/chat/completions", {"model": "llama_gqa", "messages": []}, "empty conversation"),
        (
            "/v1/chat/completions",
            {"model": "llama_gqa", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
            "top_logprobs needs logprobs",
        ),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "exactly one"),
        ("/detokenize", {"tokens": [10**6]}, "outside the vocabulary"),
        # a lone surrogate is valid JSON (json.dumps writes "\\ud800") but no text the tokenizer takes
        ("/v1/completions", {**SMALL, "prompt": "a \ud800"}, "prompt holds a lone UTF-16 surrogate"),
        ("/v1/completions", {**SMALL, "prompt": ["fine", "\udfff"]}, "prompt[1] holds a lone"),
        ("/v1/completions", {**SMALL, "stop": ["\ud800"]}, "stop string 0 holds a lone"),
        ("/v1/completions", {**SMALL, "request_id": "\ud800"}, "request_id holds a lone"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": 5, "content": "hi"}]}, "messages[0].role must be"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "a"}, {"content": "b"}]},
            "[1].role",
        ),
        ("/tokenize", {"messages": [{"role": "", "content": "a"}]}, "messages[0].role must be a role name"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt holds a lone UTF-16 surrogate"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x\ud800"}]}, "messages[0].content holds a lone"),
        *[
            ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {name: value}}, f"may not set '{name}'")
            for name, value in (
                ("messages", []),
                ("tools", []),
                ("add_generation_prompt", False),
                ("continue_final_message", True),
                ("chat_template", "{{ 1 }}"),
            )
        ],
        # as vLLM: continuing the final message and starting a new one exclude each other
        ("/v1/chat/completions", {**CHAT, "continue_final_message": True}, "exclusive"),
        ("/tokenize", {"messages": CHAT["messages"], "continue_final_message": True}, "exclusive"),
    ],
)
def test_bad_requests_are_400_with_the_reason(server, client, path, body, reason):
    status, _, answer = http(server, "POST", path, body, AUTH)
    error = error_of(answer)
    assert status == 400 and error["code"] == 400 and error["type"] == "BadRequestError"
    assert reason in error["message"], error
    still_serving(client)


def test_malformed_json_is_400(server, client):
    status, _, answer = http(server, "POST", "/v1/completions", raw=b'{"prompt": [1, 2', headers=AUTH)
    assert status == 400 and error_of(answer)["code"] == 400
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="llama_gqa", prompt=[1, 2], max_tokens=2, temperature=-1.0)
    assert refused.value.status_code == 400 and "temperature" in refused.value.message


def test_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert refused.value.body["param"] == "model" and "gpt-5" in refused.value.body["message"]
    # the refusal quotes the name: one holding a lone surrogate must still make a JSON answer
    status, _, answer = http(server, "POST", "/v1/completions", {**SMALL, "model": "gpt-\ud800"}, AUTH)
    assert status == 404 and "gpt-\ud800" in error_of(answer)["message"]
    still_serving(client)


def test_missing_or_unknown_key_is_401_and_health_needs_none(server, client):
    for headers, problem in (
        ({}, "no API key"),
        ({"Authorization": "Bearer wrong"}, "unknown API key"),
        ({"Authorization": API_KEY}, "unknown API key"),
    ):
        status, answer_headers, answer = http(server, "POST", "/v1/completions", SMALL, headers)
        error = error_of(answer)
        assert status == 401 and answer_headers["www-authenticate"] == "Bearer"
        # OpenAI's own 401: clients and chat UIs read the type and code
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_api_key", None)
        assert error["message"].startswith(problem)
    with openai_client(server, api_key="wrong") as stranger, pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    assert http(server, "GET", "/metrics")[0] == 401 and http(server, "GET", "/metrics", headers=AUTH)[0] == 200
    assert http(server, "GET", "/health")[0] == 200
    still_serving(client)


def test_no_cors_headers_unless_configured(server):
    status, headers, _ = http(server, "POST", "/v1/completions", SMALL, {**AUTH, "Origin": "https://ui.example"})
    assert status == 200 and not [name for name in headers if name.lower().startswith("access-control-")]


def test_oversized_body_is_413(server, client):
    body = json.dumps({**SMALL, "prompt": "x" * (JSON_EXPANSION * MAX_BODY)}).encode()
    status, _, answer = http(server, "POST", "/v1/completions", raw=body, headers=AUTH)
    assert status == 413 and "server.max_message_bytes" in error_of(answer)["message"]
    still_serving(client)


def open_stream(server, max_tokens: int) -> tuple[HTTPConnection, object]:
    """A streamed completion, sent; its response is read by the caller."""
    connection = HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    connection.request(
        "POST",
        "/v1/completions",
        json.dumps({**SMALL, "prompt": [1, 4, 4], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}),
        {"Content-Type": "application/json", **AUTH},
    )
    return connection, connection.getresponse()


def wait_for_metric(server, name: str, accept, timeout: float = 30) -> float:
    deadline = time.monotonic() + timeout
    while not accept(value := server.metric(name, default=0.0)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


def test_full_queue_is_429(server, client):
    # 2 running + 1 queued is the server's limit; each runs for 120 tokens, time enough to be refused
    held = [open_stream(server, max_tokens=120) for _ in range(3)]
    try:
        assert wait_for_metric(server, "jaxserve_streams_in_flight", lambda v: v == 3) == 3
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(**SMALL)
        assert refused.value.status_code == 429 and "limit" in refused.value.message
    finally:
        for connection, _ in held:
            connection.close()
    wait_for_metric(server, "jaxserve_streams_in_flight", lambda v: v == 0)
    still_serving(client)


def test_503_while_draining_and_in_flight_streams_finish(server):
    connection, response = open_stream(server, max_tokens=60)
    assert response.status == 200 and response.readline().startswith(b"data: ")
    server.process.send_signal(signal.SIGTERM)
    refused, seen = None, []  # seen: (status, seconds after the signal) of each call, to tell a failure's story
    signalled = time.monotonic()
    deadline = signalled + 30
    while refused is None and time.monotonic() < deadline:
        status, _, answer = http(server, "POST", "/v1/completions", SMALL, AUTH)
        seen.append((status, round(time.monotonic() - signalled, 2)))
        refused = (status, answer) if status == 503 else None
    assert refused is not None, f"no 503 within 30 s of SIGTERM; calls: {seen[:5]} ... {seen[-5:]} ({len(seen)})"
    assert "shutting down" in error_of(refused[1])["message"]
    events = sse_events(b"data: {}\n\n" + response.read())  # the rest of the stream
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    connection.close()
    assert server.process.wait(timeout=60) == 0


def test_a_prefill_replica_refuses_http_generation():
    """Like gRPC's FAILED_PRECONDITION: a request there would stop at its first token."""
    import asyncio
    from types import SimpleNamespace

    from jaxserve.server.openai.context import ServingContext
    from jaxserve.server.openai.errors import APIError

    context = ServingContext(metrics=None)
    context.loop = SimpleNamespace(
        draining=False, engine=SimpleNamespace(config=SimpleNamespace(disagg=SimpleNamespace(role="prefill")))
    )
    try:
        with pytest.raises(APIError) as error:
            asyncio.run(context.admit(10, lambda: ([[1, 2]], [None], None), "r", None))
        assert error.value.status == 400 and "engine.role prefill" in error.value.message
    finally:
        context.shutdown()
