"""The checks every HTTP request passes before the app sees it: its API key (401) and its size (413).

The body is read here, up to the limit and no further, then handed to the app as if unread: a
larger one is refused without buffering it (a declared Content-Length over the limit before any of
it is read), so a client cannot make the server hold more than the limit per request. /health
needs no key, as gRPC health does not: probes from load balancers carry none.
"""

from __future__ import annotations

import json

from jaxserve.server.auth import ApiKeys
from jaxserve.server.openai.errors import authentication_error_body, error_body

EXEMPT_PATHS = ("/health",)
# A body may be this many times server.max_message_bytes (the gRPC bound): JSON spends up to 6 bytes
# (12 for a character outside the BMP) on a character that protobuf spends 1-4 bytes on, and chat
# messages carry their keys, so a request within every cap can be several times its protobuf size.
JSON_EXPANSION = 4


async def send_error(send, status: int, error: dict, headers: tuple = ()) -> None:
    """error: OpenAI's error JSON (errors.py)."""
    body = json.dumps(error).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware around the whole app; on_refusal(status) counts refusals."""

    def __init__(self, app, api_keys: ApiKeys | None, max_message_bytes: int, on_refusal=lambda status: None):
        self.app = app
        self.api_keys = api_keys
        self.max_body_bytes = JSON_EXPANSION * max_message_bytes
        self.on_refusal = on_refusal

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if self.api_keys is not None and scope["path"] not in EXEMPT_PATHS:
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            if not self.api_keys.allows(authorization):
                self.on_refusal(401)
                problem = "unknown API key" if authorization else "no API key"
                return await send_error(
                    send,
                    401,
                    authentication_error_body(f"{problem}: send 'Authorization: Bearer KEY' with a key of this server"),
                    ((b"www-authenticate", b"Bearer"),),
                )
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return await self._too_large(send)
        body = await self._read_body(receive)
        if body is None:
            return await self._too_large(send)
        return await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive) -> bytes | None:
        """The whole body, or None past max_body_bytes (or when the client left while sending it)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, send) -> None:
        self.on_refusal(413)
        await send_error(
            send,
            413,
            error_body(
                413,
                f"the request body is larger than {self.max_body_bytes} bytes "
                f"({JSON_EXPANSION} x server.max_message_bytes)",
            ),
        )


def _replay(body: bytes, receive):
    """A receive that first gives the body read already, then the client's later messages (its
    disconnect), so the app still learns when the client leaves."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
