"""The decode replica's half of a handover: reserve pages for a prompt (sharing what its own prefix
cache holds), take the missing pages' KV and the first token, and decode on as if it had prefilled.
A reservation not completed in time is freed; the caller can always recompute the prompt instead.

The slot and pages are the scheduler's (`Scheduler.reserve`: the same admission check as a local
request); this side adds which rank holds them and until when."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from jaxserve.disagg.metadata import PrefilledRequest
from jaxserve.host.output_processor import append_token
from jaxserve.host.page_allocator import ROOT_KEY
from jaxserve.host.request import Request, SamplingParams
from jaxserve.host.schedule import Reservation


@dataclass
class QueuedHandover:
    """A handover waiting for a slot (or pages) on this side, in arrival order."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # (the reservation, or None and whether the wait timed out: False when the handover was cancelled)
    on_reserved: Callable[[Reservation | None, bool], None]
    deadline: float


@dataclass
class PendingHandover:
    reservation: Reservation  # the rank's scheduler holds its slot and pages
    rank: int
    deadline: float
    # the LoRA adapter the request names (None: the base model): its pages chain from the adapter's identity,
    # and the adapter must stay loaded until the request runs (requests_using_adapter)
    adapter: str | None = None


class DecodeHandovers:
    def __init__(self, engine, timeout: float = 30.0, when_full: str = "queue", clock=time.monotonic):
        """when_full (DisaggConfig.when_decode_full): with no slot or pages free, "queue" the handover
        until they free, or "prefill_here": the caller runs the whole request on this replica at once."""
        self.engine = engine
        self.timeout = timeout
        self.when_full = when_full
        self.clock = clock
        self.reservations: dict[str, PendingHandover] = {}
        self.queued: deque[QueuedHandover] = deque()
        self.num_expired = 0
        # Requests this replica prefilled itself: no room and prefill_here, or their wait timed out.
        self.num_local_prefills = 0

    def after_step(self, outputs) -> None:
        self.expire()
        self.reserve_queued()

    def stats(self) -> dict:
        return {
            "handover_reservations": len(self.reservations),
            "handover_queued": len(self.queued),
            "handover_local_prefills": self.num_local_prefills,
            "handover_expired": self.num_expired,
        }

    def reserve_or_queue(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        on_reserved: Callable[[Reservation | None, bool], None],
    ) -> None:
        """Reserve now, or, with no slot or pages free, by when_full: "queue" waits for them (in arrival
        order, retried after every step): the prefill pool does the prompt and this side's running decodes
        are not slowed by it; "prefill_here" answers at once that the caller runs it here (bench/disagg.py
        --decode-full measures both). on_reserved gets the reservation, or None and True when the caller
        is to prefill here (no room and prefill_here, or the wait outlasted the timeout)."""
        if any(queued.request_id == request_id for queued in self.queued):
            raise ValueError(f"request id {request_id!r} is already in use")
        reservation = None if self.queued else self.reserve(request_id, prompt_token_ids, params)
        if reservation is not None:
            on_reserved(reservation, False)
            return
        if self.when_full == "prefill_here":
            self.num_local_prefills += 1
            on_reserved(None, True)
            return
        self.engine.validate(prompt_token_ids, params)
        queued = QueuedHandover(request_id, prompt_token_ids, params, on_reserved, self.clock() + self.timeout)
        self.queued.append(queued)

    def reserve_queued(self) -> None:
        now = self.clock()
        while self.queued:
            queued = self.queued[0]
            reservation = None
            if queued.deadline > now:
                reservation = self.reserve(queued.request_id, queued.prompt_token_ids, queued.params)
                if reservation is None:
                    return  # still full: the rest wait behind it
            else:
                self.num_local_prefills += 1
            self.queued.popleft()
            queued.on_reserved(reservation, reservation is None)

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Reservation | None:
        """Hold pages for the prompt on the least loaded rank, or None when that rank has no slot or
        too few pages for the request's final length (the caller then queues it or prefills it here)."""
        engine = self.engine
        if engine.has_request(request_id) or request_id in self.reservations:
            raise ValueError(f"request id {request_id!r} is already in use")
        engine.validate(prompt_token_ids, params)
        adapter = engine.lora_adapter(params)  # its pages chain from the adapter's identity, not the base's root
        root_key = ROOT_KEY if adapter is None else adapter.identity
        rank = min(range(len(engine.schedulers)), key=lambda r: engine.schedulers[r].num_sequences)
        reservation = engine.schedulers[rank].reserve(request_id, prompt_token_ids, params.max_new_tokens, root_key)
        if reservation is None:
            return None
        # Cached pages evicted for these go to the host tier now, before the handover overwrites them.
        engine.move_host_tier_pages()
        self.reservations[request_id] = PendingHandover(reservation, rank, self.clock() + self.timeout, params.lora)
        return reservation

    def requests_using_adapter(self, name: str) -> list[str]:
        """Handovers reserved or queued for adapter `name`: not yet the engine's requests, but completing
        one needs the adapter loaded (Engine.unload_lora refuses while any exists)."""
        reserved = [request_id for request_id, pending in self.reservations.items() if pending.adapter == name]
        return reserved + [queued.request_id for queued in self.queued if queued.params.lora == name]

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
        for queued in [q for q in self.queued if q.request_id == request_id]:
            self.queued.remove(queued)
            queued.on_reserved(None, False)
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
