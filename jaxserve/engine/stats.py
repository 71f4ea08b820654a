"""What the engine reports: `describe()` (what it serves and how, fixed at start-up), `load()` (how
busy it is now) and `stats()` (every counter, for logs, metrics and tests). The server reads these
and nothing else of the engine's insides."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass

import jax

from jaxserve.engine.fingerprint import model_fingerprint
from jaxserve.host.page_allocator import PrefixCacheStats


@dataclass(frozen=True)
class EngineDescription:
    model_name: str  # the checkpoint's name, never a host path
    dtype: str
    mesh: str  # e.g. "1 cpu device", "data 2 x tensor 2 over 4 cpu devices"
    attention_impl: str
    page_size: int
    num_pages: int  # usable KV pages over all data-parallel ranks
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    compiled_buckets: tuple[tuple[str, int, int, int], ...]  # (kind, num_tokens, num_seqs, pages_per_seq)
    num_executables: int
    warmup_seconds: float
    model_fingerprint: str = ""  # engine/fingerprint.py: equal on two replicas means the same model
    host_tier_pages: int = 0  # what the host tier can hold, over all ranks


@dataclass
class StepTimings:
    """Measured while serving, for a router's time-to-first-token predictions (0 until measured), as moving
    averages. prefill_seconds_per_token: a step's wall time over the prompt tokens it has room for after
    its decodes; with chunked prefill, what each uncached prompt token adds to a request's time to first
    token at the current load (more running sequences: slower steps with less room). step_seconds: a
    step's wall time (a new request waits for the step under way). And the wall time per page brought
    back from the host tier."""

    prefill_seconds_per_token: float = 0.0
    step_seconds: float = 0.0
    swap_in_seconds_per_page: float = 0.0
    weight: float = 0.2  # of the newest measurement

    def _average(self, old: float, new: float) -> float:
        return new if old == 0.0 else (1 - self.weight) * old + self.weight * new

    def observe_step(self, seconds: float, num_prefill_room: int) -> None:
        self.prefill_seconds_per_token = self._average(self.prefill_seconds_per_token, seconds / num_prefill_room)
        self.step_seconds = self._average(self.step_seconds, seconds)

    def observe_swap_in(self, seconds: float, num_pages: int) -> None:
        self.swap_in_seconds_per_page = self._average(self.swap_in_seconds_per_page, seconds / num_pages)

    def stats(self) -> dict:
        return {
            "prefill_seconds_per_token": self.prefill_seconds_per_token,
            "swap_in_seconds_per_page": self.swap_in_seconds_per_page,
            "step_seconds": self.step_seconds,
        }


class StepTimer:
    """One engine step's wall time (`with StepTimer() as timer:`), and the part of it spent waiting for
    the device's results (`with timer.waiting():`); the rest is host work."""

    def __enter__(self) -> StepTimer:
        self.started, self.waited, self.elapsed = time.perf_counter(), 0.0, 0.0
        return self

    def __exit__(self, *exception) -> None:
        self.elapsed = time.perf_counter() - self.started

    @contextlib.contextmanager
    def waiting(self):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.waited += time.perf_counter() - started

    @property
    def host_seconds(self) -> float:
        return self.elapsed - self.waited


@dataclass(frozen=True)
class EngineLoad:
    num_running: int
    num_waiting: int
    num_free_pages: int
    num_tokens_waiting_prefill: int  # prompt tokens (of running and waiting sequences) not yet computed


def _mesh_description(mesh) -> str:
    if mesh is None:
        return f"1 {jax.default_backend()} device"
    kind = mesh.devices.flat[0].platform
    axes = " x ".join(f"{name} {size}" for name, size in mesh.shape.items())
    return f"{axes} over {mesh.devices.size} {kind} devices"


def describe_engine(engine) -> EngineDescription:
    runner = engine.runner.stats()
    return EngineDescription(
        model_name=engine.parts.source.name,
        dtype=engine.dtype,
        mesh=_mesh_description(engine.parts.mesh),
        attention_impl=engine.parts.attention.impl,
        page_size=engine.config.cache.page_size,
        num_pages=sum(s.allocator.num_usable_pages for s in engine.schedulers),
        max_model_len=engine.max_model_len,
        max_num_seqs=engine.config.scheduler.max_num_seqs,
        vocab_size=engine.model_config.vocab_size,
        compiled_buckets=engine.runner.compiled_buckets(),
        num_executables=runner["num_executables"],
        warmup_seconds=runner["warmup_seconds"],
        model_fingerprint=model_fingerprint(engine.parts.source),
        host_tier_pages=sum(
            s.allocator.host_tier.capacity_pages for s in engine.schedulers if s.allocator.host_tier is not None
        ),
    )


def engine_load(engine, loads=None) -> EngineLoad:
    """loads: the schedulers' own (SchedulerLoad), when the caller has them already."""
    loads = loads if loads is not None else [scheduler.load() for scheduler in engine.schedulers]
    return EngineLoad(
        num_running=sum(load.num_running for load in loads),
        num_waiting=sum(load.num_waiting for load in loads),
        num_free_pages=sum(load.num_free_pages for load in loads),
        num_tokens_waiting_prefill=sum(load.num_tokens_waiting_prefill for load in loads),
    )


def engine_stats(engine) -> dict:
    loads = [scheduler.load() for scheduler in engine.schedulers]
    load = engine_load(engine, loads)
    return {
        "kv_pages_total": sum(s.allocator.num_usable_pages for s in engine.schedulers),
        "kv_pages_free": load.num_free_pages,
        # weights and KV bytes on the devices (replicas counted on each device), KV bytes a token, executables,
        # compiles
        **engine.runner.stats(),
        # auto: the model's dtype; bfloat16 / float16 (a float32 model's); int8 / float8_e4m3 + scales
        "kv_cache_dtype": engine.config.cache.kv_dtype,
        "page_size": engine.config.cache.page_size,
        "num_running": load.num_running,
        "num_waiting": load.num_waiting,
        "num_tokens_waiting_prefill": load.num_tokens_waiting_prefill,
        **engine.timings.stats(),
        "overlap_steps": engine.overlap_steps,
        **engine.decode_chains.stats(),  # num_scheduler_steps, decode_chains (engine/decode_chain.py)
        **engine.device_clock.stats(),  # host_seconds_per_step, device_idle_seconds_per_step
        **engine.constraints.stats(),  # penalty state resets, grammars compiled and cached
        "num_preemptions": sum(scheduler_load.num_preemptions for scheduler_load in loads),
        "num_steps": engine.num_steps,
        **engine.outputs.stats(),  # num_prompt_tokens, num_generated_tokens
        "max_model_len": engine.max_model_len,
        "dtype": engine.dtype,
        "attention_impl": engine.parts.attention.impl,
        **prefix_cache_stats([s.allocator for s in engine.schedulers]),
        **engine.speculation.stats(),  # proposals, acceptance, the policy's measurements (engine/speculation.py)
        **(engine.experts.stats() if engine.experts is not None else {}),
        # disaggregated: requests parked for a decode replica, or reserved, queued, prefilled here (disagg/)
        **(engine.handovers.stats() if engine.handovers is not None else {}),
        # LoRA: each adapter's root page key, sent to routers (server/kv_events_service.py)
        **({"lora_root_keys": engine.parts.lora.root_keys()} if engine.parts.lora is not None else {}),
    }


def prefix_cache_stats(allocators) -> dict:
    """Summed over the data-parallel ranks' allocators."""
    cache = PrefixCacheStats()
    for field in dataclasses.fields(PrefixCacheStats):
        setattr(cache, field.name, sum(getattr(a.stats, field.name) for a in allocators))
    return {
        "prefix_cache_enabled": allocators[0].enable_prefix_caching,
        "prefix_cache_queries": cache.num_queries,
        "prefix_cache_query_tokens": cache.num_query_tokens,
        "prefix_cache_hit_tokens": cache.num_hit_tokens,
        "prefix_cache_hit_rate": round(cache.hit_rate, 4),
        "prefix_cache_evictions": cache.num_evictions,
        "prefix_cache_cached_pages": sum(a.num_cached_pages for a in allocators),
        "host_tier_pages": sum(len(a.host_tier) for a in allocators if a.host_tier is not None),
        "host_tier_hit_tokens": cache.host_tier_hit_tokens,
        "swapped_out_pages": cache.num_swapped_out_pages,
        "swapped_in_pages": cache.num_swapped_in_pages,
        "prefix_cache_miss_tokens": {
            "never_seen": cache.miss_tokens_never_seen,
            "evicted": cache.miss_tokens_evicted,
            "partial_page": cache.miss_tokens_partial_page,
        },
    }
