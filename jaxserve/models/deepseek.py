"""Hugging Face tensor names of DeepSeek-V2 / V3 checkpoints (and Kimi-K2's, which are V3's).

Attention (mla.py) names its projections as transformers does (q_proj or q_a_proj / q_a_layernorm / q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj), read as Llama's. MoE layers keep their router at
`mlp.gate` (V3's correction bias beside it, `mlp.gate.e_score_correction_bias`), their routed experts per
expert under `mlp.experts.{e}` (or transformers >= 5's fused layout) and their shared experts, one MLP
`moe_intermediate_size * n_shared_experts` wide, at `mlp.shared_experts`.
"""

from __future__ import annotations

from jaxserve.models import llama
from jaxserve.models.mixtral import MoENames

DEEPSEEK = MoENames(
    routers=("model.layers.{layer}.mlp.gate.weight",),
    per_expert="model.layers.{layer}.mlp.experts.{expert}.{name}.weight",
    expert_names={"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
)


def read_param(reader, path: tuple[str, ...], shape: tuple[int, ...]):
    if path[2:] == ("mlp", "expert_score_correction_bias"):
        return reader.read(f"model.layers.{path[1]}.mlp.gate.e_score_correction_bias")
    if path[2:4] == ("mlp", "shared_expert"):
        return llama.read_param(reader, (*path[:3], "shared_experts", *path[4:]), shape)
    return DEEPSEEK.read_param(reader, path, shape)
