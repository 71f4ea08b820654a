"""One request's way back to its client: the engine thread puts deltas, the RPC's thread takes them.

At most one message waits per stream: a delta that arrives while the client is still behind merges
into the waiting one. A slow reader therefore costs its own output (bounded by max_tokens) and
never a growing queue, and the engine thread never blocks on a client. A stream whose consumer has
been stuck handing a message to its client for longer than the idle timeout is expired: its request
is aborted and its RPC cancelled (on_expire).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from jaxserve.host.request import RequestOutput, SamplingParams


@dataclass
class Delta:
    """What a stream's next message carries: what is new since the previous one."""

    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int

    def merged(self, later: "Delta") -> "Delta":
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            (self.logprobs or []) + (later.logprobs or [])
        return Delta(self.token_ids + later.token_ids, self.text + later.text, logprobs, later.finish_reason,
                     later.num_prompt_tokens or self.num_prompt_tokens,
                     later.num_cached_tokens or self.num_cached_tokens)


class RequestStream:
    def __init__(self, handle: str, request_id: str, params: SamplingParams, num_prompt_tokens: int):
        self.handle = handle  # the engine's id for this request: unique, never reused
        self.request_id = request_id  # the client's id, or one the server made
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self.submitted_at = time.perf_counter()
        self.last_message_at: float | None = None
        self.num_sent_tokens = 0
        self.num_sent_chars = 0
        # text held back while it could still turn out to start a stop string
        self.holdback_chars = max((len(stop) for stop in params.stop), default=1) - 1
        self.finished = False  # the engine is done with it: its last delta is waiting or taken
        self.expired = False
        self.on_expire: Callable[[], None] | None = None  # cancels the RPC (set by the service)
        self.sending_since: float | None = None  # monotonic time the consumer began handing over a message
        self._pending: Delta | None = None
        self._condition = threading.Condition()

    def delta_from(self, output: RequestOutput) -> Delta:
        """The engine thread's view of what is new in `output` (called once per output)."""
        completion = output.outputs[0]
        finished = completion.finish_reason is not None
        visible = len(completion.text) if finished else max(len(completion.text) - self.holdback_chars, 0)
        visible = max(visible, self.num_sent_chars)
        delta = Delta(
            token_ids=completion.token_ids[self.num_sent_tokens:],
            text=completion.text[self.num_sent_chars:visible],
            logprobs=completion.logprobs[self.num_sent_tokens:] if completion.logprobs is not None else None,
            finish_reason=completion.finish_reason,
            num_prompt_tokens=len(output.prompt_token_ids),
            num_cached_tokens=output.num_cached_tokens)
        self.num_sent_tokens = len(completion.token_ids)
        self.num_sent_chars = visible
        return delta

    def put(self, delta: Delta) -> None:
        """Never blocks: merges into a message the consumer has not taken yet."""
        with self._condition:
            if self.finished:
                return
            self.finished = delta.finish_reason is not None
            self._pending = delta if self._pending is None else self._pending.merged(delta)
            self._condition.notify()

    def finish(self, reason: str, message: str = "") -> None:
        self.put(Delta([], message, None, reason, self.num_prompt_tokens, 0))

    def take(self, timeout: float | None = None) -> Delta | None:
        """The next message (everything new since the last one), or None after `timeout` seconds."""
        with self._condition:
            if not self._condition.wait_for(lambda: self._pending is not None, timeout):
                return None
            delta, self._pending = self._pending, None
            return delta

    def __iter__(self):
        """Messages until the one with a finish reason; time spent handing each over is watched."""
        while True:
            delta = self.take()
            self.sending_since = time.monotonic()
            yield delta
            self.sending_since = None
            if delta.finish_reason is not None:
                return

    def is_stuck(self, now: float, idle_timeout: float) -> bool:
        since = self.sending_since
        return since is not None and now - since > idle_timeout

    def expire(self) -> None:
        """Give up on a client that stopped reading (engine thread; the request is aborted by the caller)."""
        self.expired = True
        self.finish("abort", "the client did not read its stream within server.stream_idle_timeout")
        if self.on_expire is not None:
            self.on_expire()
