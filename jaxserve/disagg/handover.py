"""One handover between two engines in one process, and a pair of engines that serves like one."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from jaxserve.config import EngineRole
from jaxserve.disagg.transport import check_same_layout, move_pages
from jaxserve.host.request import RequestOutput, SamplingParams


@dataclass
class HandoverStats:
    num_handovers: int = 0
    num_pages_moved: int = 0
    num_pages_reused: int = 0  # prompt pages the decode side already held
    bytes_moved: int = 0
    seconds_moving: float = 0.0  # pulling (or copying) and writing the pages
    seconds_prefilling: float = 0.0  # across processes: waiting for the prefill side's answers
    num_recomputed: int = 0


def hand_over(prefill_engine, decode_engine, request_id: str, stats: HandoverStats) -> bool:
    """Move a parked request from prefill_engine to decode_engine; False (nothing moved, the prefill
    side's pages freed) when the decode side has no room: the caller decides what to do then."""
    prefilled = prefill_engine.handovers.prefilled(request_id)
    try:
        reservation = decode_engine.handovers.reserve(request_id, prefilled.prompt_token_ids, prefilled.params)
        if reservation is None:
            return False
        try:
            started = time.perf_counter()
            source_pages = prefill_engine.handovers.pages_to_send(request_id, reservation.held_keys)
            stats.bytes_moved += move_pages(prefill_engine, source_pages, decode_engine, reservation.missing_page_ids)
            stats.seconds_moving += time.perf_counter() - started
        except BaseException:
            decode_engine.handovers.cancel(request_id)
            raise
    finally:
        prefill_engine.handovers.release(request_id)
    decode_engine.handovers.complete(prefilled)
    stats.num_handovers += 1
    stats.num_pages_moved += len(reservation.missing_page_ids)
    stats.num_pages_reused += len(reservation.held_keys)
    return True


@dataclass
class DisaggregatedPair:
    """A prefill engine and a decode engine stepped in turn, each parked request handed over as soon as
    its first token is out; generate() mirrors LLM.generate's outputs."""

    prefill_engine: object
    decode_engine: object
    stats: HandoverStats = field(default_factory=HandoverStats)

    def __post_init__(self):
        if (
            self.prefill_engine.config.disagg.role != EngineRole.PREFILL
            or self.decode_engine.config.disagg.role != EngineRole.DECODE
        ):
            raise ValueError("a DisaggregatedPair needs a role 'prefill' engine and a role 'decode' engine")
        check_same_layout(self.prefill_engine, self.decode_engine)

    def add_request(self, request_id: str, prompt, params: SamplingParams) -> None:
        if params.n != 1:
            raise ValueError("disaggregated serving hands over one sequence per request (n = 1)")
        self.prefill_engine.add_request(request_id, prompt, params)

    def step(self) -> list[RequestOutput]:
        """One step of each engine; returns decode-side outputs and requests finished at prefill."""
        finished = []
        for output in self.prefill_engine.step():
            if output.finished:
                finished.append(output)
                continue
            prefilled = self.prefill_engine.handovers.prefilled(output.request_id)
            if not hand_over(self.prefill_engine, self.decode_engine, output.request_id, self.stats):
                # no room on the decode side now: it runs the whole request once room frees up
                self.decode_engine.add_request(output.request_id, prefilled.prompt_token_ids, prefilled.params)
                self.stats.num_recomputed += 1
        return finished + self.decode_engine.step()

    def has_unfinished_requests(self) -> bool:
        return (
            self.prefill_engine.has_unfinished_requests()
            or self.decode_engine.has_unfinished_requests()
            or bool(self.prefill_engine.handovers.parked)
        )

    def generate(self, prompts, params: SamplingParams) -> list[RequestOutput]:
        ids = [f"disagg-{index}" for index in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            self.add_request(request_id, prompt, params)
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            done.update((output.request_id, output) for output in self.step() if output.finished)
        return [done[request_id] for request_id in ids]
