"""The draft-model proposer (`speculative.method: draft`): a smaller model of the same tokenizer, or the
target's own quantized copy, proposes each speculating row's next k tokens greedily; the target verifies
them in its verify step (device/verify_step.py). Built at start by engine/draft_model.py.

One `propose` call per step, for every row that may speculate:

    catch up     the draft computes the KV of the row's tokens it lacks: the target's newest token and
                 whatever it accepted beyond the draft's own fed proposals (one or two tokens, as decode
                 steps), or, further behind (the first call, a row that backed off), a prefill of all but
                 the newest token, chunked by the token budget
    propose      k greedy decode steps batched over the rows, chained on the device through the token
                 buffer (each step reads the token the previous one sampled), fetched once at the end

Why greedy: a deterministic proposer is a point mass q = one-hot(d), for which Leviathan et al.'s
acceptance min(1, p(d) / q(d)) = p(d) and the residual max(0, p - q) renormalized is p without d; the
verify step's "sample every position as plain decoding would, accept the matching prefix" is exactly that
rule, so the target's distribution is kept for sampled rows too (and seeded outputs are identical with
speculation on and off). A sampled draft would need q's probabilities in the verify step.

The draft's KV is its own (its own pages and allocator, no prefix cache): proposals the target rejected
lie beyond what the next call keeps and are overwritten; a row the target preempted or took from its
prefix cache costs the draft a prefill of the row's tokens, which a small draft pays quickly. A row that
finds no draft pages (after the least recently proposing rows gave theirs up) proposes nothing; a request
never fails because of its draft.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import jax

from jaxserve.device.page_copies import CountingCompiles
from jaxserve.device.runner import ModelRunner
from jaxserve.device.step_inputs import step_shape
from jaxserve.host.page_allocator import PageAllocator, num_pages_for
from jaxserve.host.request import SamplingParams, SequenceState
from jaxserve.host.schedule import ScheduledChunk, padded_to_blocks

# A row this many tokens behind (or fewer) catches up with decode steps; further behind, with a prefill.
DECODE_CATCH_UP = 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass
class DraftRow:
    """What the draft's cache holds for one target sequence: positions [0, num_confirmed) hold the
    target's tokens, then the draft's own fed proposals (the target may have accepted some of them)."""

    page_ids: list[int] = field(default_factory=list)
    num_confirmed: int = 0
    fed_proposals: list[int] = field(default_factory=list)
    last_use: int = 0

    def num_valid(self, seq: SequenceState) -> int:
        """Positions whose KV was computed from the tokens the sequence has now, short of its newest
        token (the draft must feed that one again to sample what follows it)."""
        target = seq.token_slice(self.num_confirmed, self.num_confirmed + len(self.fed_proposals))
        matching = next((i for i, (a, b) in enumerate(zip(self.fed_proposals, target)) if a != b), len(target))
        return min(self.num_confirmed + matching, seq.num_tokens - 1)


@dataclass
class RowPlan:
    index: int  # in the propose call's lists
    seq: SequenceState
    row: DraftRow
    view: SequenceState  # the draft's sequence: the target's tokens, the draft's pages and buffer entry
    position: int  # the next position whose KV the draft computes
    limit: int  # proposals wanted

    @property
    def num_decode_steps(self) -> int:
        """Feeding position .. newest token, then limit - 1 proposals (the last proposal is not fed)."""
        return self.seq.num_tokens - self.position + self.limit - 1


class DraftProposer:
    def __init__(
        self,
        runner: ModelRunner,
        allocator: PageAllocator,
        *,
        max_rows: int,
        max_num_batched_tokens: int,
        prefill_query_block: int,
        compile_counter,
        description: str,
    ):
        self.runner = runner
        self.allocator = allocator
        self.max_rows = max_rows
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block = prefill_query_block
        self.compile_counter = compile_counter  # the target's runner: compiles while proposing count there too
        self.description = description
        self.rows: dict[int, DraftRow] = {}  # seq_id -> its draft state
        self._uses = itertools.count(1)
        self.num_prefill_steps = 0
        self.num_decode_steps = 0
        self.num_rows_without_pages = 0
        self.seconds = 0.0

    def propose(self, seqs: list[SequenceState], max_tokens: list[int]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in seqs]
        wanted = [(i, seq, limit) for i, (seq, limit) in enumerate(zip(seqs, max_tokens)) if limit > 0]
        start = time.perf_counter()
        with CountingCompiles(self.compile_counter):
            for first in range(0, len(wanted), self.max_rows):
                self._propose_group(wanted[first : first + self.max_rows], proposals)
        self.seconds += time.perf_counter() - start
        return proposals

    def forget(self, seq: SequenceState) -> None:
        row = self.rows.pop(seq.seq_id, None)
        if row is not None and row.page_ids:
            self.allocator.release(row.page_ids)

    def _propose_group(self, group: list[tuple[int, SequenceState, int]], proposals: list[list[int]]) -> None:
        in_group = {seq.seq_id for _, seq, _ in group}
        plans = []
        for index, seq, limit in group:
            row = self.rows.setdefault(seq.seq_id, DraftRow())
            row.last_use = next(self._uses)
            # KV up to the newest token and limit - 1 fed proposals
            if not self._reserve_pages(row, seq.num_tokens + limit - 1, in_group):
                self.num_rows_without_pages += 1
                continue
            view = SequenceState(
                seq_id=seq.seq_id,
                request_id=seq.request_id,
                prompt_token_ids=list(seq.token_ids),
                params=GREEDY,
                sampling_seed=0,
                arrival_order=0,
                page_ids=row.page_ids,
                token_buffer_entry=len(plans),
            )
            plans.append(RowPlan(index, seq, row, view, row.num_valid(seq), limit))
        if not plans:
            return
        self._prefill_far_behind(plans)
        for plan, tokens in zip(plans, self._decode(plans)):
            proposals[plan.index] = tokens
            plan.row.num_confirmed = plan.seq.num_tokens
            plan.row.fed_proposals = tokens[: plan.limit - 1]

    def _reserve_pages(self, row: DraftRow, num_positions: int, in_group: set[int]) -> bool:
        """Pages for positions [0, num_positions), taken from the least recently proposing other rows if
        the pool runs short."""
        needed = num_pages_for(num_positions, self.allocator.page_size) - len(row.page_ids)
        if needed <= 0:
            return True
        while not self.allocator.can_allocate(needed):
            others = [(r.last_use, seq_id) for seq_id, r in self.rows.items() if seq_id not in in_group and r.page_ids]
            if not others:
                return False
            victim = self.rows.pop(min(others)[1])
            self.allocator.release(victim.page_ids)
        row.page_ids.extend(self.allocator.allocate(needed))
        return True

    def _prefill_far_behind(self, plans: list[RowPlan]) -> None:
        """Rows more than DECODE_CATCH_UP tokens behind: prefill chunks up to (not including) the newest
        token, under the token budget; nothing is sampled, so nothing is fetched."""
        while True:
            chunks, budget = [], self.max_num_batched_tokens
            for plan in plans:
                end = plan.seq.num_tokens - 1
                if end - plan.position < DECODE_CATCH_UP or budget < self.block:
                    continue
                num_tokens = min(end - plan.position, budget // self.block * self.block)
                chunks.append(ScheduledChunk(plan.view, plan.position, num_tokens))
                budget -= padded_to_blocks(num_tokens, self.block)
                plan.position += num_tokens
            if not chunks:
                return
            self._run([chunks], is_decode=False)
            self.num_prefill_steps += 1

    def _decode(self, plans: list[RowPlan]) -> list[list[int]]:
        """Each row feeds its remaining known tokens and then its own samples, one position per step;
        the samples from the newest token on are its proposals."""
        sampled = []  # (step's sampled token ids on the device, [(plan, row in the step)])
        for step in range(max(plan.num_decode_steps for plan in plans)):
            chunks, proposing = [], []
            for plan in plans:
                if step >= plan.num_decode_steps:
                    continue
                position, view = plan.position + step, plan.view
                # a position past the known tokens reads the token the previous step sampled (the token
                # buffer): the view knows tokens up to it, and samples the next
                del view.prompt_token_ids[max(position, plan.seq.num_tokens) :]
                view.prompt_token_ids.extend([0] * (position - len(view.prompt_token_ids)))
                view.num_pending_tokens = int(position >= plan.seq.num_tokens)
                chunk = ScheduledChunk(view, position, 1)
                if chunk.samples_next_token:
                    proposing.append((plan, len(chunks)))
                chunks.append(chunk)
            sampled.append((self._run([chunks], is_decode=True), proposing))
            self.num_decode_steps += 1
        fetched = jax.device_get([token_ids for token_ids, _ in sampled])
        proposals: dict[int, list[int]] = {id(plan): [] for plan in plans}
        for token_ids, (_, proposing) in zip(fetched, sampled):
            for plan, row in proposing:
                proposals[id(plan)].append(int(token_ids[row]))
        return [proposals[id(plan)][: plan.limit] for plan in plans]

    def _run(self, per_rank_chunks: list[list[ScheduledChunk]], is_decode: bool):
        runner = self.runner
        shape = step_shape(per_rank_chunks, is_decode, runner.buckets, runner.page_size, self.block)
        return runner.execute(shape, runner.build_inputs(per_rank_chunks, shape)).sampled.token_ids

    def stats(self) -> dict:
        return {
            "speculative_draft_model": self.description,
            "speculative_draft_kv_pages_total": self.allocator.num_usable_pages,
            "speculative_draft_kv_pages_free": self.allocator.num_free_pages,
            "speculative_draft_prefill_steps": self.num_prefill_steps,
            "speculative_draft_decode_steps": self.num_decode_steps,
            "speculative_draft_rows_without_pages": self.num_rows_without_pages,
            "speculative_draft_seconds": round(self.seconds, 3),
            "speculative_draft_num_compiles_after_warmup": self.runner.num_compiles_after_warmup,
        }
