"""The Prefill service of a prefill replica (engine.role prefill), over its EngineLoop.

Prefill submits the prompt like any request; the engine parks it at its first token. On the loop
thread the pages the caller does not hold are gathered and offered on the transfer server, and the
answer says where to pull them. The request keeps its stream slot and its pages until Release, or
until engine.handover_timeout passes (a decode replica that died after Prefill leaks nothing here).
A request that the first token finishes holds nothing: the answer carries the token and its text.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import grpc

from jaxserve.proto import disagg_pb2 as dpb
from jaxserve.proto import jaxserve_pb2 as pb
from jaxserve.server.request_stream import RequestStream
from jaxserve.server.rpc import abort
from jaxserve.server.sampling_proto import token_logprobs_message
from jaxserve.server.service import refusals_as_status, sampling_params_from_proto


@dataclass
class Offered:
    stream: RequestStream
    deadline: float


def token_logprobs(token_id: int, top: dict[int, float] | None) -> pb.TokenLogprobs | None:
    return None if top is None else token_logprobs_message(token_id, top)


class PrefillService:
    def __init__(self, loop, transfers, timeout: float):
        self.loop = loop
        self.transfers = transfers
        self.timeout = timeout
        self.offered: dict[str, Offered] = {}  # by handover id (the engine's handle)
        self._lock = threading.Lock()
        self.num_offered = self.num_expired = self.bytes_offered = self.num_pages_offered = 0

    def Prefill(self, request: dpb.PrefillRequest, context) -> dpb.PrefillResponse:
        stream = self._submit(request, context)
        delta = stream.take(timeout=self.timeout)
        if delta is None or not delta.token_ids:  # not in time, or ended unstarted (an error, a drain)
            self.loop.release(stream)
            abort(
                context,
                grpc.StatusCode.DEADLINE_EXCEEDED if delta is None else grpc.StatusCode.UNAVAILABLE,
                "the prompt was not prefilled in time"
                if delta is None
                else f"the prefill replica ended the request unstarted ({delta.finish_reason}: {delta.text})",
            )
        if delta.finish_reason is not None:  # done at its first token: nothing to hand over
            self.loop.release(stream)
            return dpb.PrefillResponse(
                first_token_id=delta.token_ids[0],
                finish_reason=delta.finish_reason,
                first_text=delta.text,
                num_cached_tokens=delta.num_cached_tokens,
                first_logprobs=token_logprobs(delta.token_ids[0], (delta.logprobs or [None])[0]),
            )
        handle, held = stream.handle, list(request.held_page_keys)
        with self._lock:
            self.offered[handle] = Offered(stream, time.monotonic() + self.timeout)
        try:
            response = self.loop.call(lambda engine: self._offer(engine, handle, held)).result(self.timeout)
        except Exception as error:
            self.release(handle)
            abort(context, grpc.StatusCode.INTERNAL, f"offering the pages failed: {error!r}")
        response.num_cached_tokens = delta.num_cached_tokens
        if not context.is_active():  # the caller left meanwhile
            self.release(handle)
        return response

    def _submit(self, request: dpb.PrefillRequest, context) -> RequestStream:
        with refusals_as_status(context):
            params = sampling_params_from_proto(request.sampling)
            if params.n != 1:
                raise ValueError(f"a handed-over request has one sequence (n = 1), got n = {params.n}")
            if not request.token_ids:
                raise ValueError("the prompt is empty")
            return self.loop.submit(list(request.token_ids), params, request.request_id)

    def _offer(self, engine, handle: str, held_keys: list[int]) -> dpb.PrefillResponse:
        """On the loop thread, before the parked pages can change."""
        prefilled = engine.handovers.prefilled(handle)
        chunks = engine.runner.gather_pages(engine.handovers.pages_to_send(handle, held_keys))
        transfer_id, chunk_protos = self.transfers.offer(chunks)
        num_pages = sum(chunk.shape[1] for chunk in chunks)
        self.num_offered += 1
        self.num_pages_offered += num_pages
        self.bytes_offered += sum(chunk.nbytes for chunk in chunks)
        return dpb.PrefillResponse(
            handover_id=handle,
            first_token_id=prefilled.first_token_id,
            sampling_seed=prefilled.sampling_seed,
            first_logprobs=token_logprobs(prefilled.first_token_id, prefilled.first_logprobs),
            transfer_address=self.transfers.address,
            transfer_id=transfer_id,
            chunks=chunk_protos,
            num_pages_sent=num_pages,
        )

    def Release(self, request: dpb.ReleaseRequest, context) -> dpb.ReleaseResponse:
        return dpb.ReleaseResponse(released=self.release(request.handover_id))

    def release(self, handle: str) -> bool:
        with self._lock:
            offered = self.offered.pop(handle, None)
        if offered is None:
            return False
        self.loop.call(lambda engine: engine.handovers.release(handle))
        self.loop.release(offered.stream)
        return True

    def expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [handle for handle, offered in self.offered.items() if offered.deadline <= now]
        for handle in expired:
            self.num_expired += self.release(handle)
        self.loop.call(lambda engine: engine.handovers.expire())

    def status(self, engine) -> dpb.StatusResponse:
        """On the loop thread."""
        return dpb.StatusResponse(
            num_parked=len(engine.handovers.parked),
            num_expired=self.num_expired,
            num_handovers=self.num_offered,
            bytes_moved=self.bytes_offered,
            num_pages_moved=self.num_pages_offered,
        )
