"""The engine loop: add_request, then step() until done. Each step is schedule -> run -> postprocess.

A step runs up to two executables, the prefill chunks (query blocks of `prefill_query_block`
tokens) and the decodes (one token per sequence); both are dispatched before either result is
fetched, so the host builds the second batch while the device runs the first.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from jax.sharding import NamedSharding

from pallas_kernels import kv_cache_head_dim, resolve_attention_impl
from pallas_kernels.paged_attention.probe import pallas_problem
from sharding import build_mesh, param_logical_axes, partition_spec
from sharding.attention import kv_head_replicas
from sharding.rules import EXPERT_PARALLEL_RULES, LOGICAL_AXIS_RULES, logical_sizes

from jaxserve.loading.orbax_checkpoint import checkpoint_dtype, is_orbax_checkpoint, restore_params, save_checkpoint
from jaxserve.config import Buckets, EngineConfig, ModelConfig
from jaxserve.host.data_parallel import RankedAllocator, RankedScheduler
from sharding.expert_placement import (canonical_params, device_of_experts, initial_placement, read_load_profile,
                                       rebalance)
from jaxserve.host.page_allocator import PageAllocator, num_pages_for, swap_in_is_cheaper
from jaxserve.models import KVPages, build_model
from jaxserve.host.output_processor import append_token, token_logprobs
from jaxserve.host.request import CompletionOutput, RequestOutput, RequestStatus, SamplingParams, Sequence
from jaxserve.device.runner import ModelRunner, enable_compilation_cache, kv_cache_bytes_available
from jaxserve.host.scheduler import Scheduler
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.loading.weights import load_params

logger = logging.getLogger(__name__)

# Without an explicit max_model_len, the model's own limit is capped here so a fresh engine does not
# compile page buckets for 128k-token contexts that a CPU will never serve.
DEFAULT_MAX_MODEL_LEN_CAP = 8192
CHILD_SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads the seeds of a request's n samples apart


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.seqs)

    def output(self) -> RequestOutput:
        outputs = [CompletionOutput(index=i, text=seq.text, token_ids=list(seq.output_token_ids),
                                    finish_reason=seq.finish_reason,
                                    logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None)
                   for i, seq in enumerate(self.seqs)]
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), outputs,
                             num_cached_tokens=self.seqs[0].num_cached_tokens)


class Engine:
    def __init__(self, model_dir: str, config: EngineConfig):
        if not os.path.isdir(model_dir):
            raise ValueError(f"model directory {model_dir!r} does not exist")
        self.config = config
        self.model_dir = model_dir
        self.model_config = ModelConfig.from_model_dir(model_dir)
        self.tokenizer = Tokenizer.from_model_dir(model_dir)
        mc = self.model_config
        self.is_orbax = is_orbax_checkpoint(model_dir)
        saved_dtype = checkpoint_dtype(model_dir) if self.is_orbax else mc.checkpoint_dtype
        self.dtype = saved_dtype if config.dtype == "auto" else config.dtype
        self.max_model_len = config.max_model_len or min(mc.max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's max_position_embeddings "
                             f"({mc.max_position_embeddings})")
        eos = set(mc.eos_token_ids)
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.buckets = Buckets.derive(config, self.max_model_len)
        enable_compilation_cache(config.compilation_cache_dir)

        num_ranks = config.data_parallel_size
        self.mesh = build_mesh(num_ranks, config.tensor_parallel_size) \
            if num_ranks * config.tensor_parallel_size > 1 else None
        self.expert_parallel = config.enable_expert_parallel and mc.is_moe and self.mesh is not None
        if self.expert_parallel and mc.num_experts % self.mesh.devices.size:
            raise ValueError(f"{mc.num_experts} experts do not divide over the {self.mesh.devices.size} devices of "
                             f"data_parallel_size x tensor_parallel_size")
        self._choose_attention(num_ranks)
        abstract_model = nnx.eval_shape(lambda: build_model(
            mc, self.dtype, attention_impl=self.attention_impl, rngs=nnx.Rngs(0),
            attention_mesh=self.attention_mesh,
            expert_parallel_mesh=self.mesh if self.expert_parallel else None))
        self.num_expert_rebalances = 0
        for option in ("expert_load_profile", "expert_rebalance_interval"):
            if getattr(config, option) and not self.expert_parallel:
                raise ValueError(f"{option} places experts on devices: it needs a mixture-of-experts model with "
                                 "enable_expert_parallel and data_parallel_size x tensor_parallel_size > 1")
        # Params come from the checkpoint; the expert placements (expert parallelism only) are not params.
        graphdef, abstract_params, abstract_placement = nnx.split(abstract_model, nnx.Param, ...)
        if self.is_orbax:
            params = restore_params(abstract_params, model_dir, self.dtype, self._param_sharding)
        else:
            params = load_params(abstract_params, model_dir, mc, self.dtype, self._param_sharding)
        if self.expert_parallel:
            model = nnx.merge(graphdef, params, initial_placement(abstract_placement, mc.num_experts, self.mesh))
        else:
            model = nnx.merge(graphdef, params)

        page_bytes = KVPages.bytes_per_page(mc.num_layers, config.page_size, self.num_cache_kv_heads,
                                            self.cache_head_dim, self.dtype)
        max_pages_per_seq = num_pages_for(self.max_model_len, config.page_size)
        # Beyond what max_num_seqs full-length sequences can hold, pages only serve as prefix cache.
        useful_pages = config.max_num_seqs * max_pages_per_seq * (4 if config.enable_prefix_caching else 1) + 1
        num_pages = config.num_pages or max(2, min(kv_cache_bytes_available(config.kv_cache_memory_gib) // page_bytes,
                                                   useful_pages))
        num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
        swapping_pays = swap_in_is_cheaper(page_bytes, config.page_size, num_params, jax.default_backend())
        host_tier_pages = int(config.swap_space * 2**30) // page_bytes if swapping_pays else 0
        allocators = [PageAllocator(num_pages, config.page_size, config.enable_prefix_caching,
                                    host_tier_pages=host_tier_pages, session_ttl=config.session_ttl)
                      for _ in range(num_ranks)]
        schedulers = [Scheduler(allocator, max_num_seqs=config.max_num_seqs,
                                max_num_batched_tokens=config.max_num_batched_tokens,
                                prefill_query_block=config.prefill_query_block) for allocator in allocators]
        if num_ranks == 1:
            self.allocator, self.scheduler = allocators[0], schedulers[0]
        else:
            self.allocator, self.scheduler = RankedAllocator(allocators), RankedScheduler(schedulers)
        # Rank r's pages are rows [r * num_pages, (r + 1) * num_pages) of the pool, addressed locally.
        kv_pages = KVPages.zeros(mc.num_layers, num_ranks * num_pages, config.page_size, self.num_cache_kv_heads,
                                 self.cache_head_dim, self.dtype)
        if self.mesh is not None:
            # Each data-parallel rank holds its own pages; each tensor shard its KV heads' slice of them.
            kv_axes = ("pages", "page_offset", "kv_heads", "head_dim")
            spec = partition_spec(kv_axes, self.mesh, {"kv_heads": self.num_cache_kv_heads})
            kv_pages = jax.device_put(kv_pages, NamedSharding(self.mesh, spec))
        self.runner = ModelRunner(model, kv_pages=kv_pages, buckets=self.buckets, page_size=config.page_size,
                                  prefill_query_block=config.prefill_query_block, max_logprobs=config.max_logprobs,
                                  mesh=self.mesh)
        if config.expert_load_profile is not None:
            self.rebalance_experts(read_load_profile(config.expert_load_profile, mc.num_layers, mc.num_experts))
        self.runner.warm_up(show_progress=config.show_progress)
        if self.allocator.host_tier is not None:
            self.runner.warm_up_page_copies()
        self.requests: dict[str, RequestState] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.expert_tokens = np.zeros((mc.num_layers, mc.num_experts), np.int64)  # cumulative, real tokens
        # [layers, experts]: the device each expert sits on (expert parallelism only)
        self.expert_devices = device_of_experts(self.runner.params()) if self.expert_parallel else None
        self._expert_tokens_at_rebalance = self.expert_tokens.copy()  # the periodic rebalance's window starts here
        self.num_steps = 0

    def _choose_attention(self, num_ranks: int) -> None:
        """Where attention runs (attention_mesh), with which implementation, over what cache layout.

        Attention runs the single-device kernels per shard under shard_map (sharding/attention.py)
        when the ranks or the KV heads split the work (the cache storing copies of each KV head when
        there are fewer than tensor shards); tensor parallelism over heads that cannot split relies
        on XLA's partitioner, which only the jax.numpy reference goes through. Under "auto", the
        Pallas kernels must first pass a start-up check on this device (probe.py).
        """
        mc, config, platform = self.model_config, self.config, jax.default_backend()
        tensor_parallel = config.tensor_parallel_size
        replicas = kv_head_replicas(mc.num_heads, mc.num_kv_heads, tensor_parallel) if tensor_parallel > 1 else None
        self.num_cache_kv_heads = mc.num_kv_heads * (replicas or 1)
        self.attention_mesh = self.mesh if self.mesh is not None and (num_ranks > 1 or replicas) else None
        self.attention_impl = resolve_attention_impl(
            config.attention_impl, platform, self.dtype,
            partitioned=self.mesh is not None and self.attention_mesh is None, head_dim=mc.head_dim,
            page_size=config.page_size)
        if config.attention_impl == "auto" and self.attention_impl == "pallas":
            problem = pallas_problem(mc.num_heads, mc.num_kv_heads, mc.head_dim, config.page_size, self.dtype,
                                     query_blocks=(1, config.prefill_query_block),
                                     cache_head_dim=kv_cache_head_dim("pallas", platform, mc.head_dim))
            if problem is not None:
                logger.warning("Pallas attention kernels fail their start-up check on %s (%s); using the "
                               "reference attention", platform, problem)
                self.attention_impl = "reference"
        # KV pages may be wider than the model's head dim where a kernel needs it (zero padded).
        self.cache_head_dim = kv_cache_head_dim(self.attention_impl, platform, mc.head_dim)

    def save_checkpoint(self, directory: str) -> None:
        """Save the params (orbax, as sharded now) with the model's config and tokenizer."""
        save_checkpoint(canonical_params(self.runner.params()), self.dtype, self.model_dir, directory)

    def rebalance_experts(self, load=None) -> None:
        """Move experts between devices so that, under `load` (tokens per expert, [layers, experts] or
        [experts]; default: what this engine has routed so far), each device's load evens out. The
        step's executables take the placement as an input: nothing recompiles."""
        if not self.expert_parallel:
            raise ValueError("rebalance_experts needs a mixture-of-experts model with enable_expert_parallel "
                             "over more than one device")
        mc = self.model_config
        load = read_load_profile(self.expert_tokens if load is None else load, mc.num_layers, mc.num_experts)
        if not load.any():
            raise ValueError("the expert load profile is all zeros: nothing to balance by")
        self.runner.replace_params(rebalance(self.runner.params(), load))
        self.expert_devices = device_of_experts(self.runner.params())
        self.num_expert_rebalances += 1

    def _param_sharding(self, path: tuple) -> NamedSharding | None:
        """Where a param lives, by the logical-axis rules (None: the default device)."""
        if self.mesh is None:
            return None
        axes = param_logical_axes(path, self.model_config)
        rules = EXPERT_PARALLEL_RULES if self.expert_parallel else LOGICAL_AXIS_RULES
        return NamedSharding(self.mesh, partition_spec(axes, self.mesh, logical_sizes(self.model_config), rules))

    # -- requests ---------------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError(f"model directory {self.model_dir!r} has no tokenizer.model; pass token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, (int, np.integer)) for t in prompt):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        vocab_size = self.model_config.vocab_size
        bad = [int(t) for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        return [int(t) for t in prompt]

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) is "
                             f"{total}, more than max_model_len ({self.max_model_len})")
        if num_pages_for(total, self.config.page_size) > self.allocator.max_pages_per_sequence:
            raise ValueError(f"a sequence of {total} tokens needs more KV pages than the cache has "
                             f"({self.allocator.max_pages_per_sequence}); raise num_pages or kv_cache_memory_gib")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs ({params.logprobs}) exceeds max_logprobs ({self.config.max_logprobs})")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    session_id: str | None = None) -> None:
        """Queue a request. A session_id hints that the conversation will continue: its pages are kept
        in preference to others for session_ttl seconds after it finishes."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_token_ids = self.tokenize(prompt)
        self.validate(prompt_token_ids, params)
        base_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**63))
        seqs = [Sequence(seq_id=next(self._seq_ids), request_id=request_id, prompt_token_ids=prompt_token_ids,
                         params=params, sampling_seed=(base_seed + i * CHILD_SEED_STRIDE) % 2**64,
                         arrival_order=next(self._arrivals), session_id=session_id)
                for i in range(params.n)]
        self.requests[request_id] = RequestState(request_id, prompt if isinstance(prompt, str) else None,
                                                 prompt_token_ids, seqs)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        for seq in state.seqs if state else ():
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling step; returns the outputs of requests that progressed (finished ones leave)."""
        schedules = self.scheduler.schedule_ranks()  # one per data-parallel rank
        if all(schedule.is_empty for schedule in schedules):
            return []
        self._move_host_tier_pages()
        dispatched = []
        for is_decode in (False, True):
            per_rank = [schedule.decodes if is_decode else schedule.prefills for schedule in schedules]
            if any(per_rank):
                dispatched.append((per_rank, self.runner.execute(per_rank, is_decode)))
        progressed: dict[str, RequestState] = {}
        for per_rank, (output, expert_counts) in dispatched:
            fetched = ModelRunner.fetch(output)
            rows_per_rank = len(fetched["token_ids"]) // len(per_rank)
            for rank, chunks in enumerate(per_rank):
                self._postprocess(chunks, fetched, rank * rows_per_rank, progressed)
            if self.model_config.is_moe:
                self.expert_tokens += np.asarray(expert_counts)
        self.num_steps += 1
        interval = self.config.expert_rebalance_interval
        if interval and self.num_steps % interval == 0:
            window = self.expert_tokens - self._expert_tokens_at_rebalance
            if window.any():
                self.rebalance_experts(window)
                self._expert_tokens_at_rebalance = self.expert_tokens.copy()
        outputs = []
        for request_id, state in progressed.items():
            outputs.append(state.output())
            if state.finished:
                del self.requests[request_id]
        return outputs

    def _postprocess(self, chunks, fetched: dict, first_row: int, progressed: dict[str, RequestState]) -> None:
        """Record computed KV (caching newly full pages), then append sampled tokens and check stops."""
        for row, chunk in enumerate(chunks, start=first_row):
            seq = chunk.seq
            seq.num_computed_tokens = chunk.end
            self.scheduler.cache_full_pages(seq)
            if seq.flushing:
                self.scheduler.finish(seq, seq.finish_reason)
                continue
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                self.num_prompt_tokens += chunk.num_tokens
            if not chunk.samples_next_token or seq.status is not RequestStatus.RUNNING:
                continue
            logprobs = token_logprobs(row, fetched, seq.params.logprobs) if seq.params.logprobs is not None else None
            reason = append_token(seq, int(fetched["token_ids"][row]), logprobs, self.tokenizer,
                                  self.eos_token_ids, self.max_model_len)
            self.num_generated_tokens += 1
            if reason is not None:
                self.scheduler.finish_or_flush(seq, reason)
            progressed[seq.request_id] = self.requests[seq.request_id]

    def _move_host_tier_pages(self) -> None:
        """Demoted pages are read before promotions or the step overwrite them; promotions land before the step."""
        allocator = self.allocator
        if allocator.pending_demotions:
            demoted, allocator.pending_demotions = allocator.pending_demotions, []
            host_pages = self.runner.read_pages([page for page, _, _ in demoted])
            for host_page, (_, key, contents) in zip(host_pages, demoted):
                allocator.host_tier.store(key, contents, host_page)
        if allocator.pending_promotions:
            promoted, allocator.pending_promotions = allocator.pending_promotions, []
            self.runner.write_pages([page for page, _ in promoted], [host_page for _, host_page in promoted])

    def stats(self) -> dict:
        return {
            "kv_pages_total": self.allocator.num_usable_pages,
            "kv_pages_free": self.allocator.num_free_pages,
            "page_size": self.config.page_size,
            "num_executables": len(self.runner.executables),
            "num_compiles_after_warmup": self.runner.num_compiles_after_warmup,
            "warmup_seconds": round(self.runner.warmup_seconds, 3),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "max_model_len": self.max_model_len,
            "dtype": self.dtype,
            "attention_impl": self.attention_impl,
            **self.prefix_cache_stats(),
            **self.expert_load_stats(),
        }

    def expert_load_stats(self) -> dict:
        """Tokens routed to each expert so far (per layer), and how uneven that is (max / mean)."""
        if not self.model_config.is_moe:
            return {}
        per_expert = self.expert_tokens.sum(axis=0)
        mean = per_expert.mean()
        stats = {"expert_tokens": self.expert_tokens.tolist(),
                 "expert_load_max_over_mean": round(float(per_expert.max() / mean), 4) if mean else 0.0}
        if self.expert_parallel:
            num_devices = self.mesh.devices.size
            per_layer = np.stack([np.bincount(devices, weights=tokens, minlength=num_devices)
                                  for devices, tokens in zip(self.expert_devices, self.expert_tokens)])  # [L, D]
            stats["expert_device_tokens"] = per_layer.sum(axis=0).astype(np.int64).tolist()
            stats["expert_devices"] = self.expert_devices.tolist()
            stats["expert_rebalances"] = self.num_expert_rebalances
            # Every layer waits for its busiest device: the imbalance that costs time is per layer,
            # sum over layers of (busiest device) / sum over layers of (mean device).
            stats["expert_device_imbalance"] = round(float(per_layer.max(axis=1).sum() / per_layer.mean(axis=1).sum()),
                                                     4) if mean else 0.0
        return stats

    def prefix_cache_stats(self) -> dict:
        cache = self.allocator.stats
        return {
            "prefix_cache_enabled": self.allocator.enable_prefix_caching,
            "prefix_cache_queries": cache.num_queries,
            "prefix_cache_query_tokens": cache.num_query_tokens,
            "prefix_cache_hit_tokens": cache.num_hit_tokens,
            "prefix_cache_hit_rate": round(cache.hit_rate, 4),
            "prefix_cache_evictions": cache.num_evictions,
            "prefix_cache_cached_pages": self.allocator.num_cached_pages,
            "host_tier_pages": len(self.allocator.host_tier) if self.allocator.host_tier else 0,
            "host_tier_hit_tokens": cache.host_tier_hit_tokens,
            "swapped_out_pages": cache.num_swapped_out_pages,
            "swapped_in_pages": cache.num_swapped_in_pages,
            "prefix_cache_miss_tokens": {"never_seen": cache.miss_tokens_never_seen,
                                         "evicted": cache.miss_tokens_evicted,
                                         "partial_page": cache.miss_tokens_partial_page},
        }
