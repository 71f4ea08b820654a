"""Hugging Face tensor names of Qwen3-MoE checkpoints: Qwen3's, with Mixtral-style stacked experts
under `mlp.experts.{e}.{gate,up,down}_proj` (or transformers >= 5's fused layout) and the router at
`mlp.gate`. Layers listed as dense keep Llama's MLP names. Qwen2-MoE names its experts and router
alike; its shared expert (`mlp.shared_expert.*`, `mlp.shared_expert_gate`) is named as our module is."""

from __future__ import annotations

from jaxserve.models.mixtral import MoENames

QWEN3_MOE = MoENames(
    routers=("model.layers.{layer}.mlp.gate.weight",),
    per_expert="model.layers.{layer}.mlp.experts.{expert}.{name}.weight",
    expert_names={"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
)
read_param = QWEN3_MOE.read_param
