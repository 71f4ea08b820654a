"""Qwen fixtures: Qwen2 (biases, sliding layers), Qwen3 (q/k norms), Qwen3-MoE (60 and 128 experts too), Qwen2-MoE.

name: (seed, transformers model type, config overrides). A seed is fixed per fixture (it was its position
in make_fixtures.py's one table), so regenerating any subset writes the same weights and prompts."""

MODELS = {
    # q/k/v biases without an o_proj bias; only layers from max_window_layers on slide their window
    "qwen2": (
        7,
        "qwen2",
        dict(
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=1e6,
            use_sliding_window=True,
            sliding_window=16,
            max_window_layers=1,
            random_vectors=True,
            weight_scale=10.0,
        ),
    ),
    # per-head q/k norms; head_dim 16 is not hidden_size / heads
    "qwen3": (
        8,
        "qwen3",
        dict(
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rope_theta=1e6,
            random_vectors=True,
        ),
    ),
    # experts' own MLP width; router weights not renormalized (norm_topk_prob false)
    "qwen3_moe": (
        9,
        "qwen3_moe",
        dict(
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            random_vectors=True,
        ),
    ),
    # Qwen2-MoE's 60 experts, top 4, not renormalized: over 8 devices, four hold 8 and four hold 7
    "qwen3_moe_60x": (
        11,
        "qwen3_moe",
        dict(
            hidden_size=16,
            intermediate_size=32,
            moe_intermediate_size=8,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=60,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            random_vectors=True,
        ),
    ),
    # Qwen2-MoE: a shared expert of its own width behind a sigmoid gate, five experts (odd under EP), top 2
    # not renormalized, q/k/v biases, and a dense MLP in the middle layer (mlp_only_layers)
    "qwen2_moe": (
        19,
        "qwen2_moe",
        dict(
            hidden_size=36,
            intermediate_size=52,
            moe_intermediate_size=20,
            shared_expert_intermediate_size=44,
            num_hidden_layers=3,
            num_attention_heads=3,
            num_key_value_heads=1,
            num_experts=5,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            random_vectors=True,
        ),
    ),
    # Qwen3-30B-A3B's structure at a tenth of its width and two layers: 128 experts top 8 renormalized
    # (norm_topk_prob), GQA 32:4, head_dim 128 independent of (and wider than) hidden / heads; bf16 on disk
    # to keep the file small (the expectations are float32 math on the rounded weights)
    "qwen3_moe_30b_a3b_shape": (
        23,
        "qwen3_moe",
        dict(
            hidden_size=32,
            intermediate_size=96,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            torch_dtype="bfloat16",
        ),
    ),
}
