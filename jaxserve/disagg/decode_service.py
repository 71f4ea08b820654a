"""The Decode service of a decode replica (engine.role decode), over its EngineLoop.

Decode.Generate(request, prefill_address), one handler thread per request (an empty prefill_address:
the request runs whole here, as on a colocated replica):
  1. submit: on the loop thread, reserve pages for the prompt (its cached prefix shared), or, with no
     room, wait for it (engine.when_decode_full queue) or run the whole request here as a colocated
     replica would (prefill_here, or a wait past the reservation timeout);
  2. Prefill.Prefill on the prefill replica with the keys of the prompt pages held here;
  3. pull the missing pages from its transfer server;
  4. on the loop thread, write them into the reserved pages and admit the request at its first token;
  5. Prefill.Release (best effort: the prefill side frees them on its own timeout anyway);
  6. stream the engine's messages, as jaxserve.v1.Generation/Generate does.
The prefill replica failing, timing out or answering nonsense at 2-4 -> the prompt is recomputed here
(the request completes). The RPC ending early (the router gave up) frees the reservation and releases
the prefill side's pages.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from dataclasses import dataclass, field

import grpc
import jax

from jaxserve.disagg.handover import HandoverStats
from jaxserve.disagg.metadata import PrefilledRequest
from jaxserve.host.request import SamplingParams
from jaxserve.proto import disagg_pb2 as dpb
from jaxserve.proto import disagg_pb2_grpc
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.server.request_stream import Delta, RequestStream
from jaxserve.server.sampling_proto import logprobs_from_message
from jaxserve.server.service import checked_request, refusals_as_status, response_from_delta

logger = logging.getLogger(__name__)
RELEASE_TIMEOUT = 5.0  # seconds; a release that does not arrive is done by the prefill side's own timeout


@dataclass
class Handover:
    stream: RequestStream
    prefill_address: str
    request: pb.GenerateRequest
    params: SamplingParams
    reserved: concurrent.futures.Future  # (reservation, prompt ids), or None: run here whole
    prompt_token_ids: list[int] = field(default_factory=list)
    handover_id: str = ""  # once the prefill side holds pages for it
    ended: bool = False  # the RPC is over: nothing more to do for it


class DecodeService:
    def __init__(self, loop, limits, transfers, timeout: float):
        self.loop = loop
        self.limits = limits
        self.transfers = transfers
        self.timeout = timeout
        self.stats = HandoverStats()
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def Generate(self, request: dpb.DecodeRequest, context):
        handover = self._submit(request, context)
        stream = handover.stream
        if not context.add_callback(functools.partial(self._end, handover)):
            self._end(handover)
            return
        stream.on_expire = context.cancel
        try:
            reservation = handover.reserved.result()  # the loop thread answers between two steps
        except Exception:  # refused on the loop thread: the stream says why
            reservation = None
        if reservation is not None:
            self._hand_over(handover, reservation)
        if handover.ended:  # the client left while the prefill side worked: nothing to stream, nobody to read it
            return
        for delta in stream:
            yield response_from_delta(delta, stream.request_id)

    def _submit(self, request: dpb.DecodeRequest, context) -> Handover:
        with refusals_as_status(context):
            prompt, params = checked_request(self.limits, request.request)
            if params.n != 1:
                raise ValueError(f"a handed-over request has one sequence (n = 1), got n = {params.n}")
            reserved = concurrent.futures.Future()
            if not request.prefill_address:  # no prefill replica to ask: prefill here, as a colocated replica
                reserved.set_result(None)
            stream = self.loop.submit(
                prompt,
                params,
                request.request.request_id,
                request.request.session_id or None,
                admit=functools.partial(self._reserve, reserved) if request.prefill_address else None,
            )
        return Handover(stream, request.prefill_address, request.request, params, reserved=reserved)

    def _reserve(self, reserved: concurrent.futures.Future, engine, stream: RequestStream, prompt: list[int]):
        """Loop thread: pages for the prompt now or once a slot frees (queued); the whole request run
        here when the decode side says so (prefill_here, or the wait timed out)."""

        def on_reserved(reservation, run_here: bool) -> None:  # on the loop thread too
            if run_here:
                engine.add_request(stream.handle, prompt, stream.params)
            if not reserved.done():
                reserved.set_result(reservation and (reservation, prompt))

        try:
            engine.handovers.reserve_or_queue(stream.handle, prompt, stream.params, on_reserved)
        except Exception as error:
            reserved.set_exception(error)
            raise ValueError(f"reserving pages failed: {error}") from error  # the loop ends the stream so

    def _hand_over(self, handover: Handover, reserved) -> None:
        reservation, handover.prompt_token_ids = reserved
        started = time.perf_counter()
        try:
            response = self._stub(handover.prefill_address).Prefill(
                dpb.PrefillRequest(
                    request_id=handover.stream.request_id,
                    token_ids=handover.prompt_token_ids,
                    sampling=handover.request.sampling,
                    held_page_keys=reservation.held_keys,
                ),
                timeout=self.timeout,
            )
        except grpc.RpcError as error:
            return self._recompute(handover, f"{error.code().name}: {error.details()}")
        if response.finish_reason:  # the first token ended it: deliver that token, free the reservation
            self.loop.call(lambda engine: engine.handovers.cancel(handover.stream.handle))
            logprobs = [first_logprobs(response)] if response.HasField("first_logprobs") else None
            handover.stream.put(
                Delta(
                    [response.first_token_id],
                    response.first_text,
                    logprobs,
                    response.finish_reason,
                    len(handover.prompt_token_ids),
                    response.num_cached_tokens,
                )
            )
            return None
        handover.handover_id = response.handover_id
        answered = time.perf_counter()
        chunks = self.transfers.pull(response.transfer_address, response.transfer_id, response.chunks, self.timeout)

        def count_handover() -> None:  # before the request is admitted: a client that saw its reply sees it
            self.stats.num_handovers += 1
            self.stats.bytes_moved += sum(chunk.nbytes for chunk in chunks)
            self.stats.num_pages_moved += len(reservation.missing_page_ids)
            self.stats.num_pages_reused += len(reservation.held_keys)
            self.stats.seconds_moving += time.perf_counter() - answered
            self.stats.seconds_prefilling += answered - started

        installed = chunks is not None and self._install_on_loop(handover, response, chunks, count_handover)
        self._release(handover)
        if chunks is None or not installed:
            return self._recompute(handover, "the pages did not arrive" if chunks is None else "reservation gone")
        return None

    def _install_on_loop(self, handover: Handover, response: dpb.PrefillResponse, chunks, count_handover) -> bool:
        try:
            return self.loop.call(
                lambda engine: self._install(engine, handover, response, chunks, count_handover)
            ).result(self.timeout)
        except Exception:  # late (it still completes; recomputing then does nothing) or failed: recompute
            return False

    def _install(self, engine, handover: Handover, response: dpb.PrefillResponse, chunks, count_handover) -> bool:
        """Loop thread: the pulled KV into the reserved pages, the handover counted, and the request admitted
        at its first token (counted first: once admitted it may finish and its client ask for Status before
        the handover thread runs again)."""
        handle = handover.stream.handle
        pending = engine.handovers.reservations.get(handle)
        if pending is None or handover.ended:
            return False
        reservation = pending.reservation
        if sum(chunk.shape[1] for chunk in chunks) != len(reservation.missing_page_ids):
            return False
        if chunks:
            engine.runner.scatter_pages(
                reservation.missing_page_ids, jax.device_put(chunks, engine.runner.page_array_sharding())
            )
        count_handover()
        logprobs = first_logprobs(response) if response.HasField("first_logprobs") else None
        engine.handovers.complete(
            PrefilledRequest(
                handle,
                handover.prompt_token_ids,
                handover.params,
                response.sampling_seed,
                response.first_token_id,
                logprobs,
            )
        )
        request = engine.requests[handle]
        if not request.finished:  # the first token goes out now, not with the second
            delta = handover.stream.delta_from(request.output())
            if delta is not None and delta.token_ids:
                handover.stream.put(delta)
        return True

    def _recompute(self, handover: Handover, reason: str) -> None:
        """The prefill side could not hand over: run the prompt here (unless the client has left)."""
        handle = handover.stream.handle
        logger.warning(
            "request %s: no handover from %s (%s); prefilling it here",
            handover.stream.request_id,
            handover.prefill_address,
            reason,
        )

        def recompute(engine):
            if not handover.ended and handle in engine.handovers.reservations:
                engine.handovers.recompute(handle, handover.prompt_token_ids, handover.params)
                self.stats.num_recomputed += 1

        self.loop.call(recompute)
        return None

    def _release(self, handover: Handover) -> None:
        handover_id, handover.handover_id = handover.handover_id, ""
        if handover_id:
            try:
                self._stub(handover.prefill_address).Release(
                    dpb.ReleaseRequest(handover_id=handover_id), timeout=RELEASE_TIMEOUT
                )
            except grpc.RpcError:
                pass  # the prefill side frees them on its own timeout

    def _end(self, handover: Handover) -> None:
        """The RPC is over (finished, cancelled): free what is still held, here and there."""
        handover.ended = True
        self.loop.release(handover.stream)
        self.loop.call(lambda engine: engine.handovers.cancel(handover.stream.handle))
        if handover.handover_id:
            threading.Thread(target=self._release, args=(handover,), daemon=True).start()

    def _stub(self, address: str) -> disagg_pb2_grpc.PrefillStub:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = grpc.insecure_channel(address)
            return disagg_pb2_grpc.PrefillStub(self._channels[address])

    def expire(self) -> None:
        self.loop.call(lambda engine: engine.handovers.expire())

    def status(self, engine) -> dpb.StatusResponse:
        """On the loop thread."""
        stats = self.stats
        return dpb.StatusResponse(
            num_reservations=len(engine.handovers.reservations),
            num_expired=engine.handovers.num_expired,
            num_handovers=stats.num_handovers,
            bytes_moved=stats.bytes_moved,
            num_pages_moved=stats.num_pages_moved,
            num_pages_reused=stats.num_pages_reused,
            num_recomputed=stats.num_recomputed,
            seconds_moving=stats.seconds_moving,
            seconds_prefilling=stats.seconds_prefilling,
            num_local_prefills=engine.handovers.num_local_prefills,
            num_queued=len(engine.handovers.queued),
        )

    def close(self) -> None:
        with self._lock:
            channels, self._channels = self._channels, {}
        for channel in channels.values():
            channel.close()


def first_logprobs(response: dpb.PrefillResponse) -> dict[int, float]:
    return logprobs_from_message(response.first_logprobs)
