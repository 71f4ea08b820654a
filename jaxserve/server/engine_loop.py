"""The engine on its own thread: handlers submit and abort; the loop steps and streams deltas back."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from jaxserve.engine import Engine
from jaxserve.host.request import RequestOutput, SamplingParams
from jaxserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class Overloaded(Exception):
    """More requests in flight than the server's queue limit."""


class Draining(Exception):
    """The server is shutting down and takes no new requests."""


@dataclass
class Delta:
    """What a stream's next message carries: what is new since the previous one."""

    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass
class RequestStream:
    request_id: str
    params: SamplingParams
    submitted_at: float
    deltas: queue.Queue = field(default_factory=queue.Queue)
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    last_message_at: float | None = None
    holdback_chars: int = 0  # text held back while it could still turn out to start a stop string

    def __post_init__(self):
        self.holdback_chars = max((len(stop) for stop in self.params.stop), default=1) - 1

    def delta_from(self, output: RequestOutput) -> Delta:
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

    def __iter__(self):
        """Deltas until the one with a finish reason."""
        while True:
            delta = self.deltas.get()
            yield delta
            if delta.finish_reason is not None:
                return


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_queued_requests: int):
        self.engine = engine
        self.metrics = metrics
        self.max_in_flight = engine.config.max_num_seqs + max_queued_requests
        self.streams: dict[str, RequestStream] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._lock = threading.Lock()  # guards streams and draining against handler threads
        self._draining = False
        self._stopped = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self.streams)

    def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str = "",
               session_id: str | None = None) -> RequestStream:
        """Validate (raising ValueError) and queue a request; called from handler threads."""
        prompt_token_ids = self.engine.tokenize(prompt)  # read-only: safe off the loop thread
        self.engine.validate(prompt_token_ids, params)
        if params.n != 1:
            raise ValueError("the server streams one completion per request (n = 1)")
        with self._lock:
            if self._draining:
                raise Draining("the server is shutting down")
            if len(self.streams) >= self.max_in_flight:
                raise Overloaded(f"{len(self.streams)} requests in flight, the limit is {self.max_in_flight}")
            request_id = request_id or f"req-{next(self._ids)}"
            if request_id in self.streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            stream = RequestStream(request_id, params, time.perf_counter())
            self.streams[request_id] = stream
        self.metrics.prompt_tokens.inc(len(prompt_token_ids))
        self._commands.put(("add", request_id, prompt_token_ids, params, session_id))
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op once it has finished); its pages are freed on the loop thread."""
        self._commands.put(("abort", request_id))
        self._wakeup.set()

    def begin_drain(self) -> None:
        with self._lock:
            self._draining = True

    def wait_until_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.num_in_flight == 0:
                return True
            time.sleep(0.05)
        return self.num_in_flight == 0

    def stop(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    # -- the loop thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            if self._apply_commands():
                self.metrics.observe_engine(self.engine.stats())  # an abort frees pages without a step
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
            self.metrics.observe_engine(self.engine.stats())

    def _apply_commands(self) -> bool:
        """Apply queued adds and aborts; returns whether there were any."""
        applied = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return applied
            applied = True
            if command[0] == "add":
                _, request_id, prompt_token_ids, params, session_id = command
                try:
                    self.engine.add_request(request_id, prompt_token_ids, params, session_id=session_id)
                except ValueError as error:  # raced with another request of the same id
                    self._close(request_id, "abort", str(error))
            else:
                request_id = command[1]
                if request_id in self.engine.requests:
                    self.engine.abort_request(request_id)
                    self._close(request_id, "abort")

    def _deliver(self, output: RequestOutput) -> None:
        with self._lock:
            stream = self.streams.get(output.request_id)
        if stream is None:
            return
        now = time.perf_counter()
        delta = stream.delta_from(output)
        if delta.token_ids:
            if stream.last_message_at is None:
                self.metrics.ttft.observe(now - stream.submitted_at)
            else:
                self.metrics.itl.observe(now - stream.last_message_at)
            stream.last_message_at = now
            self.metrics.generation_tokens.inc(len(delta.token_ids))
        stream.deltas.put(delta)
        if delta.finish_reason is not None:
            self.metrics.requests.labels(delta.finish_reason).inc()
            self.metrics.e2e.observe(now - stream.submitted_at)
            with self._lock:
                self.streams.pop(output.request_id, None)

    def _close(self, request_id: str, reason: str, message: str = "") -> None:
        with self._lock:
            stream = self.streams.pop(request_id, None)
        if stream is not None:
            self.metrics.requests.labels(reason).inc()
            stream.deltas.put(Delta([], message, None, reason, 0, 0))

    def _fail_all(self) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        with self._lock:
            request_ids = list(self.streams)
        for request_id in request_ids:
            self._close(request_id, "error", "the engine failed while running this request")
