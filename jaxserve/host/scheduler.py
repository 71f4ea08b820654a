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

A decode replica also admits sequences whose prompt KV arrives from a prefill replica: `reserve` holds
a slot and the prompt's pages (its cached prefix shared) under the same admission check as a local
sequence, and `admit_reserved` runs the sequence once the KV has been written into them.

With overlapped steps the scheduler plans step N+1 while step N still runs: a sequence's next chunk
starts after the KV that N computes (`next_kv_position`), and a token that N samples is planned over
before the host has seen it (`num_planned_tokens`; the device feeds it to N+1 from the sequence's token
slot). A sequence in a running step is never preempted, and one that will finish by length once its
pending token lands is not planned further, so no step computes a token beyond max_tokens. A stop
token (EOS, stop_token_ids, a stop string) cannot be known before its step is fetched, and by then
the next step is on the device: that one row computes the stop token's KV (kept when it completes
a page) and its sampled token is dropped; the sequence, flushing, is planned nothing more
(tests/host/test_stop_in_flight.py).
"""

from __future__ import annotations

from collections import deque

from jaxserve.host.page_allocator import ROOT_KEY, CachedPrefix, PageAllocator, num_pages_for
from jaxserve.host.request import FinishReason, RequestStatus, SequenceState
from jaxserve.host.schedule import Reservation, Schedule, ScheduledChunk, SchedulerLoad, padded_to_blocks


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
        self.reservations: dict[str, Reservation] = {}  # each holds a slot until admitted or released
        self.num_preemptions = 0
        # Each running sequence holds one of max_num_seqs token buffer entries: where the device keeps the
        # newest token it sampled, so an overlapped step can read it before the host has.
        self._free_buffer_entries = list(range(max_num_seqs - 1, -1, -1))

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def load(self) -> SchedulerLoad:
        waiting_prefill = sum(
            seq.num_tokens - seq.next_kv_position - 1
            for seq in (*self.running, *self.waiting)
            if seq.num_tokens - seq.next_kv_position > 1
        )
        return SchedulerLoad(
            len(self.running), len(self.waiting), self.allocator.num_free_pages, waiting_prefill, self.num_preemptions
        )

    @property
    def num_sequences(self) -> int:
        """Running and waiting: how loaded this data-parallel rank is."""
        return len(self.running) + len(self.waiting)

    def add(self, seq: SequenceState) -> None:
        seq.status = RequestStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: SequenceState, reason: FinishReason) -> None:
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
        seq.token_buffer_entry = self._free_buffer_entries.pop()
        seq.status = RequestStatus.RUNNING
        self.running.append(seq)

    def _leave_running(self, seq: SequenceState) -> None:
        self.running.remove(seq)
        self._free_buffer_entries.append(seq.token_buffer_entry)
        seq.token_buffer_entry = -1

    def mark_dispatched(self, chunks: list[ScheduledChunk]) -> None:
        """The chunks' step is on the device: plan the next one after it."""
        for chunk in chunks:
            chunk.seq.num_inflight_tokens += chunk.num_tokens
            chunk.seq.num_pending_tokens += chunk.samples_next_token

    def mark_processed(self, chunk: ScheduledChunk) -> None:
        chunk.seq.num_inflight_tokens -= chunk.num_tokens
        chunk.seq.num_pending_tokens -= chunk.samples_next_token

    def reserve(
        self, request_id: str, prompt_token_ids: list[int], max_tokens: int, root_key: int = ROOT_KEY
    ) -> Reservation | None:
        """Hold a slot and pages for a prompt whose KV arrives from elsewhere, or None when admission
        would refuse it (no free slot, too few pages for prompt + max_tokens). root_key: the chain its cached
        pages are found under (a LoRA adapter's identity; ROOT_KEY for the base model)."""
        if request_id in self.reservations:
            raise ValueError(f"request id {request_id!r} already has a reservation")
        num_prompt_tokens = len(prompt_token_ids)
        # the whole prompt may be cached: its first token comes with the handover
        found = self._admissible(prompt_token_ids, num_prompt_tokens, num_prompt_tokens + max_tokens, root_key)
        if found is None:
            return None
        page_ids = self._claim(found, num_prompt_tokens)
        page_ids += self.allocator.allocate(num_pages_for(num_prompt_tokens, self.allocator.page_size) - len(page_ids))
        reservation = Reservation(request_id, page_ids, list(found.keys), found.num_pages * self.allocator.page_size)
        self.reservations[request_id] = reservation
        return reservation

    def release_reservation(self, request_id: str) -> bool:
        """Free a reservation's slot and pages (the handover failed or was abandoned); False if none."""
        reservation = self.reservations.pop(request_id, None)
        if reservation is not None:
            self.allocator.release(reservation.page_ids)
        return reservation is not None

    def admit_reserved(self, seq: SequenceState) -> None:
        """Its reservation's pages hold the prompt's KV now: run the sequence in the reserved slot from
        its next token. The handed-over full pages join this side's prefix cache."""
        reservation = self.reservations.pop(seq.request_id)
        seq.page_ids, seq.page_keys = reservation.page_ids, []
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_cached_tokens = reservation.num_cached_tokens
        self.cache_full_pages(seq)
        self._enter_running(seq)

    def finish_or_flush(self, seq: SequenceState, reason: FinishReason) -> None:
        """Finish a sequence; but when its newest token would complete a page, first compute that
        token's KV (one more step, nothing sampled) so the next turn of a chat finds the whole page.
        A sequence with a step in flight is computing that KV already: it finishes once that step is
        processed, and the token the step samples is dropped."""
        if seq.num_inflight_tokens or (
            self.allocator.enable_prefix_caching
            and seq.num_tokens % self.allocator.page_size == 0
            and seq.num_computed_tokens < seq.num_tokens  # a dropped token (no token allowed) left it computed
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
            parent = seq.page_keys[-1] if seq.page_keys else seq.cache_root_key
            tokens = tuple(seq.token_slice(index * size, (index + 1) * size))
            seq.page_keys.append(self.allocator.cache_full_page(seq.page_ids[index], parent, tokens))

    def _next_chunk(self, seq: SequenceState, budget: int, start: int | None = None) -> ScheduledChunk | None:
        start = seq.next_kv_position if start is None else start
        remaining = seq.num_planned_tokens - start
        if remaining == 1:
            return ScheduledChunk(seq, start, 1) if budget >= 1 else None
        num_tokens = min(remaining, budget // self.query_block * self.query_block)
        return ScheduledChunk(seq, start, num_tokens) if num_tokens > 0 else None

    def _verify_chunk(self, chunk: ScheduledChunk, drafts: list[int], budget: int) -> ScheduledChunk:
        """The decode chunk widened by its proposals, as many as the budget and free pages allow (a
        proposal never preempts anyone); the plain chunk when none fit."""
        num_drafts = min(len(drafts), budget - 1)
        while num_drafts > 0:
            verify = ScheduledChunk(chunk.seq, chunk.start, 1 + num_drafts, tuple(drafts[:num_drafts]))
            if self.allocator.can_allocate(self._pages_needed(verify)):
                return verify
            num_drafts -= 1
        return chunk

    def _cost(self, chunk: ScheduledChunk) -> int:
        return (
            chunk.num_tokens
            if chunk.seq.num_planned_tokens - chunk.start == 1
            else padded_to_blocks(chunk.num_tokens, self.query_block)
        )

    def _pages_needed(self, chunk: ScheduledChunk) -> int:
        return num_pages_for(chunk.end, self.allocator.page_size) - len(chunk.seq.page_ids)

    def _preempt(self, seq: SequenceState) -> None:
        if seq.flushing:  # nothing left to give its caller: drop it rather than recompute it
            assert seq.finish_reason is not None  # finish_or_flush set both
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
        if chunk.draft_token_ids:
            schedule.verifies.append(chunk)
        else:
            (schedule.decodes if is_decode else schedule.prefills).append(chunk)
        scheduled.add(chunk.seq.seq_id)

    def schedule(self, drafts: dict[int, list[int]] | None = None) -> Schedule:
        """drafts: seq_id -> tokens proposed to follow a decoding sequence's newest token (speculation);
        such a sequence runs a verify chunk when its pages fit without preempting anyone."""
        schedule, scheduled = Schedule(), set()
        budget = self.max_num_batched_tokens
        plannable = [s for s in self.running if self.has_work(s)]
        decoding = [s for s in plannable if s.num_planned_tokens - s.next_kv_position == 1]
        prefilling = [s for s in plannable if s.num_planned_tokens - s.next_kv_position > 1]
        for seq in decoding + prefilling:
            if seq.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            chunk = self._next_chunk(seq, budget)
            if chunk is None:
                continue
            if drafts and drafts.get(seq.seq_id):
                chunk = self._verify_chunk(chunk, drafts[seq.seq_id], budget)
            if not self._make_room(chunk, scheduled, schedule):
                continue
            self._place(chunk, schedule, scheduled)
            budget -= self._cost(chunk)
        # Admit waiting sequences in arrival order; never preempt to admit, and never re-admit in the
        # step that preempted, which would only trade one sequence for another.
        while self.waiting and not schedule.preempted:
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break
            self.waiting.popleft()
            self._enter_running(chunk.seq)
            self._place(chunk, schedule, scheduled)
            budget -= self._cost(chunk)
        return schedule

    @staticmethod
    def has_work(seq: SequenceState) -> bool:
        """Whether a running sequence has KV left to compute: not while a flushing one's last token is
        in flight, nor when the token in flight is its last by max_tokens."""
        if seq.flushing:
            return seq.next_kv_position < seq.num_tokens
        if seq.num_pending_tokens and len(seq.output_token_ids) + seq.num_pending_tokens >= seq.params.max_new_tokens:
            return False
        return seq.next_kv_position < seq.num_planned_tokens

    def _admissible(
        self, token_ids: list[int], num_cacheable_tokens: int, final_length: int, root_key: int = ROOT_KEY
    ) -> CachedPrefix | None:
        """The one admission check, for waiting sequences and reservations alike: a free slot (reserved
        ones count as taken), and free pages for everything the sequence may grow to beyond its cached
        prefix, so that admitted sequences do not keep preempting each other. The cached prefix found,
        or None."""
        if len(self.running) + len(self.reservations) >= self.max_num_seqs:
            return None
        found = self.allocator.find_cached_prefix(token_ids, num_cacheable_tokens, root_key)
        needed = num_pages_for(final_length, self.allocator.page_size) - found.num_pages
        if needed + self.allocator.num_pages_to_claim(found) > self.allocator.num_free_pages:
            return None
        return found

    def _claim(self, found: CachedPrefix, num_query_tokens: int) -> list[int]:
        self.allocator.record_query(num_query_tokens, found.num_pages * self.allocator.page_size, found.miss_reason)
        return self.allocator.claim(found)

    def _admit(self, seq: SequenceState, budget: int) -> ScheduledChunk | None:
        """Reuse the sequence's cached prefix and give it its first chunk, if it fits."""
        # at least the newest token is computed here: its logits sample the next one
        num_cacheable = seq.num_tokens - 1
        if seq.num_unscored_prompt_tokens:  # cached positions would go unscored: only the scored ones may be
            num_cacheable = min(num_cacheable, len(seq.prompt_logprobs or ()))
        found = self._admissible(
            seq.token_ids, num_cacheable, seq.num_prompt_tokens + seq.params.max_new_tokens, seq.cache_root_key
        )
        if found is None:
            return None
        num_cached = found.num_pages * self.allocator.page_size
        chunk = self._next_chunk(seq, budget, start=num_cached)
        if chunk is None:
            return None
        seq.page_ids, seq.page_keys = self._claim(found, seq.num_tokens), list(found.keys)
        seq.num_computed_tokens = num_cached
        if not seq.output_token_ids:
            seq.num_cached_tokens = num_cached
        return chunk
