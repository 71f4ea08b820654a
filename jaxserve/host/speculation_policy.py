"""When to speculate, and how well it goes. Plain Python, no JAX.

Speculation trades compute for steps: a verify row computes k + 1 tokens to emit 1 + (accepted) of
them, and a step with verify rows is processed before the next is planned (the next positions depend
on what was accepted), which gives up the overlap of host and device. On a busy batch the compute is
already used by batching, so the policy (as vLLM's dynamic speculation) measures, per batch size, the
tokens per second of steps with speculation and of steps without, and speculates only while it wins;
every `explore_every` steps at a batch size it tries the other way for `trial_steps` steps, so a change
in acceptance (another kind of text) is noticed. Above `max_batch_size` rows it never speculates (no
verify step is compiled that large).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ThroughputEstimate:
    """Moving averages of a step's tokens and of its seconds: their ratio weighs a verify step that emitted
    five tokens five times, where an average of per-step rates would not."""

    tokens: float = 0.0
    seconds: float = 0.0
    num_samples: int = 0
    weight: float = 0.1  # of the newest sample

    def observe(self, num_tokens: int, seconds: float) -> None:
        if self.num_samples == 0:
            self.tokens, self.seconds = num_tokens, seconds
        else:
            self.tokens += self.weight * (num_tokens - self.tokens)
            self.seconds += self.weight * (seconds - self.seconds)
        self.num_samples += 1

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class BatchSizeState:
    estimates: dict[bool, ThroughputEstimate] = field(
        default_factory=lambda: {True: ThroughputEstimate(), False: ThroughputEstimate()}
    )
    num_decisions: int = 0
    trial_left: int = 0  # steps left of trying the mode that is not the best
    last_observed: bool | None = None  # the mode of the last step measured


class SpeculationPolicy:
    MIN_SAMPLES = 3  # measurements of each mode before comparing them

    def __init__(
        self, max_batch_size: int, adaptive: bool = True, explore_every: int = 64, trial_steps: int = 6
    ) -> None:
        self.max_batch_size = max_batch_size
        self.adaptive = adaptive
        self.explore_every = explore_every
        self.trial_steps = trial_steps
        self.by_batch_size: dict[int, BatchSizeState] = {}

    def speculate(self, batch_size: int) -> bool:
        """Whether a step with this many decoding rows speculates."""
        if batch_size < 1 or batch_size > self.max_batch_size:
            return False
        if not self.adaptive:
            return True
        state = self.by_batch_size.setdefault(batch_size, BatchSizeState())
        state.num_decisions += 1
        on, off = state.estimates[True], state.estimates[False]
        for mode in (True, False):  # speculation is measured first
            if state.estimates[mode].num_samples < self.MIN_SAMPLES:
                return mode
        best = on.tokens_per_second >= off.tokens_per_second
        if state.trial_left == 0 and state.num_decisions % self.explore_every == 0:
            state.trial_left = self.trial_steps
        if state.trial_left:
            state.trial_left -= 1
            return not best
        return best

    def observe(self, batch_size: int, speculated: bool, seconds: float, num_tokens: int) -> None:
        """A decode-only step's wall time (overlap or its loss included) and the tokens it produced."""
        if seconds <= 0 or not 1 <= batch_size <= self.max_batch_size:
            return
        state = self.by_batch_size.setdefault(batch_size, BatchSizeState())
        switched, state.last_observed = state.last_observed not in (None, speculated), speculated
        # Once both modes are measured, the first step after a switch stands for neither: a plain step
        # after a verify step was not overlapped, and a draft model's first proposals after plain steps
        # catch up on every token decoded meanwhile; counted, they kept an exploring trial from ever winning.
        if switched and all(e.num_samples >= self.MIN_SAMPLES for e in state.estimates.values()):
            return
        state.estimates[speculated].observe(num_tokens, seconds)

    def stats(self) -> dict:
        """Per batch size: measured tokens/s with and without speculation."""
        return {
            str(size): {
                "on": round(state.estimates[True].tokens_per_second, 2),
                "off": round(state.estimates[False].tokens_per_second, 2),
            }
            for size, state in sorted(self.by_batch_size.items())
        }


@dataclass
class AcceptanceCounts:
    """Proposed and accepted tokens over verify rows (a row emits its accepted tokens plus one)."""

    num_verify_rows: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_verify_rows += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify row emits on average: its accepted proposals and the target's own next token."""
        return 1 + self.num_accepted_tokens / self.num_verify_rows if self.num_verify_rows else 0.0
