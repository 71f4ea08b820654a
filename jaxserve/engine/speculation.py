"""The engine's side of speculative decoding (config: SpeculativeConfig).

Each step: the policy decides whether this batch size speculates (host/speculation_policy.py); if so,
every decoding sequence that may speculate gets proposals from the proposer (host/proposers.py), and
the scheduler widens its decode chunk into a verify chunk when its pages fit. Verify chunks run in an
executable of their own (device/verify_step.py), after the step's prefill and decode executables, and
their results are appended by host/verify_outputs.py.

Overlap: a proposal needs the sequence's newest token on the host, and the step after a verify step
starts where acceptance left each row. So while speculation is on, the engine processes the step in
flight before planning the next (as it does for grammar rows); when the policy turns speculation off
(a large batch, poor acceptance) the steps overlap again.

Which prompt-lookup proposals a row verifies: those of a match length whose proposals the row's text has
been following (host/proposal_gate.py: per row and class of match length, a decaying average of the tokens
accepted, withheld proposals scored too once the tokens after them are known), against a line measured from
the steps' own times (a verify step's extra cost over a plain one's, per batch size). A row whose newest token is in
flight is waited for only where the proposal of its known tokens (one token stale) would be verified, so
plain chat (little to look up) keeps its overlap while code edits (long quotes) speculate on every step.

Where nothing would verify (no proposal this step, and every row quiet: its recent proposals of any class,
verified or withheld and scored, and its lookups that found nothing, well below the line), the plain steps run in
decode chains (engine/decode_chain.py, `chains_allowed`), as with speculation off: one dispatch and one fetch
for k tokens. Plain chat ran at 0.73-0.96x of speculation off before, every plain step dispatched alone. A
row's stale proposal made while a chain is in flight is scored once the chain's tokens are known, so a row
that starts to quote is seen at the chain's end; rows of a code edit (long quotes accepted) are never quiet,
so their misses are not chained through (session 44's chains on the policy's plain verdict cost code 15-20%).

A draft model's rows that keep failing back off instead (its proposals cost steps, so they cannot be scored
for free): a row whose proposal was rejected outright, or that had none, for the second time in a row skips
speculation for 2, 4, ... up to MAX_BACKOFF_TOKENS of its tokens (reset by an accepted proposal), and is not
waited for meanwhile. The first miss after an accepted proposal (or a row's first) costs no backoff: in a code
edit it is where the reply departs from the quoted text (a renamed variable) and the quote resumes a token
later.

While the policy has plain decoding winning, an ngram proposer (free to run) still proposes for the rows
(`_look_ahead`): a row whose next tokens follow such a proposal for LOOK_AHEAD_HIT_TOKENS has the policy
measure speculation again now. The policy's estimates are per batch size, not per text: bench/speculative.py's
adaptive engine measured speculation losing on its 8-token chat warm-up and then ran the code prompts plain
until its next trial, 64+ steps later (10 verify rows in all; 57 with the look-ahead).

Grammar rows speculate (as vLLM's structured outputs do): a proposal is cut at the first token the grammar
refuses (or an EOS: the target samples it itself), and each verify position gets the mask of the grammar
advanced through the proposals before it (engine/constraints.py), so every sample is the target's under the
grammar, as without speculation. Where the grammar forces the next tokens (a JSON schema's keys and
punctuation) those are the proposal, unless the proposer's follows them further (a draft model is not run in
a step where every row it would propose for has such tokens): SGLang's jump-forward, verified rather than
assumed, since the model may spell the forced text with other tokens. A grammar row backing off from its
proposer still verifies the tokens its grammar forces. A row whose grammar starts after a token (a reasoning
model's </think>) verifies proposals up to before that token: the position after it needs the grammar's
first mask, known only once the token is accepted.

Rows that never speculate (they decode as usual): multi-token bad words' (their bans depend on the tokens
before), a flushing sequence's, and one whose newest token is still on the device.
"""

from __future__ import annotations

import time

from jaxserve.config import SpeculativeConfig
from jaxserve.host.output_processor import OutputProcessor
from jaxserve.host.proposal_gate import ProposalGate, num_followed
from jaxserve.host.proposers import NgramProposer, Proposer
from jaxserve.host.request import RequestStatus, SequenceState
from jaxserve.host.schedule import ScheduledChunk
from jaxserve.host.scheduler import Scheduler
from jaxserve.host.speculation_policy import AcceptanceCounts, SpeculationPolicy
from jaxserve.host.verify_outputs import process_verified

MAX_BACKOFF_TOKENS = 16
LOOK_AHEAD_HIT_TOKENS = 4  # a look-ahead proposal followed this far (or all of it): try speculation now


def may_speculate(seq: SequenceState) -> bool:
    """Whether the sequence's next tokens can be verified exactly (see the module docstring)."""
    if seq.flushing or seq.status is not RequestStatus.RUNNING:
        return False
    return seq.controls is None or not seq.controls.multi_token_bad_words


def forced_tokens(seq: SequenceState, limit: int) -> list[int]:
    """The first `limit` tokens a grammar row's grammar forces next ([] for other rows)."""
    return seq.grammar.forced_tokens()[:limit] if seq.grammar is not None else []


def verifiable_part(
    seq: SequenceState, proposal: list[int], forced: list[int], eos_token_ids: frozenset[int]
) -> list[int]:
    """What the row verifies of a proposal (see the module docstring): all of it, but for a grammar row up
    to the first token the grammar refuses or the first EOS, or the tokens the grammar forces next (`forced`:
    forced_tokens) where the proposal departs from them or stops short of them; for a row whose grammar waits
    for a token, up to before that token."""
    if seq.waiting_grammar is not None:
        trigger = seq.params.guided_decoding_after_token
        return proposal[: proposal.index(trigger)] if trigger in proposal else proposal
    if seq.grammar is None:
        return proposal
    before_eos = next((i for i, token in enumerate(proposal) if token in eos_token_ids), len(proposal))
    proposal = proposal[: seq.grammar.num_acceptable_tokens(proposal[:before_eos])]
    follows_forced = proposal[: len(forced)] == forced[: len(proposal)]
    return proposal if follows_forced and len(proposal) > len(forced) else forced


def _gated(
    gate: ProposalGate, seq: SequenceState, match_length: int, proposal: list[int], batch_size: int
) -> list[int]:
    """The proposal if the gate admits it at this batch size; else [] (the row decodes a plain token), the
    proposal kept to be scored."""
    if not proposal or gate.admits(seq.seq_id, match_length, batch_size):
        return proposal
    gate.withhold(seq.seq_id, len(seq.output_token_ids), match_length, proposal)
    return []


def is_decoding(seq: SequenceState) -> bool:
    """Ready to decode (or verify) its next token now."""
    return seq.num_planned_tokens - seq.next_kv_position == 1


def is_past_its_prompt(seq: SequenceState) -> bool:
    """Decoding, or verifying in a step in flight (its proposals' KV is in flight beyond its planned
    tokens): what the policy counts as the batch. Counting only is_decoding rows saw a batch of 0 while
    a verify step was in flight, and so planned a plain step after every verify step."""
    return seq.status is RequestStatus.RUNNING and seq.num_planned_tokens - seq.next_kv_position <= 1


def speculation_batch_size(scheduler: Scheduler) -> int:
    """What the policy counts as a rank's batch: 0 while no row decodes (nothing to propose for), else every
    running sequence, prefilling ones too (not the waiting queue: it adds nothing to a step's cost). Counting
    only the decoding rows (and rows verifying in a step in flight) let the first few rows of a large burst
    speculate while the rest prefilled: a draft model's catch-up prefills and decode steps were added to each
    of those steps, which the policy never measures (steps with prefill chunks are not observed): 32 requests
    at once ran at 0.87x of speculation off (idle, int8 self-draft)."""
    decoding = sum(is_past_its_prompt(seq) for seq in scheduler.running)
    return len(scheduler.running) if decoding else 0


class Speculation:
    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        proposer: Proposer | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ):
        self.config = config
        self.eos_token_ids = eos_token_ids
        self.enabled = config.enabled
        self.max_model_len = max_model_len
        self.proposer: Proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        # prompt lookup's proposals are free to make and to score: gated per row (a draft's back off instead)
        self.lookup = self.proposer if isinstance(self.proposer, NgramProposer) else None
        self.gate = ProposalGate(config.verify_width - 1) if self.lookup is not None else None
        self.policy = SpeculationPolicy(config.speculative_max_batch_size, config.speculative_adaptive)
        self.counts = AcceptanceCounts()
        self.speculating = False  # this step's decision
        self.batch_size = 0  # speculation_batch_size when it was made
        # What proposing for the step being planned took (all of it), and the part its step is charged with
        # (catch-up prefills left out): the step that uses the proposals is charged, not the step processed
        # in the same call (with a draft model, proposing is most of a step)
        self.proposing_seconds = 0.0
        self.proposal_seconds = 0.0
        self.num_steps_speculating = 0
        self.num_steps_plain = 0
        self._proposed_for: dict[int, SequenceState] = {}  # seq_id -> sequence the proposer may hold state for
        self._misses: dict[int, int] = {}  # seq_id -> proposals in a row that gave nothing
        self._resume_at: dict[int, int] = {}  # seq_id -> output length before which it does not speculate
        # seq_id -> (output length then, proposal) made while plain decoding won (_look_ahead)
        self._looked_ahead: dict[int, tuple[int, list[int]]] = {}

    # -- each step ----------------------------------------------------------------------------------

    def begin_step(self, schedulers: list[Scheduler]) -> None:
        """Decide whether the step about to be planned speculates (from the busiest rank's decoding rows)."""
        if not self.enabled:
            return
        self.proposing_seconds = self.proposal_seconds = 0.0
        self.batch_size = max(speculation_batch_size(s) for s in schedulers)
        self.speculating = self.policy.speculate(self.batch_size)
        if self.speculating:
            self.num_steps_speculating += 1
        else:
            self.num_steps_plain += 1

    def waits_for(self, in_flight_executables, schedulers: list[Scheduler]) -> bool:
        """Whether the step in flight must be processed before the next is planned: it verified (the
        next positions depend on acceptance), or a row about to speculate lacks its newest token."""
        if not self.enabled:
            return False
        if any(executable.shape.verifies for executable in in_flight_executables):
            return True
        return self.speculating and any(
            seq.num_pending_tokens and self._expects_proposal(seq)
            for scheduler in schedulers
            for seq in scheduler.running
        )

    def _may_propose(self, seq: SequenceState) -> bool:
        return may_speculate(seq) and len(seq.output_token_ids) >= self._resume_at.get(seq.seq_id, 0)

    def _expects_proposal(self, seq: SequenceState) -> bool:
        """For a row whose newest token is in flight: whether the next step would verify for it (the engine
        then waits for that token). A grammar row (its forced tokens) and a draft's row: unless backing off. A
        gated row: where its known tokens' proposal (one token stale: the token in flight is most often that
        proposal's first, and then the row's own proposal is the rest, of a match one token longer) would be
        verified; where it would not, the rest is withheld and scored (the row is not waited for, so
        `proposals` does not see it until the gate lets it verify again)."""
        if not self._may_propose(seq):
            return False
        lookup, gate = self.lookup, self.gate
        if lookup is None or gate is None or seq.grammar is not None or seq.waiting_grammar is not None:
            return True
        limit = self._proposal_limit(seq)
        if limit <= 0:
            return False
        gate.settle(seq.seq_id, seq.output_token_ids)
        in_flight = seq.num_pending_tokens  # 1, or a decode chain's k
        ((match_length, stale),) = lookup.propose_matched([seq], [limit + in_flight])
        self._proposed_for[seq.seq_id] = seq  # the proposer indexed it: forgotten with the others
        if len(stale) < in_flight + 1:
            if not stale:
                gate.observe_lookup(seq.seq_id)
            return False
        if gate.admits(seq.seq_id, match_length + in_flight, self.batch_size):
            return True
        # scored only if the tokens in flight turn out to be the stale proposal's first
        start = len(seq.output_token_ids) + in_flight
        gate.withhold(seq.seq_id, start, match_length + in_flight, stale[in_flight:], after=stale[:in_flight])
        return False

    def chains_allowed(self, schedulers: list[Scheduler], proposals: list[dict[int, list[int]]]) -> bool:
        """Whether the next plain steps may run as one decode chain (engine/decode_chain.py; it still checks its
        own conditions): always without speculation; with prompt lookup, where this step verifies nothing and
        every row that may speculate is quiet (host/proposal_gate.py is_quiet: its recent proposals, verified or
        withheld and scored, fell well below the line), or the batch is past the sizes that speculate. Then the engine runs
        what speculation off runs (plain chat: nothing to look up); a row whose text starts to quote is seen at
        the chain's end, where its proposal is verified if its class admits it. With a draft model: where the
        policy has plain decoding winning at this batch size (or the batch is past the sizes that speculate), as
        speculation off would run; the draft catches up on the chained tokens when speculation resumes, as after
        plain steps one at a time. Its rows backing off while speculation wins still step one at a time (each
        resumes at its own token)."""
        if not self.enabled:
            return True
        if self.lookup is None:
            return not self.speculating
        gate = self.gate
        assert gate is not None  # prompt lookup's
        if any(proposals):
            return False
        if self.batch_size > self.policy.max_batch_size:
            return True
        return all(
            gate.is_quiet(seq.seq_id, self.batch_size)
            for scheduler in schedulers
            for seq in scheduler.running
            if self._may_propose(seq) and self._proposal_limit(seq) > 0
        )

    def _proposal_limit(self, seq: SequenceState) -> int:
        """Tokens a verify row of the sequence may propose after its newest token (pending ones counted): all its
        proposals and one more are emitted, never past max_tokens or max_model_len."""
        return min(
            self.config.verify_width - 1,
            seq.params.max_new_tokens - len(seq.output_token_ids) - seq.num_pending_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
        )

    def _observe_outcome(self, seq: SequenceState, num_accepted: int) -> None:
        """A proposal's outcome: scored by the gate (ngram), or a draft's row backs off after its second
        proposal in a row that gave nothing (see the module docstring)."""
        if self.gate is not None:
            self.gate.verified(seq.seq_id, num_accepted)
            return
        if num_accepted:
            self._misses.pop(seq.seq_id, None)
            self._resume_at.pop(seq.seq_id, None)
            return
        misses = self._misses[seq.seq_id] = self._misses.get(seq.seq_id, 0) + 1
        if misses > 1:  # the first miss in a row is free (see the module docstring)
            self._resume_at[seq.seq_id] = len(seq.output_token_ids) + min(2 ** (misses - 1), MAX_BACKOFF_TOKENS)

    def proposals(self, schedulers: list[Scheduler]) -> list[dict[int, list[int]]]:
        """Per rank: seq_id -> proposed tokens for its decoding sequences (empty unless this step
        speculates). One proposer call for every rank, so that a draft model runs all ranks' rows at once."""
        self._forget_finished()
        lookup, gate = self.lookup, self.gate
        if gate is not None:
            # a verify row the scheduler planned plain (no pages or budget for it) was never processed
            gate.clear_verifying()
        if not self.speculating:
            self._look_ahead(schedulers)
            return [{} for _ in schedulers]
        seqs, limits, forced = [], [], []  # forced: each row's forced_tokens
        proposals: list[dict[int, list[int]]] = [{} for _ in schedulers]
        for seq in (seq for scheduler in schedulers for seq in scheduler.running):
            if not (is_decoding(seq) and not seq.num_pending_tokens and may_speculate(seq)):
                continue
            if gate is not None:
                gate.settle(seq.seq_id, seq.output_token_ids)
            limit = self._proposal_limit(seq)
            if limit <= 0:
                continue
            if self._may_propose(seq):
                seqs.append(seq)
                limits.append(limit)
                forced.append(forced_tokens(seq, limit))
                self._proposed_for[seq.seq_id] = seq
            elif row_forced := forced_tokens(seq, limit):
                # backing off from the proposer, not from what the grammar forces (a JSON reply's free text
                # backs a row off just before the keys and punctuation that follow it)
                proposals[seq.rank][seq.seq_id] = row_forced
        if seqs and self._only_forced(seqs, forced, proposals):
            return proposals
        start = time.perf_counter()
        match_lengths = [0] * len(seqs)
        if lookup is not None and gate is not None and seqs:
            match_lengths, proposed = map(list, zip(*lookup.propose_matched(seqs, limits)))
            for seq, proposal in zip(seqs, proposed):
                if not proposal:
                    gate.observe_lookup(seq.seq_id)
            proposed = [_gated(gate, seq, n, p, self.batch_size) for seq, n, p in zip(seqs, match_lengths, proposed)]
        else:
            proposed = self.proposer.propose(seqs, limits) if seqs else []
        seconds = time.perf_counter() - start
        self.proposing_seconds += seconds
        # a draft's catch-up prefills are a one-off per row: charged to no step (host/speculation_policy.py)
        catch_up = getattr(self.proposer, "catch_up_seconds", 0.0) if seqs else 0.0
        self.proposal_seconds += max(seconds - catch_up, 0.0)
        for seq, looked_up, row_forced, match_length in zip(seqs, proposed, forced, match_lengths):
            proposal = verifiable_part(seq, looked_up, row_forced, self.eos_token_ids)
            if proposal:
                proposals[seq.rank][seq.seq_id] = proposal
                if gate is not None and proposal == looked_up[: len(proposal)]:
                    gate.verifying(seq.seq_id, match_length)  # not a grammar's forced tokens: the lookup's
            else:
                self._observe_outcome(seq, 0)
        return proposals

    def _only_forced(self, seqs: list[SequenceState], forced: list[list[int]], proposals) -> bool:
        """Where a draft model would propose only for grammar rows whose grammars force their next tokens, its
        proposals would be replaced by those (verifiable_part): they are the proposals, and the draft is not run
        this step (its rows catch up later, one prefill of the tokens). Beside a row that needs the draft it
        runs for all: batched, the forced rows cost it little, and their draft KV stays in step (skipping them
        at batch 4 meant a catch-up prefill on most rounds: 0.85x the constrained tokens/s)."""
        if isinstance(self.proposer, NgramProposer) or not all(forced):  # a row without forced tokens needs it
            return False
        for seq, tokens in zip(seqs, forced):
            proposals[seq.rank][seq.seq_id] = tokens
        return True

    def _look_ahead(self, schedulers: list[Scheduler]) -> None:
        """While plain decoding wins at this batch size: check the proposals made at earlier steps against the
        tokens that followed, and propose again (see the module docstring). Only for a proposer that costs
        nothing (prompt lookup; a draft model's proposals cost it steps)."""
        if not (self.policy.adaptive and isinstance(self.proposer, NgramProposer)):
            return
        if not 1 <= self.batch_size <= self.policy.max_batch_size:
            return
        k = self.config.verify_width - 1
        for seq in (seq for scheduler in schedulers for seq in scheduler.running):
            if not (is_past_its_prompt(seq) and self._may_propose(seq)):
                continue
            if seq.seq_id in self._looked_ahead:
                start, proposal = self._looked_ahead[seq.seq_id]
                followed = seq.output_token_ids[start : start + len(proposal)]
                matched = num_followed(proposal, followed)
                if matched >= min(LOOK_AHEAD_HIT_TOKENS, len(proposal)):
                    self.policy.try_speculation_now(self.batch_size)
                if matched < len(followed) or len(followed) == len(proposal) or matched >= LOOK_AHEAD_HIT_TOKENS:
                    del self._looked_ahead[seq.seq_id]  # settled
                    if self.gate is not None:  # whether the row is quiet (chains_allowed)
                        self.gate.observe_lookup(seq.seq_id, matched)
            if seq.seq_id not in self._looked_ahead:
                # what follows the known tokens (overlapped, the newest is still in flight: it is checked too)
                (proposal,) = self.proposer.propose([seq], [k])
                self._proposed_for[seq.seq_id] = seq  # the proposer indexed it (and the gate may hold a record)
                if proposal:
                    self._looked_ahead[seq.seq_id] = (len(seq.output_token_ids), proposal)
                elif self.gate is not None:
                    self.gate.observe_lookup(seq.seq_id)

    def process(
        self,
        chunks: list[ScheduledChunk],
        scheduler: Scheduler,
        result,
        first_row: int,
        width: int,
        outputs: OutputProcessor,
    ) -> set[str]:
        for index, chunk in enumerate(chunks):
            self._observe_outcome(chunk.seq, int(result.num_accepted[first_row + index]))
        return process_verified(
            chunks, scheduler, result.sampled, result.num_accepted, first_row, width, outputs, self.counts
        )

    def observe_step(
        self,
        executables,
        seconds: float,
        num_tokens: int,
        speculated: bool,
        batch_size: int,
        proposal_seconds: float = 0.0,
        num_decode_steps: int = 1,
    ) -> None:
        """A processed step's wall time and tokens, for the policy (steps with prefill chunks are left out:
        their time is not decoding's). `seconds` is the engine call's, which also proposed for the step it
        planned: that is taken out, and what proposing for this step took (proposal_seconds) put in. A decode
        chain (num_decode_steps k) is one observation for the policy (its tokens/s) and none for the gate's
        line: a verify row's alternative is a plain step alone (its row is not quiet), not a chain's share."""
        if self.enabled and executables and not any(e.shape.kind == "prefill" for e in executables):
            seconds = max(seconds - self.proposing_seconds + proposal_seconds, 0.0)
            self.policy.observe(batch_size, speculated, seconds, num_tokens)
            if self.gate is not None and num_decode_steps == 1:  # the line: a verify row's cost over a plain one
                # rows verifying on the busiest rank (batch_size counts the busiest rank's rows)
                verifying = max((len(c) for e in executables if e.shape.verifies for c in e.per_rank_chunks), default=0)
                self.gate.costs.observe(batch_size, seconds, verifying)

    def _forget_finished(self) -> None:
        for seq_id, seq in list(self._proposed_for.items()):
            if seq.status is not RequestStatus.RUNNING:
                self.proposer.forget(seq)
                del self._proposed_for[seq_id]
                self._misses.pop(seq_id, None)
                self._resume_at.pop(seq_id, None)
                if self.gate is not None:
                    self.gate.forget(seq_id)
                self._looked_ahead.pop(seq_id, None)

    # -- reporting ----------------------------------------------------------------------------------

    def stats(self) -> dict:
        if not self.enabled:
            return {"speculative_method": None}
        self._forget_finished()  # a draft's pages come back once its sequences ended, not a step later
        counts = self.counts
        proposer_stats = getattr(self.proposer, "stats", None)
        return {
            **(proposer_stats() if proposer_stats is not None else {}),
            "speculative_method": self.config.method,
            "speculative_num_verify_rows": counts.num_verify_rows,
            "speculative_num_draft_tokens": counts.num_draft_tokens,
            "speculative_num_accepted_tokens": counts.num_accepted_tokens,
            "speculative_acceptance_rate": round(counts.acceptance_rate, 4),
            "speculative_mean_accepted_length": round(counts.mean_accepted_length, 4),
            "speculative_steps_on": self.num_steps_speculating,
            "speculative_steps_off": self.num_steps_plain,
            **(
                {
                    "speculative_withheld_proposals": self.gate.num_withheld,
                    # per batch size, accepted tokens a verify row must average (measured step costs)
                    "speculative_break_even_tokens": self.gate.costs.stats(),
                }
                if self.gate is not None
                else {}
            ),
            "speculative_tokens_per_second": self.policy.stats(),
        }
