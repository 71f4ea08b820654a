"""The OpenAI-compatible HTTP API, shaped as vLLM's, beside gRPC on the same engine loop.

Data flow: uvicorn (http_server.py) runs on its own event-loop thread. A request passes the guard
(guard.py: API key, body size) and is parsed into protocol.py's models; its handler (completions.py,
chat.py) checks it against the same limits as gRPC and renders chats (server/chat_prompt.py) on a
small admission pool (context.py), then submits every prompt to the EngineLoop. The engine thread
puts deltas on the request's streams and wakes the event loop (streams.py), and the handler turns
them into server-sent events or one JSON answer (responses.py). Every refusal is OpenAI's error
JSON (errors.py). However a call ends, its streams are released, so a client that disconnects
aborts its request and frees its pages at once.
"""

from jaxserve.server.openai.app import build_app
from jaxserve.server.openai.context import ServingContext
from jaxserve.server.openai.http_server import HTTPServer

__all__ = ["HTTPServer", "ServingContext", "build_app"]
