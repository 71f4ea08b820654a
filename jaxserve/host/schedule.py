"""What the scheduler hands out: a step's plan (which sequences compute which tokens) and reservations
(a slot and pages held for a prompt whose KV another replica computes). Plain data, no JAX."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.host.request import SequenceState


def padded_to_blocks(num_tokens: int, block: int) -> int:
    """Prefill chunks start on multiples of the query block: a chunk's tokens rounded up to whole blocks."""
    return -(-num_tokens // block) * block


@dataclass(frozen=True)
class SchedulerLoad:
    """What one scheduler reports of itself (engine/stats.py sums the ranks')."""

    num_running: int
    num_waiting: int
    num_free_pages: int
    num_tokens_waiting_prefill: int  # prompt tokens (of running and waiting sequences) not yet computed
    num_preemptions: int


@dataclass
class ScheduledChunk:
    seq: SequenceState
    start: int  # position of the first token whose KV this step computes
    num_tokens: int
    # Speculation: tokens proposed to follow the newest one, verified in this chunk (a verify row: the
    # newest token then these, num_tokens = 1 + len(draft_token_ids)); empty for other chunks.
    draft_token_ids: tuple[int, ...] = ()
    # Only the chunk that reaches the newest token yields logits worth sampling (none with max_tokens 0:
    # the request ends after its prefill); fixed when planned, because the sequence grows before an
    # overlapped step's results are processed.
    samples_next_token: bool = field(init=False)

    def __post_init__(self):
        reaches_newest = self.end - len(self.draft_token_ids) == self.seq.num_planned_tokens
        self.samples_next_token = reaches_newest and self.seq.params.max_new_tokens > 0

    @property
    def scored_positions(self) -> range:
        """Positions whose logits score the next prompt token (prompt logprobs): those of this chunk
        before the prompt's last, for a sequence gathering them. Position p scores token p + 1, so a
        chunk's first token was scored by the previous chunk's last position."""
        if self.seq.prompt_logprobs is None:
            return range(0)
        return range(self.start, min(self.end, self.seq.num_prompt_tokens - 1))

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class Schedule:
    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[SequenceState] = field(default_factory=list)
    verifies: list[ScheduledChunk] = field(default_factory=list)  # decodes with proposed tokens

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.verifies

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.decodes + self.prefills + self.verifies)


@dataclass
class Reservation:
    """A slot and pages held for a prompt whose KV another replica computes."""

    request_id: str
    page_ids: list[int]  # covering the whole prompt; the first len(held_keys) hold cached KV
    held_keys: list[int]  # keys of the prompt's full pages this side already holds, in order
    num_cached_tokens: int

    @property
    def missing_page_ids(self) -> list[int]:
        """Where the KV this side lacks goes, in prompt order: the pages after the cached prefix."""
        return self.page_ids[len(self.held_keys) :]
