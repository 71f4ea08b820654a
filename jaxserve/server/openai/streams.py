"""The engine loop's streams, read from the HTTP server's event loop without a thread per stream.

One API call may hold several streams (a batch of prompts); all wake one asyncio event, set from
the engine thread through call_soon_threadsafe (RequestStream.on_put), and are drained without
blocking. Submitting (checks, tokenizing, the template) runs on a small thread pool so that a long
prompt never stalls the other streams on the event loop. Whatever ends the call (its last message, a
client gone, an error) releases every stream: the engine aborts what still runs and frees its pages
at once, as a cancelled gRPC call does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from jaxserve.host.request import SamplingParams
from jaxserve.server.openai.loop import GenerationLoop
from jaxserve.server.request_stream import Delta, RequestStream


def submit_all(
    loop: GenerationLoop, prompts: list, params: SamplingParams, request_id: str, session_id: str | None
) -> list[RequestStream]:
    """Submit every prompt or none (a refusal releases those already queued); worker thread."""
    streams: list[RequestStream] = []
    try:
        for prompt in prompts:
            streams.append(loop.submit(prompt, params, request_id, session_id))
    except Exception:
        for stream in streams:
            loop.release(stream)
        raise
    return streams


class StreamExpired(Exception):
    """A response cut off because its client stopped reading (server.stream_idle_timeout). The engine
    loop has logged it already; uvicorn closes the connection and http_server.py keeps its traceback
    out of the log."""


class StreamGroup:
    """The streams of one API call, read as (stream position, delta) pairs in arrival order."""

    def __init__(self, engine_loop: GenerationLoop, streams: list[RequestStream]):
        self.engine_loop = engine_loop
        self.streams = streams
        self.expired = False  # the engine loop expired one of the streams (cancel_on_expiry)
        self._event = asyncio.Event()
        event_loop = asyncio.get_running_loop()

        def wake() -> None:  # engine thread
            try:
                event_loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:  # the event loop has closed (shutdown): nobody is waiting
                pass

        for stream in streams:
            stream.on_put = wake

    def cancel_on_expiry(self) -> None:
        """End the calling task (the response's) when the engine loop expires one of these streams
        (stuck on its client for server.stream_idle_timeout): uvicorn then closes the connection."""
        task, event_loop = asyncio.current_task(), asyncio.get_running_loop()
        assert task is not None, "called from a response's task"

        def expire() -> None:  # event loop
            self.expired = True
            task.cancel()

        def cancel() -> None:  # engine thread
            try:
                event_loop.call_soon_threadsafe(expire)
            except RuntimeError:
                pass

        for stream in self.streams:
            stream.on_expire = cancel

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        remaining = sum(stream.params.n for stream in self.streams)  # completions yet to finish
        while remaining:
            self._event.clear()  # before looking: a put after the look sets it again
            found = False
            for position, stream in enumerate(self.streams):
                delta = stream.take(timeout=0)
                if delta is not None:
                    found = True
                    remaining -= delta.finish_reason is not None
                    yield position, delta
            if not found:
                await self._event.wait()

    def mark_sending(self, sending: bool) -> None:
        """Time spent handing a message to the client counts toward the stream idle timeout."""
        now = time.monotonic() if sending else None
        for stream in self.streams:
            stream.sending_since = now

    def release(self) -> None:
        for stream in self.streams:
            self.engine_loop.release(stream)


async def until_disconnected(receive, work):
    """Await `work`, cancelling it if the client disconnects first (non-streaming calls, whose
    responses Starlette would otherwise compute for a client long gone). None when cancelled."""

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # its own finally releases its streams
    return task.result() if task.done() and not task.cancelled() else None
