"""One request's way back to its client: the engine thread puts deltas, the RPC's thread takes them.

At most one message waits per stream: a delta that arrives while the client is still behind merges
into the waiting one. A slow reader therefore costs its own output (bounded by max_tokens) and
never a growing queue, and the engine thread never blocks on a client. A stream whose consumer has
been stuck handing a message to its client for longer than the idle timeout is expired: its request
is aborted and its RPC cancelled (on_expire).

A request with n > 1 streams n completions; each delta names its completion (index), and each
completion has its own waiting message. The stream ends once every completion's last delta is taken.
A consumer on an asyncio loop (the HTTP API) sets on_put to be woken instead of blocking in take().
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from jaxserve.host.request import FinishReason, RequestOutput, SamplingParams


@dataclass
class Delta:
    """What a stream's next message carries: what is new since the previous one."""

    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    index: int = 0  # which of the request's n completions this continues
    # With SamplingParams.prompt_logprobs, on one delta of each completion (its first once the prompt is
    # scored): the prompt's token ids and RequestOutput.prompt_logprobs (None first)
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    stop_reason: int | str | None = None  # on the last delta: the stop string or stop token that ended it

    @property
    def carries_news(self) -> bool:
        """Something new for its client (tokens, text or the end); the engine loop delivers only such deltas."""
        return bool(self.token_ids or self.text or self.finish_reason is not None)

    def merged(self, later: Delta) -> Delta:
        logprobs = (
            None if self.logprobs is None and later.logprobs is None else (self.logprobs or []) + (later.logprobs or [])
        )
        return Delta(
            self.token_ids + later.token_ids,
            self.text + later.text,
            logprobs,
            later.finish_reason,
            later.num_prompt_tokens or self.num_prompt_tokens,
            later.num_cached_tokens or self.num_cached_tokens,
            self.index,
            self.prompt_token_ids or later.prompt_token_ids,
            self.prompt_logprobs or later.prompt_logprobs,
            later.stop_reason,
        )


class RequestStream:
    def __init__(self, handle: str, request_id: str, params: SamplingParams, num_prompt_tokens: int):
        self.handle = handle  # the engine's id for this request: unique, never reused
        self.request_id = request_id  # the client's id, or one the server made
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None  # when the request's first token was delivered (TTFT)
        self.last_token_at: list[float | None] = [None] * params.n  # per completion: its previous delta's (ITL)
        self.num_sent_tokens = [0] * params.n  # per completion
        self.num_sent_chars = [0] * params.n
        self._made_final: set[int] = set()  # completions whose last delta delta_from has made
        self._prompt_scored: set[int] = set()  # completions whose delta has carried the prompt logprobs
        self._unfinished = set(range(params.n))  # completions whose last delta has not been put
        # text held back while it could still turn out to start a stop string
        self.holdback_chars = max((len(stop) for stop in params.stop or ()), default=1) - 1
        self.finished = False  # the engine is done with it: its last delta is waiting or taken
        # what an "error" finish answers over HTTP: the engine failed (500), or, in the router, the status
        # the replica's refusal stands for (router/http_api.py)
        self.error_status = 500
        self.expired = False
        # why the server ended it unfinished as it shut down (EngineLoop.cut_off_all), or "": its abort is then an
        # error to the client, gRPC's UNAVAILABLE and HTTP's error_status (503), with this message (the abort's
        # delta carries it too, after any text the client had not taken yet)
        self.cut_off = ""
        self.on_expire: Callable[[], None] | None = None  # cancels the RPC (set by the service)
        self.sending_since: float | None = None  # monotonic time the consumer began handing over a message
        self.on_put: Callable[[], None] | None = None  # wakes an asyncio consumer (engine thread; must not block)
        self._pending: dict[int, Delta] = {}  # by completion index
        self._condition = threading.Condition()

    def delta_from(self, output: RequestOutput, index: int = 0) -> Delta | None:
        """The engine thread's view of what is new in completion `index` of `output` (called once per
        output and completion); None once that completion's last delta has been made."""
        if index in self._made_final:
            return None
        completion = output.outputs[index]
        finished = completion.finish_reason is not None
        sent_tokens, sent_chars = self.num_sent_tokens[index], self.num_sent_chars[index]
        visible = len(completion.text) if finished else max(len(completion.text) - self.holdback_chars, 0)
        visible = max(visible, sent_chars)
        delta = Delta(
            token_ids=completion.token_ids[sent_tokens:],
            text=completion.text[sent_chars:visible],
            logprobs=completion.logprobs[sent_tokens:] if completion.logprobs is not None else None,
            finish_reason=completion.finish_reason,
            num_prompt_tokens=len(output.prompt_token_ids),
            num_cached_tokens=output.num_cached_tokens,
            index=index,
            stop_reason=completion.stop_reason,
        )
        scored = output.prompt_logprobs
        # only on a delta that is delivered (one with nothing new for its client is dropped): a completion still
        # prefilling when the scores complete would never get them
        if (
            delta.carries_news
            and scored is not None
            and len(scored) == len(output.prompt_token_ids)
            and index not in self._prompt_scored
        ):
            self._prompt_scored.add(index)
            delta.prompt_token_ids, delta.prompt_logprobs = list(output.prompt_token_ids), scored
        self.num_sent_tokens[index] = len(completion.token_ids)
        self.num_sent_chars[index] = visible
        if finished:
            self._made_final.add(index)
        return delta

    def put(self, delta: Delta) -> None:
        """Never blocks: merges into a message the consumer has not taken yet."""
        with self._condition:
            if delta.index not in self._unfinished:
                return
            if delta.finish_reason is not None:
                self._unfinished.discard(delta.index)
                self.finished = not self._unfinished
            waiting = self._pending.get(delta.index)
            self._pending[delta.index] = delta if waiting is None else waiting.merged(delta)
            self._condition.notify()
        if self.on_put is not None:
            self.on_put()

    def finish(self, reason: FinishReason, message: str = "") -> None:
        """End every completion still running (an abort, an error, an expiry)."""
        for index in sorted(self._unfinished):
            self.put(Delta([], message, None, reason, self.num_prompt_tokens, 0, index))

    def take(self, timeout: float | None = None) -> Delta | None:
        """The next message (everything new in one completion since its last one), or None after
        `timeout` seconds."""
        with self._condition:
            if not self._condition.wait_for(lambda: self._pending, timeout):
                return None
            return self._pending.pop(min(self._pending))

    def __iter__(self):
        """Messages until every completion's last one; time spent handing each over is watched."""
        num_finished = 0
        while num_finished < len(self.num_sent_tokens):
            delta = self.take()
            if delta is None:  # never: take waits as long as it must without a timeout
                continue
            self.sending_since = time.monotonic()
            yield delta
            self.sending_since = None
            num_finished += delta.finish_reason is not None

    def is_stuck(self, now: float, idle_timeout: float) -> bool:
        since = self.sending_since
        return since is not None and now - since > idle_timeout

    def expire(self) -> None:
        """Give up on a client that stopped reading (engine thread; the request is aborted by the caller)."""
        self.expired = True
        self.finish(FinishReason.ABORT, "the client did not read its stream within server.stream_idle_timeout")
        if self.on_expire is not None:
            self.on_expire()
