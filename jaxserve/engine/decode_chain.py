"""Decode chains (scheduler.num_scheduler_steps; vLLM's multi-step scheduling): while every running sequence
only decodes, plan k decode steps at once and run them as one executable (device/step.py chained_steps).

Why: a decode step's host work (JAX's dispatch of ~400 arguments and outputs, the inputs, the fetch, the
scheduler) is ~1.5-2.5 ms of CPU, paid again on every token. On a CPU it shares the cores with the step itself,
so it lands on every token's time: a quantized one-row step of the default model is ~5 ms on a 2-core machine,
and the server ran such a stream at ~7.7 ms a token. A chain pays the dispatch and the fetch once per k steps;
each step inside reads the token the one before it sampled from the sequence buffers, on the device, exactly
as an overlapped step does, so outputs are the same as with one step at a time (same seeds, same penalties).

When a chain runs: speculation off (or, with prompt lookup, every row quiet; with a draft model, the policy has
plain decoding winning at this batch size: engine/speculation.py chains_allowed), no request waiting or reserved
(nothing would be admitted mid-chain; a newcomer waits for the chain running and, overlapped, the one planned after
it), every running sequence decoding (no prefill chunk) with rows that do not need each token on the host first
(grammars, multi-token bad words), the k steps' pages free without preempting anyone, some sequence with k tokens
left to generate, and the rows and pages in a compiled chain's shape (up to CHAINED_DECODE_MAX_SEQS rows: above it
the host's share of a step is small, and a chain would only delay admissions). Otherwise steps run one at a time,
as before.

A sequence that stops mid-chain (EOS, a stop string) keeps its slot until the chain is processed; the tokens
its later steps sampled are dropped as an overlapped step's are (scheduler.py), and KV computed past its end
is never counted as computed nor cached.
"""

from __future__ import annotations

import jax

from jaxserve.config import Buckets, EngineConfig, EngineRole
from jaxserve.device.step_inputs import StepShape
from jaxserve.engine.constraints import RowConstraints
from jaxserve.host.page_allocator import num_pages_for
from jaxserve.host.request import SequenceState
from jaxserve.host.scheduler import Scheduler

# Chains are compiled for decode buckets of up to this many rows: measured on a 2-core CPU, the host's work is
# ~25% of a one-row quantized step's time and ~4% of a 32-row one's.
CHAINED_DECODE_MAX_SEQS = 8
# num_scheduler_steps when the config leaves it unset, on a CPU engine that can chain (auto)
CPU_DEFAULT_STEPS = 4
MAX_SCHEDULER_STEPS = 32


def decode_chain_length(config: EngineConfig, several_processes: bool) -> int:
    """The decode steps per chain the engine runs (1: none), from scheduler.num_scheduler_steps; refused where
    chains cannot run. Unset: CPU_DEFAULT_STEPS on a CPU engine that can chain, 1 elsewhere (accelerators: not
    measured yet)."""
    steps = config.scheduler.num_scheduler_steps
    blockers = [
        reason
        for reason, blocks in (
            # speculation chains its plain steps where it proposes nothing (engine/speculation.py chains_allowed)
            ("several processes (jax.distributed)", several_processes),
            (f"disaggregated serving (disagg.role {config.disagg.role.value})", config.disagg.role != EngineRole.BOTH),
        )
        if blocks
    ]
    if steps is None:
        return CPU_DEFAULT_STEPS if not blockers and jax.devices()[0].platform == "cpu" else 1
    if steps > 1 and blockers:
        raise ValueError(
            f"scheduler.num_scheduler_steps {steps} (decode chains) cannot run with {blockers[0]}: set it to 1"
        )
    return steps


class DecodeChains:
    """Decides, before each step is scheduled, whether the next k decode steps can run as one chain, and in
    which compiled shape."""

    def __init__(self, length: int, chain_shapes: list[StepShape], buckets: Buckets, page_size: int):
        self.length = length
        self.shapes = set(chain_shapes)
        self.buckets = buckets
        self.page_size = page_size
        self.num_chains = 0

    def stats(self) -> dict:
        # host_seconds_per_step and step_seconds count a chain as its k steps (Engine._observe_step_time);
        # num_steps counts Engine.step calls
        return {"num_scheduler_steps": self.length, "decode_chains": self.num_chains}

    def shape(self, schedulers: list[Scheduler]) -> StepShape | None:
        """The compiled chain shape the next `length` steps fit in, or None when they should run one at a time."""
        if self.length < 2 or not self.shapes:
            return None
        rows, pages_per_seq, longest = 0, 0, 0
        for scheduler in schedulers:
            if scheduler.waiting or scheduler.reservations:
                return None
            pages_needed, num_rows = 0, 0
            for seq in scheduler.running:
                if not Scheduler.has_work(seq):
                    continue  # nothing more to plan (its last token in flight, flushed): no row
                if seq.num_planned_tokens - seq.next_kv_position != 1 or RowConstraints.reads_each_token(seq):
                    return None  # a prefill chunk (max_tokens 0 too), or rows the host must see each token of
                num_rows += 1
                left = self._tokens_left(seq)  # 0: a max_tokens 0 prompt's last token, one row that samples nothing
                longest = max(longest, left)
                end = seq.next_kv_position + max(1, min(left, self.length))
                pages_per_seq = max(pages_per_seq, num_pages_for(end, self.page_size))
                pages_needed += max(0, num_pages_for(end, self.page_size) - len(seq.page_ids))
            if not scheduler.allocator.can_allocate(pages_needed):
                return None  # planning would preempt: one step at a time decides who goes
            rows = max(rows, num_rows)
        if not rows or longest < self.length:
            return None
        if rows > self.buckets.decode_seqs[-1] or pages_per_seq > self.buckets.pages_per_seq[-1]:
            return None
        num_seqs = Buckets.fit(rows, self.buckets.decode_seqs)
        shape = StepShape(num_seqs, num_seqs, Buckets.fit(pages_per_seq, self.buckets.pages_per_seq), 1)
        return shape if shape in self.shapes else None

    @staticmethod
    def _tokens_left(seq: SequenceState) -> int:
        """Decode rows the scheduler may still plan for a sequence that has work (Scheduler.has_work's rule)."""
        if seq.is_finished:
            return 0
        if seq.flushing:  # finished for its caller, its newest token's KV still to compute (to complete a page)
            return max(0, seq.num_tokens - seq.next_kv_position)
        return max(0, seq.params.max_new_tokens - len(seq.output_token_ids) - seq.num_pending_tokens)
