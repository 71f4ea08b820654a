"""The sparse mixture-of-experts block (Mixtral, Qwen3-MoE, Qwen2-MoE): a softmax top-k router over X gated
experts, and for Qwen2-MoE a shared expert every token passes through, scaled by its own sigmoid gate.

The router runs here. How the routed tokens reach their experts (grouped matmuls on every device,
or an all-to-all to the devices that hold them) is the `experts` function the model is built with
(sharding/moe.py provides both).
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.models.config import ModelConfig
from jaxserve.models.deepseek_config import DEEPSEEK_MODEL_TYPES
from jaxserve.models.grouped_routing import GroupedRouting
from jaxserve.models.layers import ACTIVATIONS, MLP, Matmul, gated_activation, linear, row_softmax, tree_sum

# Legend: T = tokens, E = embed, X = experts, F = expert mlp, k = experts per token, S = stored expert rows
# (X, or X padded to an even number per device under expert parallelism: rows no expert id points at).


class Experts(Protocol):
    def num_expert_rows(self, num_experts: int) -> int:
        """Rows of each expert weight array: num_experts, or more where spreading them over devices pads them."""
        ...

    def initial_placement(self, num_experts: int) -> tuple:
        """Variables saying where each expert lives, kept beside its weights; () when every device holds all."""
        ...

    def __call__(
        self,
        x,
        weights,
        expert_ids,
        gate_proj,
        up_proj,
        down_proj,
        placement: tuple,
        *,
        activation,
        biases: tuple = (),
        glu=None,
        lora=None,
    ) -> jax.Array:
        """x [T, E], weights / expert_ids [T, k], gate/up [S, E, F], down [S, F, E] -> [T, E]; biases: the
        experts' gate/up [S, F] and down [S, E] biases, or (); glu(gate, up) -> hidden in place of
        activation(gate) * up (None: that); lora: adapter slots on the experts and each token's slot
        (pallas_kernels/matmul/lora.py's ExpertLora), or None."""
        ...


def route(router_logits, top_k: int, normalize: bool = True):
    """As HF: softmax over all experts in float32, keep the top k (rescaled to sum to 1 where the model
    does) -> (weights [T, k] float32, expert ids [T, k])."""
    router_probs = row_softmax(router_logits.astype(jnp.float32))  # [T, X], each row alike in any step (layers.py)
    weights, expert_ids = jax.lax.top_k(router_probs, top_k)
    if normalize:
        weights = weights / tree_sum(weights)
    return weights, expert_ids


def clamped_swiglu(gate, up, *, alpha: float, limit: float):
    """GPT-OSS's gated unit: the gate clamped from above and the up projection both ways at `limit`, then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


class SparseMoE(nnx.Module):
    lora: Any = None  # jaxserve/lora's ExpertLoraSlots where adapters may target the routed experts

    def __init__(self, config: ModelConfig, dtype, matmul: Matmul, rngs: nnx.Rngs, experts: Experts):
        e, f, x = config.hidden_size, config.expert_intermediate_size, config.num_experts
        s = experts.num_expert_rows(x)
        init = nnx.initializers.lecun_normal()
        # the router: small, replicated
        self.gate = linear(e, x, ("embed", None), bias=config.router_bias, dtype=dtype, matmul=matmul, rngs=rngs)
        self.gate_proj = nnx.Param(
            init(rngs.params(), (s, e, f), dtype), logical_axes=("expert", "embed", "expert_mlp")
        )  # [S, E, F]
        self.up_proj = nnx.Param(
            init(rngs.params(), (s, e, f), dtype), logical_axes=("expert", "embed", "expert_mlp")
        )  # [S, E, F]
        self.down_proj = nnx.Param(
            init(rngs.params(), (s, f, e), dtype), logical_axes=("expert", "expert_mlp", "embed")
        )  # [S, F, E]
        # GPT-OSS: each expert's projections have biases, and its unit is a clamped SwiGLU
        biases = config.expert_biases
        self.gate_proj_bias = (
            nnx.Param(jnp.zeros((s, f), dtype), logical_axes=("expert", "expert_mlp")) if biases else None
        )
        self.up_proj_bias = (
            nnx.Param(jnp.zeros((s, f), dtype), logical_axes=("expert", "expert_mlp")) if biases else None
        )
        self.down_proj_bias = nnx.Param(jnp.zeros((s, e), dtype), logical_axes=("expert", "embed")) if biases else None
        self.swiglu = (config.swiglu_alpha, config.swiglu_limit) if config.swiglu_limit else None
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(config, dtype, matmul, rngs, shared_expert=True)
            self.shared_expert_gate = (
                linear(e, 1, ("embed", None), bias=False, dtype=dtype, matmul=matmul, rngs=rngs)
                if config.shared_expert_gated
                else None
            )
        else:
            self.shared_expert = self.shared_expert_gate = None
        # DeepSeek: softmax or sigmoid scores, group-limited top k, a bias that shifts the choice, scaled weights
        self.grouped_routing = GroupedRouting.from_config(config) if config.model_type in DEEPSEEK_MODEL_TYPES else None
        self.expert_score_correction_bias = (
            nnx.Param(jnp.zeros((x,), dtype), logical_axes=(None,)) if config.expert_score_correction_bias else None
        )  # [X]
        self.top_k = config.num_experts_per_token
        self.normalize_weights = config.normalize_expert_weights
        self.activation = config.hidden_act
        self.experts = experts
        # Under expert parallelism, where each expert lives (sharding/expert_placement.py moves them).
        self.expert_device, self.expert_slot = experts.initial_placement(x) or (None, None)

    def __call__(self, x):
        if self.grouped_routing is not None:
            bias = None if self.expert_score_correction_bias is None else self.expert_score_correction_bias[...]
            weights, expert_ids = self.grouped_routing(self.gate(x), bias)
        else:
            weights, expert_ids = route(self.gate(x), self.top_k, self.normalize_weights)
        self.sow(nnx.Intermediate, "routed_experts", expert_ids)  # [T, k]: read back for expert-load stats
        placement = (
            ()
            if self.expert_device is None or self.expert_slot is None
            else (self.expert_device[...], self.expert_slot[...])
        )
        routed = self.experts(
            x,
            weights,
            expert_ids,
            self.gate_proj[...],
            self.up_proj[...],
            self.down_proj[...],
            placement,
            activation=ACTIVATIONS[self.activation],
            **self._expert_options(),
            **({} if self.lora is None else {"lora": self.lora.weights()}),
        )
        if self.shared_expert is None:
            return routed
        if self.shared_expert_gate is None:  # DeepSeek's shared experts: every token, ungated
            return routed + self.shared_expert(x)
        gate = jax.nn.sigmoid(self.shared_expert_gate(x))  # [T, 1]
        return routed + gate * self.shared_expert(x)

    def _expert_options(self) -> dict:
        """The experts' biases where the model has them (GPT-OSS), and their gated unit (GPT-OSS's clamped SwiGLU,
        else activation(gate) * up rounded as the dense MLP rounds it)."""
        options = {}
        if self.gate_proj_bias is not None and self.up_proj_bias is not None and self.down_proj_bias is not None:
            options["biases"] = (self.gate_proj_bias[...], self.up_proj_bias[...], self.down_proj_bias[...])
        if self.swiglu is not None:
            alpha, limit = self.swiglu
            options["glu"] = functools.partial(clamped_swiglu, alpha=alpha, limit=limit)
        else:  # as the dense MLP: rounded as transformers rounds it in the model's dtype
            options["glu"] = functools.partial(gated_activation, ACTIVATIONS[self.activation])
        return options
