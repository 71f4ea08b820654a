"""Which prompt-lookup proposals are worth a verify row (engine/speculation.py). Plain Python, no JAX.

A verify row costs more than a decode row (on a 2-core CPU a 1-row step of 8 tokens took 1.45x a plain step of
one), so a proposal pays only if enough of it is accepted. How much is, depends on the text and on how long the
matched suffix was: replaying the default model's greedy replies through the proposer (bench/speculative.py's
prompts), a code edit's one-token matches were followed for 1.4 tokens a proposal and its 3+-token matches for
5.4, while plain chat's one-token matches gave 0.22 (87% rejected outright) and its two-token ones 0.87.

So each row keeps, per class of match length (1, 2, 3 or more tokens), a decaying average of the tokens its
proposals of that class had accepted, and verifies a proposal only while its class's average reaches
BREAK_EVEN_TOKENS. Proposals of prompt lookup cost nothing to make, so a withheld one is still scored: once the
tokens that followed it are known, its would-be accepted length enters the average as a verified one's does.
A class that fell below the line comes back as soon as the text starts to follow it again, without a trial.

The line itself is measured (StepCosts): a verify step's extra time over a plain step's, in plain steps, is the
tokens a verifying row must add to pay for it. On the 2-core CPU above the device's steps alone make it ~0.45
(BREAK_EVEN_TOKENS, the line until both kinds of step were measured at the batch size); the engine loop's, whose
verify steps also give up the host's overlap, measured 0.8 at one row in float32 and 1.0 in bfloat16; on an accelerator, where a decode step of a few rows
is a read of the weights and 8 tokens a row cost about what 1 does, it is near 0 and every proposal is verified.
In a batch where only some rows verify, the verify executable runs beside the decode one, so its cost is shared by
fewer rows: the line is the extra time over the rows that verified (batch size / verifying rows, on average).
That measures a lone verifying row in a large batch, which pays for a whole pass over the weights; were the line
left there, rows whose proposals are followed for most of their length (a batch of code edits, where many rows
would verify at once and share that pass) could never verify again to show it: it stops at half a proposal's
tokens, and the policy (host/speculation_policy.py), which measures whole steps, still turns speculation off
where it loses.

Each row also keeps one decaying average over every class together, with the lookups that found nothing (0) and,
while the policy has plain decoding winning, how far its look-ahead proposals were followed: a row whose average
is below the line is quiet (`is_quiet`), and where every row is quiet and nothing verifies, the engine runs its
plain steps in decode chains (engine/speculation.py `chains_allowed`).

This replaced a backoff (skip 2, 4, ... 16 tokens after a second miss in a row), which on a code edit's
replies turned a third of the steps plain: a miss is where the reply departs from the quote, and the quote
resumes a token or two later. A draft model's proposals cost steps to make: it keeps the backoff.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BREAK_EVEN_TOKENS = 0.5  # accepted tokens a verify row must average to beat a plain step, until measured (see above)
PRIOR_TOKENS, PRIOR_WEIGHT = 1.0, 2.0  # a row's classes start here: a new row verifies its first proposals
DECAY = 0.8  # of the older samples, per new one: a row's text changes (a quote ends, another begins)
MATCH_CLASSES = 3  # match lengths 1, 2 and 3+
# a withheld proposal followed this far is scored at once (a lower bound: enough to let its class back in)
SETTLED_TOKENS = 4
COST_SAMPLES = 4  # steps of each kind at a batch size before its measured line replaces BREAK_EVEN_TOKENS
COST_WEIGHT = 0.1  # of the newest step in the moving means (a plain mean of the first 1 / COST_WEIGHT)
# A row is quiet below this share of the line (is_quiet): well below it, since chaining through the start of a
# quote costs more than a plain step alone (the measured line moves 0.4-1.0 between runs on a 2-core CPU; at the
# line itself code edits' rows turned quiet in their prose and ran 15-20% slower)
QUIET_SHARE = 0.5


def num_followed(proposal: list[int], followed: list[int]) -> int:
    """How many of a proposal's tokens the tokens that came after it (`followed`, as many as are known) repeat."""
    return next((i for i, (a, b) in enumerate(zip(followed, proposal)) if a != b), len(followed))


def match_class(match_length: int) -> int:
    return min(max(match_length, 1), MATCH_CLASSES) - 1


@dataclass
class MovingMean:
    value: float = 0.0
    num_samples: int = 0

    def add(self, sample: float) -> None:
        self.num_samples += 1
        self.value += max(COST_WEIGHT, 1 / self.num_samples) * (sample - self.value)


@dataclass
class BatchCosts:
    verify_seconds: MovingMean = field(default_factory=MovingMean)  # steps with verify rows
    plain_seconds: MovingMean = field(default_factory=MovingMean)  # decode steps without
    rows_per_verifier: MovingMean = field(default_factory=MovingMean)  # batch size / verifying rows, verify steps

    def break_even(self) -> float | None:
        if min(self.verify_seconds.num_samples, self.plain_seconds.num_samples) < COST_SAMPLES:
            return None
        extra = self.verify_seconds.value / max(self.plain_seconds.value, 1e-9) - 1.0
        return max(extra, 0.0) * self.rows_per_verifier.value


class StepCosts:
    """Per batch size, the measured line a proposal's expected accepted tokens must reach (see the module
    docstring): (verify step seconds / plain step seconds - 1) x (batch size / rows verifying), at most
    `max_line`."""

    def __init__(self, max_line: float) -> None:
        self.by_batch_size: dict[int, BatchCosts] = {}
        self.max_line = max_line

    def observe(self, batch_size: int, seconds: float, num_verifying_rows: int) -> None:
        """A processed decode step (no prefill chunks) of `batch_size` rows, its wall time and its verify rows."""
        if batch_size < 1 or seconds <= 0:
            return
        costs = self.by_batch_size.setdefault(batch_size, BatchCosts())
        if num_verifying_rows:
            costs.verify_seconds.add(seconds)
            costs.rows_per_verifier.add(batch_size / num_verifying_rows)
        else:
            costs.plain_seconds.add(seconds)

    def break_even(self, batch_size: int) -> float:
        costs = self.by_batch_size.get(batch_size)
        measured = costs.break_even() if costs is not None else None
        return min(BREAK_EVEN_TOKENS if measured is None else measured, self.max_line)

    def stats(self) -> dict[str, float]:
        """The measured lines, per batch size."""
        return {
            str(size): round(self.break_even(size), 3)
            for size, costs in sorted(self.by_batch_size.items())
            if costs.break_even() is not None
        }


@dataclass
class RowRecord:
    tokens: list[float] = field(default_factory=lambda: [PRIOR_TOKENS * PRIOR_WEIGHT] * MATCH_CLASSES)
    weights: list[float] = field(default_factory=lambda: [PRIOR_WEIGHT] * MATCH_CLASSES)
    # every class together: the tokens the row's proposals were followed for lately (quiet rows: see `is_quiet`)
    recent_tokens: float = PRIOR_TOKENS * PRIOR_WEIGHT
    recent_weight: float = PRIOR_WEIGHT
    num_scored: int = 0  # proposals scored (verified, or withheld and followed): a quiet row has had one
    verifying: int | None = None  # class of the proposal in a verify step not processed yet
    # per class, a withheld proposal being scored: (the output index of its first token, its tokens, the tokens
    # that must come just before it for it to count, or None)
    withheld: dict[int, tuple[int, list[int], list[int] | None]] = field(default_factory=dict)

    def add(self, cls: int, accepted: int) -> None:
        self.tokens[cls] = DECAY * self.tokens[cls] + accepted
        self.weights[cls] = DECAY * self.weights[cls] + 1.0
        self.num_scored += 1
        self.add_recent(accepted)

    def add_recent(self, accepted: int) -> None:
        self.recent_tokens = DECAY * self.recent_tokens + accepted
        self.recent_weight = DECAY * self.recent_weight + 1.0

    def expected(self, cls: int) -> float:
        return self.tokens[cls] / self.weights[cls]

    def recent(self) -> float:
        return self.recent_tokens / self.recent_weight


class ProposalGate:
    """Per row: whether a proposal of a given match length is verified (see the module docstring)."""

    def __init__(self, max_proposal_tokens: int) -> None:
        self.costs = StepCosts(max_line=max_proposal_tokens / 2)
        self.rows: dict[int, RowRecord] = {}
        self.num_withheld = 0

    def admits(self, seq_id: int, match_length: int, batch_size: int = 1) -> bool:
        """Whether the row verifies a proposal of this match length in a step of `batch_size` rows."""
        record = self.rows.get(seq_id)
        if record is None:
            return True
        return record.expected(match_class(match_length)) >= self.costs.break_even(batch_size)

    def is_quiet(self, seq_id: int, batch_size: int = 1) -> bool:
        """Whether the row's recent proposals, of every class together, fell below the line: its text has not been
        following its lookups (plain chat). The engine then runs its plain steps in decode chains
        (engine/speculation.py `chains_allowed`). A row none of whose proposals was scored yet is not quiet: its
        first proposal is verified (or withheld and scored) first, whatever its lookups that found nothing."""
        record = self.rows.get(seq_id)
        if record is None or not record.num_scored:
            return False
        return record.recent() < QUIET_SHARE * self.costs.break_even(batch_size)

    def observe_lookup(self, seq_id: int, accepted: int = 0) -> None:
        """A lookup that found nothing to propose for the row (0), or a proposal made while speculation was off
        whose tokens were followed `accepted` far (engine/speculation.py's look-ahead): the row's recent record
        only, not a class's (is_quiet)."""
        self.rows.setdefault(seq_id, RowRecord()).add_recent(accepted)

    def verifying(self, seq_id: int, match_length: int) -> None:
        """The row verifies a proposal of this match length in the step being planned."""
        self.rows.setdefault(seq_id, RowRecord()).verifying = match_class(match_length)

    def verified(self, seq_id: int, num_accepted: int) -> None:
        """The row's verify step was processed: num_accepted of its proposal's tokens were accepted."""
        record = self.rows.get(seq_id)
        if record is not None and record.verifying is not None:
            record.add(record.verifying, num_accepted)
            record.verifying = None

    def withhold(
        self, seq_id: int, start: int, match_length: int, proposal: list[int], after: list[int] | None = None
    ) -> None:
        """A proposal not verified (its class below the line), for the output from index `start` on: scored once
        the tokens there are known, if the tokens just before them are `after` (when given: a proposal made while
        those tokens were in flight). One at a time per row and class (a later one while it is open is not
        scored)."""
        record = self.rows.setdefault(seq_id, RowRecord())
        self.num_withheld += 1
        record.withheld.setdefault(match_class(match_length), (start, proposal, after))

    def clear_verifying(self) -> None:
        """Before a step is planned: a proposal marked verifying whose verify step was never processed (the
        scheduler planned the row plain, or not at all) is not scored."""
        for record in self.rows.values():
            record.verifying = None

    def settle(self, seq_id: int, output_token_ids: list[int]) -> None:
        """Scores the row's withheld proposals against the tokens that followed them, once they tell: a
        mismatch, as many tokens as proposed, or SETTLED_TOKENS."""
        record = self.rows.get(seq_id)
        if record is None:
            return
        for cls, (start, proposal, after) in list(record.withheld.items()):
            if (
                after is not None
                and len(output_token_ids) >= start
                and output_token_ids[start - len(after) : start] != after
            ):
                del record.withheld[cls]  # the tokens in flight were others: the row proposed from another match
                continue
            followed = output_token_ids[start : start + len(proposal)]
            matched = num_followed(proposal, followed)
            if matched < len(followed) or len(followed) == len(proposal) or matched >= SETTLED_TOKENS:
                record.add(cls, matched)
                del record.withheld[cls]

    def forget(self, seq_id: int) -> None:
        self.rows.pop(seq_id, None)
