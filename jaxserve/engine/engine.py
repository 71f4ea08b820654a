"""The engine loop: add_request, then step() until done. Each step is schedule -> run -> postprocess.

A step runs up to two executables, the prefill chunks (query blocks of `prefill_query_block`
tokens) and the decodes (one token per sequence); both are dispatched before either result is
fetched, so the host builds the second batch while the device runs the first. Every data-parallel
rank has its own scheduler over its own pages; a step runs all ranks' chunks at once.

With overlap_steps (the default) the host never makes the device wait for it: step() plans and
dispatches step N+1 first, then fetches and processes step N, whose sampled tokens N+1 already reads
on the device (the scheduler's token slots). Outputs trail by one step and are otherwise the same.

While every running sequence only decodes, a step may plan k decode steps at once and run them as one
executable (scheduler.num_scheduler_steps: engine/decode_chain.py); its outputs then carry up to k tokens each.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.config import EngineConfig, EngineRole
from jaxserve.device.runner import ModelRunner, PendingResults, StepResult
from jaxserve.device.step_inputs import StepShape, chunk_token_slots, step_shape
from jaxserve.device.verify_inputs import verify_step_shape
from jaxserve.disagg.roles import handovers_for
from jaxserve.distributed.runtime import ProcessGroup
from jaxserve.engine.admission import RequestChecks, prompt_input
from jaxserve.engine.builder import EngineParts, build_engine
from jaxserve.engine.constraints import RowConstraints
from jaxserve.engine.decode_chain import DecodeChains
from jaxserve.engine.device_clock import DeviceClock
from jaxserve.engine.host_tier_copies import move_host_tier_pages
from jaxserve.engine.speculation import Speculation
from jaxserve.engine.stats import (
    EngineDescription,
    EngineLoad,
    StepTimer,
    StepTimings,
    describe_engine,
    engine_load,
    engine_stats,
)
from jaxserve.host.kv_events import KVEventLog
from jaxserve.host.output_processor import OutputProcessor
from jaxserve.host.page_allocator import ROOT_KEY
from jaxserve.host.request import FinishReason, Request, RequestOutput, SamplingParams, SequenceState
from jaxserve.host.scheduler import ScheduledChunk
from jaxserve.loading.orbax_checkpoint import save_checkpoint
from jaxserve.lora.registry import LoadedAdapter
from jaxserve.models.config import ModelConfig

CHILD_SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads the seeds of a request's n samples apart


@dataclass
class DispatchedExecutable:
    per_rank_chunks: list[list[ScheduledChunk]]  # what each data-parallel rank runs in it
    shape: StepShape
    pending: PendingResults
    scores_prompt: bool = False  # some chunk gathers prompt logprobs: fetch them too


@dataclass
class DispatchedStep:
    executables: list[DispatchedExecutable]  # the prefill, decode and verify executables, in dispatch order
    prefill_room: int  # prompt tokens the step had room for (StepTimings)
    speculated: bool = False  # planned while speculation was on (engine/speculation.py's policy)
    batch_size: int = 0  # the decoding sequences the policy saw then
    proposal_seconds: float = 0.0  # what its proposer took (a draft model's steps), for the policy
    num_decode_steps: int = 1  # a decode chain's k (engine/decode_chain.py): timings count them as k steps


class Engine:
    def __init__(self, parts: EngineParts):
        self.parts = parts
        self.config: EngineConfig = parts.config
        self.model_config: ModelConfig = parts.source.config
        self.tokenizer = parts.source.tokenizer
        self.dtype = parts.dtype
        self.max_model_len = parts.max_model_len
        self.schedulers = parts.schedulers
        self.runner = parts.runner
        self.experts = parts.experts
        self.outputs = OutputProcessor(self.tokenizer, parts.eos_token_ids, parts.max_model_len)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._seed_rng = np.random.default_rng(parts.config.seed)
        self.num_steps = 0
        self.timings = StepTimings()
        self._kv_events = KVEventLog()
        for rank, scheduler in enumerate(self.schedulers):
            scheduler.allocator.attach_events(self._kv_events.for_rank(rank))
        self.handovers = handovers_for(self)  # None unless disaggregated (role prefill or decode)
        # A prefill replica parks each request as its first token arrives, before another step runs.
        self.overlap_steps = self.config.scheduler.overlap_steps and self.config.disagg.role != EngineRole.PREFILL
        self._in_flight: DispatchedStep | None = None  # overlapped: the step on the device, processed next call
        self._was_busy = False  # whether the last step() did any work (else the device waited for requests)
        self.device_clock = DeviceClock()
        self.constraints = RowConstraints(
            self.tokenizer,
            parts.eos_token_ids,
            self.model_config.vocab_size,
            self.config.scheduler.max_bias_entries,
            parts.layout,
            self.runner,
        )
        self.admission = RequestChecks(parts, self.constraints)
        self.speculation = Speculation(
            self.config.speculative, parts.max_model_len, parts.draft, eos_token_ids=parts.eos_token_ids
        )
        runner = self.runner
        self.decode_chains = (
            DecodeChains(
                max(1, runner.chain_length), runner.chain_shapes(), runner.buckets, self.config.cache.page_size
            )
            if isinstance(runner, ModelRunner)
            else DecodeChains(1, [], runner.buckets, self.config.cache.page_size)
        )

    @classmethod
    def from_model(cls, model_path: str, config: EngineConfig, process_group: ProcessGroup | None = None) -> Engine:
        """process_group: jaxserve.distributed.runtime.initialize's, to run as one program over several processes."""
        return cls(build_engine(model_path, config, process_group))

    # -- requests ---------------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int] | dict, params: SamplingParams | None = None) -> list[int]:
        """The prompt's token ids; with params, as the request uses them (truncate_prompt_tokens applied)."""
        prompt_token_ids = self.admission.tokenize(prompt)
        return prompt_token_ids if params is None else self.admission.truncated(prompt_token_ids, params)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.admission.validate(prompt_token_ids, params)
        self.lora_adapter(params)

    def add_request(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams, session_id: str | None = None
    ) -> None:
        """Queue a request on the least loaded rank. A session_id hints that the conversation will
        continue: its pages are kept in preference to others for session_ttl seconds after it finishes."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = prompt_input(prompt)
        prompt_token_ids = self.tokenize(prompt, params)
        params = self.admission.with_max_tokens(prompt_token_ids, params)
        self.validate(prompt_token_ids, params)
        adapter = self.lora_adapter(params)
        base_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**63))
        seqs = [
            SequenceState(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                prompt_token_ids=prompt_token_ids,
                params=params,
                sampling_seed=(base_seed + i * CHILD_SEED_STRIDE) % 2**64,
                arrival_order=next(self._arrivals),
                session_id=session_id,
                lora_slot=0 if adapter is None else adapter.slot,
                cache_root_key=ROOT_KEY if adapter is None else adapter.identity,
            )
            for i in range(params.n)
        ]
        self.requests[request_id] = Request(
            request_id, prompt if isinstance(prompt, str) else None, prompt_token_ids, seqs
        )
        if params.prompt_logprobs is not None:
            seqs[0].prompt_logprobs = []  # one sequence scores the prompt for all n
        controls, grammar = self.constraints.prepare(params)
        for seq in seqs:
            self.constraints.attach(seq, controls, grammar)
            seq.rank = min(range(len(self.schedulers)), key=lambda rank: self.schedulers[rank].num_sequences)
            self.schedulers[seq.rank].add(seq)

    def new_sequence(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, sampling_seed: int
    ) -> SequenceState:
        """A sequence with this engine's next id and arrival order, for a request admitted some other
        way than add_request (a decode replica's handed-over request), with its sampling controls and
        its LoRA adapter (ValueError where this engine cannot serve it)."""
        adapter = self.lora_adapter(params)
        seq = SequenceState(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            sampling_seed=sampling_seed,
            arrival_order=next(self._arrivals),
            lora_slot=0 if adapter is None else adapter.slot,
            cache_root_key=ROOT_KEY if adapter is None else adapter.identity,
        )
        self.constraints.attach(seq, *self.constraints.prepare(params))
        return seq

    # -- LoRA adapters (jaxserve/lora) -----------------------------------------------------------------

    def lora_adapter(self, params: SamplingParams) -> LoadedAdapter | None:
        """The loaded adapter a request names (None: the base model); ValueError for an unknown one."""
        if params.lora is None:
            return None
        if self.parts.lora is None:
            raise ValueError(
                f"LoRA adapter {params.lora!r} asked for, but this engine serves none (start it with lora "
                "adapters or max_adapters)"
            )
        # A handover names its adapter (params.lora); both replicas key its pages from the adapter's identity.
        return self.parts.lora.resolve(params.lora)

    def load_lora(self, name: str, path: str) -> LoadedAdapter:
        """Load a PEFT adapter into a free slot, addressable as `name` from the next request on."""
        if self.parts.lora is None:
            raise ValueError("this engine has no LoRA slots: start it with lora max_adapters > 0")
        return self.parts.lora.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Free an adapter's slot; refused while an unfinished request uses it."""
        if self.parts.lora is None:
            raise ValueError("this engine has no LoRA slots: start it with lora max_adapters > 0")
        self.parts.lora.resolve(name)
        users = sorted(
            request.request_id
            for request in self.requests.values()
            if any(seq.params.lora == name and not seq.is_finished for seq in request.seqs)
        )
        if self.handovers is not None:  # a decode replica's handovers reserved or queued for the adapter
            users += self.handovers.requests_using_adapter(name)
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {len(users)} unfinished requests ({users[:4]})")
        self.parts.lora.unload(name)

    def lora_adapters(self) -> list[dict]:
        """The loaded adapters: name, slot, path and rank of each."""
        return [] if self.parts.lora is None else self.parts.lora.describe()

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        for seq in request.seqs if request else ():
            if not seq.is_finished:
                self.schedulers[seq.rank].finish(seq, FinishReason.ABORT)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def has_unfinished_requests(self) -> bool:
        return self.has_step_in_flight or any(scheduler.has_unfinished for scheduler in self.schedulers)

    @property
    def has_step_in_flight(self) -> bool:
        """Overlapped: a dispatched step whose results the next step() call processes."""
        return self._in_flight is not None

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling step; returns the outputs of requests that progressed (finished ones leave).
        Overlapped, these are the outputs of the step dispatched by the previous call."""
        num_generated_before = self.outputs.num_generated_tokens
        with StepTimer() as timer:
            self.speculation.begin_step(self.schedulers)
            if self._in_flight is not None and self._rows_wait_for_tokens():
                # Process the step in flight first: the next step's masks and bans need its tokens.
                to_process, self._in_flight = self._in_flight, None
                progressed = self._fetch_and_postprocess(to_process, timer)
                dispatched = self._in_flight = self._schedule_and_dispatch()
            else:
                dispatched = self._schedule_and_dispatch()
                to_process = self._step_to_process(dispatched)
                progressed = self._fetch_and_postprocess(to_process, timer)
        if to_process is None and dispatched is None:
            self._was_busy = False
            return []
        self._observe_step_time(timer, to_process)
        if to_process is not None:
            generated = self.outputs.num_generated_tokens - num_generated_before
            self.speculation.observe_step(
                to_process.executables,
                timer.elapsed,
                generated,
                to_process.speculated,
                to_process.batch_size,
                to_process.proposal_seconds,
                to_process.num_decode_steps,
            )
        self._was_busy = dispatched is not None and self.has_unfinished_requests()
        return self._end_step(progressed)

    def _rows_wait_for_tokens(self) -> bool:
        """Some running sequence's next row (a grammar's mask, a bad word's ban, a proposal) depends on a
        token in flight, or the step in flight verified proposals (the next one starts where they ended)."""
        assert self._in_flight is not None
        return any(
            RowConstraints.waits_for_tokens(seq) for s in self.schedulers for seq in s.running
        ) or self.speculation.waits_for(self._in_flight.executables, self.schedulers)

    def _schedule_and_dispatch(self) -> DispatchedStep | None:
        speculation = self.speculation
        proposals = speculation.proposals(self.schedulers) if speculation.enabled else None  # every rank's at once
        # a runner wrapped after the engine was built (a test's) has no chains
        if isinstance(self.runner, ModelRunner) and speculation.chains_allowed(self.schedulers, proposals or []):
            chain_shape = self.decode_chains.shape(self.schedulers)
            if chain_shape is not None:
                return self._dispatch_chain(chain_shape)
        if proposals is None:
            proposals = speculation.proposals(self.schedulers)  # (one draft call for every rank)
        schedules = [scheduler.schedule(p) for scheduler, p in zip(self.schedulers, proposals)]
        if all(schedule.is_empty for schedule in schedules):
            return None
        self.move_host_tier_pages()
        executables = []
        for kind in ("prefills", "decodes", "verifies"):
            if any(per_rank := [getattr(s, kind) for s in schedules]):
                continues_busy_period = bool(executables) or self._in_flight is not None or self._was_busy
                executables.append(self._dispatch(per_rank, kind, continues_busy_period))
        return DispatchedStep(
            executables,
            self._prefill_room(schedules),
            speculation.speculating,
            speculation.batch_size,
            speculation.proposal_seconds,
        )

    def _dispatch_chain(self, shape: StepShape) -> DispatchedStep:
        """k decode steps planned one after the other (each after the one before it is marked dispatched, as
        overlapped steps are) and run as one executable of `shape` (engine/decode_chain.py)."""
        assert isinstance(self.runner, ModelRunner)
        continues_busy_period = self._in_flight is not None or self._was_busy
        steps, inputs, first_schedules = [], [], None
        for _ in range(self.decode_chains.length):
            schedules = [scheduler.schedule() for scheduler in self.schedulers]
            # DecodeChains.shape checked that nothing is waiting and that the pages fit: decodes only
            assert not any(s.prefills or s.verifies or s.preempted for s in schedules), (
                "a chain planned more than decodes"
            )
            per_rank = [s.decodes for s in schedules]
            first_schedules = first_schedules or schedules
            self.constraints.before_dispatch(per_rank)
            inputs.append(self.runner.build_inputs(per_rank, shape))
            for scheduler, chunks in zip(self.schedulers, per_rank):
                scheduler.mark_dispatched(chunks)
            steps.append(per_rank)
        self.move_host_tier_pages()  # what planning evicted leaves before the chain writes over it
        pending = self.runner.execute_chain(shape, jax.tree.map(lambda *arrays: np.stack(arrays), *inputs))
        self.device_clock.dispatched(pending.sampled.token_ids, continues_busy_period)
        self.decode_chains.num_chains += 1
        executables = [DispatchedExecutable(per_rank, shape, pending.step(i)) for i, per_rank in enumerate(steps)]
        speculation = self.speculation
        return DispatchedStep(
            executables,
            self._prefill_room(first_schedules),
            speculation.speculating,
            speculation.batch_size,
            num_decode_steps=len(steps),
        )

    def _step_to_process(self, dispatched: DispatchedStep | None) -> DispatchedStep | None:
        """The step whose results this call processes: overlapped, the one the previous call dispatched."""
        if not self.overlap_steps:
            return dispatched
        to_process, self._in_flight = self._in_flight, dispatched
        return to_process

    def _fetch_and_postprocess(self, to_process: DispatchedStep | None, timer: StepTimer) -> set[str]:
        progressed: set[str] = set()
        for executable in to_process.executables if to_process else ():
            with timer.waiting():
                result = executable.pending.fetch()
            progressed |= self._postprocess(executable, result)
        return progressed

    def _observe_step_time(self, timer: StepTimer, processed: DispatchedStep | None) -> None:
        # a decode chain counts as its k steps: the router's predictions read these per step
        steps = processed.num_decode_steps if processed is not None else 1
        self.device_clock.observe_step(timer.host_seconds, steps)
        if processed is not None:  # a step's time: the wait for its results plus the host work around it
            for _ in range(steps):
                self.timings.observe_step(timer.elapsed / steps, processed.prefill_room)

    def _end_step(self, progressed: set[str]) -> list[RequestOutput]:
        """Count the step, let experts move, and hand back the outputs (finished requests leave)."""
        self.num_steps += 1
        if self.experts is not None:
            self.experts.maybe_rebalance(self.num_steps)
        outputs = self._collect(progressed)
        if self.handovers is not None:
            self.handovers.after_step(outputs)
        return outputs

    def _prefill_room(self, schedules) -> int:
        """Prompt tokens the step had room for after its decodes (whole query blocks, on every rank)."""
        block = self.config.scheduler.prefill_query_block
        return sum(
            max(self.config.scheduler.max_num_batched_tokens - len(s.decodes), block) // block * block
            for s in schedules
        )

    def _dispatch(self, per_rank_chunks, kind: str, continues_busy_period: bool) -> DispatchedExecutable:
        """kind: the Schedule's list the chunks come from (prefills, decodes or verifies)."""
        config = self.config
        if kind == "verifies":
            shape = verify_step_shape(per_rank_chunks, self.runner.buckets, config.cache.page_size)
        else:
            shape = step_shape(
                per_rank_chunks,
                kind == "decodes",
                self.runner.buckets,
                config.cache.page_size,
                config.scheduler.prefill_query_block,
            )
        self.constraints.before_dispatch(per_rank_chunks)
        pending = self.runner.execute(shape, self.runner.build_inputs(per_rank_chunks, shape))
        for scheduler, chunks in zip(self.schedulers, per_rank_chunks):
            scheduler.mark_dispatched(chunks)
        self.device_clock.dispatched(pending.sampled.token_ids, continues_busy_period)
        scores_prompt = any(chunk.scored_positions for chunks in per_rank_chunks for chunk in chunks)
        return DispatchedExecutable(per_rank_chunks, shape, pending, scores_prompt)

    def _postprocess(self, executable: DispatchedExecutable, result: StepResult) -> set[str]:
        progressed, shape, layout = set(), executable.shape, self.parts.layout
        scored = executable.pending.fetch_prompt_logprobs() if executable.scores_prompt else None
        for rank, chunks in enumerate(executable.per_rank_chunks):
            first_row = layout.rows(rank, shape.num_seqs).start
            if shape.verifies:
                scheduler, width = self.schedulers[rank], shape.query_block
                progressed |= self.speculation.process(chunks, scheduler, result, first_row, width, self.outputs)
                continue
            prompt_logprobs = None
            if scored is not None:
                first_token = layout.first_token(rank, shape.num_tokens)
                prompt_logprobs = (scored, [first_token + s for s in chunk_token_slots(chunks, shape.query_block)])
            progressed |= self.outputs.process(
                chunks, self.schedulers[rank], result.sampled, first_row, prompt_logprobs
            )
        if self.experts is not None:
            self.experts.observe(result.expert_counts)
        return progressed

    def _collect(self, progressed: set[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in progressed:
            request = self.requests[request_id]
            if not request.finished and request.seqs[0].num_unscored_prompt_tokens:
                continue  # another of its n sequences ran ahead (from cached pages): its output waits for the scores
            outputs.append(request.output())
            if request.finished:
                del self.requests[request_id]
        return outputs

    def move_host_tier_pages(self) -> None:
        """Host-tier copies the allocators asked for, before a step or a KV handover (engine/host_tier_copies.py)."""
        move_host_tier_pages(self.schedulers, self.runner, self.parts.layout, self.timings)

    # -- checkpoints, experts, reporting ----------------------------------------------------------

    def save_checkpoint(self, directory: str) -> None:
        """Save the params (orbax, as sharded now) with the model's config and tokenizer."""
        save_checkpoint(
            self.runner.params(), self.dtype, self.parts.source.description_dir, directory, self.parts.process_group
        )

    def rebalance_experts(self, load=None) -> None:
        """Move experts between devices so that, under `load` (tokens per expert, [layers, experts] or
        [experts]; default: what this engine has routed so far), each device's load evens out. The
        step's executables take the placement as an input: nothing recompiles."""
        if self.experts is None:
            raise ValueError(
                "rebalance_experts needs a mixture-of-experts model with enable_expert_parallel "
                "over more than one device"
            )
        self.experts.rebalance(load)

    def stats(self) -> dict:
        return engine_stats(self)

    def describe(self) -> EngineDescription:
        return describe_engine(self)

    def load(self) -> EngineLoad:
        return engine_load(self)

    def kv_events(self) -> KVEventLog:
        """The prefix cache's page events (host/kv_events.py): what a router subscribes to."""
        return self._kv_events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached page on every rank; False (nothing forgotten) while requests run."""
        if self.has_unfinished_requests():
            return False
        return all([scheduler.allocator.clear_prefix_cache() for scheduler in self.schedulers])
