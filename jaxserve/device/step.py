"""The pure step function the runner compiles: (params, KV pages, sequence buffers, inputs) -> (sampled
tokens, prompt logprobs, routing counts, updated pages, updated sequence buffers); and a chain of such steps
in one executable (chained_steps: a target's decode steps, scheduler.num_scheduler_steps, and a draft model's
proposals)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.device.logits_processors import process_logits
from jaxserve.device.prompt_logprobs import score_prompt_tokens
from jaxserve.device.sampler import sample
from jaxserve.device.sequence_buffers import SequenceBuffers, gather_entries
from jaxserve.device.step_inputs import StepInputs
from jaxserve.lora.slots import bind_row_slots
from jaxserve.models.kv_pages import KVPages


def step(
    graphdef,
    params_treedef,
    param_leaves,
    kv_pages: KVPages,
    buffers: SequenceBuffers,
    inputs: StepInputs,
    *,
    max_logprobs: int,
    num_experts: int,
    sampler_sharding=None,
):
    """Params arrive as a flat list of arrays: flattening an nnx.State on every call costs about a
    millisecond of host time, a quarter of a one-sequence decode step on a CPU.

    buffers hold each running sequence's newest sampled token: a step planned before the previous one
    finished reads the tokens the host has not seen from there (device/sequence_buffers.py)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(params_treedef, param_leaves))
    token_ids = jnp.where(
        inputs.token_sources >= 0, buffers.newest_tokens(jnp.maximum(inputs.token_sources, 0)), inputs.token_ids
    )
    bind_row_slots(model, inputs.lora_slots)  # each token's LoRA adapter (jaxserve/lora)
    (hidden, kv_pages), intermediates = nnx.capture(model, nnx.Intermediate)(token_ids, kv_pages, inputs.attention)
    logits = rows_whole(model.compute_logits(hidden[inputs.logits_indices]), sampler_sharding)
    counts = expert_token_counts(jax.tree.leaves(intermediates), inputs, num_experts)
    processed = process_logits(logits, inputs.sampling, lambda: gather_entries(buffers, inputs.sampled_entries))
    sampled = sample(processed, inputs.sampling, max_logprobs, model_logits=logits, rows_sharding=sampler_sharding)
    prompt_logprobs = score_prompt_tokens(model.compute_logits, hidden, inputs.prompt_logprob_targets, max_logprobs)
    return sampled, prompt_logprobs, counts, kv_pages, buffers.record(inputs.sampled_entries, sampled.token_ids)


def chained_steps(
    graphdef,
    params_treedef,
    param_leaves,
    kv_pages: KVPages,
    buffers: SequenceBuffers,
    stacked_inputs: StepInputs,
    *,
    max_logprobs: int,
    num_experts: int,
    sampler_sharding=None,
):
    """`step` once per leading entry of stacked_inputs ([L, ...] each), in order, in one executable: each step
    reads the tokens the one before it sampled through the sequence buffers, as separate steps would. One
    dispatch instead of L, whose host time (~1-2 ms each on a CPU: JAX's dispatch of ~400 arguments, the
    inputs, the fetch) is a quarter of a quantized one-row decode step there and a fifth of a small draft's
    (the engine's decode chains, engine/decode_chain.py; a draft's proposals, engine/draft_proposer.py). The
    pages stay in place in the loop's carry (no copy per step).

    Returns each step's SamplerOutput stacked ([L, S, ...] per field), its expert token counts [L, layers,
    experts], the pages and the buffers."""

    def one_step(carry, inputs):
        pages, buffers = carry
        sampled, _, counts, pages, buffers = step(
            graphdef,
            params_treedef,
            param_leaves,
            pages,
            buffers,
            inputs,
            max_logprobs=max_logprobs,
            num_experts=num_experts,
            sampler_sharding=sampler_sharding,
        )
        return (pages, buffers), (sampled, counts)

    (kv_pages, buffers), (sampled, counts) = jax.lax.scan(one_step, (kv_pages, buffers), stacked_inputs)
    return sampled, counts, kv_pages, buffers


def rows_whole(logits, sampler_sharding):
    """logits [S, V] laid out as sampler_sharding says (on a mesh: rows over the data ranks, each row's vocabulary
    whole on every device), so that the processors and the sampler run on whole rows. Left to XLA's partitioner, a
    vocabulary split over "tensor" (the LM head's columns) splits the sampler's top-k, prefix sums and halvings too:
    a tensor-parallel step executable took ~40% longer to compile, for [S, V] of float32 that the gather moves."""
    return logits if sampler_sharding is None else jax.lax.with_sharding_constraint(logits, sampler_sharding)


def expert_token_counts(routed: list, inputs: StepInputs, num_experts: int):
    """[layers, experts] tokens routed to each expert this step, padding excluded ([0, 0] when dense).

    routed: per MoE layer, the [T, k] expert ids its router chose (sown by the MoE block)."""
    if not routed:
        return jnp.zeros((0, 0), jnp.int32)
    real = (inputs.attention.positions >= 0).astype(jnp.int32)
    return jnp.stack(
        [
            jnp.bincount(experts.reshape(-1), weights=jnp.repeat(real, experts.shape[1]), length=num_experts)
            for experts in routed
        ]
    ).astype(jnp.int32)
