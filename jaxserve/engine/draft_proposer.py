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

The draft's KV is its own (its own pages and allocators, no prefix cache): proposals the target rejected
lie beyond what the next call keeps and are overwritten; a row the target preempted or took from its
prefix cache costs the draft a prefill of the row's tokens, which a small draft pays quickly. A row that
finds no draft pages (after the least recently proposing rows gave theirs up) proposes nothing; a request
never fails because of its draft.

On a data-parallel mesh the draft's rows follow each rank's sequences: its pool is split by the target's
ranks (device/rank_layout.py), one allocator per rank, and every draft step runs all ranks' rows at once,
each rank's on its own devices, as the target's steps do.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import jax

from jaxserve.arrays import HostOrDeviceArray
from jaxserve.device.page_copies import CountingCompiles
from jaxserve.device.runner import ModelRunner
from jaxserve.device.step_inputs import step_shape
from jaxserve.host.page_allocator import PageAllocator, num_pages_for
from jaxserve.host.request import SamplingParams, SequenceState
from jaxserve.host.schedule import ScheduledChunk, padded_to_blocks
from jaxserve.lora.registry import LoraRegistry

# A row this many tokens behind (or fewer) catches up with decode steps; further behind, with a prefill.
DECODE_CATCH_UP = 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass
class DraftRow:
    """What the draft's cache holds for one target sequence: positions [0, num_confirmed) hold the
    target's tokens, then the draft's own fed proposals (the target may have accepted some of them)."""

    rank: int  # the data-parallel rank whose pages (of the draft's pool) hold it: the sequence's
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
        allocators: list[PageAllocator],
        *,
        max_rows: int,
        max_num_batched_tokens: int,
        prefill_query_block: int,
        compile_counter,
        description: str,
        lora: LoraRegistry | None = None,
    ):
        self.runner = runner
        self.allocators = allocators  # one per data-parallel rank, over its own pages of the draft's pool
        self.max_rows = max_rows  # per rank
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block = prefill_query_block
        self.compile_counter = compile_counter  # the target's runner: compiles while proposing count there too
        self.description = description
        self.lora = lora  # the draft's own adapter slots, loaded with the target's (engine/draft_lora.py)
        self.rows: dict[int, DraftRow] = {}  # seq_id -> its draft state
        self._uses = itertools.count(1)
        self.num_prefill_steps = 0
        self.num_decode_steps = 0
        self.num_rows_without_pages = 0
        self.seconds = 0.0
        # What the last propose call spent on catch-up prefills (a new row, a row that backed off, speculation
        # back on after plain steps): a one-off per row, which the policy leaves out of the step's time
        self.catch_up_seconds = 0.0

    def propose(self, seqs: list[SequenceState], max_tokens: list[int]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in seqs]
        per_rank: list[list[tuple[int, SequenceState, int]]] = [[] for _ in self.allocators]
        for i, (seq, limit) in enumerate(zip(seqs, max_tokens)):
            if limit > 0:
                per_rank[seq.rank].append((i, seq, limit))
        start = time.perf_counter()
        self.catch_up_seconds = 0.0
        with CountingCompiles(self.compile_counter):
            # each round: up to max_rows rows of every rank, all ranks in the same draft steps
            for first in range(0, max(map(len, per_rank)), self.max_rows):
                self._propose_group([wanted[first : first + self.max_rows] for wanted in per_rank], proposals)
        self.seconds += time.perf_counter() - start
        return proposals

    def forget(self, seq: SequenceState) -> None:
        row = self.rows.pop(seq.seq_id, None)
        if row is not None and row.page_ids:
            self.allocators[row.rank].release(row.page_ids)

    def _propose_group(
        self, per_rank_group: list[list[tuple[int, SequenceState, int]]], proposals: list[list[int]]
    ) -> None:
        in_group = {seq.seq_id for group in per_rank_group for _, seq, _ in group}
        per_rank_plans: list[list[RowPlan]] = []
        for rank, group in enumerate(per_rank_group):
            plans = []
            for index, seq, limit in group:
                row = self.rows.setdefault(seq.seq_id, DraftRow(rank))
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
                    token_buffer_entry=len(plans),  # within the rank's entries
                    # the adapter's slot, in the draft's slots where it has them (else its base weights)
                    lora_slot=seq.lora_slot if self.lora is not None else 0,
                )
                plans.append(RowPlan(index, seq, row, view, row.num_valid(seq), limit))
            per_rank_plans.append(plans)
        if not any(per_rank_plans):
            return
        self._prefill_far_behind(per_rank_plans)
        for plans, proposed in zip(per_rank_plans, self._decode(per_rank_plans)):
            for plan, tokens in zip(plans, proposed):
                proposals[plan.index] = tokens
                plan.row.num_confirmed = plan.seq.num_tokens
                plan.row.fed_proposals = tokens[: plan.limit - 1]

    def _reserve_pages(self, row: DraftRow, num_positions: int, in_group: set[int]) -> bool:
        """Pages for positions [0, num_positions), taken from the least recently proposing other rows if
        the rank's pool runs short."""
        allocator = self.allocators[row.rank]
        needed = num_pages_for(num_positions, allocator.page_size) - len(row.page_ids)
        if needed <= 0:
            return True
        while not allocator.can_allocate(needed):
            others = [
                (r.last_use, seq_id)
                for seq_id, r in self.rows.items()
                if seq_id not in in_group and r.page_ids and r.rank == row.rank
            ]
            if not others:
                return False
            victim = self.rows.pop(min(others)[1])
            allocator.release(victim.page_ids)
        row.page_ids.extend(allocator.allocate(needed))
        return True

    def _prefill_far_behind(self, per_rank_plans: list[list[RowPlan]]) -> None:
        """Rows more than DECODE_CATCH_UP tokens behind: prefill chunks up to (not including) the newest
        token, under each rank's token budget; nothing is sampled, so nothing is fetched."""
        start, token_ids = time.perf_counter(), None
        while True:
            per_rank_chunks = []
            for plans in per_rank_plans:
                chunks, budget = [], self.max_num_batched_tokens
                for plan in plans:
                    end = plan.seq.num_tokens - 1
                    if end - plan.position < DECODE_CATCH_UP or budget < self.block:
                        continue
                    num_tokens = min(end - plan.position, budget // self.block * self.block)
                    chunks.append(ScheduledChunk(plan.view, plan.position, num_tokens))
                    budget -= padded_to_blocks(num_tokens, self.block)
                    plan.position += num_tokens
                per_rank_chunks.append(chunks)
            if not any(per_rank_chunks):
                break
            token_ids, _ = self._run(per_rank_chunks, is_decode=False)
            self.num_prefill_steps += 1
        if token_ids is not None:  # waited for, so that its time is known (rare: not the steady state)
            jax.block_until_ready(token_ids)
            self.catch_up_seconds += time.perf_counter() - start

    def _decode(self, per_rank_plans: list[list[RowPlan]]) -> list[list[list[int]]]:
        """Each row feeds its remaining known tokens and then its own samples, one position per step;
        the samples from the newest token on are its proposals (per rank, per plan)."""
        layout = self.runner.layout
        sampled = []  # (step's sampled token ids on the device, [(plan, row of the step)])
        num_steps = max(plan.num_decode_steps for plans in per_rank_plans for plan in plans)
        for step in range(num_steps):
            per_rank_chunks, proposing = [], []
            for rank, plans in enumerate(per_rank_plans):
                chunks = []
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
                        proposing.append((plan, rank, len(chunks)))
                    chunks.append(chunk)
                per_rank_chunks.append(chunks)
            token_ids, num_seqs = self._run(per_rank_chunks, is_decode=True)
            rows = [(plan, layout.rows(rank, num_seqs).start + row) for plan, rank, row in proposing]
            sampled.append((token_ids, rows))
            self.num_decode_steps += 1
        fetched = jax.device_get([token_ids for token_ids, _ in sampled])
        proposals: dict[int, list[int]] = {id(plan): [] for plans in per_rank_plans for plan in plans}
        for token_ids, (_, proposing) in zip(fetched, sampled):
            for plan, row in proposing:
                proposals[id(plan)].append(int(token_ids[row]))
        return [[proposals[id(plan)][: plan.limit] for plan in plans] for plans in per_rank_plans]

    def _run(self, per_rank_chunks: list[list[ScheduledChunk]], is_decode: bool) -> tuple[HostOrDeviceArray, int]:
        """Dispatch one draft step: its sampled token ids (on the device, not fetched) and its rows per rank
        (rank r's rows start at layout.rows(r, that).start)."""
        runner = self.runner
        shape = step_shape(per_rank_chunks, is_decode, runner.buckets, runner.page_size, self.block)
        pending = runner.execute(shape, runner.build_inputs(per_rank_chunks, shape))
        return pending.sampled.token_ids, shape.num_seqs

    def stats(self) -> dict:
        return {
            "speculative_draft_model": self.description,
            "speculative_draft_kv_pages_total": sum(a.num_usable_pages for a in self.allocators),
            "speculative_draft_kv_pages_free": sum(a.num_free_pages for a in self.allocators),
            "speculative_draft_prefill_steps": self.num_prefill_steps,
            "speculative_draft_decode_steps": self.num_decode_steps,
            "speculative_draft_rows_without_pages": self.num_rows_without_pages,
            "speculative_draft_seconds": round(self.seconds, 3),
            "speculative_draft_num_compiles_after_warmup": self.runner.num_compiles_after_warmup,
        }
