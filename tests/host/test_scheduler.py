"""The scheduler and page allocator, as plain Python (no JAX): a fake model samples token 7."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.host.page_allocator import RESERVED_PAGE, PageAllocator
from jaxserve.host.request import RequestStatus
from tests.support.scheduling import assert_no_leaks, drive, make_scheduler, make_seq, run_step


def test_allocator_reference_counts():
    allocator = PageAllocator(5, 16)
    pages = allocator.allocate(3)
    assert RESERVED_PAGE not in pages and allocator.num_free_pages == 1
    allocator.share(pages[:1])
    allocator.release(pages)
    assert allocator.num_free_pages == 3  # the shared page still has a holder
    allocator.release(pages[:1])
    assert allocator.num_free_pages == 4
    assert not allocator.can_allocate(5)
    with pytest.raises(RuntimeError):
        allocator.allocate(5)


def test_long_prompt_is_chunked_and_decodes_keep_running():
    scheduler = make_scheduler(budget=16, block=4)
    short = make_seq(3, 40)
    scheduler.add(short)
    run_step(scheduler)  # short's prefill
    long = make_seq(100, 2)
    scheduler.add(long)
    steps_with_long_prefill = 0
    while long.num_computed_tokens < long.num_prompt_tokens:
        schedule = run_step(scheduler)
        assert [c.seq for c in schedule.decodes] == [short], "the running decode must never be stalled"
        assert sum(-(-c.num_tokens // 4) * 4 for c in schedule.prefills) + len(schedule.decodes) <= 16
        steps_with_long_prefill += 1
    assert steps_with_long_prefill == -(-100 // 12)  # 15 tokens left after the decode -> 12-token chunks


def test_finished_sequence_frees_its_slot_for_the_next_step():
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(5, 1), make_seq(5, 3), make_seq(5, 3)]
    for seq in seqs:
        scheduler.add(seq)
    first = run_step(scheduler)
    assert {c.seq.seq_id for c in first.prefills} == {seqs[0].seq_id, seqs[1].seq_id}
    assert seqs[0].is_finished and scheduler.allocator.num_free_pages == 63 - 2
    second = run_step(scheduler)
    assert seqs[2] in [c.seq for c in second.prefills], "the waiting sequence takes the freed slot at once"


def test_youngest_is_preempted_when_pages_run_out_and_finishes_later():
    scheduler = make_scheduler(num_pages=7, page_size=4, max_num_seqs=3, budget=64)  # 6 usable pages
    seqs = [make_seq(4, 8), make_seq(4, 8), make_seq(4, 8)]
    for seq in seqs:
        scheduler.add(seq)
    preempted = []
    for _ in range(100):
        if not scheduler.has_unfinished:
            break
        preempted += run_step(scheduler).preempted
        assert_no_leaks(scheduler)
    assert all(s.is_finished and len(s.output_token_ids) == 8 for s in seqs)
    assert preempted and preempted[0] is seqs[2], "the youngest goes first"
    assert scheduler.allocator.num_free_pages == 6


def test_abort_frees_pages_immediately():
    scheduler = make_scheduler()
    seq = make_seq(10, 5)
    scheduler.add(seq)
    run_step(scheduler)
    assert scheduler.allocator.num_free_pages < 63
    scheduler.finish(seq, "abort")
    assert scheduler.allocator.num_free_pages == 63 and not scheduler.has_unfinished
    assert seq.status is RequestStatus.FINISHED


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 20), st.integers(0, 6), st.booleans()), min_size=1, max_size=12
    ),
    st.integers(12, 40),
    st.sampled_from([1, 2, 4]),
    st.integers(1, 5),
)
def test_random_workloads_complete_without_leaks(requests, num_pages, block, max_num_seqs):
    """Random arrivals, lengths and cancellations, with a cache small enough to force preemption."""
    page_size = 4
    scheduler = make_scheduler(
        num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs, budget=4 * block, block=block
    )
    pending = [
        (arrival, make_seq(p, m), cancel)
        for p, m, arrival, cancel in requests
        if -(-(p + m) // page_size) <= num_pages - 1
    ]  # the engine rejects what can never fit
    drive(scheduler, pending)
