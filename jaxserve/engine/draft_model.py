"""Start-up of a draft model for speculative decoding (`speculative.method: draft`): the draft's params,
its own paged KV cache and its own runner, built by the same machinery as the target's (engine/builder.py)
and warmed up the same way, so that proposing never compiles. In three parts: load_draft (before any KV pool
is sized: the target's and the draft's share one budget, engine/kv_budget.py kv_budgets), draft_pool_pages,
build_draft (its pool and runner).

    speculative.draft_model: "self" (the target's own source) or any model source the engine loads
    speculative.draft_quantization: none | int8 | int4 | auto (self-speculation: the target's int4 copy)

Refused at start: a draft whose vocabulary or tokenizer differs from the target's (its proposals would be
other tokens), a draft that cannot hold max_model_len, `draft_kv_from_target: true` where the draft's cache
cannot take the target's pages. The draft's pool takes cache.kv_dtype where its model can (else its own dtype).

On a data-parallel mesh the draft's pool is split as the target's is (device/rank_layout.py): each rank's
pages on its own devices, one allocator per rank, and each sequence's draft rows on its rank.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxserve.config import Buckets, EngineConfig, kv_cache_problem
from jaxserve.device.huge_pages import move_weights_to_huge_pages
from jaxserve.device.page_copies import pools_alike
from jaxserve.device.placement import kv_pages_on
from jaxserve.device.rank_layout import RankLayout
from jaxserve.device.runner import ModelRunner
from jaxserve.device.sampling_inputs import SamplingWidths
from jaxserve.engine.attention_plan import AttentionPlan, choose_attention
from jaxserve.engine.draft_lora import log_adapters_not_followed
from jaxserve.engine.draft_proposer import DECODE_CATCH_UP, DraftProposer
from jaxserve.host.page_allocator import PageAllocator, num_pages_for
from jaxserve.loading.model_source import ModelSource, open_model
from jaxserve.loading.quantize import QuantizationSpec
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.lora.registry import LoraRegistry
from jaxserve.models import KVPages
from jaxserve.models.config import ModelConfig
from sharding.attention import devices_per_page

logger = logging.getLogger(__name__)

# Text whose encoding two tokenizers must agree on (words, code, digits, whitespace runs, non-ASCII).
TOKENIZER_PROBE = "Hello, world! def f(x):\n    return x * 12345  # ünïcödé 日本語 \t\n\n<|end|></s>"


@dataclasses.dataclass(frozen=True)
class DraftWeights:
    """A draft model loaded, before its KV pool is sized (engine/kv_budget.py sizes the target's and the draft's
    pools from one budget measured after both models' weights are in memory)."""

    source: ModelSource
    config: ModelConfig
    dtype: str
    attention: AttentionPlan
    model: nnx.Module
    lora_slots: dict
    kv_dtype: str = "auto"  # its pool's cache type (_draft_kv_dtype)


def load_draft(
    target: ModelSource, config: EngineConfig, mesh: Mesh | None, max_model_len: int, load_model, attach_lora
) -> DraftWeights:
    """load_model: builder._load_model (params placed by the rules table as they are read); attach_lora:
    builder._attach_lora (a self-draft gets the target's adapter slots: engine/draft_lora.py)."""
    speculative = config.speculative
    source = target if speculative.draft_model == "self" else open_model(speculative.draft_model)
    check_draft_matches(source, target, max_model_len)
    model_config = source.config.with_context_length(max_model_len)
    dtype = source.checkpoint_dtype if config.dtype == "auto" else config.dtype
    kv_dtype = _draft_kv_dtype(config, model_config, dtype, speculative.draft_model)
    attention = choose_attention(model_config, _with_kv_dtype(config, kv_dtype), dtype, mesh)
    expert_parallel = config.parallel.enable_expert_parallel and model_config.is_moe and mesh is not None
    quantization = QuantizationSpec(speculative.draft_quantization, config.quantization_group_size)
    try:
        model = load_model(
            dataclasses.replace(source, config=model_config), dtype, attention, mesh, expert_parallel, quantization
        )
    except ValueError as error:  # e.g. a K int4's groups cannot take: say it is the draft's option
        raise ValueError(
            f"the speculative draft ({speculative.draft_model}, draft_quantization "
            f"{speculative.draft_quantization}): {error}"
        ) from None
    lora_slots = {}
    if config.lora.enabled and speculative.draft_model == "self":
        lora_slots = attach_lora(model, config, model_config, mesh, expert_parallel)
    elif config.lora.enabled:
        log_adapters_not_followed(speculative.draft_model)
    if mesh is None:
        move_weights_to_huge_pages(model)  # as the target's: a CPU draft step streams them twice as fast
    return DraftWeights(source, model_config, dtype, attention, model, lora_slots, kv_dtype)


def _draft_kv_dtype(config: EngineConfig, model_config: ModelConfig, dtype: str, name: str) -> str:
    """The draft pool's cache type: the target's cache.kv_dtype (pools alike: a self-draft copies the target's pages
    of a prompt instead of prefilling it), or the draft's own dtype (auto) where its model cannot take that type
    (latent attention; a 16-bit draft beside the other 16-bit type), said in the log: the draft is the engine's
    helper, its cache the user's choice only as far as it goes."""
    kv_dtype = config.cache.kv_dtype
    if problem := kv_cache_problem(kv_dtype, jnp.dtype(dtype).name, model_config.is_latent_attention):
        logger.info("the speculative draft (%s) keeps its KV cache in its own dtype: %s", name, problem)
        return "auto"
    return kv_dtype


def _with_kv_dtype(config: EngineConfig, kv_dtype: str) -> EngineConfig:
    """config with cache.kv_dtype set (the draft's attention plan probes its kernels on the draft's own pages)."""
    if kv_dtype == config.cache.kv_dtype:
        return config
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, kv_dtype=kv_dtype))


def draft_device_page_bytes(draft: DraftWeights, config: EngineConfig, mesh: Mesh | None) -> int:
    """What one page of the draft's pool takes on a device (its KV heads' share of the page on a mesh)."""
    attention = draft.attention
    page_bytes = KVPages.bytes_per_page(
        draft.config.num_layers,
        config.cache.page_size,
        attention.num_cache_kv_heads,
        attention.cache_head_dim,
        draft.dtype,
        draft.kv_dtype,
    )
    return -(-page_bytes // devices_per_page(mesh, attention.num_cache_kv_heads))


def draft_pool_pages(
    draft: DraftWeights, config: EngineConfig, mesh: Mesh | None, max_model_len: int, budget_bytes: int
) -> int:
    """The draft's pages a rank: draft_num_pages, else enough for every proposing row at max_model_len within
    budget_bytes of a device (a row that finds no pages proposes nothing, and the least recently proposing rows
    of its rank give theirs up first)."""
    speculative = config.speculative
    rows = min(speculative.speculative_max_batch_size, config.scheduler.max_num_seqs)  # per rank
    num_pages = speculative.draft_num_pages or max(
        2,
        min(
            rows * num_pages_for(max_model_len, config.cache.page_size) + 1,
            budget_bytes // draft_device_page_bytes(draft, config, mesh),
        ),
    )
    if (warning := short_pool_warning(num_pages, config.cache.page_size, max_model_len)) is not None:
        logger.warning(warning)
    return num_pages


def build_draft(
    draft: DraftWeights,
    num_pages: int,
    config: EngineConfig,
    mesh: Mesh | None,
    target_buckets: Buckets,
    compile_counter,
    target_config: ModelConfig | None = None,
) -> DraftProposer:
    """The draft's KV pool of num_pages a rank (draft_pool_pages) and its runner, warmed up.
    compile_counter: the target's runner, whose count of compiles after warm-up the draft's add to, and
    whose pages a row far behind copies where the draft takes the target's KV (target_config: the target
    model's, for `draft_kv_from_target`'s default)."""
    speculative = config.speculative
    model_config, attention = draft.config, draft.attention
    rows = min(speculative.speculative_max_batch_size, config.scheduler.max_num_seqs)  # per rank
    num_ranks = config.parallel.data_parallel_size
    page_size = config.cache.page_size
    layout = RankLayout(num_ranks, num_pages, entries_per_rank=rows)
    zeros = functools.partial(
        KVPages.zeros,
        model_config.num_layers,
        layout.total_pages,
        page_size,
        attention.num_cache_kv_heads,
        attention.cache_head_dim,
        draft.dtype,
        draft.kv_dtype,
    )
    kv_pages = kv_pages_on(mesh, zeros, attention.num_cache_kv_heads)
    # (decided before the draft's warm-up: a draft_kv_from_target that cannot be served is refused at once)
    takes_target_kv = _takes_target_kv(draft, config, mesh, compile_counter, kv_pages, target_config)
    buckets = Buckets(
        decode_seqs=tuple(b for b in target_buckets.decode_seqs if b < rows) + (rows,),
        # a prefill of one query block too: a row a few tokens behind (it backed off) catches up cheaply
        prefill_tokens=tuple(sorted({config.scheduler.prefill_query_block, *target_buckets.prefill_tokens})),
        pages_per_seq=target_buckets.pages_per_seq,
        # a row two tokens behind (all proposals accepted: the last one and the target's next token) feeds
        # both in one step
        catch_up_width=DECODE_CATCH_UP,
    )
    runner = ModelRunner(
        draft.model,
        kv_pages=kv_pages,
        buckets=buckets,
        page_size=page_size,
        prefill_query_block=config.scheduler.prefill_query_block,
        max_logprobs=0,
        vocab_size=model_config.vocab_size,
        sampling_widths=SamplingWidths.for_vocab(model_config.vocab_size, 0),
        num_experts=model_config.num_experts,
        layout=layout,
        mesh=mesh,
        # a round's k - 1 proposals after its first, chained in one executable (engine/draft_proposer.py); from
        # k = 3 on: a chain of one step would save no dispatch
        chain_length=k - 1 if (k := speculative.num_speculative_tokens or 1) >= 3 else 0,
    )
    runner.warm_up(show_progress=config.show_progress)
    return DraftProposer(
        runner,
        [PageAllocator(num_pages, page_size) for _ in range(num_ranks)],
        max_rows=rows,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        prefill_query_block=config.scheduler.prefill_query_block,
        compile_counter=compile_counter,
        description=f"{draft.source.name} ({speculative.draft_quantization})",
        lora=LoraRegistry(config.lora, runner, draft.lora_slots) if draft.lora_slots else None,
        target_runner=compile_counter if takes_target_kv else None,
    )


def _takes_target_kv(
    draft: DraftWeights,
    config: EngineConfig,
    mesh: Mesh | None,
    target_runner,
    draft_pages: KVPages,
    target_config: ModelConfig | None,
) -> bool:
    """`draft_kv_from_target` resolved: where it can be (one process, one device, pools alike) and is wanted
    (True; None: the draft is the target at another precision: draft_model self, or the target's own model
    config). True where it cannot be is refused."""
    wanted = config.speculative.draft_kv_from_target
    if wanted is False:
        return False
    reason = None
    if mesh is not None or config.parallel.data_parallel_size != 1 or jax.process_count() != 1:
        reason = "the engine runs on a device mesh or several processes"
    elif not isinstance(target_runner, ModelRunner) or not pools_alike(target_runner.kv_pages, draft_pages):
        reason = "the draft's KV pages differ from the target's (layers, heads, head size, page size or dtype)"
    if reason is not None and wanted:
        raise ValueError(f"speculative draft_kv_from_target: true cannot be served: {reason}")
    if reason is not None:
        return False
    return wanted or config.speculative.draft_model == "self" or draft.config == target_config


def short_pool_warning(num_pages: int, page_size: int, max_model_len: int) -> str | None:
    """What a user who sized the draft's pool below one whole sequence should know (None: it holds one): a
    row whose KV the pool cannot hold proposes nothing, so long requests silently decode without speculation."""
    tokens = (num_pages - 1) * page_size  # one page of each rank's pool is its scratch page
    if tokens >= max_model_len:
        return None
    return (
        f"the draft's KV pool ({num_pages} pages of {page_size} tokens a rank, one a scratch page) holds {tokens} "
        f"tokens, less than one sequence of max_model_len {max_model_len}: a row longer than that decodes without "
        "proposals (raise draft_num_pages, or leave it unset to size the pool for every speculating row)"
    )


def check_draft_matches(draft: ModelSource, target: ModelSource, max_model_len: int) -> None:
    """The draft must speak the target's tokens: the same vocabulary size and the same tokenizer."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft model {draft.path!r} has a vocabulary of {draft.config.vocab_size} tokens, the target "
            f"{target.path!r} {target.config.vocab_size}: a draft must share the target's tokenizer"
        )
    if max_model_len > draft.config.max_position_embeddings:
        raise ValueError(
            f"draft model {draft.path!r} holds {draft.config.max_position_embeddings} positions, fewer than "
            f"max_model_len ({max_model_len})"
        )
    problem = tokenizer_difference(draft.tokenizer, target.tokenizer)
    if problem is not None:
        raise ValueError(f"draft model {draft.path!r} has another tokenizer than the target {target.path!r}: {problem}")


def tokenizer_difference(draft: Tokenizer | None, target: Tokenizer | None) -> str | None:
    """What tells the two tokenizers apart (None: nothing that matters to proposals)."""
    if draft is None or target is None:
        return None if draft is target else "only one of them has a tokenizer"
    checks = (
        ("vocabulary size", draft.vocab_size, target.vocab_size),
        ("EOS ids", sorted(draft.eos_token_ids), sorted(target.eos_token_ids)),
        ("BOS id", draft.bos_token_id, target.bos_token_id),
        ("special tokens", draft.special_tokens, target.special_tokens),
        ("encoding of a probe text", draft.encode(TOKENIZER_PROBE), target.encode(TOKENIZER_PROBE)),
    )
    for what, mine, theirs in checks:
        if mine != theirs:
            return f"{what} differ ({_short(mine)} vs {_short(theirs)})"
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
