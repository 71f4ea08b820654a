"""The pure step function the runner compiles: (params, KV pages, token buffer, inputs) -> (sampled
tokens, routing counts, updated pages, updated token buffer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.device.sampler import sample
from jaxserve.device.step_inputs import StepInputs
from jaxserve.models.kv_pages import KVPages


def step(
    graphdef,
    params_treedef,
    param_leaves,
    kv_pages: KVPages,
    token_buffer: jax.Array,
    inputs: StepInputs,
    *,
    max_logprobs: int,
    num_experts: int,
):
    """Params arrive as a flat list of arrays: flattening an nnx.State on every call costs about a
    millisecond of host time, a quarter of a one-sequence decode step on a CPU.

    token_buffer holds each running sequence's newest sampled token: a step planned before the previous
    one finished reads the tokens the host has not seen from it (step_inputs.py, the token buffer)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(params_treedef, param_leaves))
    token_ids = jnp.where(
        inputs.token_sources >= 0, token_buffer[jnp.maximum(inputs.token_sources, 0)], inputs.token_ids
    )
    (hidden, kv_pages), intermediates = nnx.capture(model, nnx.Intermediate)(token_ids, kv_pages, inputs.attention)
    logits = model.compute_logits(hidden[inputs.logits_indices])
    counts = expert_token_counts(jax.tree.leaves(intermediates), inputs, num_experts)
    sampled = sample(logits, inputs.sampling, max_logprobs)
    token_buffer = token_buffer.at[inputs.sampled_entries].set(sampled.token_ids)
    return sampled, counts, kv_pages, token_buffer


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
