"""What DeepSeek-V2 / V2-Lite / V3 (and Kimi-K2, a V3 by another name) config.json files say, read as
transformers' DeepseekV2Config / DeepseekV3Config read them.

Attention is multi-head latent attention (mla.py): the cache holds one latent head per token, so the
config reports one KV head; head_dim is the query/key width (qk_nope_head_dim + qk_rope_head_dim) and
rope turns only the last qk_rope_head_dim lanes. Routing (grouped_routing.py): V2 scores experts with a
softmax and may limit them to the best groups by their best expert (group_limited_greedy); V3 scores
with a sigmoid plus a per-expert correction bias (used to choose, not to weigh) and ranks groups by
their two best experts (noaux_tc), as transformers does whatever topk_method says. The first
first_k_dense_replace layers (and those off moe_layer_freq) keep a dense MLP. Plain Python: the router
reads configs without JAX.
"""

from __future__ import annotations

DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def _positive(hf: dict, name: str, default: int | None = None) -> int:
    value = hf.get(name, default)
    if value is None or int(value) <= 0:
        raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
    return int(value)


def deepseek_fields(model_type: str, hf: dict) -> dict:
    """ModelConfig fields of a DeepSeek checkpoint beyond the Llama-family ones (overriding them)."""
    v3 = model_type != "deepseek_v2"
    nope, rope = _positive(hf, "qk_nope_head_dim", 128), _positive(hf, "qk_rope_head_dim", 64)
    if rope % 2:
        raise ValueError(f"config.json: qk_rope_head_dim must be even for rotary embeddings, got {rope}")
    bias = bool(hf.get("attention_bias", False))
    fields: dict = dict(
        num_kv_heads=1,  # the latent: one head every query head reads
        head_dim=nope + rope,
        rotary_dim=rope,
        kv_lora_rank=_positive(hf, "kv_lora_rank", 512),
        q_lora_rank=int(hf.get("q_lora_rank") or 0),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=_positive(hf, "v_head_dim", 128),
        # V2 rotates (even, odd) lane pairs as complex numbers; V3 does so unless rope_interleave is off
        rope_interleave=bool(hf.get("rope_interleave", True)) if v3 else True,
        attention_bias=bias,  # on q_a_proj and kv_a_proj_with_mqa (never q_proj, q_b_proj or kv_b_proj)
        attention_output_bias=bias,
        mlp_bias=bool(hf.get("mlp_bias", False)) if not v3 else False,
        sliding_window=None,
        layer_types=(),
    )
    num_experts = int(hf.get("n_routed_experts") or hf.get("num_local_experts") or hf.get("num_experts") or 0)
    if not num_experts:
        return fields
    num_layers = int(hf["num_hidden_layers"])
    first_moe = int(hf.get("first_k_dense_replace") or 0)
    frequency = int(hf.get("moe_layer_freq") or 1)
    topk_method = "noaux_tc" if v3 else str(hf.get("topk_method") or "greedy")
    if not v3 and topk_method not in V2_TOPK_METHODS:
        raise ValueError(f"config.json: unsupported topk_method {topk_method!r} for {model_type}")
    grouped = v3 or topk_method == "group_limited_greedy"
    groups = int(hf.get("n_group") or 1) if grouped else 1
    topk_groups = int(hf.get("topk_group") or groups) if grouped else 1
    if num_experts % groups or not 0 < topk_groups <= groups:
        raise ValueError(
            f"config.json: {num_experts} experts must split evenly into n_group={groups} groups, "
            f"and topk_group ({topk_groups}) must be in [1, n_group]"
        )
    top_k = _positive(hf, "num_experts_per_tok")
    if top_k > num_experts // groups * topk_groups:
        raise ValueError(
            f"config.json: num_experts_per_tok ({top_k}) exceeds the experts of topk_group={topk_groups} "
            f"groups of {num_experts // groups}"
        )
    shared = int(hf.get("n_shared_experts") or 0)
    expert_width = _positive(hf, "moe_intermediate_size", 1407)
    fields.update(
        num_experts=num_experts,
        num_experts_per_token=top_k,
        expert_intermediate_size=expert_width,
        # transformers' V2 router never renormalizes its top k, whatever norm_topk_prob says
        normalize_expert_weights=bool(hf.get("norm_topk_prob", True)) if v3 else False,
        shared_expert_intermediate_size=shared * expert_width,
        shared_expert_gated=False,
        dense_layers=tuple(layer for layer in range(num_layers) if layer < first_moe or layer % max(frequency, 1)),
        expert_scoring="sigmoid" if v3 else "softmax",
        expert_group_scoring=("top2_sum" if v3 else "max") if grouped else "none",
        num_expert_groups=groups,
        num_expert_groups_kept=topk_groups,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        expert_score_correction_bias=v3,
    )
    return fields
