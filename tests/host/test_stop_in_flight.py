"""A stop token sampled by step N is known to the host only once N is fetched; with overlapped steps
N+1 is already planned and dispatched by then (it reads N's token on the device). That one row is the
whole cost: N+1 computes the stop token's KV, its sampled token is dropped, the request is reported
finished when N is processed, and nothing after N+1 is planned for the sequence."""

from types import SimpleNamespace

import numpy as np
import pytest

from jaxserve.host.output_processor import OutputProcessor
from jaxserve.host.page_allocator import PageAllocator
from jaxserve.host.request import SamplingParams, SequenceState
from jaxserve.host.scheduler import Scheduler

STOP, OTHER = 5, 9


def one_sequence(page_size: int, prompt_len: int, params: SamplingParams):
    """A scheduler (prefix caching on) holding one sequence of prompt 10, 11, ..., and its output processor."""
    scheduler = Scheduler(
        PageAllocator(32, page_size, enable_prefix_caching=True),
        max_num_seqs=2,
        max_num_batched_tokens=16,
        prefill_query_block=4,
    )
    seq = SequenceState(
        seq_id=0,
        request_id="r",
        prompt_token_ids=list(range(10, 10 + prompt_len)),
        params=params,
        sampling_seed=0,
        arrival_order=0,
    )
    scheduler.add(seq)
    return scheduler, OutputProcessor(None, frozenset(), max_model_len=64), seq


def drive(scheduler, outputs, overlap: bool, sample, on_step=lambda step: None, steps: int = 40):
    """Steps `scheduler` as the engine does, overlapped (a step processed after the next is dispatched) or in turn:
    `sample(step, chunks)` is what the device samples for a step's chunks (token_ids, no_token_allowed), `on_step(step)`
    runs after each step's processing."""
    in_flight = []
    for step in range(steps):
        schedule = scheduler.schedule()
        chunks = schedule.decodes + schedule.prefills
        sampled = sample(step, chunks)
        scheduler.mark_dispatched(chunks)
        dispatched = [(chunks, sampled)] if chunks else []
        to_process, in_flight = (in_flight, dispatched) if overlap else (dispatched, [])
        for done, result in to_process:
            outputs.process(done, scheduler, result, 0)
        on_step(step)
        if not scheduler.has_unfinished and not in_flight:
            break


def run(overlap: bool, stop_at: int, page_size: int = 4, prompt_len: int = 3):
    """One sequence whose device samples STOP as its stop_at-th token (1-based), OTHER before; returns
    (the chunks planned for it, per step, from the one that samples the stop on), the sequence and
    the step at which the host saw the request finished."""
    scheduler, outputs, seq = one_sequence(page_size, prompt_len, SamplingParams(max_tokens=20, stop_token_ids=[STOP]))
    planned, finished_at, samples = [], None, 0

    def sample(step, chunks):
        nonlocal samples
        tokens = []
        for chunk in chunks:
            samples += chunk.samples_next_token
            tokens.append(STOP if chunk.samples_next_token and samples == stop_at else OTHER)
            planned.append((step, samples >= stop_at))
        return SimpleNamespace(token_ids=np.array(tokens), no_token_allowed=np.zeros(len(tokens), bool))

    def on_step(step):
        nonlocal finished_at
        if finished_at is None and seq.finish_reason is not None:
            finished_at = step

    drive(scheduler, outputs, overlap, sample, on_step)
    return [step for step, after_stop in planned if after_stop], seq, finished_at


@pytest.mark.parametrize("stop_at", [1, 2, 4])
def test_overlapped_a_stop_in_flight_costs_one_row_and_the_output_is_right(stop_at):
    after_stop, seq, finished_at = run(overlap=True, stop_at=stop_at, page_size=64)
    plain_after_stop, plain_seq, _ = run(overlap=False, stop_at=stop_at, page_size=64)
    # the step sampling the stop, and the one already dispatched behind it; nothing later
    assert len(after_stop) == 2 and after_stop[1] == after_stop[0] + 1
    assert finished_at == after_stop[1], "finished as soon as the stop's step is processed"
    assert seq.output_token_ids == plain_seq.output_token_ids == [OTHER] * (stop_at - 1) + [STOP]
    assert seq.finish_reason == plain_seq.finish_reason == "stop" and seq.is_finished
    assert len(plain_after_stop) == 1, "stepping in turn, the stop's step is the last"


def test_a_stop_that_fills_a_page_gets_its_kv_computed_once_either_way():
    """prompt 3 + 1 output fills a page of 4: the stop token's KV is computed (so the next turn finds the
    whole page); overlapped, by the step already in flight, not by one more."""
    after_stop, seq, _ = run(overlap=True, stop_at=1, page_size=4)
    plain_after_stop, plain_seq, _ = run(overlap=False, stop_at=1, page_size=4)
    assert len(after_stop) == 2 and len(plain_after_stop) == 2
    assert seq.output_token_ids == plain_seq.output_token_ids == [STOP]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_step_that_allowed_no_token_ends_a_page_aligned_sequence(overlap):
    """A grammar at a dead end (or allowed_token_ids it shares none with) drops the step's token: the newest
    token's KV is computed already, so a sequence whose length fills a page finishes at once rather than
    waiting, flushing, for a step that never comes (LLM.generate used to loop for ever)."""
    scheduler, outputs, seq = one_sequence(4, 3, SamplingParams(max_tokens=20))
    samples = 0

    def sample(step, chunks):
        nonlocal samples
        allowed = []
        for chunk in chunks:
            samples += chunk.samples_next_token
            allowed.append(samples < 2)  # prompt 3 + 1 token fills a page; the next step allows none
        return SimpleNamespace(token_ids=np.full(len(allowed), OTHER), no_token_allowed=~np.array(allowed, bool))

    drive(scheduler, outputs, overlap, sample, steps=20)
    assert seq.is_finished and seq.finish_reason == "no_token_allowed", (seq.finish_reason, seq.flushing)
    assert seq.output_token_ids == [OTHER] and not scheduler.running
    assert scheduler.allocator.ref_counts[1:] == [0] * 31
