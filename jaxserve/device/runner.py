"""Where the step is compiled and run: one ahead-of-time compiled executable per step shape, the KV
pages donated.

Every shape in the bucket set is compiled at warm-up; a step whose shape was not compiled (which
the scheduler never produces) is compiled on the spot and counted, so a compile after warm-up is
visible in stats instead of silently stalling the loop.

A runner may also compile, for decode shapes, a chain of chain_length decode steps in one executable
(device/step.py chained_steps): a target's decode steps for scheduler.num_scheduler_steps (decode shapes of
up to chain_max_seqs rows; engine/decode_chain.py), a draft model's proposals past the first (every decode
shape; engine/draft_model.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Protocol, cast

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from jaxserve.config import Buckets
from jaxserve.device import page_copies
from jaxserve.device.placement import zeros_on
from jaxserve.device.prompt_logprobs import PromptLogprobs
from jaxserve.device.rank_layout import RankLayout
from jaxserve.device.sampler import SamplerOutput
from jaxserve.device.sampling_inputs import SamplingWidths
from jaxserve.device.sequence_buffers import SequenceBuffers, reset_entry, sequence_buffers_shardings
from jaxserve.device.step import chained_steps, step
from jaxserve.device.step_inputs import (
    StepInputs,
    StepShape,
    all_step_shapes,
    build_ranked_inputs,
    decode_step_shapes,
)
from jaxserve.device.verify_inputs import build_ranked_verify_inputs, verify_shapes
from jaxserve.device.verify_step import VerifyInputs, verify_step
from jaxserve.models.kv_pages import KVPages, kv_cache_bytes_per_token
from pallas_kernels.matmul.row_blocks import verify_rows
from sharding import partition_spec

logger = logging.getLogger(__name__)


def _abstract(tree, sharding=None):
    """Shapes (and, for placed arrays, shardings) of a pytree, for lowering ahead of time."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or getattr(x, "sharding", None)), tree
    )


def _device_bytes(tree) -> int:
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards)


@dataclass(frozen=True)
class StepResult:
    """What one step sampled, fetched to the host."""

    sampled: SamplerOutput  # numpy arrays; rank r's rows are RankLayout.rows(r, the step's rows per rank)
    expert_counts: np.ndarray  # [layers, experts] tokens routed to each expert ([0, 0] for dense models)
    # A verify step (device/verify_step.py): [S] proposals each row accepted; `sampled` then has W rows
    # per verify row, one per position.
    num_accepted: np.ndarray | None = None


@dataclass(frozen=True)
class PendingStep:
    """A dispatched step whose results are still on the device (JAX dispatch is asynchronous)."""

    sampled: SamplerOutput
    expert_counts: jax.Array
    prompt_logprobs: PromptLogprobs  # [T] / [T, K], per token slot; zeros unless some row asked
    num_accepted: jax.Array | None = None  # a verify step's
    # The results live in host memory (CPU devices): read them as they are. jax.device_get first starts an
    # asynchronous copy of each array, which overlaps the transfers of an accelerator and only costs on a
    # CPU: 0.45 -> 0.25 ms of host time per step (issue #29: a single-stream CPU step is ~20 ms and the host
    # shares the cores with it).
    on_host: bool = False

    def fetch(self) -> StepResult:
        arrays = (self.sampled, self.expert_counts, self.num_accepted)
        sampled, counts, accepted = jax.tree.map(np.asarray, arrays) if self.on_host else jax.device_get(arrays)
        return StepResult(
            SamplerOutput(*(np.asarray(x) for x in vars(sampled).values())),
            np.asarray(counts),
            None if accepted is None else np.asarray(accepted),
        )

    def fetch_prompt_logprobs(self) -> PromptLogprobs:
        """Only for a step whose rows asked (the engine knows which): a plain step never moves them."""
        fetched = jax.device_get(self.prompt_logprobs)
        return PromptLogprobs(*(np.asarray(x) for x in vars(fetched).values()))


class PendingChain:
    """A dispatched chain of decode steps (execute_chain): each field of `sampled` and `expert_counts` has the
    steps on a leading axis. Fetched once, by whichever of its steps asks first."""

    def __init__(self, sampled: SamplerOutput, expert_counts: jax.Array, on_host: bool):
        self.sampled = sampled
        self.expert_counts = expert_counts
        self.on_host = on_host
        self._fetched: StepResult | None = None

    def fetch(self) -> StepResult:
        if self._fetched is None:
            self._fetched = PendingStep(
                self.sampled, self.expert_counts, _NO_PROMPT_LOGPROBS, on_host=self.on_host
            ).fetch()
        return self._fetched

    def step(self, index: int) -> ChainedStep:
        return ChainedStep(self, index)


@dataclass(frozen=True)
class ChainedStep:
    """One step of a PendingChain, as the engine asks a step's results (PendingResults)."""

    chain: PendingChain
    index: int

    @property
    def sampled(self) -> SamplerOutput:
        return SamplerOutput(*(x[self.index] for x in vars(self.chain.sampled).values()))

    def fetch(self) -> StepResult:
        whole = self.chain.fetch()
        return StepResult(
            SamplerOutput(*(x[self.index] for x in vars(whole.sampled).values())), whole.expert_counts[self.index]
        )

    def fetch_prompt_logprobs(self) -> PromptLogprobs:
        raise ValueError("a chained decode step scores no prompt tokens")


_NO_PROMPT_LOGPROBS = cast(PromptLogprobs, None)  # a chain returns none; PendingStep.fetch never reads them


class PendingResults(Protocol):
    """What the engine asks of a dispatched step: PendingStep, or the leader's wrapper that watches
    its fetch."""

    @property
    def sampled(self) -> SamplerOutput: ...
    def fetch(self) -> StepResult: ...
    def fetch_prompt_logprobs(self) -> PromptLogprobs: ...


class StepRunner(Protocol):
    """What the engine, the KV handovers and the expert balancer ask of a runner: ModelRunner on one
    process, distributed/leader_runner.LeaderRunner (which also sends each call to the followers) on
    several."""

    @property
    def buckets(self) -> Buckets: ...
    @property
    def layout(self) -> RankLayout: ...
    @property
    def kv_pages(self) -> KVPages: ...

    def build_inputs(self, per_rank_chunks, shape: StepShape) -> StepInputs | VerifyInputs: ...
    def execute(self, shape: StepShape, inputs: StepInputs | VerifyInputs) -> PendingResults: ...
    def warm_up(self, show_progress: bool = True) -> None: ...
    def warm_up_page_copies(self) -> None: ...
    def reset_sequence_buffers(self, entry: int, output_counts: np.ndarray, prompt_tokens: np.ndarray) -> None: ...
    def warm_up_handover_copies(self, max_pages: int) -> None: ...
    def read_pages(self, pages: list[int]) -> list[page_copies.HostPage]: ...
    def write_pages(self, pages: list[int], host_pages: list[page_copies.HostPage]) -> None: ...
    def gather_pages(self, pages: list[int]) -> list[jax.Array]: ...
    def scatter_pages(self, pages: list[int], chunks: list[jax.Array]) -> None: ...
    def params(self) -> nnx.State: ...
    def replace_params(self, params: nnx.State) -> None: ...
    def compiled_buckets(self) -> tuple[tuple[str, int, int, int], ...]: ...
    def largest_scratch_bytes(self) -> int: ...
    def stats(self) -> dict: ...


class ModelRunner:
    def __init__(
        self,
        model,
        *,
        kv_pages: KVPages,
        buckets: Buckets,
        page_size: int,
        prefill_query_block: int,
        max_logprobs: int,
        vocab_size: int,
        sampling_widths: SamplingWidths,
        num_experts: int = 0,
        layout: RankLayout,
        mesh: Mesh | None = None,
        chain_length: int = 0,
        chain_max_seqs: int | None = None,
    ):
        """With a mesh, params and KV pages arrive already placed on it, the pages as `layout` says.
        chain_length: decode steps per chained executable (execute_chain; 0: none), compiled for the decode
        shapes of up to chain_max_seqs rows (None: every decode shape)."""
        self.graphdef, params = nnx.split(model)
        self.param_leaves, self.params_treedef = jax.tree.flatten(params)
        # Committed where they lie (an alias, no copy): a step returns committed pools, and a jit call's cache key
        # counts committedness, so copies warmed up on the uncommitted pools (the host tier's, a handover's)
        # compiled again on their first use while serving.
        self.kv_pages = kv_pages if mesh is not None else jax.device_put(kv_pages, kv_pages.keys[0].sharding)
        # What the runner holds, summed once: every later params or pages array keeps its leaf's shape, dtype
        # and placement (replace_params checks it; a step returns the pools it was given), and summing ~330
        # arrays' shards took ~1 ms a step where the server reads stats() after every step.
        self._held_bytes = {
            "weights_device_bytes": _device_bytes(self.param_leaves),
            "kv_cache_device_bytes": _device_bytes(kv_pages),
            "kv_cache_bytes_per_token": kv_cache_bytes_per_token(kv_pages),
        }
        # Every step input's leading axis is the ranks' rows laid end to end: the "batch" logical axis,
        # split over the data-parallel ranks by the rules table (replicated when there is one rank).
        self.input_sharding = NamedSharding(mesh, partition_spec(("batch",), mesh)) if mesh is not None else None
        # A chain's inputs are its steps' inputs stacked: the rows are their second axis.
        self.chain_input_sharding = (
            NamedSharding(mesh, partition_spec((None, "batch"), mesh)) if mesh is not None else None
        )
        self.num_ranks = mesh.shape["data"] if mesh is not None else 1
        if layout.num_ranks != self.num_ranks or layout.total_pages != kv_pages.keys[0].shape[0]:
            raise ValueError(
                f"{layout} does not describe {self.num_ranks} ranks over {kv_pages.keys[0].shape[0]} pages"
            )
        self.layout = layout
        self.buckets = buckets
        self.page_size = page_size
        self.prefill_query_block = prefill_query_block
        self.sampling_widths = sampling_widths
        replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        # the sampler's rows as the step's inputs lie (over the data ranks), each row's vocabulary whole (step.py)
        sampler_sharding = None if mesh is None else NamedSharding(mesh, partition_spec(("batch", None), mesh))
        buffers = SequenceBuffers.zeros(layout.num_ranks, layout.buffer_entries_per_rank, vocab_size)
        # Each rank's part on its own devices, made there (device_put would compare the host value across
        # processes, whole); the step and the resets keep them so.
        buffers_shardings = None if mesh is None else sequence_buffers_shardings(buffers, mesh)
        # Without a mesh, committed beside the pages (as the pages, above): host buffers here warmed `_reset_entry`
        # up for a signature serving never shows (its first reset after a step compiled it again).
        self.buffers = (
            jax.device_put(buffers, kv_pages.keys[0].sharding)
            if buffers_shardings is None
            else zeros_on(buffers, buffers_shardings)
        )
        self._reset_entry = jax.jit(reset_entry, donate_argnums=(0,), out_shardings=buffers_shardings)
        # On a mesh the pages must come back laid out as they went in, so that donation reuses them.
        out_shardings = (
            None
            if mesh is None
            else (
                self.input_sharding,
                self.input_sharding,
                replicated,
                jax.tree.map(lambda x: x.sharding, kv_pages),
                buffers_shardings,
            )
        )
        self._jitted = jax.jit(
            functools.partial(
                step,
                self.graphdef,
                self.params_treedef,
                max_logprobs=max_logprobs,
                num_experts=num_experts,
                sampler_sharding=sampler_sharding,
            ),
            donate_argnums=(1, 2),
            out_shardings=out_shardings,
        )
        self._jitted_verify = jax.jit(
            functools.partial(
                verify_step,
                self.graphdef,
                self.params_treedef,
                max_logprobs=max_logprobs,
                num_experts=num_experts,
                sampler_sharding=sampler_sharding,
            ),
            donate_argnums=(1, 2),
            out_shardings=None if out_shardings is None else (*out_shardings, self.input_sharding),
        )
        self._jitted_chain = jax.jit(
            functools.partial(
                chained_steps,
                self.graphdef,
                self.params_treedef,
                max_logprobs=max_logprobs,
                num_experts=num_experts,
                sampler_sharding=sampler_sharding,
            ),
            donate_argnums=(1, 2),
            # each step's sampled rows as a step's inputs lie; the counts whole; pages and buffers as a step's
            out_shardings=None if out_shardings is None else (self.chain_input_sharding, *out_shardings[2:]),
        )
        self.chain_length = chain_length
        self.chain_max_seqs = chain_max_seqs
        self.executables: dict[StepShape, jax.stages.Compiled] = {}
        # decode shape -> its chain of chain_length steps
        self.chain_executables: dict[StepShape, jax.stages.Compiled] = {}
        self.warmed_up = False
        self.num_compiles_after_warmup = 0
        self.warmup_seconds = 0.0
        self.host_device = jax.devices("cpu")[0]
        self._results_on_host = all(device.platform == "cpu" for device in jax.tree.leaves(kv_pages)[0].devices())

    def compiled_buckets(self) -> tuple[tuple[str, int, int, int], ...]:
        """(kind, num_tokens, num_seqs, pages_per_seq) of every compiled step, sorted."""
        return tuple(
            sorted((shape.kind, shape.num_tokens, shape.num_seqs, shape.pages_per_seq) for shape in self.executables)
        )

    def largest_scratch_bytes(self) -> int:
        """The most temporary memory one of the compiled steps takes on a device while it runs (XLA's buffer
        assignment; 0 where the backend does not say)."""
        analyses = (e.memory_analysis() for e in [*self.executables.values(), *self.chain_executables.values()])
        return max((analysis.temp_size_in_bytes for analysis in analyses if analysis is not None), default=0)

    def stats(self) -> dict:
        """What the runner holds and has compiled; bytes summed over every device's shards."""
        return {
            **self._held_bytes,
            "num_executables": len(self.executables) + len(self.chain_executables),
            "num_compiles_after_warmup": self.num_compiles_after_warmup,
            "warmup_seconds": round(self.warmup_seconds, 3),
        }

    def params(self) -> nnx.State:
        return jax.tree.unflatten(self.params_treedef, self.param_leaves)

    def replace_params(self, params: nnx.State) -> None:
        """New values for the params (and expert placements), which must match the old ones in shape,
        dtype and sharding: the compiled executables take them as they are."""
        leaves, treedef = jax.tree.flatten(params)
        if treedef != self.params_treedef or any(
            (new.shape, new.dtype, new.sharding) != (old.shape, old.dtype, old.sharding)
            for new, old in zip(leaves, self.param_leaves)
        ):
            raise ValueError("replacement params differ from the compiled ones in structure, shape or placement")
        self.param_leaves = leaves

    def _compile(self, shape: StepShape) -> jax.stages.Compiled:
        example_inputs = self.build_inputs([[]] * self.num_ranks, shape)
        # A draft model's catch-up step (rows of catch_up_width tokens) computes its rows as its decode rows
        # are, as a verify step does (pallas_kernels/matmul/row_blocks.py): in bfloat16 on AMX CPUs its 2 x S
        # rows went to XLA's dots above 8, and the draft's proposals then differed from what the target, and
        # the draft's own one-token steps, compute (a self-draft accepted 95-99%, not all)
        catch_up = bool(self.buckets.catch_up_width) and shape.query_block == self.buckets.catch_up_width
        with verify_rows() if catch_up else contextlib.nullcontext():
            lowered = (self._jitted_verify if shape.verifies else self._jitted).lower(
                _abstract(self.param_leaves),
                _abstract(self.kv_pages),
                _abstract(self.buffers),
                _abstract(example_inputs, self.input_sharding),
            )
        return lowered.compile()

    def _compile_chain(self, shape: StepShape) -> jax.stages.Compiled:
        example_inputs = self.build_inputs([[]] * self.num_ranks, shape)
        stacked = jax.tree.map(lambda x: np.stack([x] * self.chain_length), example_inputs)
        return self._jitted_chain.lower(
            _abstract(self.param_leaves),
            _abstract(self.kv_pages),
            _abstract(self.buffers),
            _abstract(stacked, self.chain_input_sharding),
        ).compile()

    def build_inputs(self, per_rank_chunks, shape: StepShape) -> StepInputs | VerifyInputs:
        if shape.verifies:
            return build_ranked_verify_inputs(per_rank_chunks, shape, self.page_size, self.layout, self.sampling_widths)
        return build_ranked_inputs(per_rank_chunks, shape, self.page_size, self.layout, self.sampling_widths)

    def warm_up(self, show_progress: bool = True) -> None:
        start = time.perf_counter()
        for shape in tqdm(
            all_step_shapes(self.buckets, self.prefill_query_block) + verify_shapes(self.buckets),
            desc="compiling step buckets",
            disable=not show_progress,
        ):
            if shape not in self.executables:
                self.executables[shape] = self._compile(shape)
        for shape in tqdm(
            self.chain_shapes(),
            desc=f"compiling chains of {self.chain_length} decode steps",
            disable=not (show_progress and self.chain_length),  # no bar for a runner without chains
        ):
            self.chain_executables[shape] = self._compile_chain(shape)
        # The penalties' entry reset compiles now too (on the scratch entry, which nobody reads).
        vocab_size, mask_words = self.buffers.output_counts.shape[-1], self.buffers.prompt_tokens.shape[-1]
        self.reset_sequence_buffers(
            self.layout.buffer_entry(0, self.layout.scratch_entry),
            np.zeros(vocab_size, np.int32),
            np.zeros(mask_words, np.int32),
        )
        self.warmed_up = True
        self.warmup_seconds = time.perf_counter() - start

    def execute(self, shape: StepShape, inputs: StepInputs | VerifyInputs) -> PendingStep:
        """Dispatch one step of the given bucket on padded host inputs, without waiting for it."""
        executable = self.executables.get(shape)
        if executable is None:
            logger.warning("compiling step shape %s while serving", shape)
            executable = self.executables[shape] = self._compile(shape)
            if self.warmed_up:
                self.num_compiles_after_warmup += 1
        if self.input_sharding is not None:
            inputs = jax.device_put(inputs, self.input_sharding)
        outputs = executable(self.param_leaves, self.kv_pages, self.buffers, inputs)
        sampled, prompt_logprobs, expert_counts, self.kv_pages, self.buffers = outputs[:5]
        accepted = outputs[5] if shape.verifies else None
        return PendingStep(sampled, expert_counts, prompt_logprobs, accepted, on_host=self._results_on_host)

    def chain_shapes(self) -> list[StepShape]:
        """The decode shapes compiled as chains too: the decode buckets only (a prefill bucket of query_block 1 has
        a decode step's kind, and is never chained), of up to chain_max_seqs rows."""
        if not self.chain_length:
            return []
        limit = self.chain_max_seqs
        return [shape for shape in decode_step_shapes(self.buckets) if limit is None or shape.num_seqs <= limit]

    def execute_chain(self, shape: StepShape, stacked_inputs: StepInputs) -> PendingChain:
        """Dispatch chain_length decode steps of one decode shape in one executable, without waiting: each
        step's padded host inputs stacked on a new leading axis ([chain_length, ...]). Their results, each
        field [chain_length, ...] (on the device)."""
        executable = self.chain_executables.get(shape)
        if executable is None:
            logger.warning("compiling a chain of %d steps of shape %s while serving", self.chain_length, shape)
            executable = self.chain_executables[shape] = self._compile_chain(shape)
            if self.warmed_up:
                self.num_compiles_after_warmup += 1
        if self.chain_input_sharding is not None:
            stacked_inputs = jax.device_put(stacked_inputs, self.chain_input_sharding)
        sampled, counts, self.kv_pages, self.buffers = executable(
            self.param_leaves, self.kv_pages, self.buffers, stacked_inputs
        )
        return PendingChain(sampled, counts, self._results_on_host)

    def read_pages(self, pages: list[int]) -> list[page_copies.HostPage]:
        return page_copies.read_pages(self.kv_pages, pages, self.host_device)

    def write_pages(self, pages: list[int], host_pages: list[page_copies.HostPage]) -> None:
        """Dispatched before the next step, so it lands before that step reads the pages."""
        self.kv_pages = page_copies.write_pages(self.kv_pages, pages, host_pages)

    def gather_pages(self, pages: list[int]) -> list[jax.Array]:
        """The pages' KV as power-of-two chunks on this runner's devices (for a KV handover)."""
        with page_copies.CountingCompiles(self):
            return page_copies.gather_pages(self.kv_pages, pages)

    def scatter_pages(self, pages: list[int], chunks: list[jax.Array]) -> None:
        """Write handed-over KV (gather_pages' chunks, already on page_array_sharding) into pages."""
        with page_copies.CountingCompiles(self):
            self.kv_pages = page_copies.scatter_pages(self.kv_pages, pages, chunks)

    def page_array_sharding(self):
        """Where gather_pages' layout lives on this runner: the pool's sharding with the stacked
        layer axis in front."""
        sharding = self.kv_pages.keys[0].sharding
        if isinstance(sharding, NamedSharding):
            return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
        return sharding

    def warm_up_handover_copies(self, max_pages: int) -> None:
        """Compile a KV handover's gathers and scatters: every power-of-two chunk up to max_pages."""
        self.kv_pages = page_copies.warm_up_handover_copies(self.kv_pages, max_pages, self.page_array_sharding())

    def reset_sequence_buffers(self, entry: int, output_counts: np.ndarray, prompt_tokens: np.ndarray) -> None:
        """A sequence with penalties starts running at `entry` (the whole buffer's: RankLayout.buffer_entry):
        its output counts [V] and prompt bitmask [W] (dispatched before the step that samples for it, so that
        step reads them)."""
        self.buffers = self._reset_entry(self.buffers, np.int32(entry), output_counts, prompt_tokens)

    def warm_up_page_copies(self) -> None:
        """Compile the host-tier copies (reading and rewriting the reserved page changes nothing)."""
        self.write_pages([page_copies.RESERVED_PAGE], self.read_pages([page_copies.RESERVED_PAGE]))


def enable_compilation_cache(directory: str | None) -> None:
    # jax.config's options are attributes set at run time, which its type stubs do not declare.
    if directory is None or cast(Any, jax.config).jax_compilation_cache_dir:
        return  # off, or the user already chose a cache
    if directory == "default":
        directory = os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "xla")
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def kv_cache_bytes_available(memory_gib: float | None, mesh=None) -> int:
    """The KV cache budget of one device: as configured, else 90% of what the engine's devices have left after
    the params (measured_free_bytes), else (a CPU reports no limit) a modest 1 GiB that the user raises with
    kv_cache_memory_gib."""
    if memory_gib is not None:
        return int(memory_gib * 2**30)
    free = measured_free_bytes(mesh)
    return 2**30 if free is None else int(0.9 * free)


def measured_free_bytes(mesh=None) -> int | None:
    """The least free memory of the engine's devices (this process's of the mesh; without one, this process's
    first: another engine in the process, parallel.device_ids, may use other devices); None where the devices
    report no limit (CPU)."""
    devices = list(mesh.local_devices) if mesh is not None else jax.local_devices()[:1]
    free = [
        stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        for stats in (device.memory_stats() or {} for device in devices)
        if "bytes_limit" in stats
    ]
    return min(free) if free else None
