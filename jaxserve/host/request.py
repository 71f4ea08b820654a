"""Requests as the host sees them: sampling parameters, per-sequence state, and the outputs returned."""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, named as in vLLM. temperature 0 means greedy."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (the sampled one is always added)

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be a non-negative integer below 2**63, got {self.seed!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {min(self.stop_token_ids)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be a non-negative integer, got {self.logprobs!r}")

    @functools.cached_property
    def stop_token_id_set(self) -> frozenset[int]:
        """stop_token_ids for the per-token check: O(1) however many a request names."""
        return frozenset(self.stop_token_ids)


class FinishReason(enum.StrEnum):
    """Why a sequence ended. A str, so it travels as itself over JSON and gRPC ("stop", "length", ...)."""

    STOP = "stop"  # an EOS or stop token, or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # the caller (or the server, for a client that stopped reading) cancelled it
    ERROR = "error"  # the server failed it; the stream carries the reason


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)  # identity, not field-by-field, equality: sequences are compared in queues
class SequenceState:
    """One generated sequence: the prompt plus what has been sampled so far, and where its KV lives.

    A request with n > 1 owns n sequences that share the prompt.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling_seed: int  # the key all of this sequence's random draws derive from
    arrival_order: int
    session_id: str | None = None
    rank: int = 0  # the data-parallel rank whose devices and pages hold this sequence
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)
    page_keys: list[int] = field(default_factory=list)  # prefix-cache keys of the full pages, in order
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    # Overlapped steps: the scheduler plans a step while the previous one still runs on the device.
    num_inflight_tokens: int = 0  # tokens whose KV a dispatched, not yet processed, step computes
    num_pending_tokens: int = 0  # tokens a dispatched step samples that the host has not seen yet
    token_slot: int = -1  # where the device keeps this sequence's newest sampled token (-1: not running)
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    flushing: bool = False  # finished for its caller; runs one more step to cache its last page
    text: str = ""
    detokenizer_state: object = None
    stop_matcher: object = None  # where the stop-string search stands in text (host/stop_strings.py)

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without concatenating prompt and output (this runs every step)."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Known tokens plus the ones dispatched steps are sampling: what the scheduler plans over."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def next_kv_position(self) -> int:
        """The first position whose KV no step has computed or is computing."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(output.finished for output in self.outputs)


@dataclass
class Request:
    """A request as the engine holds it: its prompt and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[SequenceState]

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.seqs)

    def output(self) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=i,
                text=seq.text,
                token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason,
                logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            )
            for i, seq in enumerate(self.seqs)
        ]
        return RequestOutput(
            self.request_id,
            self.prompt,
            list(self.prompt_token_ids),
            outputs,
            num_cached_tokens=self.seqs[0].num_cached_tokens,
        )
