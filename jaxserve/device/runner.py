"""Runs the model: one ahead-of-time compiled executable per step shape, the KV pages donated.

Every shape in the bucket set is compiled at warm-up; a step whose shape was not compiled (which
the scheduler never produces) is compiled on the spot and counted, so a compile after warm-up is
visible in stats instead of silently stalling the loop.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from sharding import partition_spec

from jaxserve.device.step_inputs import StepInputs, StepShape, build_ranked_inputs
from jaxserve.config import Buckets
from jaxserve.host.page_allocator import RESERVED_PAGE
from jaxserve.models.kv_pages import KVPages
from jaxserve.device.sampler import SamplerOutput, sample
from jaxserve.host.scheduler import ScheduledChunk

logger = logging.getLogger(__name__)

PAGE_COPY_GROUP = 16  # pages per host-tier copy


@dataclass(frozen=True)
class HostPage:
    """One page's KV in host memory: a column of a copied group [2 * num_layers, group, page_size, K, D]."""

    group: jax.Array
    column: int


def host_pages_to_array(host_pages: list[HostPage]) -> np.ndarray:
    """[2 * num_layers, len(host_pages), page_size, num_kv_heads, head_dim]."""
    return np.stack([np.asarray(page.group)[:, page.column] for page in host_pages], axis=1)


def _abstract(tree, sharding=None):
    """Shapes (and, for placed arrays, shardings) of a pytree, for lowering ahead of time."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or getattr(x, "sharding", None)), tree)


def step(graphdef, params_treedef, param_leaves, kv_pages: KVPages, inputs: StepInputs, *, max_logprobs: int):
    """The pure step: (params, pages, inputs) -> (sampled tokens, updated pages).

    Params arrive as a flat list of arrays: flattening an nnx.State on every call costs about a
    millisecond of host time, a quarter of a one-sequence decode step on a CPU.
    """
    model = nnx.merge(graphdef, jax.tree.unflatten(params_treedef, param_leaves))
    (hidden, kv_pages), intermediates = nnx.capture(model, nnx.Intermediate)(
        inputs.token_ids, kv_pages, inputs.attention)
    logits = model.compute_logits(hidden[inputs.logits_indices])
    counts = expert_token_counts(model, jax.tree.leaves(intermediates), inputs)
    return sample(logits, inputs.sampling, max_logprobs), counts, kv_pages


def expert_token_counts(model, routed: list, inputs: StepInputs):
    """[layers, experts] tokens routed to each expert this step, padding excluded ([0, 0] when dense).

    routed: per MoE layer, the [T, k] expert ids its router chose (sown by SparseMoE)."""
    if not routed:
        return jnp.zeros((0, 0), jnp.int32)
    num_experts = model.layers[0].mlp.num_experts
    real = (inputs.attention.positions >= 0).astype(jnp.int32)
    return jnp.stack([jnp.bincount(experts.reshape(-1), weights=jnp.repeat(real, experts.shape[1]),
                                   length=num_experts) for experts in routed]).astype(jnp.int32)


class ModelRunner:
    def __init__(self, model, *, kv_pages: KVPages, buckets: Buckets, page_size: int, prefill_query_block: int,
                 max_logprobs: int, mesh: Mesh | None = None):
        """With a mesh, params and KV pages arrive already placed on it; step inputs are replicated."""
        self.graphdef, params = nnx.split(model)
        self.param_leaves, self.params_treedef = jax.tree.flatten(params)
        self.kv_pages = kv_pages
        # Every step input's leading axis is the ranks' rows laid end to end: the "batch" logical axis,
        # split over the data-parallel ranks by the rules table (replicated when there is one rank).
        self.input_sharding = NamedSharding(mesh, partition_spec(("batch",), mesh)) if mesh is not None else None
        self.num_ranks = mesh.shape["data"] if mesh is not None else 1
        self.buckets = buckets
        self.page_size = page_size
        self.prefill_query_block = prefill_query_block
        self.max_logprobs = max_logprobs
        # On a mesh the pages must come back laid out as they went in, so that donation reuses them.
        out_shardings = None if mesh is None else (
            self.input_sharding, NamedSharding(mesh, PartitionSpec()), jax.tree.map(lambda x: x.sharding, kv_pages))
        self._jitted = jax.jit(functools.partial(step, self.graphdef, self.params_treedef, max_logprobs=max_logprobs),
                               donate_argnums=(1,), out_shardings=out_shardings)
        self.executables: dict[StepShape, jax.stages.Compiled] = {}
        self.warmed_up = False
        self.num_compiles_after_warmup = 0
        self.warmup_seconds = 0.0
        self.host_device = jax.devices("cpu")[0]

    def params(self) -> nnx.State:
        return jax.tree.unflatten(self.params_treedef, self.param_leaves)

    def replace_params(self, params: nnx.State) -> None:
        """New values for the params (and expert placements), which must match the old ones in shape,
        dtype and sharding: the compiled executables take them as they are."""
        leaves, treedef = jax.tree.flatten(params)
        if treedef != self.params_treedef or any(
                (new.shape, new.dtype, new.sharding) != (old.shape, old.dtype, old.sharding)
                for new, old in zip(leaves, self.param_leaves)):
            raise ValueError("replacement params differ from the compiled ones in structure, shape or placement")
        self.param_leaves = leaves

    def all_shapes(self) -> list[StepShape]:
        shapes = [StepShape(s, s, p, 1) for s in self.buckets.decode_seqs for p in self.buckets.pages_per_seq]
        block = self.prefill_query_block
        shapes += [StepShape(t, t // block, p, block)
                   for t in self.buckets.prefill_tokens for p in self.buckets.pages_per_seq]
        return shapes

    def _compile(self, shape: StepShape) -> jax.stages.Compiled:
        example_inputs = build_ranked_inputs([[]] * self.num_ranks, shape, self.page_size)
        return self._jitted.lower(_abstract(self.param_leaves), _abstract(self.kv_pages),
                                  _abstract(example_inputs, self.input_sharding)).compile()

    def warm_up(self, show_progress: bool = True) -> None:
        start = time.perf_counter()
        for shape in tqdm(self.all_shapes(), desc="compiling step buckets", disable=not show_progress):
            if shape not in self.executables:
                self.executables[shape] = self._compile(shape)
        self.warmed_up = True
        self.warmup_seconds = time.perf_counter() - start

    def shape_for(self, per_rank_chunks: list[list[ScheduledChunk]], is_decode: bool) -> StepShape:
        """The smallest bucket every rank's chunks fit in (ranks share one shape)."""
        every = [chunk for chunks in per_rank_chunks for chunk in chunks]
        num_pages = max(-(-chunk.end // self.page_size) for chunk in every)
        pages_per_seq = Buckets.fit(num_pages, self.buckets.pages_per_seq)
        if is_decode:
            num_seqs = Buckets.fit(max(len(chunks) for chunks in per_rank_chunks), self.buckets.decode_seqs)
            return StepShape(num_seqs, num_seqs, pages_per_seq, 1)
        block = self.prefill_query_block
        num_tokens = Buckets.fit(max(sum(-(-c.num_tokens // block) * block for c in chunks)
                                     for chunks in per_rank_chunks), self.buckets.prefill_tokens)
        return StepShape(num_tokens, num_tokens // block, pages_per_seq, block)

    def execute(self, per_rank_chunks: list[list[ScheduledChunk]], is_decode: bool
                ) -> tuple[SamplerOutput, jax.Array]:
        """Dispatch one step (chunks per data-parallel rank); returns the sampled tokens, rank r's rows
        at r * num_seqs, and the step's [layers, experts] routing counts, as device arrays without
        waiting for them (JAX dispatch is async)."""
        shape = self.shape_for(per_rank_chunks, is_decode)
        executable = self.executables.get(shape)
        if executable is None:
            logger.warning("compiling step shape %s while serving", shape)
            executable = self.executables[shape] = self._compile(shape)
            if self.warmed_up:
                self.num_compiles_after_warmup += 1
        inputs = build_ranked_inputs(per_rank_chunks, shape, self.page_size)
        if self.input_sharding is not None:
            inputs = jax.device_put(inputs, self.input_sharding)
        output, expert_counts, self.kv_pages = executable(self.param_leaves, self.kv_pages, inputs)
        return output, expert_counts

    def read_pages(self, pages: list[int]) -> list[HostPage]:
        """Start copying pages' KV to host memory; returns a handle per page without waiting.

        Pages move in groups of PAGE_COPY_GROUP (padded with the reserved page) so that one compiled
        copy serves every count; the transfer to the host device is asynchronous.
        """
        handles = []
        for start in range(0, len(pages), PAGE_COPY_GROUP):
            group = pages[start:start + PAGE_COPY_GROUP]
            index = np.asarray(group + [RESERVED_PAGE] * (PAGE_COPY_GROUP - len(group)), np.int32)
            on_host = jax.device_put(_gather_pages(self.kv_pages, index), self.host_device)
            handles += [HostPage(on_host, column) for column in range(len(group))]
        return handles

    def write_pages(self, pages: list[int], host_pages: list[HostPage]) -> None:
        """Copy host KV back into pages; dispatched before the next step, so it lands before it reads them."""
        for start in range(0, len(pages), PAGE_COPY_GROUP):
            group = pages[start:start + PAGE_COPY_GROUP]
            data = host_pages_to_array(host_pages[start:start + len(group)])
            padding = np.zeros((data.shape[0], PAGE_COPY_GROUP - len(group)) + data.shape[2:], data.dtype)
            index = np.asarray(group + [RESERVED_PAGE] * (PAGE_COPY_GROUP - len(group)), np.int32)
            self.kv_pages = _scatter_pages(self.kv_pages, index, np.concatenate([data, padding], axis=1))

    def warm_up_page_copies(self) -> None:
        """Compile the host-tier copies (reading and rewriting the reserved page changes nothing)."""
        self.write_pages([RESERVED_PAGE], self.read_pages([RESERVED_PAGE]))

    @staticmethod
    def fetch(output: SamplerOutput) -> dict[str, np.ndarray]:
        return {name: np.asarray(value) for name, value in vars(jax.device_get(output)).items()}


@jax.jit
def _gather_pages(kv_pages: KVPages, pages):
    return jax.numpy.stack([layer[pages] for layer in kv_pages.keys + kv_pages.values])


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter_pages(kv_pages: KVPages, pages, data):
    num_layers = len(kv_pages.keys)
    layers = [layer.at[pages].set(data[i]) for i, layer in enumerate(kv_pages.keys + kv_pages.values)]
    return KVPages(keys=layers[:num_layers], values=layers[num_layers:])


def enable_compilation_cache(directory: str | None) -> None:
    if directory is None or jax.config.jax_compilation_cache_dir:
        return  # off, or the user already chose a cache
    if directory == "default":
        directory = os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "xla")
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def kv_cache_bytes_available(memory_gib: float | None) -> int:
    """The KV cache budget: as configured, else 90% of what the device has left after the params."""
    if memory_gib is not None:
        return int(memory_gib * 2**30)
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(0.9 * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    # CPU reports no limit: a modest default that the user raises with kv_cache_memory_gib.
    return 2**30
