"""The prefill replica's half of a handover: park each request at its first token, pages held, until a
decode replica has taken them or the handover times out; then free them."""

from __future__ import annotations

import time
from dataclasses import dataclass

from jaxserve.disagg.metadata import PrefilledRequest, missing_page_indices
from jaxserve.host.request import FinishReason, RequestOutput, SequenceState


@dataclass
class Parked:
    seq: SequenceState
    deadline: float


class PrefillHandovers:
    def __init__(self, engine, timeout: float = 30.0, clock=time.monotonic):
        self.engine = engine
        self.timeout = timeout
        self.clock = clock
        self.parked: dict[str, Parked] = {}
        self.num_expired = 0

    def after_step(self, outputs: list[RequestOutput]) -> None:
        """Park the requests that just sampled their first token (before the next step decodes them);
        requests that finished at once (EOS, max_tokens 1) have nothing to hand over."""
        for output in outputs:
            if output.finished or output.request_id in self.parked:
                continue
            seq = self.engine.requests[output.request_id].seqs[0]
            self.engine.schedulers[seq.rank].park(seq)
            self.parked[output.request_id] = Parked(seq, self.clock() + self.timeout)
        self.expire()

    def stats(self) -> dict:
        return {"handover_parked": len(self.parked), "handover_expired": self.num_expired}

    def requests_using_adapter(self, name: str) -> list[str]:
        """None beyond the engine's own: a parked request stays an unfinished request of the engine until it
        is released, so Engine.unload_lora already counts it."""
        return []

    def prefilled(self, request_id: str) -> PrefilledRequest:
        seq = self.parked[request_id].seq
        logprobs = seq.output_logprobs[0] if seq.output_logprobs else None
        return PrefilledRequest(
            request_id, list(seq.prompt_token_ids), seq.params, seq.sampling_seed, seq.output_token_ids[0], logprobs
        )

    def pages_to_send(self, request_id: str, held_keys) -> list[int]:
        """This side's page ids of the prompt pages the receiver does not hold, in prompt order."""
        seq = self.parked[request_id].seq
        page_size = self.engine.config.cache.page_size
        indices = missing_page_indices(seq.prompt_token_ids, page_size, held_keys, seq.cache_root_key)
        return [seq.page_ids[index] for index in indices]

    def release(self, request_id: str) -> None:
        """The handover is over (taken, failed or abandoned): free the pages (full ones stay cached)."""
        parked = self.parked.pop(request_id, None)
        if parked is None:
            return
        if not parked.seq.is_finished:  # an abort may have freed them already
            self.engine.schedulers[parked.seq.rank].finish(parked.seq, FinishReason.HANDED_OVER)
        self.engine.requests.pop(request_id, None)

    def expire(self) -> list[str]:
        now = self.clock()
        expired = [request_id for request_id, parked in self.parked.items() if parked.deadline <= now]
        for request_id in expired:
            self.release(request_id)
        self.num_expired += len(expired)
        return expired
