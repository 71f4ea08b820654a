"""The KV pools' size: one device's budget (as configured, else 90% of its free memory), split between the target's
pool and a draft's when the memory is measured; what a device lacks for the largest compiled step's scratch beside
the pools (the builder then sizes them again); and the target's pool with one scheduler per data-parallel rank.
"""

from __future__ import annotations

import functools
import logging

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxserve.config import EngineConfig
from jaxserve.device.placement import kv_pages_on
from jaxserve.device.rank_layout import RankLayout
from jaxserve.device.runner import StepRunner, kv_cache_bytes_available, measured_free_bytes
from jaxserve.distributed.runtime import ProcessGroup, spans_processes
from jaxserve.engine.attention_plan import AttentionPlan
from jaxserve.engine.draft_model import DraftWeights, draft_device_page_bytes, draft_pool_pages
from jaxserve.host.page_allocator import PageAllocator, num_pages_for, swap_in_is_cheaper
from jaxserve.host.scheduler import Scheduler
from jaxserve.models import KVPages
from jaxserve.models.config import ModelConfig
from sharding.attention import devices_per_page

logger = logging.getLogger(__name__)


def kv_budgets(
    config: EngineConfig,
    mesh: Mesh | None,
    max_model_len: int,
    draft: DraftWeights | None,
    at_most: int | None = None,
) -> tuple[int, int | None]:
    """(the target's KV budget of one device, the draft's pool in pages a rank; None without a draft).

    Measured from free device memory, one budget serves both pools, taken after both models' weights are in
    memory: the draft's pool what its rows need up to a fifth of it (a quarter of the target's), the target's
    the rest. (Sized one after the other, the target's pool took 90% of what was free before the draft's weights
    loaded: a draft larger than the 10% left failed to load, and its pool got a quarter of a remainder.) A
    configured budget (kv_cache_memory_gib, or the CPU's default) is the target's, the draft's pool a quarter of
    it beside. at_most: what both pools may take of a device at most (pools sized again: scratch_shortfall)."""
    budget = kv_cache_bytes_available(config.cache.kv_cache_memory_gib, mesh)
    if at_most is not None:
        budget = min(budget, at_most)
    if draft is None:
        return budget, None
    shared = config.cache.kv_cache_memory_gib is None and measured_free_bytes(mesh) is not None
    draft_pages = draft_pool_pages(draft, config, mesh, max_model_len, budget // 5 if shared else budget // 4)
    if shared:
        budget -= draft_pages * draft_device_page_bytes(draft, config, mesh)
    return budget, draft_pages


def draft_pool_bytes(
    draft: DraftWeights | None, draft_pages: int | None, config: EngineConfig, mesh: Mesh | None
) -> int:
    """What the draft's pool will take on a device (0: no draft)."""
    if draft is None or draft_pages is None:
        return 0
    return draft_pages * draft_device_page_bytes(draft, config, mesh)


def one_device_bytes(arrays) -> int:
    """What arrays take on one device (each array's largest shard): a pool's share of a device's memory."""
    return sum(max(shard.data.nbytes for shard in leaf.addressable_shards) for leaf in jax.tree.leaves(arrays))


def scratch_shortfall(
    runner: StepRunner,
    config: EngineConfig,
    mesh: Mesh | None,
    process_group: ProcessGroup | None,
    draft_pool: int,
) -> int:
    """How much memory a device lacks for the largest compiled step's scratch beside the KV pools (the target's
    made, the draft's still to come: draft_pool), plus a margin of 5% of it; 0 where it fits or where the
    pool's size is not the engine's to change: a budget set by the user (kv_cache_memory_gib, num_pages),
    devices that report no free memory (CPU), several processes (each would decide alone on its own measure)."""
    cache = config.cache
    if cache.kv_cache_memory_gib is not None or cache.num_pages is not None or spans_processes(process_group):
        return 0
    free = measured_free_bytes(mesh)
    if free is None:
        return 0
    needed, free = runner.largest_scratch_bytes(), free - draft_pool
    return 0 if needed <= free else needed - free + needed // 20


def warn_if_scratch_does_not_fit(runners: list, mesh: Mesh | None) -> None:
    """The KV pools are sized before anything compiles, within 90% of the free memory: where the largest
    step's scratch (a long prefill's activations) needs more than what is left, it would fail when such a
    step first runs, while serving. Say so at start, with what to change."""
    free = measured_free_bytes(mesh)
    if free is None:
        return
    needed = max(runner.largest_scratch_bytes() for runner in runners)
    if needed > free:
        logger.warning(
            "the largest compiled step needs %.2f GiB of scratch memory a device while it runs, and %.2f GiB are "
            "free beside the KV cache: a step that large (a long prefill) may fail for want of memory. Lower "
            "cache.kv_cache_memory_gib (or num_pages), or scheduler.max_num_batched_tokens",
            needed / 2**30,
            free / 2**30,
        )


def kv_cache(
    model: ModelConfig,
    config: EngineConfig,
    dtype: str,
    attention: AttentionPlan,
    mesh: Mesh | None,
    max_model_len: int,
    loaded_model,
    budget_bytes: int,
) -> tuple[list[Scheduler], KVPages, RankLayout]:
    """The page pool, one scheduler per rank over its own pages (addressed locally), and the layout
    that places each rank's pages in the pool; budget_bytes: one device's (kv_budgets)."""
    kv_dtype = config.cache.kv_dtype  # (one the model can take: build_engine checked it before loading)
    page_bytes = KVPages.bytes_per_page(
        model.num_layers,
        config.cache.page_size,
        attention.num_cache_kv_heads,
        attention.cache_head_dim,
        dtype,
        kv_dtype,
    )
    # Beyond what max_num_seqs full-length sequences can hold, pages only serve as prefix cache.
    useful_pages = (
        config.scheduler.max_num_seqs
        * num_pages_for(max_model_len, config.cache.page_size)
        * (4 if config.cache.enable_prefix_caching else 1)
        + 1
    )
    # The budget is one device's memory, and a device holds only its KV heads' share of each page.
    device_page_bytes = -(-page_bytes // devices_per_page(mesh, attention.num_cache_kv_heads))
    num_pages = config.cache.num_pages or max(2, min(budget_bytes // device_page_bytes, useful_pages))
    if (num_pages - 1) * config.cache.page_size < max_model_len:  # one page a rank is reserved
        logger.warning(
            "the KV cache holds %d tokens a rank (%d pages of %d, one reserved), fewer than one sequence of "
            "max_model_len %d: a request that needs more is refused. Raise cache.kv_cache_memory_gib (or num_pages), "
            "or lower max_model_len",
            (num_pages - 1) * config.cache.page_size,
            num_pages,
            config.cache.page_size,
            max_model_len,
        )
    num_params = sum(x.size for x in jax.tree.leaves(nnx.state(loaded_model)))
    swapping_pays = swap_in_is_cheaper(page_bytes, config.cache.page_size, num_params, jax.default_backend())
    host_tier_pages = int(config.cache.swap_space * 2**30) // page_bytes if swapping_pays else 0
    if config.cache.swap_space and not swapping_pays:
        logger.warning(
            "cache.swap_space %s GiB left unused: on %s recomputing a page's prefill is cheaper than bringing its KV "
            "back from host memory (pages of %d bytes), so evicted pages are dropped (no host tier)",
            config.cache.swap_space,
            jax.default_backend(),
            page_bytes,
        )
    num_ranks = config.parallel.data_parallel_size
    layout = RankLayout(num_ranks, num_pages, entries_per_rank=config.scheduler.max_num_seqs)
    schedulers = [
        Scheduler(
            PageAllocator(
                num_pages,
                config.cache.page_size,
                config.cache.enable_prefix_caching,
                host_tier_pages=host_tier_pages,
                session_ttl=config.cache.session_ttl,
            ),
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            prefill_query_block=config.scheduler.prefill_query_block,
        )
        for _ in range(num_ranks)
    ]
    zeros = functools.partial(
        KVPages.zeros,
        model.num_layers,
        layout.total_pages,
        config.cache.page_size,
        attention.num_cache_kv_heads,
        attention.cache_head_dim,
        dtype,
        kv_dtype,
    )
    # each device makes only its own shard: the whole cache on the first device would not fit there
    return schedulers, kv_pages_on(mesh, zeros, attention.num_cache_kv_heads), layout
