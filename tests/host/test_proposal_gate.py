"""Prompt lookup's gate (host/proposal_gate.py) as engine/speculation.py drives it, without JAX: per-row classes of
match length withheld and scored, stale proposals of an overlapped row, the measured line, and quiet rows whose
plain steps may run in decode chains."""

from types import SimpleNamespace

import pytest

from tests.host.test_speculation_host import running_scheduler


def test_prompt_lookup_withholds_a_match_length_its_row_stopped_following_and_scores_it_meanwhile():
    """An ngram row verifies a proposal only while proposals of its match length have been paying
    (host/proposal_gate.py): two one-token matches rejected outright withhold the next one-token match (not a
    longer match's), the withheld proposal is scored against the tokens that follow, and once those follow it
    the class is verified again. A row whose newest token is in flight is waited for only where its known
    tokens' proposal would be verified."""
    from jaxserve.config import SpeculativeConfig
    from jaxserve.engine.speculation import Speculation

    scheduler, seq = running_scheduler(num_pages=64, max_tokens=64)  # prompt 10..15, output [3]
    speculation = Speculation(SpeculativeConfig(method="ngram", speculative_adaptive=False), max_model_len=256)
    gate = speculation.gate
    assert gate is not None  # prompt lookup's rows are gated

    def step(*tokens: int) -> list[int]:
        seq.output_token_ids += tokens
        seq.num_computed_tokens += len(tokens)  # decoded: still one token ahead of its KV
        speculation.begin_step([scheduler])
        return speculation.proposals([scheduler])[0].get(seq.seq_id, [])

    assert step(10) == [11, 12, 13, 14, 15, 3, 10]  # a one-token match
    speculation._observe_outcome(seq, 0)  # rejected outright
    assert step(12) == [13, 14, 15, 3, 10, 12]
    speculation._observe_outcome(seq, 0)  # twice: one-token matches no longer pay here
    assert step(14) == [] and gate.num_withheld == 1  # withheld, kept to be scored
    assert gate.admits(seq.seq_id, 3) and gate.admits(seq.seq_id, 2)  # longer matches are their own classes
    assert speculation.stats()["speculative_withheld_proposals"] == 1

    assert step(15, 3, 7) == []  # the withheld proposal [15, 3, 10, ...] was followed for two tokens
    assert gate.admits(seq.seq_id, 1)  # scored: one-token matches pay again
    assert step(11) == [12, 13, 14, 15, 3, 10, 12]  # a one-token match verified again
    speculation._observe_outcome(seq, 7)


def test_an_overlapped_row_below_the_gate_scores_its_stale_proposals_and_is_waited_for_once_they_pay():
    """A row none of whose classes pays is not waited for, so its newest token is always in flight when the next
    step is planned: its known tokens' proposal (one token stale) is withheld and scored instead, and once the
    text follows it the row is waited for again (and verifies)."""
    from jaxserve.config import SpeculativeConfig
    from jaxserve.engine.speculation import Speculation

    scheduler, seq = running_scheduler(num_pages=64, prompt_len=16, max_tokens=64)  # prompt 10..25, output [3]
    speculation = Speculation(SpeculativeConfig(method="ngram", speculative_adaptive=False), max_model_len=256)
    gate = speculation.gate
    assert gate is not None  # prompt lookup's rows are gated
    gate.verifying(seq.seq_id, 1)
    gate.verified(seq.seq_id, 0)
    for match_class in range(3):  # nothing has paid
        for _ in range(5):
            gate.rows[seq.seq_id].add(match_class, 0)
    speculation.begin_step([scheduler])
    seq.num_pending_tokens = 1  # overlapped: a token always in flight at planning
    waited = []
    for token in range(10, 26):  # the reply quotes the prompt
        seq.output_token_ids.append(token)
        seq.num_computed_tokens += 1
        waited.append(speculation.waits_for([], [scheduler]))
    assert not waited[0] and any(waited)
    first = waited.index(True)
    assert gate.num_withheld >= 1 and first <= 10
    seq.num_pending_tokens = 0  # waited for: the next step proposes, and verifies
    speculation.begin_step([scheduler])
    assert speculation.proposals([scheduler])[0].get(seq.seq_id)
    seq.num_pending_tokens = 0


def test_the_gate_line_is_the_measured_cost_of_a_verify_row_over_a_plain_one():
    """The accepted tokens a proposal's class must average (host/proposal_gate.py StepCosts): the prior line until
    both kinds of step were measured at the batch size, then (verify seconds / plain seconds - 1) x (rows / rows
    verifying). A class accepting 0.3 tokens a proposal is withheld where a verify step costs 1.45 plain steps (a
    2-core CPU) and verified where it costs 1.05 (an accelerator, weights read once for 8 tokens a row). At most
    half a proposal's tokens (a lone verifier's cost in a large batch must not lock out rows of long quotes)."""
    from jaxserve.config import SpeculativeConfig
    from jaxserve.engine.speculation import Speculation
    from jaxserve.host.proposal_gate import BREAK_EVEN_TOKENS, COST_SAMPLES, RowRecord

    speculation = Speculation(SpeculativeConfig(method="ngram", speculative_adaptive=False), max_model_len=256)
    gate = speculation.gate
    assert gate is not None

    def executable(kind: str, rows: int, verifies: bool = False):
        return SimpleNamespace(shape=SimpleNamespace(kind=kind, verifies=verifies), per_rank_chunks=[[None] * rows])

    def observe(batch_size: int, plain_ms: float, verify_ms: float, verifying: int, steps: int = COST_SAMPLES):
        for _ in range(steps):
            speculation.observe_step([executable("decode", batch_size)], plain_ms / 1e3, batch_size, True, batch_size)
            step = [executable("decode", batch_size - verifying), executable("decode", verifying, verifies=True)]
            speculation.observe_step(
                step[1:] if verifying == batch_size else step, verify_ms / 1e3, 9, True, batch_size
            )

    seq_id = 5
    for _ in range(10):
        gate.rows.setdefault(seq_id, RowRecord()).add(0, 0.3)  # one-token matches: 0.3 tokens a proposal
    assert gate.costs.break_even(1) == BREAK_EVEN_TOKENS and not gate.admits(seq_id, 1)
    observe(1, 22.0, 32.0, 1, steps=COST_SAMPLES - 1)
    assert gate.costs.break_even(1) == BREAK_EVEN_TOKENS  # not measured enough yet
    observe(1, 22.0, 32.0, 1, steps=1)
    assert gate.costs.break_even(1) == pytest.approx(10 / 22) and not gate.admits(seq_id, 1)
    assert speculation.stats()["speculative_break_even_tokens"] == {"1": round(10 / 22, 3)}
    # a prefill step's time is not a decode step's: left out
    speculation.observe_step([executable("prefill", 1)], 1.0, 1, True, 1)
    assert gate.costs.break_even(1) == pytest.approx(10 / 22)

    observe(2, 20.0, 21.0, 2, steps=40)  # the accelerator's costs, two rows both verifying
    assert gate.costs.break_even(2) == pytest.approx(0.05) and gate.admits(seq_id, 1, batch_size=2)
    assert not gate.admits(seq_id, 1, batch_size=1)  # lines are per batch size
    observe(4, 20.0, 30.0, 1, steps=40)  # one row of four verifies: its executable's cost falls on it alone
    assert gate.costs.break_even(4) == pytest.approx(4 * 0.5)
    observe(16, 20.0, 30.0, 1, steps=40)  # 8 x 0.5: past half a proposal, where rows of long quotes still verify
    assert speculation.config.verify_width == 8 and gate.costs.break_even(16) == 3.5
    observe(3, 30.0, 25.0, 3, steps=40)  # verify steps measured faster (noise): every proposal verifies
    assert gate.costs.break_even(3) == 0.0 and gate.admits(seq_id, 1, batch_size=3)


def test_quiet_rows_let_plain_steps_chain_until_their_text_quotes_again():
    """Prompt lookup lets the engine run its plain steps in decode chains (engine/speculation.py chains_allowed)
    only where nothing would verify: no proposal this step, and every row quiet (its recent proposals, verified,
    withheld and scored, or lookups that found nothing, well below the line; a row none of whose proposals was
    scored is not). With a chain of 4 in
    flight, the row's stale proposal (its known tokens') is withheld and scored once the chain's tokens tell: a
    quote found there ends the quiet."""
    from jaxserve.config import SpeculativeConfig
    from jaxserve.engine.speculation import Speculation

    scheduler, seq = running_scheduler(num_pages=64, prompt_len=16, max_tokens=64)  # prompt 10..25, output [3]
    speculation = Speculation(SpeculativeConfig(method="ngram", speculative_adaptive=False), max_model_len=256)
    gate = speculation.gate
    assert gate is not None
    speculation.begin_step([scheduler])
    assert not speculation.chains_allowed([scheduler], [{}])  # nothing known of the row yet
    for _ in range(5):
        gate.observe_lookup(seq.seq_id)  # lookups that found nothing
    assert not gate.is_quiet(seq.seq_id)  # but no proposal of the row was scored yet
    gate.verifying(seq.seq_id, 1)
    gate.verified(seq.seq_id, 0)  # one rejected outright
    assert gate.is_quiet(seq.seq_id) and speculation.chains_allowed([scheduler], [{}])
    assert not speculation.chains_allowed([scheduler], [{seq.seq_id: [5, 6]}])  # a proposal verifies this step
    assert Speculation(SpeculativeConfig(), max_model_len=256).chains_allowed([scheduler], [{}])  # speculation off

    for match_class in range(3):  # and its classes closed: no proposal would be verified
        for _ in range(5):
            gate.rows[seq.seq_id].add(match_class, 0)
    seq.output_token_ids += [10, 11]  # the known tokens end in a quote of the prompt
    seq.num_computed_tokens += 2
    seq.num_pending_tokens = 4  # a chain in flight
    assert not speculation.waits_for([], [scheduler])  # its stale proposal [16, 17, ...] is withheld, not waited for
    assert gate.num_withheld == 1 and gate.is_quiet(seq.seq_id)
    seq.output_token_ids += [12, 13, 14, 15, 16, 17, 18, 19]  # the chain's tokens, and the next chain's
    seq.num_computed_tokens += 8
    seq.num_pending_tokens = 0
    speculation.begin_step([scheduler])
    proposals = speculation.proposals([scheduler])  # scores the withheld proposal: followed for 4 tokens
    assert not gate.is_quiet(seq.seq_id)
    assert proposals[0][seq.seq_id][:3] == [20, 21, 22] and not speculation.chains_allowed([scheduler], proposals)
