"""Mixtral's sparse mixture-of-experts block: a top-k softmax router over N SwiGLU experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import ModelConfig
from jaxserve.models.layers import ACTIVATIONS, linear
from sharding.expert_placement import ExpertPlacement
from sharding.moe import expert_parallel_moe, place_experts

# Legend: T = tokens, E = embed, X = experts, F = expert mlp, R = routed copies (T * top_k).


class SparseMoE(nnx.Module):
    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs, expert_parallel_mesh=None):
        e, f, x = config.hidden_size, config.intermediate_size, config.num_experts
        init = nnx.initializers.lecun_normal()
        self.gate = linear(e, x, bias=False, dtype=dtype, rngs=rngs)
        self.gate_proj = nnx.Param(init(rngs.params(), (x, e, f), dtype))  # [X, E, F]  (HF w1)
        self.up_proj = nnx.Param(init(rngs.params(), (x, e, f), dtype))  # [X, E, F]  (HF w3)
        self.down_proj = nnx.Param(init(rngs.params(), (x, f, e), dtype))  # [X, F, E]  (HF w2)
        self.top_k = config.num_experts_per_token
        self.num_experts = x
        self.activation = config.hidden_act
        self.expert_parallel_mesh = expert_parallel_mesh  # set: experts spread over all its devices
        if expert_parallel_mesh is not None:  # contiguous blocks until a load profile says otherwise
            device_of, slot_of, _ = place_experts(None, x, expert_parallel_mesh.devices.size)
            self.expert_device = ExpertPlacement(device_of)
            self.expert_slot = ExpertPlacement(slot_of)

    def route(self, x):
        """As HF: softmax over all experts in float32, keep the top k, renormalize them to sum to 1."""
        router_probs = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)  # [T, X]
        weights, experts = jax.lax.top_k(router_probs, self.top_k)  # [T, k]
        return weights / jnp.sum(weights, axis=-1, keepdims=True), experts

    def __call__(self, x):
        num_tokens = x.shape[0]
        weights, experts = self.route(x)
        self.sow(nnx.Intermediate, "routed_experts", experts)  # [T, k]: read back for expert-load stats
        if self.expert_parallel_mesh is not None:
            mesh = self.expert_parallel_mesh
            return expert_parallel_moe(x, self.gate.kernel[...], self.gate_proj[...], self.up_proj[...],
                                       self.down_proj[...], self.expert_device[...], self.expert_slot[...],
                                       mesh=mesh, axis=mesh.axis_names,
                                       top_k=self.top_k, activation=ACTIVATIONS[self.activation])
        # Group the routed copies of tokens by expert and run one grouped matmul per projection.
        flat_experts = experts.reshape(-1)  # [R]
        order = jnp.argsort(flat_experts, stable=True)
        token_of_copy = order // self.top_k  # [R]
        group_sizes = jnp.bincount(flat_experts, length=self.num_experts).astype(jnp.int32)
        routed = x[token_of_copy]  # [R, E]
        hidden = ACTIVATIONS[self.activation](jax.lax.ragged_dot(routed, self.gate_proj[...], group_sizes))
        hidden = hidden * jax.lax.ragged_dot(routed, self.up_proj[...], group_sizes)
        out = jax.lax.ragged_dot(hidden, self.down_proj[...], group_sizes)  # [R, E]
        out = out.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
        combined = jnp.zeros((num_tokens, x.shape[1]), jnp.float32).at[token_of_copy].add(out)
        return combined.astype(x.dtype)
