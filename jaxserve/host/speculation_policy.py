"""When to speculate, and how well it goes. Plain Python, no JAX.

Speculation trades compute for steps: a verify row computes k + 1 tokens to emit 1 + (accepted) of
them, and a step with verify rows is processed before the next is planned (the next positions depend
on what was accepted), which gives up the overlap of host and device. On a busy batch the compute is
already used by batching, so the policy (as vLLM's dynamic speculation) measures, per batch size, the
tokens per second of steps with speculation and of steps without, and speculates only while it wins;
every `explore_every` steps at a batch size (and no more often than 1 / EXPLORE_TIME_RATIO of the time)
it tries the other way for `trial_steps` steps, so a change in acceptance (another kind of text) is
noticed. Above `max_batch_size` rows it never speculates (no
verify step is compiled that large).

A batch size's first verdict comes from MIN_SAMPLES steps of each mode at its start, often an engine's
first steps: cold caches, a reply's first tokens, which a draft model accepts less of. A wrong verdict for
speculation corrects itself (its estimate stays live), but a wrong one for plain decoding stood until the
next trial, 20 trials' time away (12 s for a draft on the default model: a whole short run at plain speed
while forced speculation ran 1.65x). So a first verdict for plain decoding is confirmed once,
`explore_every // 4` steps later, by a trial of speculation whose estimate starts afresh.

A batch size not measured yet borrows the verdict of the nearest measured one where that verdict carries
over (speculation pays less the larger the batch: plain winning at a smaller batch means plain here,
speculation winning at a larger one means speculation here), so that a growing batch does not pay for
measuring speculation at every size once it stopped paying, and measures only when nothing carries over.

What a measurement leaves out: the first step after a switch of mode (a plain step after a verify step
was not overlapped, and a draft model's first proposals after plain steps catch up on every token decoded
meanwhile); counted, they kept the draft's exploring trials from ever winning. The engine also leaves out
steps with prefill chunks and charges a draft's catch-up prefills to no step (engine/speculation.py).
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
    samples_since_restart: int = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        # a plain mean of the first 1 / weight samples (no weight on the first sample alone), then moving
        weight = max(self.weight, 1 / (self.samples_since_restart + 1))
        self.tokens += weight * (num_tokens - self.tokens)
        self.seconds += weight * (seconds - self.seconds)
        self.num_samples += 1
        self.samples_since_restart += 1

    def restart(self) -> None:
        """The next sample starts a fresh mean: the old ones are forgotten once it comes (until then they
        stand, and with them the verdict)."""
        self.samples_since_restart = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class BatchSizeState:
    estimates: dict[bool, ThroughputEstimate] = field(
        default_factory=lambda: {True: ThroughputEstimate(), False: ThroughputEstimate()}
    )
    trial_left: int = 0  # steps left of trying the mode that is not the best
    trial_mode: bool = False  # the mode tried (fixed for the trial: its samples may change the verdict)
    first_verdict_confirmed: bool = False
    steps_since_trial: int = 0  # decided since the last trial ended
    seconds_since_trial: float = 0.0  # measured since the last trial ended
    last_observed: bool | None = None  # the mode of the last step measured


class SpeculationPolicy:
    MIN_SAMPLES = 3  # measurements of each mode before comparing them
    # A trial of the losing mode waits for this many times its expected length of steps in the winning
    # mode: on a batch where a verify step takes 6 plain steps' time, trials every 64 steps spent half the
    # time in the losing mode.
    EXPLORE_TIME_RATIO = 20
    # While speculation wins, trials of plain decoding wait up to this many times longer (_speculation_margin)
    MAX_PATIENCE = 2.0

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
        best = self.best_mode(batch_size)
        if best is None:  # measured neither here nor anywhere that carries over: speculation first, then plain
            return next(mode for mode in (True, False) if state.estimates[mode].num_samples < self.MIN_SAMPLES)
        if state.trial_left == 0:
            state.steps_since_trial += 1
            if best and _measured(state):
                state.first_verdict_confirmed = True  # only a first verdict for plain decoding needs it
            confirming = _measured(state) and not state.first_verdict_confirmed
            if self._trial_due(state, best, confirming):
                # a confirming trial is as long as a first measurement (its first step is left out, a switch's)
                state.trial_left = self.MIN_SAMPLES + 1 if confirming else self.trial_steps
                state.trial_mode = not best
                if confirming:
                    state.estimates[True].restart()  # the conditions of its first samples have passed
                state.first_verdict_confirmed = True  # or a trial came first (a verdict carried over)
                state.steps_since_trial, state.seconds_since_trial = 0, 0.0
        if state.trial_left:
            state.trial_left -= 1
            return state.trial_mode
        return best

    def _trial_due(self, state: BatchSizeState, best: bool, confirming: bool) -> bool:
        if confirming:
            return state.steps_since_trial >= self.explore_every // 4
        other = state.estimates[not best]
        # an unmeasured mode's step (a verdict carried over) is taken to be as long as a measured one's
        trial_seconds = self.trial_steps * (other.seconds or state.estimates[best].seconds)
        patience = _speculation_margin(state) if best else 1.0
        return (
            state.steps_since_trial >= self.explore_every * patience
            and state.seconds_since_trial >= self.EXPLORE_TIME_RATIO * trial_seconds * patience
        )

    def try_speculation_now(self, batch_size: int) -> None:
        """Evidence that speculation would pay at this batch size while plain decoding wins (the text changed:
        rows now follow what the proposer would have proposed): speculation is measured again from its next
        step, its old estimate (taken on other text) forgotten, instead of at the next scheduled trial, 64+
        steps away. At most once every `explore_every // 4` steps."""
        state = self.by_batch_size.get(batch_size)
        if not self.adaptive or state is None or state.trial_left or not _measured(state):
            return
        if _speculation_wins(state) or state.steps_since_trial < self.explore_every // 4:
            return
        state.estimates[True] = ThroughputEstimate()  # unmeasured: speculate() measures it first
        state.steps_since_trial, state.seconds_since_trial = 0, 0.0

    def best_mode(self, batch_size: int) -> bool | None:
        """Whether speculation wins at this batch size: measured here, else carried over from the nearest
        measured batch size whose verdict carries over (see the module docstring); None: unknown."""
        state = self.by_batch_size.get(batch_size)
        if state is not None and _measured(state):
            return _speculation_wins(state)
        for size in sorted(self.by_batch_size, key=lambda size: abs(size - batch_size)):
            other = self.by_batch_size[size]
            if size == batch_size or not _measured(other):
                continue
            wins = _speculation_wins(other)
            if (size < batch_size and not wins) or (size > batch_size and wins):
                return wins
        return None

    def observe(self, batch_size: int, speculated: bool, seconds: float, num_tokens: int) -> None:
        """A decode-only step's wall time (overlap or its loss included) and the tokens it produced."""
        if seconds <= 0 or not 1 <= batch_size <= self.max_batch_size:
            return
        state = self.by_batch_size.setdefault(batch_size, BatchSizeState())
        if not state.trial_left:
            state.seconds_since_trial += seconds
        switched, state.last_observed = state.last_observed not in (None, speculated), speculated
        if switched:  # the first step after a switch stands for neither mode (see the module docstring)
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


def _measured(state: BatchSizeState) -> bool:
    return all(e.num_samples >= SpeculationPolicy.MIN_SAMPLES for e in state.estimates.values())


def _speculation_margin(state: BatchSizeState) -> float:
    """How far speculation's measured tokens/s lead plain's here (1 to MAX_PATIENCE; 1 unless both are
    measured here). While speculation wins, its own estimate is measured on every step, so a change of text
    (acceptance) shows at once: a trial of plain decoding only refreshes plain's estimate, and waits this
    many times longer. Each plain trial cost a draft model 6 plain steps and a catch-up prefill (7 tokens in
    a query block of 16) when it came back: the adaptive draft's whole lag behind forced speculation. (Where
    decode chains run, a trial's plain steps are chains of k: a trial then lasts k times the tokens, and the wait
    before the next one, measured in its seconds, grows with it.)"""
    on, off = (state.estimates[mode].tokens_per_second for mode in (True, False))
    if not _measured(state) or off <= 0:
        return 1.0
    return min(max(on / off, 1.0), SpeculationPolicy.MAX_PATIENCE)


def _speculation_wins(state: BatchSizeState) -> bool:
    return state.estimates[True].tokens_per_second >= state.estimates[False].tokens_per_second


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
