"""The decode replica's half of a handover: reserve pages for a prompt (sharing what its own prefix
cache holds), take the missing pages' KV and the first token, and decode on as if it had prefilled.
A reservation not completed in time is freed; the caller can always recompute the prompt instead."""

from __future__ import annotations

import time
from dataclasses import dataclass

from jaxserve.disagg.metadata import PrefilledRequest, missing_page_indices
from jaxserve.host.output_processor import append_token
from jaxserve.host.page_allocator import num_pages_for
from jaxserve.host.request import Request, RequestStatus, SamplingParams, SequenceState


@dataclass
class Reservation:
    request_id: str
    page_ids: list[int]  # covering the whole prompt; the first len(held_keys) hold cached KV
    held_keys: list[int]  # keys of the prompt's pages this side already holds
    missing_page_ids: list[int]  # where the handed-over pages go, in prompt order
    num_cached_tokens: int
    rank: int
    deadline: float


class DecodeHandovers:
    def __init__(self, engine, timeout: float = 30.0, clock=time.monotonic):
        self.engine = engine
        self.timeout = timeout
        self.clock = clock
        self.reservations: dict[str, Reservation] = {}
        self.num_expired = 0

    def after_step(self, outputs) -> None:
        self.expire()

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Reservation | None:
        """Hold pages for the prompt, or None when this replica has no slot or too few pages for the
        request's final length (the router then tries another, or colocates)."""
        engine = self.engine
        if request_id in engine.requests or request_id in self.reservations:
            raise ValueError(f"request id {request_id!r} is already in use")
        engine.validate(prompt_token_ids, params)
        rank = min(range(len(engine.schedulers)), key=lambda r: engine.schedulers[r].num_sequences)
        scheduler, size = engine.schedulers[rank], engine.config.page_size
        allocator = scheduler.allocator
        found = allocator.find_cached_prefix(prompt_token_ids, len(prompt_token_ids))
        final_pages = num_pages_for(len(prompt_token_ids) + params.max_tokens, size)
        needed = final_pages - found.num_pages + allocator.num_pages_to_claim(found)
        if (
            len(scheduler.running) + scheduler.reserved_slots >= scheduler.max_num_seqs
            or needed > allocator.num_free_pages
        ):
            return None
        page_ids = allocator.claim(found)
        page_ids += allocator.allocate(num_pages_for(len(prompt_token_ids), size) - len(page_ids))
        # Cached pages evicted for these go to the host tier now, before the handover overwrites them.
        engine.move_host_tier_pages()
        scheduler.reserved_slots += 1  # local requests admitted meanwhile must leave the slot free
        num_cached = found.num_pages * size
        allocator.record_query(len(prompt_token_ids), num_cached, found.miss_reason)
        missing = missing_page_indices(prompt_token_ids, size, found.keys)
        reservation = Reservation(
            request_id,
            page_ids,
            list(found.keys),
            [page_ids[i] for i in missing],
            num_cached,
            rank,
            self.clock() + self.timeout,
        )
        self.reservations[request_id] = reservation
        return reservation

    def complete(self, prefilled: PrefilledRequest) -> None:
        """The missing pages hold the prompt's KV now: run the request from its first token on."""
        reservation = self.reservations.pop(prefilled.request_id)
        engine, prompt = self.engine, prefilled.prompt_token_ids
        engine.schedulers[reservation.rank].reserved_slots -= 1
        seq = SequenceState(
            seq_id=next(engine._seq_ids),
            request_id=prefilled.request_id,
            prompt_token_ids=prompt,
            params=prefilled.params,
            sampling_seed=prefilled.sampling_seed,
            arrival_order=next(engine._arrivals),
            rank=reservation.rank,
            page_ids=reservation.page_ids,
            page_keys=[],
            num_computed_tokens=len(prompt),
            num_cached_tokens=reservation.num_cached_tokens,
            status=RequestStatus.RUNNING,
        )
        scheduler = engine.schedulers[reservation.rank]
        scheduler.cache_full_pages(seq)  # the handed-over full pages become this side's prefix cache too
        engine.requests[prefilled.request_id] = Request(prefilled.request_id, None, prompt, [seq])
        reason = append_token(
            seq,
            prefilled.first_token_id,
            prefilled.first_logprobs,
            engine.tokenizer,
            engine.parts.eos_token_ids,
            engine.max_model_len,
        )
        scheduler.admit_prefilled(seq)
        if reason is not None:
            scheduler.finish_or_flush(seq, reason)

    def cancel(self, request_id: str) -> None:
        reservation = self.reservations.pop(request_id, None)
        if reservation is not None:
            scheduler = self.engine.schedulers[reservation.rank]
            scheduler.reserved_slots -= 1
            scheduler.allocator.release(reservation.page_ids)

    def recompute(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The prefill side is gone: free the reservation and run the whole request here."""
        self.cancel(request_id)
        self.engine.add_request(request_id, prompt_token_ids, params)

    def expire(self) -> list[str]:
        now = self.clock()
        expired = [request_id for request_id, r in self.reservations.items() if r.deadline <= now]
        for request_id in expired:
            self.cancel(request_id)
        self.num_expired += len(expired)
        return expired
