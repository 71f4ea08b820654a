"""Start-up: from a model path and an EngineConfig to the parts the engine loop runs.

    open the checkpoint -> the mesh -> the attention plan -> the model, its params placed as they
    are read -> the KV page pool and one scheduler per data-parallel rank -> the runner, warmed up

Everything here runs once; `Engine` takes the result and only loops.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.config import Buckets, EngineConfig, EngineRole, kv_cache_problem
from jaxserve.device.huge_pages import move_weights_to_huge_pages
from jaxserve.device.panel_weights import store_projections_in_panels, store_quantized_in_tiles
from jaxserve.device.rank_layout import RankLayout
from jaxserve.device.runner import (
    ModelRunner,
    StepRunner,
    enable_compilation_cache,
)
from jaxserve.device.sampling_inputs import SamplingWidths
from jaxserve.distributed.agreement import agree_on_engine, check_every_process_holds_devices, expert_balancer_type
from jaxserve.distributed.leader_runner import warm_up, wrap_runner
from jaxserve.distributed.runtime import ProcessGroup
from jaxserve.engine.attention_plan import AttentionPlan, choose_attention
from jaxserve.engine.decode_chain import CHAINED_DECODE_MAX_SEQS, decode_chain_length
from jaxserve.engine.draft_lora import AdaptersWithDraft
from jaxserve.engine.draft_model import (
    build_draft,
    load_draft,
)
from jaxserve.engine.draft_proposer import DraftProposer
from jaxserve.engine.expert_balancer import ExpertBalancer
from jaxserve.engine.kv_budget import (
    draft_pool_bytes,
    kv_budgets,
    kv_cache,
    one_device_bytes,
    scratch_shortfall,
    warn_if_scratch_does_not_fit,
)
from jaxserve.host.page_allocator import num_pages_for
from jaxserve.host.scheduler import Scheduler
from jaxserve.loading.model_source import ModelSource, open_model
from jaxserve.loading.quantize import QuantizationSpec, mark_quantized
from jaxserve.lora.registry import LoraRegistry
from jaxserve.lora.slots import attach_lora
from jaxserve.models import build_model
from jaxserve.models.config import ModelConfig
from pallas_kernels.matmul import choose_matmul
from sharding import build_mesh, param_shardings
from sharding.attention import attention_dispatch
from sharding.expert_placement import expert_parallel_reader, initial_placement, read_load_profile
from sharding.moe import expert_dispatch
from sharding.rules import EXPERT_PARALLEL_RULES, LOGICAL_AXIS_RULES

logger = logging.getLogger(__name__)

NO_QUANTIZATION = QuantizationSpec()

# Without an explicit max_model_len, the model's own limit is capped here so a fresh engine does not
# compile page buckets for 128k-token contexts that a CPU will never serve.
DEFAULT_MAX_MODEL_LEN_CAP = 8192


@dataclass(frozen=True)
class EngineParts:
    config: EngineConfig
    source: ModelSource
    dtype: str
    max_model_len: int
    eos_token_ids: frozenset[int]
    mesh: Mesh | None  # None: one device
    attention: AttentionPlan
    schedulers: list[Scheduler]  # one per data-parallel rank, each over its own range of KV pages
    layout: RankLayout  # where each rank's pages, rows and token slots sit in the shared arrays
    runner: StepRunner
    experts: ExpertBalancer | None  # mixture-of-experts models only
    process_group: ProcessGroup | None  # several processes: from runtime.initialize; None: one
    lora: LoraRegistry | None = None  # LoRA adapter slots (jaxserve/lora), when the config gives any
    draft: DraftProposer | None = None  # speculative.method draft: the draft model (engine/draft_model.py)


def build_engine(model_path: str, config: EngineConfig, process_group: ProcessGroup | None = None) -> EngineParts:
    if config.speculative.enabled and process_group is not None:
        raise ValueError("speculative decoding over several processes (jax.distributed) is not available yet")
    decode_chain_length(config, process_group is not None)  # refused before anything loads
    source = open_model(model_path)
    model_config = source.config
    dtype = source.checkpoint_dtype if config.dtype == "auto" else config.dtype
    # (dtype auto: the checkpoint's own, known before any weight is read)
    if problem := kv_cache_problem(config.cache.kv_dtype, jnp.dtype(dtype).name, model_config.is_latent_attention):
        raise ValueError(problem)
    max_model_len = _max_model_len(model_config, config)
    if config.scheduler.max_logprobs > model_config.vocab_size:  # top-k over the vocabulary, at warm-up
        raise ValueError(
            f"max_logprobs ({config.scheduler.max_logprobs}) exceeds the model's vocabulary ({model_config.vocab_size} "
            "tokens): a request can see at most every token's logprob"
        )
    # LongRoPE's factors follow max_model_len, chosen once (as vLLM): cached keys never change their rope
    model_config = model_config.with_context_length(max_model_len)
    source = dataclasses.replace(source, config=model_config)
    enable_compilation_cache(config.compile.compilation_cache_dir)
    # Chosen devices get a mesh even when there is one, so that everything is placed on them.
    devices = [jax.devices()[i] for i in config.parallel.device_ids] if config.parallel.device_ids is not None else None
    mesh = (
        build_mesh(config.parallel.data_parallel_size, config.parallel.tensor_parallel_size, devices)
        if config.parallel.data_parallel_size * config.parallel.tensor_parallel_size > 1 or devices
        else None
    )
    check_every_process_holds_devices(mesh, config.parallel, process_group)  # refused alike on every process
    expert_parallel = _expert_parallel(model_config, config, mesh)
    attention = choose_attention(model_config, config, dtype, mesh)
    quantization = QuantizationSpec(
        config.quantization or "none", config.quantization_group_size, config.quantization_embedding
    )
    # a load profile lays the experts out as they are read (no copy of them once the KV pool took the memory left)
    load_profile = (
        read_load_profile(config.parallel.expert_load_profile, model_config.num_moe_layers, model_config.num_experts)
        if config.parallel.expert_load_profile is not None
        else None
    )
    model = _load_model(
        source, dtype, attention, mesh, expert_parallel, quantization, config.quantized_activations, load_profile
    )
    lora_slots = _attach_lora(model, config, model_config, mesh, expert_parallel)
    if lora_slots and process_group is not None:  # the slot writes would have to reach every process
        raise ValueError("LoRA adapters over several processes (jax.distributed) are not available yet")
    if mesh is None:
        move_weights_to_huge_pages(model)  # a CPU decode step streams them twice as fast
    draft_weights = None
    if config.speculative.method == "draft":  # loaded before any KV pool is sized (engine/kv_budget.py)
        # the draft's quantized projections keep x as the target's do
        load_draft_model = functools.partial(_load_model, quantized_activations=config.quantized_activations)
        draft_weights = load_draft(source, config, mesh, max_model_len, load_draft_model, _attach_lora)
    config = agree_on_engine(config, model_config, process_group)  # several processes: the same engine everywhere
    kv_budget, draft_pages = kv_budgets(config, mesh, max_model_len, draft_weights)
    target = functools.partial(
        _warmed_up_target,
        model,
        model_config,
        config,
        dtype,
        attention,
        mesh,
        expert_parallel,
        max_model_len,
        process_group,
    )
    schedulers, layout, runner, experts = target(kv_budget)
    draft_pool = draft_pool_bytes(draft_weights, draft_pages, config, mesh)  # made after the target's warm-up
    shortfall = scratch_shortfall(runner, config, mesh, process_group, draft_pool)
    if shortfall:  # the largest step would not find its scratch memory beside the pools: smaller pools
        logger.info(
            "the largest compiled step needs %.1f MiB more scratch memory than the KV cache left free: the cache is "
            "sized again that much smaller and compiled again (cache.kv_cache_memory_gib sets it at once)",
            shortfall / 2**20,
        )
        # smaller than the pools made, which can be under the measured budget (capped by what max_num_seqs
        # sequences can use): the measured budget less the shortfall would make the same pools again
        pools_bytes = one_device_bytes(runner.kv_pages) + draft_pool
        del schedulers, layout, runner, experts  # the old pool goes before the new one is made
        gc.collect()
        kv_budget, draft_pages = kv_budgets(config, mesh, max_model_len, draft_weights, at_most=pools_bytes - shortfall)
        schedulers, layout, runner, experts = target(kv_budget)
    draft = None
    if draft_weights is not None and draft_pages is not None:
        draft = build_draft(draft_weights, draft_pages, config, mesh, runner.buckets, runner, model_config)
    lora = None
    if lora_slots:  # a self-draft's adapter slots load with the target's (engine/draft_lora.py)
        draft_lora = draft.lora if draft is not None else None
        lora = (
            LoraRegistry(config.lora, runner, lora_slots)
            if draft_lora is None
            else AdaptersWithDraft(config.lora, runner, lora_slots, draft_lora)
        )
    if lora is not None:
        for name, path in (config.lora.adapters or {}).items():
            lora.load(name, path)
    warn_if_scratch_does_not_fit([runner] if draft is None else [runner, draft.runner], mesh)
    if schedulers[0].allocator.host_tier is not None:
        runner.warm_up_page_copies()
    if config.disagg.role != EngineRole.BOTH:  # a KV handover never compiles while serving
        runner.warm_up_handover_copies(num_pages_for(max_model_len, config.cache.page_size))
    return EngineParts(
        config=config,
        source=source,
        dtype=dtype,
        max_model_len=max_model_len,
        eos_token_ids=_eos_token_ids(source),
        mesh=mesh,
        attention=attention,
        schedulers=schedulers,
        layout=layout,
        runner=runner,
        experts=experts,
        process_group=process_group,
        lora=lora,
        draft=draft,
    )


def _max_model_len(model: ModelConfig, config: EngineConfig) -> int:
    max_model_len = config.scheduler.max_model_len or min(model.max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)
    if max_model_len > model.max_position_embeddings:
        raise ValueError(
            f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
            f"({model.max_position_embeddings})"
        )
    return max_model_len


def _eos_token_ids(source: ModelSource) -> frozenset[int]:
    """What generation stops on, as vLLM does: the config's and generation_config's EOS ids and the
    tokenizer's (a chat model's end-of-turn token may be only the tokenizer's)."""
    tokenizer_eos = source.tokenizer.eos_token_ids if source.tokenizer is not None else frozenset()
    return frozenset(source.config.eos_token_ids) | tokenizer_eos


def _expert_parallel(model: ModelConfig, config: EngineConfig, mesh: Mesh | None) -> bool:
    # Any expert count spreads: where it does not divide the devices, some hold one more (sharding/moe.py).
    expert_parallel = config.parallel.enable_expert_parallel and model.is_moe and mesh is not None
    for option in ("expert_load_profile", "expert_rebalance_interval"):
        if getattr(config.parallel, option) and not expert_parallel:
            raise ValueError(
                f"{option} places experts on devices: it needs a mixture-of-experts model with "
                "enable_expert_parallel and data_parallel_size x tensor_parallel_size > 1"
            )
    return expert_parallel


def _load_model(
    source: ModelSource,
    dtype: str,
    attention: AttentionPlan,
    mesh: Mesh | None,
    expert_parallel: bool,
    quantization: QuantizationSpec = NO_QUANTIZATION,
    quantized_activations: str = "int8",
    expert_load_profile: np.ndarray | None = None,
):
    """The model with its params read from the checkpoint, each placed on the mesh as it is read; expert
    placements (expert parallelism only) are not params: they start contiguous, or where
    expert_load_profile ([MoE layers, experts]) puts them. `quantized_activations`: the engine option, for
    the CPU quantized kernel (pallas_kernels/matmul/quantized_cpu.py)."""
    # the projections' kernels, by the engine's own devices: one device (no mesh, or parallel.device_ids naming one)
    # keeps the one-device kernels even where the process holds several (a multi-GPU host, fake CPU devices)
    num_devices = 1 if mesh is None else mesh.size
    matmul = choose_matmul(jax.default_backend(), num_devices, quantized_activations)
    abstract_model = nnx.eval_shape(
        lambda: build_model(
            source.config,
            dtype,
            write_and_attend=attention_dispatch(attention.impl, attention.mesh),
            matmul=matmul,
            experts=expert_dispatch(mesh if expert_parallel else None, matmul),
            rngs=nnx.Rngs(0),
        )
    )
    graphdef, abstract_params, abstract_placement = nnx.split(abstract_model, nnx.Param, ...)
    abstract_params = mark_quantized(abstract_params, quantization)  # projection kernels quantize as they load
    rules = EXPERT_PARALLEL_RULES if expert_parallel else LOGICAL_AXIS_RULES
    shardings = param_shardings(abstract_params, mesh, source.config.logical_axis_sizes(), rules)
    # Under expert parallelism, experts are read in checkpoint order and then laid out device by device.
    read_params = (
        expert_parallel_reader(source.read_params, source.config.num_experts, mesh, expert_load_profile)
        if expert_parallel
        else source.read_params
    )
    params = read_params(abstract_params, dtype, shardings.get)  # None: the default device
    if expert_parallel:
        placement = initial_placement(abstract_placement, source.config.num_experts, mesh, expert_load_profile)
        return nnx.merge(graphdef, params, placement)
    model = nnx.merge(graphdef, params)
    if matmul.panel_dtypes:  # the layout the CPU kernel reads fastest (device/panel_weights.py)
        store_projections_in_panels(model, matmul.panel_dtypes)
    if matmul.tiles_quantized:  # the int8-dot kernel's layout (device/panel_weights.py)
        store_quantized_in_tiles(model)
    return model


def _attach_lora(model, config: EngineConfig, model_config: ModelConfig, mesh: Mesh | None, expert_parallel: bool):
    """Zero adapter slots beside the targeted projections (jaxserve/lora), placed by the rules table."""
    if not config.lora.enabled:
        return {}
    return attach_lora(
        model,
        num_slots=int(config.lora.max_adapters or 0) + 1,  # slot 0: no adapter
        max_rank=config.lora.max_rank,
        target_modules=config.lora.target_modules,
        routed_experts=config.lora.routed_experts,
        mesh=mesh,
        sizes=model_config.logical_axis_sizes(),
        rules=EXPERT_PARALLEL_RULES if expert_parallel else LOGICAL_AXIS_RULES,
    )


def _warmed_up_target(
    model,
    model_config: ModelConfig,
    config: EngineConfig,
    dtype: str,
    attention: AttentionPlan,
    mesh: Mesh | None,
    expert_parallel: bool,
    max_model_len: int,
    process_group: ProcessGroup | None,
    kv_budget: int,
) -> tuple[list[Scheduler], RankLayout, StepRunner, ExpertBalancer | None]:
    """The target's KV pool within kv_budget (one device's bytes), its schedulers, its runner warmed up and
    (mixture-of-experts) the expert balancer over it."""
    schedulers, kv_pages, layout = kv_cache(
        model_config, config, dtype, attention, mesh, max_model_len, model, kv_budget
    )
    runner = ModelRunner(
        model,
        kv_pages=kv_pages,
        buckets=Buckets.derive(config, max_model_len),
        page_size=config.cache.page_size,
        prefill_query_block=config.scheduler.prefill_query_block,
        max_logprobs=config.scheduler.max_logprobs,
        vocab_size=model_config.vocab_size,
        sampling_widths=SamplingWidths.for_vocab(model_config.vocab_size, config.scheduler.max_bias_entries),
        num_experts=model_config.num_experts,
        layout=layout,
        mesh=mesh,
        # decode chains (engine/decode_chain.py): k steps in one executable, for the smaller decode buckets
        chain_length=chain_length
        if (chain_length := decode_chain_length(config, process_group is not None)) > 1
        else 0,
        chain_max_seqs=CHAINED_DECODE_MAX_SEQS,
    )
    runner = wrap_runner(runner, mesh, schedulers, process_group)  # several processes: process 0 sends plans
    experts = None
    if model_config.is_moe and model_config.num_moe_layers:  # a MoE family whose layers are all dense routes nothing
        experts = expert_balancer_type(ExpertBalancer, process_group)(
            model_config,
            runner,
            mesh.devices.size if expert_parallel and mesh is not None else None,
            config.parallel.expert_rebalance_interval,
        )
    warm_up(runner, process_group, config.show_progress)  # several processes: returns once all have
    return schedulers, layout, runner, experts
