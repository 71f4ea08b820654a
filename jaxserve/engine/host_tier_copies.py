"""The host tier's copies, made where the engine is about to overwrite pages: demoted pages are read
before promotions, a step or a KV handover overwrite them; promotions land before the step that reads
them. The allocators (host/) only ask for them: they import no JAX."""

from __future__ import annotations

import time
from typing import cast

from jaxserve.device.page_copies import HostPage
from jaxserve.device.rank_layout import RankLayout
from jaxserve.device.runner import StepRunner
from jaxserve.engine.stats import StepTimings
from jaxserve.host.scheduler import Scheduler


def move_host_tier_pages(
    schedulers: list[Scheduler], runner: StepRunner, layout: RankLayout, timings: StepTimings
) -> None:
    for rank, scheduler in enumerate(schedulers):
        allocator = scheduler.allocator
        if allocator.pending_demotions:
            assert allocator.host_tier is not None  # only a host tier demotes pages
            demoted, allocator.pending_demotions = allocator.pending_demotions, []
            host_pages = runner.read_pages(layout.pool_pages(rank, [page for page, _, _ in demoted]))
            for host_page, (_, key, contents) in zip(host_pages, demoted):
                allocator.host_tier.store(key, contents, host_page)
        if allocator.pending_promotions:
            promoted, allocator.pending_promotions = allocator.pending_promotions, []
            started = time.perf_counter()
            # The host tier keeps the HostPages read_pages returned as opaque data (host/ imports no JAX).
            host_pages = cast(list[HostPage], [host_page for _, host_page in promoted])
            runner.write_pages(layout.pool_pages(rank, [page for page, _ in promoted]), host_pages)
            timings.observe_swap_in(time.perf_counter() - started, len(promoted))
