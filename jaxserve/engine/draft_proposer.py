"""The draft-model proposer (`speculative.method: draft`): a smaller model of the same tokenizer, or the
target's own quantized copy, proposes each speculating row's next k tokens greedily; the target verifies
them in its verify step (device/verify_step.py). Built at start by engine/draft_model.py.

One `propose` call per step, for every row that may speculate:

    catch up     the draft computes the KV of the row's tokens it lacks: the target's newest token and
                 whatever it accepted beyond the draft's own fed proposals (one or two tokens, as decode
                 steps), or, further behind (the first call, a row that backed off), a prefill of all but
                 the newest token, chunked by the token budget; where the draft is the target at another
                 precision (its cache has the target's layout: `draft_kv_from_target`), those tokens' pages
                 are copied from the target's pool instead, which holds their KV already
    propose      k greedy decode steps batched over the rows, chained on the device through the token
                 buffer (each step reads the token the previous one sampled), fetched once at the end;
                 where every row wants k proposals, steps 2..k run as one executable (device/step.py
                 chained_steps: one dispatch, whose host time is a fifth of a small draft's step on a CPU)

Why greedy: a deterministic proposer is a point mass q = one-hot(d), for which Leviathan et al.'s
acceptance min(1, p(d) / q(d)) = p(d) and the residual max(0, p - q) renormalized is p without d; the
verify step's "sample every position as plain decoding would, accept the matching prefix" is exactly that
rule, so the target's distribution is kept for sampled rows too (and seeded outputs are identical with
speculation on and off). A sampled draft would need q's probabilities in the verify step.

The draft's KV is its own (its own pages and allocators, no prefix cache): proposals the target rejected
lie beyond what the next call keeps and are overwritten; a row the target preempted or took from its
prefix cache costs the draft a prefill of the row's tokens, which a small draft pays quickly, or a copy of
the target's pages. Why copy: a 4-bit draft's prefill is compute-bound as the target's is, so a 170-token
code prompt cost the draft 350 ms beside the target's 430 (AVX2 EPYC, session 44), and the target's KV of
those tokens is the exact KV the draft's own approximates; the draft attends it with its own queries. A row that
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
import numpy as np

from jaxserve.arrays import HostOrDeviceArray
from jaxserve.device.page_copies import CountingCompiles, PagesBetweenPools
from jaxserve.device.runner import ModelRunner
from jaxserve.device.step_inputs import StepShape, catch_up_step_shape, step_shape
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

    def catch_up_chunk(self) -> ScheduledChunk:
        """The draft's first step: position .. the newest token (one or two tokens), sampling the first proposal."""
        self.view.num_pending_tokens = 0
        return ScheduledChunk(self.view, self.position, self.seq.num_tokens - self.position)

    def proposal_chunk(self, step: int) -> ScheduledChunk:
        """The draft's later steps feed its own previous sample, which the step reads from the draft's token
        buffer: the view knows the tokens up to its position (placeholders past the sequence's), and one
        pending."""
        position, view = self.seq.num_tokens + step - 1, self.view
        del view.prompt_token_ids[position:]
        view.prompt_token_ids.extend([0] * (position - len(view.prompt_token_ids)))
        view.num_pending_tokens = 1
        return ScheduledChunk(view, position, 1)


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
        target_runner: ModelRunner | None = None,
    ):
        self.runner = runner
        # the target's runner where rows far behind copy its pages (one device, pools alike), else None
        self.target_runner = target_runner
        self._copy_pages = PagesBetweenPools(target_runner.kv_pages, runner.kv_pages) if target_runner else None
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
        self.num_chained_steps = 0  # of num_decode_steps, those run in chains
        # Chain a round's steps after the first where the runner compiled chains of that length (tests turn it
        # off to compare)
        self.chain_steps = True
        self.num_rows_without_pages = 0
        self.num_copied_pages = 0  # from the target's pool
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
        token, under each rank's token budget; nothing is sampled, so nothing is fetched. Where the draft takes the
        target's KV, their pages are copied instead."""
        if self.target_runner is not None:
            self._copy_far_behind(per_rank_plans)
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
            runner = self.runner
            shape = step_shape(per_rank_chunks, False, runner.buckets, runner.page_size, self.block)
            token_ids = self._run(per_rank_chunks, shape)
            self.num_prefill_steps += 1
        if token_ids is not None:  # waited for, so that its time is known (rare: not the steady state)
            jax.block_until_ready(token_ids)
            self.catch_up_seconds += time.perf_counter() - start

    def _copy_far_behind(self, per_rank_plans: list[list[RowPlan]]) -> None:
        """Rows more than DECODE_CATCH_UP tokens behind: the target's pages of positions [position, newest token)
        into the row's draft pages at the same page index (the pools' pages hold the same positions). The target
        computed every one of them (a row proposes once its newest token alone is left), and whole pages go: a
        first page's earlier positions are the same tokens' KV, a last page's later ones the draft overwrites
        before it reads them."""
        page_size = self.runner.page_size
        source, dest = [], []
        for plans in per_rank_plans:
            for plan in plans:
                end = plan.seq.num_tokens - 1
                if end - plan.position < DECODE_CATCH_UP:
                    continue
                first, last = plan.position // page_size, (end - 1) // page_size + 1
                row_source, row_dest = plan.seq.page_ids[first:last], plan.row.page_ids[first:last]
                if len(row_source) != last - first or len(row_dest) != last - first:
                    continue  # (not expected: both hold these positions) the draft prefills the row instead
                source += row_source
                dest += row_dest
                plan.position = end
        if not source:
            return
        start = time.perf_counter()
        assert self.target_runner is not None and self._copy_pages is not None
        self.runner.kv_pages = self._copy_pages(self.target_runner.kv_pages, self.runner.kv_pages, source, dest)
        self.num_copied_pages += len(source)
        # waited for, as a prefill is: a one-off per row that the policy leaves out of the step's time
        jax.block_until_ready(self.runner.kv_pages)
        self.catch_up_seconds += time.perf_counter() - start

    def _decode(self, per_rank_plans: list[list[RowPlan]]) -> list[list[list[int]]]:
        """Each row feeds its remaining known tokens (one or two: DECODE_CATCH_UP) in a first step and then
        its own samples, one position per step: `limit` steps, whose samples are its proposals (per rank,
        per plan). Two known tokens (all proposals accepted: the last one, never fed, and the target's next
        token) go in one catch-up step of two-token rows: a whole draft step less per such round."""
        runner = self.runner
        num_steps = max(plan.limit for plans in per_rank_plans for plan in plans)
        # every row wants num_steps proposals, and the runner chains num_steps - 1 steps: steps 1.. in one
        # dispatch (rows with fewer, near max_tokens or max_model_len, take the steps one at a time)
        chained = (
            self.chain_steps
            and num_steps - 1 == runner.chain_length > 0
            and all(plan.limit == num_steps for plans in per_rank_plans for plan in plans)
        )
        # (sampled token ids on the device: [rows] a step's, [steps, rows] a chain's; [(plan, row of the step)])
        sampled = []
        for step in range(1 if chained else num_steps):
            per_rank_chunks, proposing = [], []
            for rank, plans in enumerate(per_rank_plans):
                chunks = []
                for plan in plans:
                    if step < plan.limit:
                        proposing.append((plan, rank, len(chunks)))
                        chunks.append(plan.catch_up_chunk() if step == 0 else plan.proposal_chunk(step))
                per_rank_chunks.append(chunks)
            if any(chunk.num_tokens > 1 for chunks in per_rank_chunks for chunk in chunks):
                shape = catch_up_step_shape(per_rank_chunks, runner.buckets, runner.page_size)
            else:
                shape = step_shape(per_rank_chunks, True, runner.buckets, runner.page_size, self.block)
            token_ids = self._run(per_rank_chunks, shape)
            rows = [(plan, runner.layout.rows(rank, shape.num_seqs).start + row) for plan, rank, row in proposing]
            sampled.append((token_ids, rows))
            self.num_decode_steps += 1
        if chained:
            sampled.append(self._run_chain(per_rank_plans, num_steps))
        fetched = jax.device_get([token_ids for token_ids, _ in sampled])
        proposals: dict[int, list[int]] = {id(plan): [] for plans in per_rank_plans for plan in plans}
        for token_ids, (_, proposing) in zip(fetched, sampled):
            for step_token_ids in np.reshape(token_ids, (-1, np.shape(token_ids)[-1])):
                for plan, row in proposing:
                    proposals[id(plan)].append(int(step_token_ids[row]))
        return [[proposals[id(plan)] for plan in plans] for plans in per_rank_plans]

    def _run_chain(self, per_rank_plans: list[list[RowPlan]], num_steps: int) -> tuple[HostOrDeviceArray, list]:
        """Steps 1 .. num_steps - 1 of rows that all propose num_steps tokens, in one dispatch: each step's
        inputs built as for a step of its own, all in the last step's shape (whose pages bucket holds every
        step's), stacked. (Their sampled token ids [steps, rows] on the device, [(plan, row)].)"""
        runner = self.runner

        def chunks(step: int) -> list[list[ScheduledChunk]]:
            # proposal_chunk sets the view to the step's: each step's inputs are built right after its chunks
            return [[plan.proposal_chunk(step) for plan in plans] for plans in per_rank_plans]

        shape = step_shape(chunks(num_steps - 1), True, runner.buckets, runner.page_size, self.block)
        steps = [runner.build_inputs(chunks(step), shape) for step in range(1, num_steps)]
        token_ids = runner.execute_chain(
            shape, jax.tree.map(lambda *arrays: np.stack(arrays), *steps)
        ).sampled.token_ids
        rows = [
            (plan, runner.layout.rows(rank, shape.num_seqs).start + row)
            for rank, plans in enumerate(per_rank_plans)
            for row, plan in enumerate(plans)
        ]
        self.num_decode_steps += num_steps - 1
        self.num_chained_steps += num_steps - 1
        return token_ids, rows

    def _run(self, per_rank_chunks: list[list[ScheduledChunk]], shape: StepShape) -> HostOrDeviceArray:
        """Dispatch one draft step: its sampled token ids (on the device, not fetched); rank r's rows start at
        layout.rows(r, shape.num_seqs).start."""
        pending = self.runner.execute(shape, self.runner.build_inputs(per_rank_chunks, shape))
        return pending.sampled.token_ids

    def stats(self) -> dict:
        return {
            "speculative_draft_model": self.description,
            "speculative_draft_kv_pages_total": sum(a.num_usable_pages for a in self.allocators),
            "speculative_draft_kv_pages_free": sum(a.num_free_pages for a in self.allocators),
            "speculative_draft_prefill_steps": self.num_prefill_steps,
            "speculative_draft_copied_pages": self.num_copied_pages,
            "speculative_draft_decode_steps": self.num_decode_steps,
            "speculative_draft_chained_steps": self.num_chained_steps,
            "speculative_draft_rows_without_pages": self.num_rows_without_pages,
            "speculative_draft_seconds": round(self.seconds, 3),
            "speculative_draft_num_compiles_after_warmup": self.runner.num_compiles_after_warmup,
        }
