"""The decode replica's half of a handover: reserve pages for a prompt (sharing what its own prefix
cache holds), take the missing pages' KV and the first token, and decode on as if it had prefilled.
A reservation not completed in time is freed; the caller can always recompute the prompt instead.

The slot and pages are the scheduler's (`Scheduler.reserve`: the same admission check as a local
request); this side adds which rank holds them and until when."""

from __future__ import annotations

import time
from dataclasses import dataclass

from jaxserve.disagg.metadata import PrefilledRequest
from jaxserve.host.output_processor import append_token
from jaxserve.host.request import Request, SamplingParams
from jaxserve.host.schedule import Reservation


@dataclass
class PendingHandover:
    reservation: Reservation  # the rank's scheduler holds its slot and pages
    rank: int
    deadline: float


class DecodeHandovers:
    def __init__(self, engine, timeout: float = 30.0, clock=time.monotonic):
        self.engine = engine
        self.timeout = timeout
        self.clock = clock
        self.reservations: dict[str, PendingHandover] = {}
        self.num_expired = 0
        # Requests this replica prefilled itself because no slot or pages were free for a handover
        # (counted by whoever decides so: decode_service.py, handover.py).
        self.num_local_prefills = 0

    def after_step(self, outputs) -> None:
        self.expire()

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Reservation | None:
        """Hold pages for the prompt on the least loaded rank, or None when that rank has no slot or
        too few pages for the request's final length (the caller then queues it or prefills it here)."""
        engine = self.engine
        if engine.has_request(request_id) or request_id in self.reservations:
            raise ValueError(f"request id {request_id!r} is already in use")
        engine.validate(prompt_token_ids, params)
        rank = min(range(len(engine.schedulers)), key=lambda r: engine.schedulers[r].num_sequences)
        reservation = engine.schedulers[rank].reserve(request_id, prompt_token_ids, params.max_tokens)
        if reservation is None:
            return None
        # Cached pages evicted for these go to the host tier now, before the handover overwrites them.
        engine.move_host_tier_pages()
        self.reservations[request_id] = PendingHandover(reservation, rank, self.clock() + self.timeout)
        return reservation

    def complete(self, prefilled: PrefilledRequest) -> None:
        """The missing pages hold the prompt's KV now: run the request from its first token on."""
        pending = self.reservations.pop(prefilled.request_id)
        engine, prompt = self.engine, prefilled.prompt_token_ids
        seq = engine.new_sequence(prefilled.request_id, prompt, prefilled.params, prefilled.sampling_seed)
        seq.rank = pending.rank
        scheduler = engine.schedulers[pending.rank]
        scheduler.admit_reserved(seq)
        engine.requests[prefilled.request_id] = Request(prefilled.request_id, None, prompt, [seq])
        reason = append_token(
            seq,
            prefilled.first_token_id,
            prefilled.first_logprobs,
            engine.tokenizer,
            engine.parts.eos_token_ids,
            engine.max_model_len,
        )
        if reason is not None:
            scheduler.finish_or_flush(seq, reason)

    def cancel(self, request_id: str) -> None:
        pending = self.reservations.pop(request_id, None)
        if pending is not None:
            self.engine.schedulers[pending.rank].release_reservation(request_id)

    def recompute(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The prefill side is gone: free the reservation and run the whole request here."""
        self.cancel(request_id)
        self.engine.add_request(request_id, prompt_token_ids, params)

    def expire(self) -> list[str]:
        now = self.clock()
        expired = [request_id for request_id, pending in self.reservations.items() if pending.deadline <= now]
        for request_id in expired:
            self.cancel(request_id)
        self.num_expired += len(expired)
        return expired
