"""Page events in, the router's view out: after random workloads with evictions, host-tier demotions and
promotions, cancellations, gaps and clears, the view equals the allocator's cache page for page.
No servers, no JAX: the scheduler and allocator run under a fake model (tests/support/scheduling.py)."""

import random

import pytest

from jaxserve.host.kv_events import DEVICE, HOST, KVEventLog
from jaxserve.host.page_allocator import PageAllocator
from jaxserve.host.request import SamplingParams, SequenceState
from jaxserve.host.scheduler import Scheduler
from jaxserve.router.cache_view import CacheView, prefix_keys
from tests.support.scheduling import assert_no_leaks, run_step

PAGE_SIZE = 4


def allocator_pages(allocator: PageAllocator) -> dict[str, dict[int, tuple[int, int]]]:
    """What the allocator holds, as {tier: {key: (parent key, tokens)}}."""
    device = {
        key: (allocator.page_contents[page][0], len(allocator.page_contents[page][1]))
        for key, page in allocator.pages_by_key.items()
    }
    host = {key: (contents[0], len(contents[1])) for key, (contents, _) in allocator.host_tier.entries.items()}
    return {DEVICE: device, HOST: host}


def view_pages(view: CacheView, rank: int = 0) -> dict[str, dict[int, tuple[int, int]]]:
    return {
        tier: {key: (page.parent_key, page.num_tokens) for key, page in view.state.pages(rank, tier).items()}
        for tier in (DEVICE, HOST)
    }


def move_host_tier_pages(allocator: PageAllocator) -> None:
    """What Engine.move_host_tier_pages does, without bytes."""
    demoted, allocator.pending_demotions = allocator.pending_demotions, []
    for _, key, contents in demoted:
        allocator.host_tier.store(key, contents, None)
    allocator.pending_promotions = []


class Subscriber:
    """Reads the log as the gRPC stream does, in random-sized deltas; sometimes loses one (a gap)."""

    def __init__(self, log: KVEventLog, rng: random.Random):
        self.log, self.rng, self.view = log, rng, CacheView()
        self.num_snapshots = self.num_gaps = 0
        self.resubscribe()

    def resubscribe(self) -> None:
        sequence, events, _ = self.log.snapshot()
        self.view.reset(sequence, events)
        self.num_snapshots += 1

    def poll(self) -> None:
        sequence, events, _ = self.log.events_after(self.view.sequence)
        if events and self.rng.random() < 0.05:
            dropped = self.rng.randint(1, len(events))
            sequence, events = sequence + 1, events[:-dropped] + [events[-1]]  # numbers no longer add up
        if not self.view.apply(sequence, events):
            self.num_gaps += 1
            self.resubscribe()


def random_prompt(rng: random.Random, conversations: list[list[int]]) -> list[int]:
    """Shared system prompts, continued conversations and fresh text, so that prefixes repeat."""
    choice = rng.random()
    if conversations and choice < 0.5:
        base = rng.choice(conversations)
        prompt = base + [7] * rng.randint(0, 6) + [rng.randint(3, 50) for _ in range(rng.randint(1, 6))]
    else:
        system = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 8, 8, 7, 7]][rng.randint(0, 1)]
        prompt = system + [rng.randint(3, 50) for _ in range(rng.randint(1, 12))]
    conversations.append(prompt)
    return prompt


def run_workload(seed: int, num_steps: int = 300, host_tier_pages: int = 6):
    rng = random.Random(seed)
    allocator = PageAllocator(18, PAGE_SIZE, enable_prefix_caching=True, host_tier_pages=host_tier_pages)
    log = KVEventLog(max_retained=64)  # small, so that a slow subscriber also falls behind it
    allocator.attach_events(log.for_rank(0))
    scheduler = Scheduler(allocator, max_num_seqs=3, max_num_batched_tokens=16, prefill_query_block=4)
    subscriber, conversations, live = Subscriber(log, rng), [], []
    for step in range(num_steps):
        if rng.random() < 0.4:
            prompt = random_prompt(rng, conversations)
            seq = SequenceState(
                seq_id=step,
                request_id=str(step),
                prompt_token_ids=prompt,
                params=SamplingParams(max_tokens=rng.randint(1, 6)),
                sampling_seed=0,
                arrival_order=step,
            )
            if len(prompt) + seq.params.max_tokens <= 60:
                scheduler.add(seq)
                live.append(seq)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            if not victim.is_finished:
                scheduler.finish(victim, "abort")
        if not scheduler.has_unfinished and rng.random() < 0.03:
            assert allocator.clear_prefix_cache()
        run_step(scheduler)
        move_host_tier_pages(allocator)
        assert_no_leaks(scheduler)
        if rng.random() < 0.7:  # sometimes several steps' events arrive together
            subscriber.poll()
            assert view_pages(subscriber.view) == allocator_pages(allocator), f"step {step}"
    subscriber.poll()
    return allocator, subscriber


@pytest.mark.parametrize("seed", range(6))
def test_view_equals_the_allocator_after_a_random_workload(seed):
    allocator, subscriber = run_workload(seed)
    assert view_pages(subscriber.view) == allocator_pages(allocator)
    stats = allocator.stats
    # the workload did what it is meant to exercise
    assert stats.num_evictions > 0 and stats.num_swapped_out_pages > 0 and stats.num_swapped_in_pages > 0
    assert stats.num_hit_tokens > 0 and subscriber.num_gaps > 0


def test_a_view_built_from_the_first_event_equals_a_snapshot():
    allocator, subscriber = run_workload(11, num_steps=120)
    log = subscriber.log
    sequence, events, _ = log.snapshot()
    fresh = CacheView()
    fresh.reset(sequence, events)
    assert view_pages(fresh) == view_pages(subscriber.view) == allocator_pages(allocator)


@pytest.mark.parametrize("seed", range(3))
def test_match_predicts_what_the_scheduler_finds(seed):
    allocator, subscriber = run_workload(seed, num_steps=200)
    rng, conversations = random.Random(100 + seed), []
    num_hits = 0
    for _ in range(200):
        prompt = random_prompt(rng, conversations)
        found = allocator.find_cached_prefix(prompt, len(prompt) - 1)
        match = subscriber.view.match(prefix_keys(prompt, PAGE_SIZE))
        assert (match.num_device_pages, match.num_host_pages) == (len(found.pages), len(found.host_keys))
        assert prefix_keys(prompt, PAGE_SIZE)[: found.num_pages] == found.keys
        num_hits += found.num_pages > 0
    assert num_hits > 0


def test_data_parallel_ranks_are_kept_apart():
    log = KVEventLog()
    allocators = [PageAllocator(6, 2, enable_prefix_caching=True) for _ in range(2)]
    for rank, allocator in enumerate(allocators):
        allocator.attach_events(log.for_rank(rank))
    view = CacheView()
    view.reset(*log.snapshot()[:2])
    pages = allocators[1].allocate(2)
    key = allocators[1].cache_full_page(pages[0], 0, (5, 6))
    allocators[1].cache_full_page(pages[1], key, (7, 8))
    allocators[0].cache_full_page(allocators[0].allocate(1)[0], 0, (5, 6))
    assert view.apply(*log.events_after(0)[:2])
    assert view.keys(DEVICE, 0) == {key} and len(view.keys(DEVICE, 1)) == 2
    assert view.match(prefix_keys([5, 6, 7, 8, 9], 2)).num_device_pages == 2  # the best rank
    allocators[1].release(pages)
    assert allocators[1].clear_prefix_cache()
    assert view.apply(*log.events_after(view.sequence)[:2])
    assert view.keys(DEVICE, 0) == {key} and view.keys(DEVICE, 1) == set()


def test_clear_is_refused_while_a_cached_page_is_held():
    allocator = PageAllocator(4, 2, enable_prefix_caching=True)
    page = allocator.allocate(1)
    allocator.cache_full_page(page[0], 0, (1, 2))
    assert not allocator.clear_prefix_cache()
    allocator.release(page)
    assert allocator.clear_prefix_cache() and allocator.num_cached_pages == 0
    assert allocator.num_free_pages == allocator.num_usable_pages


def test_pending_pages_count_for_the_blind_window_only():
    now = [0.0]
    view = CacheView(blind_window=2.0, clock=lambda: now[0])
    view.reset(0, [])
    keys = prefix_keys(list(range(3, 20)), 4)
    view.note_routed(keys)
    assert view.match(keys).num_pending_pages == 4
    now[0] = 2.5
    assert view.match(keys).num_pages == 0


def test_keys_are_the_same_in_every_process():
    """A router in another process (another interpreter, PYTHONHASHSEED) computes the same keys."""
    import subprocess
    import sys

    code = "from jaxserve.router.cache_view import prefix_keys; print(prefix_keys(list(range(40)), 16))"
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": seed}
        ).stdout
        for seed in ("1", "2")
    }
    assert outputs == {f"{prefix_keys(list(range(40)), 16)}\n"}
