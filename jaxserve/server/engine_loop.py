"""The engine on its own thread: handlers submit and release streams; the loop steps and streams deltas back.

Every request gets a handle, the engine's id for it, made here and never reused: the client's
request_id is only a label, so two clients may use the same one, and an abort (a cancelled or
finished RPC, an expired stream) reaches exactly the request it was meant for.

A stream counts toward the in-flight limit from submit until its RPC ends (release), not until the
engine finishes it: a client that stops reading keeps its slot until it reads, goes away, or is
expired after stream_idle_timeout.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxserve.host.request import FinishReason, RequestOutput, SamplingParams
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.request_stream import Delta, RequestStream

if TYPE_CHECKING:  # only annotations: the router imports this module's refusals and must not load JAX
    from jaxserve.engine import Engine

logger = logging.getLogger(__name__)

EXPIRY_CHECK_INTERVAL = 0.25  # seconds between looks for streams stuck on a client that does not read


class Overloaded(Exception):
    """More requests in flight than the server's queue limit."""


class Draining(Exception):
    """The server is shutting down and takes no new requests."""


@dataclass(frozen=True)
class AddRequest:
    """Queue a validated request on the engine (or hand it to `admit`, e.g. a KV handover's)."""

    stream: RequestStream
    prompt_token_ids: list[int]
    session_id: str | None
    admit: Callable | None


@dataclass(frozen=True)
class CallOnLoop:
    """Run function(engine) between steps; its result or exception goes to the future."""

    function: Callable[[Any], Any]
    future: concurrent.futures.Future


@dataclass(frozen=True)
class AbortStream:
    """The stream's RPC ended before its request finished: abort the request."""

    stream: RequestStream


LoopCommand = AddRequest | CallOnLoop | AbortStream


class EngineLoop:
    def __init__(
        self, engine: Engine, metrics: ServerMetrics, max_queued_requests: int, stream_idle_timeout: float = 30.0
    ):
        self.engine = engine
        self.metrics = metrics
        self.description = engine.describe()  # fixed once warm: read by info calls without the engine
        self.stats = engine.stats()  # refreshed on the loop thread after every change; read by info calls
        self.max_in_flight = self.description.max_num_seqs + max_queued_requests
        self.stream_idle_timeout = stream_idle_timeout
        self.streams: dict[str, RequestStream] = {}  # by handle, from submit until release
        self._num_reserved = 0  # submits past the capacity check, still tokenizing
        self._commands: queue.SimpleQueue[LoopCommand] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._lock = threading.Lock()  # guards streams, reservations and draining against handler threads
        self._draining = False
        self._stopped = False
        self._handles = itertools.count()
        self._next_expiry_check = 0.0
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self.streams)

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str = "",
        session_id: str | None = None,
        admit=None,
    ) -> RequestStream:
        """Check capacity, validate (raising ValueError) and queue a request; called from handler threads.
        admit(engine, stream, prompt_token_ids), when given, runs on the loop thread instead of add_request
        (a decode replica admits a handed-over request so; jaxserve/disagg/decode_service.py)."""
        with self._lock:
            if self._draining:
                raise Draining("the server is shutting down")
            in_flight = len(self.streams) + self._num_reserved
            if in_flight >= self.max_in_flight:
                raise Overloaded(f"{in_flight} requests in flight, the limit is {self.max_in_flight}")
            self._num_reserved += 1
        try:
            if params.n > self.description.max_num_seqs:  # n sequences for one in-flight slot: bounded
                raise ValueError(
                    f"n ({params.n}) is more than the engine runs at once "
                    f"(engine.max_num_seqs = {self.description.max_num_seqs})"
                )
            prompt_token_ids = self.engine.tokenize(prompt, params)  # read-only: safe off the loop thread
            self.engine.validate(prompt_token_ids, params)
            request_id = request_id or f"req-{uuid.uuid4().hex}"
            stream = RequestStream(f"{request_id}#{next(self._handles)}", request_id, params, len(prompt_token_ids))
            with self._lock:
                self.streams[stream.handle] = stream
                self.metrics.streams_in_flight.set(len(self.streams))
        finally:
            with self._lock:
                self._num_reserved -= 1
        self.metrics.prompt_tokens.inc(len(prompt_token_ids))
        self._commands.put(AddRequest(stream, prompt_token_ids, session_id, admit))
        self._wakeup.set()
        return stream

    def call(self, function) -> concurrent.futures.Future:
        """Run function(engine) on the loop thread between steps; any thread. Its result or exception
        comes back in the future."""
        future = concurrent.futures.Future()
        self._commands.put(CallOnLoop(function, future))
        self._wakeup.set()
        return future

    def release(self, stream: RequestStream) -> None:
        """The stream's RPC has ended (finished, cancelled, expired): free its slot, and abort its request
        if the engine still runs it. Any thread; returns at once."""
        with self._lock:
            self.streams.pop(stream.handle, None)
            self.metrics.streams_in_flight.set(len(self.streams))
        if not stream.finished:
            self._commands.put(AbortStream(stream))
            self._wakeup.set()

    def begin_drain(self) -> None:
        with self._lock:
            self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    def wait_until_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.num_in_flight == 0:
                return True
            time.sleep(0.05)
        return self.num_in_flight == 0

    def cut_off_all(self, message: str, timeout: float) -> None:
        """End every request still in flight as an abort with `message` (shutting down past the drain timeout),
        then wait up to `timeout` seconds for their calls to send that and end. Any thread."""
        future = self.call(lambda engine: self._cut_off_all(message))
        try:
            future.result(timeout)
        except concurrent.futures.TimeoutError:
            logger.warning("the engine loop did not end the remaining requests within %.0fs", timeout)
            return
        self.wait_until_idle(timeout)

    def stop(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    # -- the loop thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            changed = self._apply_commands()
            changed |= self._expire_stuck_streams()
            if changed:
                self._observe()  # an abort frees pages without a step
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait(timeout=0.1)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # a broken step must not leave streams hanging
                logger.exception("engine step failed; failing every in-flight request")
                self._fail_all()
                continue
            for output in outputs:
                self._deliver(output)
            self._observe()

    def _observe(self) -> None:
        self.stats = self.engine.stats()
        self.metrics.observe_engine(self.stats)
        self.engine.kv_events().publish(self.stats)  # wakes SubscribeKVEvents streams (routers)

    def _apply_commands(self) -> bool:
        """Apply queued adds and aborts; returns whether there were any."""
        applied = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return applied
            applied = True
            match command:
                case CallOnLoop(function, future):
                    _run_call(self.engine, function, future)
                case AddRequest(stream, prompt_token_ids, session_id, admit):
                    self._add(stream, prompt_token_ids, session_id, admit)
                case AbortStream(stream):
                    self._abort(stream, FinishReason.ABORT)

    def _add(self, stream: RequestStream, prompt_token_ids: list[int], session_id: str | None, admit) -> None:
        try:
            if admit is not None:
                admit(self.engine, stream, prompt_token_ids)
            else:
                self.engine.add_request(stream.handle, prompt_token_ids, stream.params, session_id=session_id)
        except ValueError as error:  # validated already; a failure here is a bug, but not a hang
            logger.error("add_request refused a validated request: %s", error)
            self._finish(stream, FinishReason.ERROR, str(error))

    def _cut_off_all(self, message: str) -> None:
        with self._lock:
            streams = [stream for stream in self.streams.values() if not stream.finished]
        for stream in streams:
            stream.cut_off, stream.error_status = message, 503
            self._abort(stream, FinishReason.ABORT, message)
        self._observe()

    def _abort(self, stream: RequestStream, reason: FinishReason, message: str = "") -> None:
        """Abort the stream's request where the engine runs it, and end the stream either way: a request not in
        the engine (a decode replica's handover still reserving pages, admit) has a handler thread that would
        otherwise wait on its stream forever (and hold the process's exit)."""
        if self.engine.has_request(stream.handle):
            self.engine.abort_request(stream.handle)
        self._finish(stream, reason, message)

    def _expire_stuck_streams(self) -> bool:
        now = time.monotonic()
        if now < self._next_expiry_check:
            return False
        self._next_expiry_check = now + EXPIRY_CHECK_INTERVAL
        with self._lock:
            stuck = [s for s in self.streams.values() if not s.expired and s.is_stuck(now, self.stream_idle_timeout)]
        for stream in stuck:
            logger.warning(
                "request %s: its client has not read for %.0fs (server.stream_idle_timeout); aborting",
                stream.request_id,
                self.stream_idle_timeout,
            )
            self.metrics.idle_streams_expired.inc()
            self._abort(stream, FinishReason.ABORT)
            stream.expire()
        return bool(stuck)

    def _deliver(self, output: RequestOutput) -> None:
        with self._lock:
            stream = self.streams.get(output.request_id)
        if stream is None:
            return
        for completion in output.outputs:
            delta = stream.delta_from(output, completion.index)
            # with n > 1 an output carries every completion, most with nothing new for their clients
            if delta is not None and delta.carries_news:
                self._deliver_delta(stream, delta)
                if delta.finish_reason is not None and completion.num_draft_tokens:
                    self.metrics.request_acceptance.observe(completion.acceptance_rate)

    def _deliver_delta(self, stream: RequestStream, delta: Delta) -> None:
        now = time.perf_counter()
        if delta.token_ids:
            if stream.first_token_at is None:
                stream.first_token_at = now
                self.metrics.ttft.observe(now - stream.submitted_at)
            # per completion: with n > 1 a step delivers one delta per completion, microseconds apart
            previous = stream.last_token_at[delta.index]
            if previous is not None:
                # a delta may carry several tokens (a decode chain's steps, accepted proposals): each token is
                # one interval, its share of the wait, so the histogram's mean stays the time per output token
                share = (now - previous) / len(delta.token_ids)
                for _ in delta.token_ids:
                    self.metrics.itl.observe(share)
            stream.last_token_at[delta.index] = now
            self.metrics.generation_tokens.inc(len(delta.token_ids))
        stream.put(delta)
        if delta.finish_reason is not None:
            self.metrics.requests.labels(delta.finish_reason).inc()
            if stream.finished:
                self.metrics.e2e.observe(now - stream.submitted_at)

    def _finish(self, stream: RequestStream, reason: FinishReason, message: str = "") -> None:
        if not stream.finished:
            self.metrics.requests.labels(reason).inc()
            stream.finish(reason, message)

    def _fail_all(self) -> None:
        for handle in self.engine.request_ids():
            self.engine.abort_request(handle)
        with self._lock:
            streams = list(self.streams.values())
        for stream in streams:
            self._finish(stream, FinishReason.ERROR, "the engine failed while running this request")


def _run_call(engine: Engine, function, future: concurrent.futures.Future) -> None:
    try:
        future.set_result(function(engine))
    except Exception as error:  # the caller's to handle; the loop goes on
        future.set_exception(error)
