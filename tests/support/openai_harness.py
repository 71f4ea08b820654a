"""The OpenAI HTTP API of a ServerProcess, as clients see it: the real openai client, raw HTTP, SSE."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request

import openai

# A template the fixture tokenizers can render (the fixtures have none of their own), as LLM.chat's test uses.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}bot:{% endif %}"
)


def base_url(server, scheme: str = "http") -> str:
    return f"{scheme}://127.0.0.1:{server.http_port}"


def openai_client(server, api_key: str = "unused", **options) -> openai.OpenAI:
    # no retries: a refusal must reach the test as it was answered
    return openai.OpenAI(base_url=base_url(server) + "/v1", api_key=api_key, max_retries=0, timeout=120, **options)


def async_openai_client(server, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(server) + "/v1", api_key=api_key, max_retries=0, timeout=300)


def http(
    server,
    method: str,
    path: str,
    body=None,
    headers: dict | None = None,
    raw: bytes | None = None,
    scheme: str = "http",
    context: ssl.SSLContext | None = None,
    timeout: float = 60,
) -> tuple[int, dict, bytes]:
    """(status, headers, body bytes) of one plain HTTP call; error statuses are returned, not raised."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(
        base_url(server, scheme) + path,
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def error_of(body: bytes) -> dict:
    """OpenAI's error JSON, checked for its shape."""
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def sse_events(body: bytes) -> list:
    """The data payloads of a server-sent event stream, [DONE] as the string."""
    events = []
    for block in body.decode().split("\n\n"):
        block = block.strip()
        if block:
            assert block.startswith("data: "), block
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
