"""The pure step function the runner compiles: (params, KV pages, sequence buffers, inputs) -> (sampled
tokens, prompt logprobs, routing counts, updated pages, updated sequence buffers)."""

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
):
    """Params arrive as a flat list of arrays: flattening an nnx.State on every call costs about a
    millisecond of host time, a quarter of a one-sequence decode step on a CPU.

    buffers hold each running sequence's newest sampled token: a step planned before the previous one
    finished reads the tokens the host has not seen from there (device/sequence_buffers.py)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(params_treedef, param_leaves))
    token_ids = jnp.where(
        inputs.token_sources >= 0, buffers.newest_token_ids[jnp.maximum(inputs.token_sources, 0)], inputs.token_ids
    )
    bind_row_slots(model, inputs.lora_slots)  # each token's LoRA adapter (jaxserve/lora)
    (hidden, kv_pages), intermediates = nnx.capture(model, nnx.Intermediate)(token_ids, kv_pages, inputs.attention)
    logits = model.compute_logits(hidden[inputs.logits_indices])
    counts = expert_token_counts(jax.tree.leaves(intermediates), inputs, num_experts)
    processed = process_logits(logits, inputs.sampling, lambda: gather_entries(buffers, inputs.sampled_entries))
    sampled = sample(processed, inputs.sampling, max_logprobs, model_logits=logits)
    prompt_logprobs = score_prompt_tokens(model.compute_logits, hidden, inputs.prompt_logprob_targets, max_logprobs)
    return sampled, prompt_logprobs, counts, kv_pages, buffers.record(inputs.sampled_entries, sampled.token_ids)


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
