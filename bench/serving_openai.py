"""bench/serving.py's client for the OpenAI HTTP API: the same stream() as jaxserve.client.AsyncClient,
over POST /v1/completions with stream = true, so that one load generator drives either API.

It asks for vLLM's return_token_ids, so that tokens are counted (and TTFT taken at the first token)
exactly as over gRPC, and for stream_options.include_usage, whose last chunk carries the cached
prompt tokens. Chunks are parsed as plain JSON (the openai client's raw streaming response): building
the client's pydantic objects per chunk would charge client time to the HTTP path.
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass, field

import openai


@dataclass
class Message:
    """What bench/serving.py reads of a gRPC GenerateResponse."""

    token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0


class OpenAIStreamClient:
    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ):
        """TLS as bench/serving.py's --tls-* arguments give it (PEM files); the API key as a string."""
        options = {}
        if tls_ca is not None:
            context = ssl.create_default_context(cafile=tls_ca)
            if tls_cert is not None:
                context.load_cert_chain(tls_cert, tls_key)
            options["http_client"] = openai.DefaultAsyncHttpxClient(verify=context)
        self.model = model
        self.client = openai.AsyncOpenAI(
            base_url=base_url.rstrip("/") + "/v1", api_key=api_key or "none", max_retries=0, timeout=600, **options
        )

    async def stream(
        self, prompt, max_tokens: int, temperature: float = 0.0, ignore_eos: bool = False, session_id: str = ""
    ):
        extra = {"ignore_eos": ignore_eos, "return_token_ids": True}
        if session_id:
            extra["session_id"] = session_id
        async with self.client.completions.with_streaming_response.create(
            model=self.model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        ) as response:
            async for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if chunk["choices"]:
                    yield Message(token_ids=chunk["choices"][0].get("token_ids") or [])
                elif chunk.get("usage"):
                    yield Message(num_cached_tokens=chunk["usage"]["prompt_tokens_details"]["cached_tokens"])

    async def close(self) -> None:
        await self.client.close()
