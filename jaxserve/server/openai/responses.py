"""Response pieces shared by completions and chat: choices gathered from deltas, usage, logprobs in
both of OpenAI's shapes, and server-sent events.

An event stream releases its streams around the whole response, not in its generator: Starlette
stops the response of a client that disconnects by cancelling it, and a generator cancelled before
its first step never runs its own cleanup. So the engine's request is aborted (its pages freed) in
every case: finished, disconnected, expired or failed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.responses import StreamingResponse

from jaxserve.server.openai.errors import APIError, error_body
from jaxserve.server.openai.streams import StreamExpired, StreamGroup
from jaxserve.server.request_stream import Delta, RequestStream

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must not buffer the stream
logger = logging.getLogger("jaxserve.openai")


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStreamResponse(StreamingResponse):
    def __init__(self, events, group: StreamGroup):
        super().__init__(ended_by_an_error_event(events), media_type="text/event-stream", headers=SSE_HEADERS)
        self.group = group

    async def __call__(self, scope, receive, send) -> None:
        # This task, not the one Starlette streams the events on: cancelling that one alone would leave
        # this one waiting for a disconnect that a stuck client never sends.
        self.group.cancel_on_expiry()
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            if not self.group.expired:
                raise  # the server is stopping
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # the cancellation ends here, as StreamExpired
            raise StreamExpired("the client stopped reading (server.stream_idle_timeout)") from None
        finally:
            self.group.release()


async def ended_by_an_error_event(events):
    """The events; a failure while making them (a server bug) ends the stream as a refusal does, with an error
    event and [DONE], rather than cutting the connection mid-body (clients then see a protocol error)."""
    try:
        async for event in events:
            yield event
    except Exception as error:  # (a cancellation is no Exception: it goes on up)
        logger.exception("a streamed response failed")
        status, message = (error.status, error.message) if isinstance(error, APIError) else (500, repr(error))
        yield sse(error_body(status, message))
        yield DONE


def response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


@dataclass
class Choice:
    """One completion, gathered from its deltas (a non-streamed response)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # SamplingParams.prompt_logprobs
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.prompt_logprobs = self.prompt_logprobs or delta.prompt_logprobs
        self.stop_reason = delta.stop_reason if delta.stop_reason is not None else self.stop_reason


@dataclass
class UsageCounter:
    """Prompt tokens count once per prompt (not once per choice), as OpenAI and vLLM count them."""

    prompt_tokens: dict[int, int] = field(default_factory=dict)  # by prompt position
    cached_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0

    @classmethod
    def of_streams(cls, streams) -> UsageCounter:
        """Starting from the streams' prompts (continuous usage stats count them from the first chunk)."""
        return cls(prompt_tokens={position: stream.num_prompt_tokens for position, stream in enumerate(streams)})

    def add(self, position: int, delta: Delta) -> None:
        self.prompt_tokens[position] = delta.num_prompt_tokens
        self.cached_tokens[position] = max(self.cached_tokens.get(position, 0), delta.num_cached_tokens)
        self.completion_tokens += len(delta.token_ids)

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }


def failure(delta: Delta, stream: RequestStream) -> str | None:
    """The message when the engine failed the request (finish reason "error"), or when the server cut it off as
    it shut down (an "abort" of a stream marked cut_off); either answers the stream's error_status."""
    if delta.finish_reason == "error":
        return delta.text or "the engine failed while running this request"
    if delta.finish_reason == "abort" and stream.cut_off:
        return stream.cut_off
    return None


async def gather_choices(group: StreamGroup, choice_index) -> tuple[dict[int, Choice], UsageCounter]:
    """Every delta of a non-streamed response, gathered per choice (choice_index(position, delta)); the
    group's streams are released however it ends."""
    choices, usage = defaultdict(Choice), UsageCounter()
    try:
        async for position, delta in group.deltas():
            if (message := failure(delta, group.streams[position])) is not None:
                raise APIError(group.streams[position].error_status, message)
            usage.add(position, delta)
            choices[choice_index(position, delta)].add(delta)
    finally:
        group.release()
    return choices, usage


class TokenText:
    """Each token's own text (as vLLM shows tokens in logprobs), decoded once per token id; and its bytes, which
    for a token holding part of a UTF-8 character are its raw bytes (joined over the character's tokens they
    make the character, what OpenAI's `bytes` is for) where vLLM gives those of the U+FFFD its text shows."""

    def __init__(self, tokenizer, raw_bytes: Callable[[int], bytes | None] | None = None):
        self.tokenizer = tokenizer
        self.raw_bytes = raw_bytes
        self._cache: dict[int, str] = {}

    @classmethod
    async def for_engine(cls, engine) -> TokenText:
        """With the grammar engine's byte table where the engine has one (fake and router engines do not), built
        off the event loop: the first build reads the whole vocabulary (0.3 s for 49k tokens)."""
        constraints = getattr(engine, "constraints", None)
        if constraints is None:
            return cls(engine.tokenizer)
        await asyncio.to_thread(constraints.token_bytes, 0)
        return cls(engine.tokenizer, constraints.token_bytes)

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"
            self._cache[token_id] = text
        return text

    def bytes(self, token_id: int) -> list[int]:
        text = self(token_id)
        if "\ufffd" in text and self.raw_bytes is not None:
            raw = self.raw_bytes(token_id)
            if raw:
                return list(raw)
        return list(text.encode("utf-8"))


def completion_logprobs(
    token_text: TokenText, token_ids: list[int], logprobs: list[dict[int, float] | None], text_offset: int
) -> dict:
    """/v1/completions' shape: parallel lists; text_offset counts from the start of the choice's text. An
    entry without logprobs (an echoed prompt's first token) is null, as OpenAI's."""
    tokens, offsets = [], []
    for token_id in token_ids:
        tokens.append(token_text(token_id))
        offsets.append(text_offset)
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [None if top is None else top[t] for t, top in zip(token_ids, logprobs)],
        "top_logprobs": [None if top is None else _by_text(token_text, top) for top in logprobs],
        "text_offset": offsets,
    }


def _by_text(token_text: TokenText, top: dict[int, float]) -> dict[str, float]:
    """Keyed by token text, most likely first; tokens that decode alike keep the likeliest's logprob."""
    by_text: dict[str, float] = {}
    for token_id, logprob in _ranked(top):
        by_text.setdefault(token_text(token_id), logprob)
    return by_text


def chat_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[dict[int, float]], num_top: int) -> dict:
    """/v1/chat/completions' shape: one entry per token with its num_top most likely alternatives."""

    def entry(token_id: int, logprob: float) -> dict:
        return {"token": token_text(token_id), "logprob": logprob, "bytes": token_text.bytes(token_id)}

    return {
        "content": [
            {**entry(t, top[t]), "top_logprobs": [entry(a, v) for a, v in _ranked(top)[:num_top]]}
            for t, top in zip(token_ids, logprobs)
        ]
    }


def within_top(entry: dict, num_top: int, token_id: int) -> dict:
    """An entry scored with more alternatives cut to its num_top most likely, and its own token."""
    ranked = _ranked(entry)
    return {t: v for i, (t, v) in enumerate(ranked) if i < num_top or t == token_id}


def vllm_prompt_logprobs(
    token_text: TokenText, prompt_logprobs: list, num_top: int, token_ids: list[int] | None = None
) -> list[dict | None]:
    """vLLM's `prompt_logprobs` field: per prompt token (None first) {token id: {logprob, rank, decoded_token}} for
    the token and its num_top most likely alternatives. token_ids: the prompt's, where the engine scored more
    alternatives than num_top (echo's logprobs asked more)."""

    def keep(position: int, token_id: int, logprob) -> bool:
        rank = getattr(logprob, "rank", None)
        return token_ids is None or rank is None or rank <= num_top or token_id == token_ids[position]

    return [
        None
        if entry is None
        else {
            str(token_id): {
                "logprob": max(float(logprob), -9999.0),  # -inf as vLLM writes it: JSON has no infinity
                "rank": getattr(logprob, "rank", None),
                "decoded_token": token_text(token_id),
            }
            for token_id, logprob in _ranked(entry)
            if keep(position, token_id, logprob)
        }
        for position, entry in enumerate(prompt_logprobs)
    ]


def _ranked(top: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(top.items(), key=lambda item: -item[1])
