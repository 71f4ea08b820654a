"""A fake model for driving the scheduler as the engine does (plain Python, no JAX): it samples token 7."""

import itertools

from jaxserve.host.page_allocator import RESERVED_PAGE, PageAllocator
from jaxserve.host.request import SamplingParams, SequenceState
from jaxserve.host.scheduler import Scheduler

_ids = itertools.count()


def make_seq(prompt_len: int, max_tokens: int) -> SequenceState:
    seq_id = next(_ids)
    return SequenceState(
        seq_id=seq_id,
        request_id=str(seq_id),
        prompt_token_ids=[1] * prompt_len,
        params=SamplingParams(max_tokens=max_tokens),
        sampling_seed=0,
        arrival_order=seq_id,
    )


def make_scheduler(num_pages=64, page_size=4, max_num_seqs=4, budget=32, block=4):
    allocator = PageAllocator(num_pages, page_size)
    return Scheduler(allocator, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, prefill_query_block=block)


def run_step(scheduler: Scheduler):
    """Schedule, pretend to run, postprocess as the engine does; returns the schedule."""
    schedule = scheduler.schedule()
    for chunk in schedule.decodes + schedule.prefills:
        seq = chunk.seq
        assert len(seq.page_ids) * scheduler.allocator.page_size >= chunk.end
        seq.num_computed_tokens = chunk.end
        scheduler.cache_full_pages(seq)
        if seq.flushing:
            scheduler.finish(seq, seq.finish_reason)
        elif chunk.samples_next_token:
            seq.output_token_ids.append(7)
            if len(seq.output_token_ids) == seq.params.max_tokens:
                scheduler.finish_or_flush(seq, "length")
    return schedule


def assert_no_leaks(scheduler: Scheduler):
    """Every page's reference count is the number of running sequences and reservations holding it; the
    rest are free."""
    allocator, holders = scheduler.allocator, {}
    held = [seq.page_ids for seq in scheduler.running] + [r.page_ids for r in scheduler.reservations.values()]
    for page_ids in held:
        for page in page_ids:
            holders[page] = holders.get(page, 0) + 1
    assert RESERVED_PAGE not in holders
    for page in range(1, allocator.num_pages):
        assert allocator.ref_counts[page] == holders.get(page, 0), f"page {page} has a wrong reference count"
    assert allocator.num_free_pages + len(holders) == allocator.num_usable_pages


def drive(scheduler: Scheduler, pending: list) -> list:
    """Run (arrival step, sequence, cancel) requests to completion, cancelling two steps after arrival."""
    added, step = [], 0
    while pending or scheduler.has_unfinished:
        for item in [x for x in pending if x[0] <= step]:
            pending.remove(item)
            scheduler.add(item[1])
            added.append(item)
        for arrival, seq, cancel in added:
            if cancel and step == arrival + 2 and not seq.is_finished:
                scheduler.finish(seq, "abort")
        run_step(scheduler)
        assert_no_leaks(scheduler)
        step += 1
        assert step < 5000, "the scheduler stopped making progress"
    assert scheduler.allocator.num_free_pages == scheduler.allocator.num_usable_pages
    for _, seq, _cancel in added:
        assert seq.is_finished
        assert seq.finish_reason == "abort" or len(seq.output_token_ids) == seq.params.max_tokens
    return added
