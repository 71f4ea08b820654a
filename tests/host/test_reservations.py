"""A decode replica's reservations in the scheduler (plain Python, no JAX): a reserved slot and its pages
are held under the same admission check as a local sequence, then admitted or released."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.scheduling import assert_no_leaks, make_scheduler, make_seq, run_step


def test_a_reservation_holds_its_slot_against_local_admission():
    scheduler = make_scheduler(max_num_seqs=2)
    assert scheduler.reserve("handed", [2] * 8, max_tokens=4) is not None
    local = [make_seq(5, 3), make_seq(5, 3)]
    for seq in local:
        scheduler.add(seq)
    schedule = run_step(scheduler)
    assert [chunk.seq for chunk in schedule.prefills] == [local[0]], "one slot is reserved"
    assert scheduler.reserve("another", [3] * 8, max_tokens=4) is None, "no slot left"
    assert scheduler.release_reservation("handed") and not scheduler.release_reservation("handed")
    assert local[1] in [chunk.seq for chunk in run_step(scheduler).prefills], "the released slot admits at once"
    assert_no_leaks(scheduler)


def test_reserve_refuses_what_local_admission_would_refuse_for_pages():
    """Both count pages for prompt + max_tokens: 8 + 8 tokens need 4 pages of 4; 3 are free."""
    scheduler = make_scheduler(num_pages=4, page_size=4)
    assert scheduler.reserve("big", [2] * 8, max_tokens=8) is None
    waiting = make_seq(8, 8)
    scheduler.add(waiting)
    assert run_step(scheduler).is_empty and waiting in scheduler.waiting
    assert scheduler.reserve("fits", [2] * 8, max_tokens=4) is not None  # 3 pages
    assert scheduler.allocator.num_free_pages == 1
    assert_no_leaks(scheduler)


def test_reservation_shares_the_cached_prefix_and_the_admitted_sequence_decodes():
    scheduler = make_scheduler(page_size=4)
    scheduler.allocator.enable_prefix_caching = True
    warm = make_seq(10, 1)  # caches two full pages of token 1
    scheduler.add(warm)
    while scheduler.has_unfinished:
        run_step(scheduler)
    reservation = scheduler.reserve("0", [1] * 10, max_tokens=3)
    assert reservation is not None and reservation.num_cached_tokens == 8 and len(reservation.held_keys) == 2
    assert len(reservation.page_ids) == 3 and reservation.missing_page_ids == reservation.page_ids[2:]
    seq = make_seq(10, 3)
    seq.request_id = "0"
    scheduler.admit_reserved(seq)
    seq.output_token_ids.append(7)  # the first token, sampled by the prefill side
    assert not scheduler.reservations and seq.num_computed_tokens == 10 and seq.num_cached_tokens == 8
    schedule = run_step(scheduler)
    assert [(chunk.seq, chunk.start, chunk.num_tokens) for chunk in schedule.decodes] == [(seq, 10, 1)]
    while scheduler.has_unfinished:
        run_step(scheduler)
    assert seq.output_token_ids == [7, 7, 7]
    assert scheduler.allocator.num_free_pages == scheduler.allocator.num_usable_pages


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(1, 30), st.integers(1, 10), st.integers(0, 4)), max_size=14),
    st.integers(10, 30),
    st.integers(1, 4),
)
def test_reservations_and_local_sequences_share_slots_and_pages_without_leaks(requests, num_pages, max_num_seqs):
    """Each request either arrives locally or as a handover that completes (or, when `wait` is 0, is
    released) `wait` steps after it was reserved; slots are never oversubscribed and nothing leaks."""
    scheduler = make_scheduler(num_pages=num_pages, page_size=4, max_num_seqs=max_num_seqs)
    scheduler.allocator.enable_prefix_caching = True  # every prompt is token 1s: reservations share pages
    fits = [r for r in requests if -(-(r[1] + r[2]) // 4) <= num_pages - 1]
    reserved: dict[str, tuple[int, object]] = {}
    local, admitted, step = [], [], 0
    queue = list(enumerate(fits))
    while queue or reserved or scheduler.has_unfinished:
        for index, (handed, prompt_len, max_tokens, wait) in list(queue):
            seq = make_seq(prompt_len, max_tokens)
            if not handed:
                scheduler.add(seq)
                local.append(seq)
            elif scheduler.reserve(seq.request_id, seq.prompt_token_ids, max_tokens) is not None:
                reserved[seq.request_id] = (step + wait, seq if wait else None)
            else:
                break  # the decode side queues the handover: try again next step, in order
            queue.remove((index, (handed, prompt_len, max_tokens, wait)))
        for request_id, (due, seq) in list(reserved.items()):
            if due <= step:
                del reserved[request_id]
                if seq is None:
                    scheduler.release_reservation(request_id)
                else:
                    scheduler.admit_reserved(seq)
                    seq.output_token_ids.append(7)  # the first token, as the engine appends it
                    if seq.params.max_tokens == 1:
                        scheduler.finish_or_flush(seq, "length")
                    admitted.append(seq)
        assert len(scheduler.running) + len(scheduler.reservations) <= max_num_seqs
        run_step(scheduler)
        assert_no_leaks(scheduler)
        step += 1
        assert step < 2000, "no progress"
    assert scheduler.allocator.num_free_pages == scheduler.allocator.num_usable_pages
    assert all(len(seq.output_token_ids) == seq.params.max_tokens for seq in local + admitted)
