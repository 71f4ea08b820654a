"""Continuous batching: each step, decide which sequences run which tokens, and give them pages.

Plain Python, no JAX. A sequence's next work is always "compute KV for tokens [num_computed_tokens,
num_tokens)": one token for a decode, a chunk of the prompt (or of prompt + output after a
preemption) for a prefill. The per-step token budget is shared: decodes first, so a long prompt
never holds running sequences back for more than one chunk; then chunks of running prefills; then
newly admitted sequences. Admission reuses the longest cached prefix of full pages and requires
room for everything the sequence may grow to (prompt + max_tokens). When pages still run out the
youngest running sequence is preempted: its pages are released (its full pages stay cached, on the
device or in the host tier) and it is recomputed from what remains cached, which leaves its output
unchanged.

With overlapped steps the scheduler plans step N+1 while step N still runs: a sequence's next chunk
starts after the KV that N computes (`next_kv_position`), and a token that N samples is planned over
before the host has seen it (`num_planned_tokens`; the device feeds it to N+1 from the sequence's token
slot). A sequence in a running step is never preempted, and one that will finish by length once its
pending token lands is not planned further, so no step computes a token beyond max_tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from jaxserve.host.page_allocator import ROOT_KEY, PageAllocator, num_pages_for
from jaxserve.host.request import RequestStatus, SequenceState


def padded_to_blocks(num_tokens: int, block: int) -> int:
    """Prefill chunks start on multiples of the query block: a chunk's tokens rounded up to whole blocks."""
    return -(-num_tokens // block) * block


@dataclass
class ScheduledChunk:
    seq: SequenceState
    start: int  # position of the first token whose KV this step computes
    num_tokens: int
    # Only the chunk that reaches the newest token yields logits worth sampling; fixed when planned,
    # because the sequence grows before an overlapped step's results are processed.
    samples_next_token: bool = field(init=False)

    def __post_init__(self):
        self.samples_next_token = self.end == self.seq.num_planned_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class Schedule:
    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[SequenceState] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.decodes + self.prefills)


class Scheduler:
    def __init__(
        self, allocator: PageAllocator, *, max_num_seqs: int, max_num_batched_tokens: int, prefill_query_block: int
    ):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.query_block = prefill_query_block
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []  # in admission order: the last is the youngest
        self.reserved_slots = 0  # held for KV handovers under way (a decode replica's reservations)
        self.num_preemptions = 0
        # Each running sequence holds one of max_num_seqs token slots: where the device keeps the
        # newest token it sampled, so an overlapped step can read it before the host has.
        self._free_token_slots = list(range(max_num_seqs - 1, -1, -1))

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_sequences(self) -> int:
        """Running and waiting: how loaded this data-parallel rank is."""
        return len(self.running) + len(self.waiting)

    def add(self, seq: SequenceState) -> None:
        seq.status = RequestStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: SequenceState, reason: str) -> None:
        """Drop a sequence (finished or aborted) wherever it is and free its pages at once. A step still
        running may write its KV into them: any later step that reuses them runs after it on the device."""
        if seq in self.running:
            self._leave_running(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.session_id is not None:
            self.allocator.keep_for_session(seq.page_ids)
        self._release_pages(seq)
        seq.status = RequestStatus.FINISHED
        seq.finish_reason = reason

    def park(self, seq: SequenceState) -> None:
        """Stop scheduling a running sequence but keep its pages held (a prefill replica's sequence
        waiting for a decode replica to take its KV); `finish` releases them later."""
        self._leave_running(seq)
        seq.status = RequestStatus.PREEMPTED

    def _enter_running(self, seq: SequenceState) -> None:
        seq.token_slot = self._free_token_slots.pop()
        seq.status = RequestStatus.RUNNING
        self.running.append(seq)

    def _leave_running(self, seq: SequenceState) -> None:
        self.running.remove(seq)
        self._free_token_slots.append(seq.token_slot)
        seq.token_slot = -1

    def mark_dispatched(self, chunks: list[ScheduledChunk]) -> None:
        """The chunks' step is on the device: plan the next one after it."""
        for chunk in chunks:
            chunk.seq.num_inflight_tokens += chunk.num_tokens
            chunk.seq.num_pending_tokens += chunk.samples_next_token

    def mark_processed(self, chunk: ScheduledChunk) -> None:
        chunk.seq.num_inflight_tokens -= chunk.num_tokens
        chunk.seq.num_pending_tokens -= chunk.samples_next_token

    def admit_prefilled(self, seq: SequenceState) -> None:
        """Run a sequence whose pages already hold its KV (handed over by a prefill replica): its
        page_ids, page_keys and num_computed_tokens are set, so its next chunk is a decode."""
        if len(self.running) >= self.max_num_seqs:
            raise RuntimeError("admit_prefilled needs a free slot; reserve one first")
        self._enter_running(seq)

    def finish_or_flush(self, seq: SequenceState, reason: str) -> None:
        """Finish a sequence; but when its newest token would complete a page, first compute that
        token's KV (one more step, nothing sampled) so the next turn of a chat finds the whole page.
        A sequence with a step in flight is computing that KV already: it finishes once that step is
        processed, and the token the step samples is dropped."""
        if seq.num_inflight_tokens or (
            self.allocator.enable_prefix_caching and seq.num_tokens % self.allocator.page_size == 0
        ):
            seq.finish_reason, seq.flushing = reason, True
        else:
            self.finish(seq, reason)

    def _release_pages(self, seq: SequenceState) -> None:
        self.allocator.release(seq.page_ids)
        seq.page_ids = []
        seq.page_keys = []

    def cache_full_pages(self, seq: SequenceState) -> None:
        """Make the sequence's newly filled pages findable by later requests (prompt and output alike)."""
        if not self.allocator.enable_prefix_caching:
            return
        size = self.allocator.page_size
        for index in range(len(seq.page_keys), seq.num_computed_tokens // size):
            parent = seq.page_keys[-1] if seq.page_keys else ROOT_KEY
            tokens = tuple(seq.token_slice(index * size, (index + 1) * size))
            seq.page_keys.append(self.allocator.cache_full_page(seq.page_ids[index], parent, tokens))

    def _next_chunk(self, seq: SequenceState, budget: int, start: int | None = None) -> ScheduledChunk | None:
        start = seq.next_kv_position if start is None else start
        remaining = seq.num_planned_tokens - start
        if remaining == 1:
            return ScheduledChunk(seq, start, 1) if budget >= 1 else None
        num_tokens = min(remaining, budget // self.query_block * self.query_block)
        return ScheduledChunk(seq, start, num_tokens) if num_tokens > 0 else None

    def _cost(self, chunk: ScheduledChunk) -> int:
        return (
            1
            if chunk.seq.num_planned_tokens - chunk.start == 1
            else padded_to_blocks(chunk.num_tokens, self.query_block)
        )

    def _pages_needed(self, chunk: ScheduledChunk) -> int:
        return num_pages_for(chunk.end, self.allocator.page_size) - len(chunk.seq.page_ids)

    def _preempt(self, seq: SequenceState) -> None:
        if seq.flushing:  # nothing left to give its caller: drop it rather than recompute it
            self.finish(seq, seq.finish_reason)
            return
        self._leave_running(seq)
        self._release_pages(seq)  # full pages stay cached, so the resumed sequence finds them again
        seq.num_computed_tokens = 0
        seq.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _make_room(self, chunk: ScheduledChunk, scheduled: set[int], schedule: Schedule) -> bool:
        """Preempt the youngest unscheduled running sequences until the chunk's pages fit.

        Returns False when the chunk's own sequence had to go.
        """
        needed = self._pages_needed(chunk)
        while not self.allocator.can_allocate(needed):
            victim = next(
                (s for s in reversed(self.running) if s.seq_id not in scheduled and not s.num_inflight_tokens), None
            )
            if victim is None:
                return False
            self._preempt(victim)
            schedule.preempted.append(victim)
            if victim is chunk.seq:
                return False
        return True

    def _place(self, chunk: ScheduledChunk, schedule: Schedule, scheduled: set[int]) -> None:
        chunk.seq.page_ids.extend(self.allocator.allocate(self._pages_needed(chunk)))
        is_decode = chunk.seq.num_planned_tokens - chunk.start == 1
        (schedule.decodes if is_decode else schedule.prefills).append(chunk)
        scheduled.add(chunk.seq.seq_id)

    def schedule(self) -> Schedule:
        schedule, scheduled = Schedule(), set()
        budget = self.max_num_batched_tokens
        plannable = [s for s in self.running if self._has_work(s)]
        decoding = [s for s in plannable if s.num_planned_tokens - s.next_kv_position == 1]
        prefilling = [s for s in plannable if s.num_planned_tokens - s.next_kv_position > 1]
        for seq in decoding + prefilling:
            if seq.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            chunk = self._next_chunk(seq, budget)
            if chunk is None:
                continue
            if not self._make_room(chunk, scheduled, schedule):
                continue
            self._place(chunk, schedule, scheduled)
            budget -= self._cost(chunk)
        # Admit waiting sequences in arrival order; never preempt to admit, and never re-admit in the
        # step that preempted, which would only trade one sequence for another.
        while self.waiting and not schedule.preempted and len(self.running) + self.reserved_slots < self.max_num_seqs:
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break
            self.waiting.popleft()
            self._enter_running(chunk.seq)
            self._place(chunk, schedule, scheduled)
            budget -= self._cost(chunk)
        return schedule

    @staticmethod
    def _has_work(seq: SequenceState) -> bool:
        """Whether a running sequence has KV left to compute: not while a flushing one's last token is
        in flight, nor when the token in flight is its last by max_tokens."""
        if seq.flushing:
            return seq.next_kv_position < seq.num_tokens
        if seq.num_pending_tokens and len(seq.output_token_ids) + seq.num_pending_tokens >= seq.params.max_tokens:
            return False
        return seq.next_kv_position < seq.num_planned_tokens

    def _admit(self, seq: SequenceState, budget: int) -> ScheduledChunk | None:
        """Reuse the sequence's cached prefix and give it its first chunk, if it fits.

        Admission counts everything the sequence may grow to (prompt + max_tokens), not only its
        first chunk, so that admitted sequences do not keep preempting each other.
        """
        size = self.allocator.page_size
        found = self.allocator.find_cached_prefix(seq.token_ids, seq.num_tokens - 1)
        num_cached = found.num_pages * size
        chunk = self._next_chunk(seq, budget, start=num_cached)
        if chunk is None:
            return None
        final_length = seq.num_prompt_tokens + seq.params.max_tokens
        needed = num_pages_for(max(chunk.end, final_length), size) - found.num_pages
        if needed + self.allocator.num_pages_to_claim(found) > self.allocator.num_free_pages:
            return None
        seq.page_ids, seq.page_keys = self.allocator.claim(found), list(found.keys)
        self.allocator.record_query(seq.num_tokens, num_cached, found.miss_reason)
        seq.num_computed_tokens = num_cached
        if not seq.output_token_ids:
            seq.num_cached_tokens = num_cached
        return chunk
