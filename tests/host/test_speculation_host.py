"""The host side of speculation without JAX: prompt-lookup proposals, verify chunks in the scheduler (pages
and budget), the per-batch-size policy, and appending a verify row's tokens (stops, KV accounting)."""

from types import SimpleNamespace

import numpy as np

from jaxserve.host.output_processor import OutputProcessor
from jaxserve.host.page_allocator import ROOT_KEY, PageAllocator, page_key
from jaxserve.host.proposers import NgramProposer
from jaxserve.host.request import FinishReason, SamplingParams, SequenceState
from jaxserve.host.scheduler import Scheduler
from jaxserve.host.speculation_policy import AcceptanceCounts, SpeculationPolicy
from jaxserve.host.verify_outputs import process_verified


def sequence(prompt, max_tokens=32, seq_id=0, **params):
    return SequenceState(seq_id, f"r{seq_id}", list(prompt), SamplingParams(max_tokens=max_tokens, **params), 0, 0)


def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(min_n=1, max_n=3)
    seq = sequence([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    # suffix [1, 2, 3] occurred twice before; the latest (ending at index 7) was followed by 4 5 6 7
    assert proposer.propose([seq], [3]) == [[4, 5, 6]]
    seq.output_token_ids += [4, 5]  # grows incrementally
    assert proposer.propose([seq], [8]) == [[6, 7, 1, 2, 3, 4, 5]]
    assert proposer.propose([sequence([5, 6, 7, 8], seq_id=1)], [4]) == [[]]  # no earlier occurrence
    assert proposer.propose([sequence([5, 5], seq_id=2)], [0]) == [[]]  # nothing asked
    shortest = NgramProposer(min_n=2, max_n=3)
    assert shortest.propose([sequence([4, 1, 8, 1], seq_id=3)], [2]) == [[]]  # a 1-gram match is too short


def test_ngram_index_matches_a_brute_force_search():
    rng = np.random.default_rng(1)
    proposer = NgramProposer(min_n=2, max_n=4)
    seq = sequence(rng.integers(0, 4, size=30).tolist())
    for _ in range(40):
        tokens = seq.token_ids
        want = []
        for n in range(4, 1, -1):
            suffix = tokens[-n:]
            ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1 : e + 1] == suffix]
            if ends:
                want = tokens[ends[-1] + 1 : ends[-1] + 4]
                break
        assert proposer.propose([seq], [3]) == [want]
        seq.output_token_ids.append(int(rng.integers(0, 4)))
    proposer.forget(seq)
    assert not proposer._indexes


def running_scheduler(num_pages, prompt_len=6, page_size=4, budget=64, max_tokens=8, max_num_seqs=4):
    """A sequence that prefilled its prompt and sampled its first token (admission wants pages for all of
    prompt + max_tokens)."""
    scheduler = Scheduler(
        PageAllocator(num_pages, page_size, enable_prefix_caching=True),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        prefill_query_block=4,
    )
    seq = sequence(range(10, 10 + prompt_len), max_tokens=max_tokens)
    scheduler.add(seq)
    (chunk,) = scheduler.schedule().prefills
    scheduler.mark_dispatched([chunk])
    scheduler.mark_processed(chunk)
    seq.num_computed_tokens = chunk.end
    seq.output_token_ids.append(3)  # its first token: now decoding
    return scheduler, seq


def test_a_proposal_widens_the_decode_chunk_when_its_pages_fit():
    scheduler, seq = running_scheduler(num_pages=8)
    schedule = scheduler.schedule({seq.seq_id: [4, 5, 6, 7]})
    assert not schedule.decodes and len(schedule.verifies) == 1
    (chunk,) = schedule.verifies
    assert (chunk.start, chunk.num_tokens, chunk.draft_token_ids) == (6, 5, (4, 5, 6, 7))
    assert chunk.samples_next_token
    assert len(seq.page_ids) == 3  # positions up to 10: three pages of 4


def test_a_proposal_never_preempts_and_shrinks_to_the_free_pages():
    scheduler, seq = running_scheduler(num_pages=3, max_tokens=2)  # pages 1 and 2 held, nothing free
    schedule = scheduler.schedule({seq.seq_id: [4, 5, 6]})
    assert [c.draft_token_ids for c in schedule.verifies] == [(4,)]  # positions 6 and 7: the held page 2
    assert not schedule.preempted and scheduler.allocator.num_free_pages == 0
    scheduler, seq = running_scheduler(num_pages=3, prompt_len=8, max_tokens=0)  # positions 0-7 fill both
    seq.output_token_ids.pop()
    seq.prompt_token_ids.pop()
    seq.num_computed_tokens = 7
    seq.output_token_ids.append(3)  # position 8 would need a third page: none is free
    schedule = scheduler.schedule({seq.seq_id: [4, 5]})
    assert not schedule.verifies and not schedule.preempted
    scheduler, seq = running_scheduler(num_pages=4, max_tokens=6)  # one free page: positions up to 11
    (chunk,) = scheduler.schedule({seq.seq_id: [4, 5, 6, 7, 8, 9]}).verifies
    assert chunk.draft_token_ids == (4, 5, 6, 7, 8)


def test_the_token_budget_bounds_the_proposals():
    scheduler, seq = running_scheduler(num_pages=16, budget=4)
    (chunk,) = scheduler.schedule({seq.seq_id: [4, 5, 6, 7, 8]}).verifies
    assert chunk.num_tokens == 4


def test_policy_turns_speculation_off_above_its_batch_size_and_follows_measurements():
    assert SpeculationPolicy(8, adaptive=False).speculate(8)
    assert not SpeculationPolicy(8, adaptive=False).speculate(9)
    policy = SpeculationPolicy(4, explore_every=20, trial_steps=2)
    decisions = [policy.speculate(2) for _ in range(3)]
    for on in decisions:
        policy.observe(2, on, 0.01, 3 if on else 1)  # speculation: 300 tokens/s
    decisions = [policy.speculate(2) for _ in range(4)]
    assert decisions == [False] * 4  # plain is measured next
    for on in decisions:
        policy.observe(2, on, 0.01, 1)  # plain: 100 tokens/s (the first, after a switch, left out)
    later = []
    for _ in range(100):
        later.append(policy.speculate(2))
        policy.observe(2, later[-1], 0.01, 3 if later[-1] else 1)
    # speculation wins; plain is retried now and then (every 20 steps, and 1/20 of the time at most, both
    # times speculation's lead, capped at 2: every 80 steps here)
    assert later.count(True) >= 94 and later.count(False) >= 2
    for _ in range(20):
        policy.observe(2, True, 0.02, 1)  # acceptance collapses: speculation now loses (50 tokens/s)
    assert [policy.speculate(2) for _ in range(10)].count(False) >= 8


class Tokenizerless(OutputProcessor):
    def __init__(self):
        super().__init__(None, frozenset({2}), max_model_len=64)


def verified(seq, scheduler, drafts, samples, accepted):
    (chunk,) = scheduler.schedule({seq.seq_id: drafts}).verifies
    scheduler.mark_dispatched([chunk])
    width = len(samples)
    sampled = SimpleNamespace(token_ids=np.asarray(samples), no_token_allowed=np.zeros(width, bool))
    counts = AcceptanceCounts()
    process_verified([chunk], scheduler, sampled, np.asarray([accepted]), 0, width, Tokenizerless(), counts)
    return counts


def test_a_verify_row_appends_accepted_tokens_and_the_next_one():
    scheduler, seq = running_scheduler(num_pages=16)
    counts = verified(seq, scheduler, [4, 5, 6], [4, 5, 9, 8], accepted=2)
    assert seq.output_token_ids == [3, 4, 5, 9]
    assert seq.num_computed_tokens == seq.num_tokens - 1  # the newest token (9) has no KV yet
    assert (counts.num_draft_tokens, counts.num_accepted_tokens, counts.mean_accepted_length) == (3, 2, 3.0)
    assert (seq.num_draft_tokens, seq.num_accepted_draft_tokens) == (3, 2)
    # cached as full pages: positions 0-7 only; page 3 holds the rejected proposal's KV at position 9
    tokens = seq.token_ids
    assert seq.page_keys == [
        page_key(ROOT_KEY, tuple(tokens[0:4])),
        page_key(seq.page_keys[0], tuple(tokens[4:8])),
    ]
    assert scheduler.allocator.num_cached_pages == 2


def test_a_stop_token_among_accepted_proposals_ends_the_row_there():
    scheduler, seq = running_scheduler(num_pages=16)
    free_before = scheduler.allocator.num_free_pages + len(seq.page_ids)
    verified(seq, scheduler, [4, 2, 6], [4, 2, 6, 8], accepted=3)  # 2 is EOS
    assert seq.output_token_ids == [3, 4, 2] and seq.finish_reason == FinishReason.STOP and seq.is_finished
    assert scheduler.allocator.num_free_pages == free_before  # its pages went back


def test_max_tokens_cuts_a_verify_row():
    scheduler, seq = running_scheduler(num_pages=16)
    seq.params = SamplingParams(max_tokens=3)
    verified(seq, scheduler, [4, 5, 6], [4, 5, 6, 7], accepted=3)
    assert seq.output_token_ids == [3, 4, 5] and seq.finish_reason == FinishReason.LENGTH


def test_policy_leaves_out_the_first_step_after_a_switch():
    """Once both modes are measured, a switch's first step (a draft catching up, a plain step that was not
    overlapped) is not counted against the mode it switched to."""
    policy = SpeculationPolicy(4)
    for on in (True,) * 3 + (False,) * 3:
        policy.observe(1, on, 0.01, 3 if on else 1)
    policy.observe(1, True, 10.0, 1)  # the first speculating step after plain ones: left out
    assert policy.stats()["1"] == {"on": 300.0, "off": 100.0}
    policy.observe(1, True, 0.01, 3)
    policy.observe(1, True, 10.0, 1)  # not after a switch: counted
    assert policy.stats()["1"]["on"] < 100.0


def simulated_run(policy, batch_size, tokens_per_second, num_steps, seed=0, cold_speculating_steps=0):
    """Steps decided by the policy, whose measurements come from a world where each mode yields its
    tokens/s ({True: speculating, False: plain}) with noise (+-40%, as a loaded machine gives), and the
    first step after each switch costs 4x (a draft catching up, a plain step that was not overlapped).
    The first `cold_speculating_steps` speculating steps emit half the tokens in 1.5x the time (a cold
    engine, a reply's first tokens). Returns (the fraction of steps that speculated, the tokens/s the run
    achieved)."""
    rng = np.random.default_rng(seed)
    previous, num_on, total_tokens, total_seconds = None, 0, 0, 0.0
    for _ in range(num_steps):
        on = policy.speculate(batch_size)
        tokens = batch_size * (4 if on else 1)  # a verify row emits 4 tokens
        seconds = tokens / tokens_per_second[on] * rng.uniform(0.6, 1.4) * (4 if previous not in (None, on) else 1)
        if on and num_on < cold_speculating_steps:
            tokens, seconds = tokens // 2, seconds * 1.5
        policy.observe(batch_size, on, seconds, tokens)
        previous, num_on = on, num_on + on
        total_tokens, total_seconds = total_tokens + tokens, total_seconds + seconds
    return num_on / num_steps, total_tokens / total_seconds


def test_policy_keeps_a_paying_draft_on_and_a_losing_one_off():
    """At batch 1 a draft that pays 1.35x stays on (the off trials and the switches' costs do not talk it
    down); at batch 8, where speculation costs more than it gives, plain decoding stays on; the run's
    throughput is near the better mode's either way."""
    policy = SpeculationPolicy(8)
    fraction_on, achieved = simulated_run(policy, 1, {True: 13.5, False: 10.0}, 640)
    assert fraction_on > 0.85 and achieved > 12.0, (fraction_on, achieved)
    fraction_on, achieved = simulated_run(policy, 8, {True: 50.0, False: 80.0}, 640)
    assert fraction_on < 0.15 and achieved > 72.0, (fraction_on, achieved)
    stats = policy.stats()
    assert stats["1"]["on"] > stats["1"]["off"] and stats["8"]["on"] < stats["8"]["off"]


def test_a_first_verdict_for_plain_decoding_taken_cold_is_confirmed_once():
    """A draft paying 1.5x whose first speculating steps accept half as much: the verdict taken on them
    (plain) is tried again 16 steps later, from a fresh estimate, instead of after 20 trials' time (~240
    steps here, as long as a short run); a losing draft pays for that one trial only."""
    for seed in range(3):
        policy = SpeculationPolicy(8)
        fraction_on, achieved = simulated_run(policy, 1, {True: 15.0, False: 10.0}, 160, seed, cold_speculating_steps=4)
        assert fraction_on > 0.75 and achieved > 13.0, (seed, fraction_on, achieved)
        state = policy.by_batch_size[1]
        assert state.first_verdict_confirmed and state.estimates[True].tokens_per_second > 13.0
    losing = SpeculationPolicy(8)
    fraction_on, _ = simulated_run(losing, 1, {True: 8.0, False: 10.0}, 200, cold_speculating_steps=4)
    assert round(200 * fraction_on) <= 3 + 4 + 1, fraction_on  # the first measurement, the confirmation (+1 left out)


def test_plain_trials_wait_longer_the_more_speculation_wins():
    """While speculation wins, its estimate is live (a change of text shows at once); trials of plain only
    refresh plain's estimate, and wait as many times longer as speculation leads (up to 2x): a draft paying
    1.5x spends 40 of 640 steps plain instead of 58 (every 64 steps: the adaptive draft's lag behind
    forced), one paying 1.8x 28-34."""
    for rates, most_plain in (({True: 15.0, False: 10.0}, 45), ({True: 18.0, False: 10.0}, 36)):
        for seed in range(2):
            policy = SpeculationPolicy(8)
            fraction_on, _ = simulated_run(policy, 1, rates, 640, seed)
            assert 10 <= round(640 * (1 - fraction_on)) <= most_plain, (rates, seed, fraction_on)


def test_policy_carries_a_verdict_over_to_batch_sizes_not_measured():
    """Plain winning at batch 4 means plain at 6 from its first step (no speculation measured first), and
    speculation winning at batch 4 means speculation at 2; with nothing that carries over (speculation
    wins at a larger batch, plain at a smaller) a batch size measures speculation first."""
    losing = SpeculationPolicy(8)
    simulated_run(losing, 4, {True: 20.0, False: 40.0}, 64)
    assert losing.best_mode(6) is False and not losing.speculate(6)
    assert losing.best_mode(2) is None and losing.speculate(2)  # measured first: speculation
    winning = SpeculationPolicy(8)
    simulated_run(winning, 4, {True: 40.0, False: 20.0}, 64)
    assert winning.best_mode(2) is True and winning.speculate(2)
    assert winning.best_mode(6) is None
    # its own measurements, once both modes have them, overrule a carried-over verdict
    fraction_on, _ = simulated_run(losing, 6, {True: 60.0, False: 30.0}, 320)
    assert losing.best_mode(6) is True and fraction_on > 0.5


def test_the_policy_batch_counts_every_sequence_once_one_decodes():
    """A burst's first decoding rows do not speculate while the rest of it prefills or waits."""
    from jaxserve.engine.speculation import speculation_batch_size

    scheduler, _ = running_scheduler(num_pages=64, max_num_seqs=10)
    assert speculation_batch_size(scheduler) == 1
    for seq_id in range(1, 10):
        scheduler.add(sequence(range(20, 26), max_tokens=8, seq_id=seq_id))
    assert speculation_batch_size(scheduler) == 1  # the waiting queue adds nothing to a step
    chunks = scheduler.schedule().prefills  # admitted: prefilling in this step
    assert len(chunks) >= 8 and len(scheduler.running) == 1 + len(chunks)
    assert speculation_batch_size(scheduler) == 1 + len(chunks)  # one decoding, the rest prefilling
    policy = SpeculationPolicy(max_batch_size=8)
    assert not policy.speculate(speculation_batch_size(scheduler))
    allocator = PageAllocator(64, 4, enable_prefix_caching=True)
    prefilling = Scheduler(allocator, max_num_seqs=4, max_num_batched_tokens=64, prefill_query_block=4)
    prefilling.add(sequence(range(10, 16)))
    assert speculation_batch_size(prefilling) == 0  # nothing decodes: nothing to propose for


def test_a_row_backs_off_after_its_second_miss_in_a_row():
    """The first proposal that gives nothing costs no backoff (a code edit's renamed word: the quote resumes
    a token later); the second in a row skips 2 tokens, the third 4; an accepted proposal forgives."""
    from jaxserve.config import SpeculativeConfig
    from jaxserve.engine.speculation import Speculation

    class NothingToPropose:
        def __init__(self):
            self.calls = 0

        def propose(self, seqs, max_tokens):
            self.calls += 1
            return [[] for _ in seqs]

        def forget(self, seq):
            pass

    scheduler, seq = running_scheduler(num_pages=64, max_tokens=64)
    proposer = NothingToPropose()
    config = SpeculativeConfig(method="ngram", speculative_adaptive=False)
    speculation = Speculation(config, max_model_len=256, proposer=proposer)

    def proposed_after(new_tokens: int) -> bool:
        seq.output_token_ids += [5] * new_tokens
        seq.num_computed_tokens += new_tokens  # decoded: still one token ahead of its KV
        calls = proposer.calls
        speculation.begin_step([scheduler])
        speculation.proposals([scheduler])
        return proposer.calls > calls

    assert proposed_after(0)  # miss 1: free
    assert proposed_after(1)  # miss 2: backs off 2 tokens
    assert not proposed_after(1) and proposed_after(1)  # miss 3: backs off 4 tokens
    assert not proposed_after(3) and proposed_after(1)  # miss 4
    speculation._observe_outcome(seq, 3)  # an accepted proposal
    assert proposed_after(1) and proposed_after(1)  # its first miss after it is free again
    assert not proposed_after(1)
    calls_before_forced = proposer.calls

    class Forcing:  # a grammar that forces its next tokens: backing off from the proposer is not from them
        def __init__(self, forced):
            self.forced = forced

        def forced_tokens(self):
            return self.forced

    seq.grammar = Forcing([7, 8, 9])
    speculation.begin_step([scheduler])
    assert speculation.proposals([scheduler]) == [{seq.seq_id: [7, 8, 9]}] and proposer.calls == calls_before_forced
    seq.grammar = Forcing([])
    assert not proposed_after(0)


def test_plain_decoding_looks_ahead_and_tries_speculation_when_the_text_turns_to_quoting():
    """While the policy has plain decoding winning, prompt lookup still proposes (free): once a row's next tokens
    follow such a proposal for LOOK_AHEAD_HIT_TOKENS, speculation is measured again from the next step."""
    from jaxserve.config import SpeculativeConfig
    from jaxserve.engine.speculation import Speculation

    scheduler, seq = running_scheduler(num_pages=64, max_tokens=64)  # prompt 10..15
    speculation = Speculation(SpeculativeConfig(method="ngram"), max_model_len=256)
    for on in (True,) * 4 + (False,) * 4:  # speculation measured at 100 tokens/s, plain at 200
        speculation.policy.observe(1, on, 0.01, 1 if on else 2)
    speculation.policy.by_batch_size[1].first_verdict_confirmed = True  # a settled verdict, not a first one

    def step(*tokens: int) -> bool:
        seq.output_token_ids += tokens
        seq.num_computed_tokens += len(tokens)  # decoded: still one token ahead of its KV
        speculation.begin_step([scheduler])
        speculation.proposals([scheduler])
        return speculation.speculating

    assert not any(step(100 + i) for i in range(20))  # nothing to look up: plain throughout
    assert not step(10)  # looks ahead: 11 12 13 14 15 10 ...
    assert not step(11) and not step(12) and not step(13) and not step(14)  # followed for 4 tokens now
    assert step(15)  # speculation measured again
    assert speculation.policy.stats()["1"]["on"] == 0.0  # from scratch (its old estimate was of other text)


def test_a_guided_rows_proposal_is_cut_to_what_its_grammar_can_verify():
    """engine/speculation.py verifiable_part: up to the first token the grammar refuses or the first EOS; the
    tokens the grammar forces where the proposal departs from them or stops short; for a grammar that waits
    for a token, up to before that token."""
    from jaxserve.engine.speculation import forced_tokens, verifiable_part
    from jaxserve.host.request import GuidedDecodingParams
    from tests.host.test_grammar import compiler_for, load_tokenizer

    tokenizer, compiler = load_tokenizer("qwen_byte_level"), compiler_for("qwen_byte_level")
    one, two, three, four, five, six = (tokenizer.encode(d, add_special_tokens=False)[0] for d in "123456")
    a, b, c, z = (tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abcz")
    eos = min(tokenizer.eos_token_ids)
    eos_ids = frozenset(tokenizer.eos_token_ids)
    compiled = compiler.compile_async(GuidedDecodingParams(regex="[0-9]{4,6}(abc)?[0-9]*")).result()
    seq = sequence([one, two])
    seq.grammar = compiled.new_matcher()
    assert verifiable_part(seq, [one, two, z, three], forced_tokens(seq, 8), eos_ids) == [one, two]  # z refused
    assert verifiable_part(seq, [one, two, three, four, eos, five], forced_tokens(seq, 8), eos_ids) == [
        one,
        two,
        three,
        four,
    ]
    assert verifiable_part(seq, [], forced_tokens(seq, 8), eos_ids) == []  # nothing forced: the first token is a choice
    assert seq.grammar.num_accepted_tokens == 0  # cutting changed nothing
    forced = compiler.compile_async(GuidedDecodingParams(regex="[0-9]{2}abc[0-9]+")).result()
    seq.grammar = forced.new_matcher()
    assert all(seq.grammar.accept_token(t) for t in (one, two))
    assert verifiable_part(seq, [], forced_tokens(seq, 8), eos_ids) == [
        a,
        b,
        c,
    ]  # forced (one token each in this vocabulary)
    assert verifiable_part(seq, [], forced_tokens(seq, 2), eos_ids) == [a, b]  # within the row's limit
    assert verifiable_part(seq, [a, b], forced_tokens(seq, 8), eos_ids) == [a, b, c]  # stops short: the forced tokens
    assert verifiable_part(seq, [a, b, c, six, five], forced_tokens(seq, 8), eos_ids) == [
        a,
        b,
        c,
        six,
        five,
    ]  # follows them further
    assert verifiable_part(seq, [a, z], forced_tokens(seq, 8), eos_ids) == [a, b, c]  # departs (z refused after a)
    waiting = sequence([one, two], guided_decoding=GuidedDecodingParams(regex="[0-9]+"), guided_decoding_after_token=z)
    waiting.waiting_grammar = compiled.new_matcher()
    assert verifiable_part(waiting, [a, b, z, one, two], forced_tokens(waiting, 8), eos_ids) == [
        a,
        b,
    ]  # the token after z needs the grammar
    assert verifiable_part(waiting, [a, b, c], forced_tokens(waiting, 8), eos_ids) == [a, b, c]
    assert verifiable_part(sequence([1, 2]), [7, eos, 9], [], eos_ids) == [7, eos, 9]  # no grammar: all of it


def test_a_draft_model_is_not_run_for_a_row_whose_grammar_forces_its_next_tokens():
    """A draft's proposals would be replaced by the forced tokens: the row verifies those, no draft call."""
    from jaxserve.config import SpeculativeConfig
    from jaxserve.engine.speculation import Speculation

    class CountingDraft:  # not prompt lookup: a proposer whose calls cost steps
        def __init__(self):
            self.rows = []

        def propose(self, seqs, max_tokens):
            self.rows += [seq.seq_id for seq in seqs]
            return [[3] for _ in seqs]

        def forget(self, seq):
            pass

    class Forcing:
        def __init__(self, forced):
            self.forced = forced

        def forced_tokens(self):
            return self.forced

        def num_acceptable_tokens(self, token_ids):
            return len(token_ids)

    scheduler, seq = running_scheduler(num_pages=64, max_tokens=64)
    draft = CountingDraft()
    speculation = Speculation(SpeculativeConfig(method="ngram", speculative_adaptive=False), 256, proposer=draft)
    seq.grammar = Forcing([7, 8, 9])
    speculation.begin_step([scheduler])
    assert speculation.proposals([scheduler]) == [{seq.seq_id: [7, 8, 9]}] and draft.rows == []
    seq.grammar = Forcing([])  # a choice next: the draft proposes
    speculation.begin_step([scheduler])
    assert speculation.proposals([scheduler]) == [{seq.seq_id: [3]}] and draft.rows == [seq.seq_id]
    # beside a row that needs it, the draft runs for every row (its KV stays in step); forced tokens still win
    other = sequence([20, 21, 22, 23, 24, 25], max_tokens=64, seq_id=1)
    scheduler.add(other)
    (chunk,) = scheduler.schedule().prefills  # the second row prefills and samples its first token
    scheduler.mark_dispatched([chunk])
    scheduler.mark_processed(chunk)
    other.num_computed_tokens = chunk.end
    other.output_token_ids.append(3)
    seq.grammar = Forcing([7, 8, 9])
    draft.rows.clear()
    speculation.begin_step([scheduler])
    proposed = speculation.proposals([scheduler])[0]
    assert sorted(draft.rows) == [0, 1] and proposed[seq.seq_id] == [7, 8, 9] and proposed[other.seq_id] == [3]
