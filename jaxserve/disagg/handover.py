"""One handover between two engines in one process, and a pair of engines that serves like one."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxserve.config import EngineRole
from jaxserve.disagg.decode_side import DecodeHandovers
from jaxserve.disagg.prefill_side import PrefillHandovers
from jaxserve.disagg.transport import check_same_layout, move_pages
from jaxserve.host.request import RequestOutput, SamplingParams

if TYPE_CHECKING:  # the engine imports disagg/ (its handovers): a type only
    from jaxserve.engine.engine import Engine


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
    """Move a parked request from prefill_engine to decode_engine; False (nothing moved, the request
    still parked) when the decode side has no room: the caller retries later or gives up."""
    prefilled = prefill_engine.handovers.prefilled(request_id)
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

    prefill_engine: Engine
    decode_engine: Engine
    stats: HandoverStats = field(default_factory=HandoverStats)
    # With no slot free on the decode side: "queue" keeps the request parked (its pages held on the
    # prefill side) and hands it over once one frees, in arrival order; "prefill_here" frees it and
    # the decode side runs the whole request (bench/disagg.py --decode-full compares them). None: the
    # decode engine's config (disagg.when_decode_full), as a decode replica does.
    when_decode_full: str | None = None
    waiting: deque = field(default_factory=deque)  # PrefilledRequests parked for a decode slot

    def __post_init__(self):
        if (
            self.prefill_engine.config.disagg.role != EngineRole.PREFILL
            or self.decode_engine.config.disagg.role != EngineRole.DECODE
        ):
            raise ValueError("a DisaggregatedPair needs a role 'prefill' engine and a role 'decode' engine")
        check_same_layout(self.prefill_engine, self.decode_engine)
        if self.when_decode_full is None:
            self.when_decode_full = self.decode_engine.config.disagg.when_decode_full
        if self.when_decode_full not in ("queue", "prefill_here"):
            raise ValueError(f"when_decode_full must be queue or prefill_here, got {self.when_decode_full!r}")

    def add_request(self, request_id: str, prompt, params: SamplingParams) -> None:
        if params.n != 1:
            raise ValueError("disaggregated serving hands over one sequence per request (n = 1)")
        self.prefill_engine.add_request(request_id, prompt, params)

    @property
    def prefill_side(self) -> PrefillHandovers:
        handovers = self.prefill_engine.handovers
        assert isinstance(handovers, PrefillHandovers)  # checked by role in __post_init__
        return handovers

    @property
    def decode_side(self) -> DecodeHandovers:
        handovers = self.decode_engine.handovers
        assert isinstance(handovers, DecodeHandovers)
        return handovers

    def step(self) -> list[RequestOutput]:
        """One step of each engine; returns decode-side outputs and requests finished at prefill."""
        finished = []
        for output in self.prefill_engine.step():
            if output.finished:
                finished.append(output)
            else:
                self.waiting.append(self.prefill_side.prefilled(output.request_id))
        self._hand_over_waiting()
        return finished + self.decode_engine.step()

    def _hand_over_waiting(self) -> None:
        while self.waiting:
            prefilled = self.waiting[0]
            parked = prefilled.request_id in self.prefill_side.parked
            if parked and hand_over(self.prefill_engine, self.decode_engine, prefilled.request_id, self.stats):
                self.waiting.popleft()
                continue
            if parked and self.when_decode_full == "queue":
                return  # no slot yet: it and those behind it wait
            # expired while waiting, or not to wait: the decode side runs the whole request
            self.waiting.popleft()
            self.prefill_side.release(prefilled.request_id)
            self.decode_engine.add_request(prefilled.request_id, prefilled.prompt_token_ids, prefilled.params)
            self.decode_side.num_local_prefills += 1

    def has_unfinished_requests(self) -> bool:
        return (
            self.prefill_engine.has_unfinished_requests()
            or self.decode_engine.has_unfinished_requests()
            or bool(self.prefill_side.parked)
        )

    def generate(self, prompts, params: SamplingParams) -> list[RequestOutput]:
        ids = [f"disagg-{index}" for index in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            self.add_request(request_id, prompt, params)
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            done.update((output.request_id, output) for output in self.step() if output.finished)
        return [done[request_id] for request_id in ids]
