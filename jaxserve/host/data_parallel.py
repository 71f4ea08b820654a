"""Data-parallel ranks: each device group schedules its own sequences on its own range of KV pages.

`RankedScheduler` and `RankedAllocator` give the engine one scheduler and one allocator however many
ranks there are: a new sequence goes to the least loaded rank and stays there; page ids are local
to a rank (each rank's slice of the page pool starts at its own reserved page 0).
"""

from __future__ import annotations

import dataclasses

from jaxserve.host.page_allocator import PageAllocator, PrefixCacheStats
from jaxserve.host.request import Sequence
from jaxserve.host.scheduler import Schedule, Scheduler


class RankedAllocator:
    """Sums over the ranks' allocators, for stats; a sequence's own pages come from its rank's."""

    def __init__(self, allocators: list[PageAllocator]):
        self.allocators = allocators
        self.enable_prefix_caching = allocators[0].enable_prefix_caching
        self.host_tier = None
        self.pending_demotions, self.pending_promotions = [], []

    @property
    def num_pages_per_rank(self) -> int:
        return self.allocators[0].num_pages

    @property
    def num_usable_pages(self) -> int:
        return sum(a.num_usable_pages for a in self.allocators)

    @property
    def max_pages_per_sequence(self) -> int:
        return self.allocators[0].num_usable_pages

    @property
    def num_free_pages(self) -> int:
        return sum(a.num_free_pages for a in self.allocators)

    @property
    def num_cached_pages(self) -> int:
        return sum(a.num_cached_pages for a in self.allocators)

    @property
    def stats(self) -> PrefixCacheStats:
        totals = PrefixCacheStats()
        for field in dataclasses.fields(PrefixCacheStats):
            setattr(totals, field.name, sum(getattr(a.stats, field.name) for a in self.allocators))
        return totals


class RankedScheduler:
    def __init__(self, ranks: list[Scheduler]):
        self.ranks = ranks

    def add(self, seq: Sequence) -> None:
        seq.rank = min(range(len(self.ranks)), key=lambda r: len(self.ranks[r].running) + len(self.ranks[r].waiting))
        self.ranks[seq.rank].add(seq)

    def schedule_ranks(self) -> list[Schedule]:
        return [rank.schedule() for rank in self.ranks]

    def finish(self, seq: Sequence, reason: str) -> None:
        self.ranks[seq.rank].finish(seq, reason)

    def finish_or_flush(self, seq: Sequence, reason: str) -> None:
        self.ranks[seq.rank].finish_or_flush(seq, reason)

    def cache_full_pages(self, seq: Sequence) -> None:
        self.ranks[seq.rank].cache_full_pages(seq)

    @property
    def has_unfinished(self) -> bool:
        return any(rank.has_unfinished for rank in self.ranks)

    @property
    def running(self) -> list[Sequence]:
        return [seq for rank in self.ranks for seq in rank.running]

    @property
    def waiting(self) -> list[Sequence]:
        return [seq for rank in self.ranks for seq in rank.waiting]

    @property
    def num_preemptions(self) -> int:
        return sum(rank.num_preemptions for rank in self.ranks)
