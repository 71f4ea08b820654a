"""Gemma 2 and Gemma 3 (text) fixtures: soft-caps, sliding and global layers, their ropes and norms.

name: (seed, transformers model type, config overrides). A seed is fixed per fixture (it was its position
in make_fixtures.py's one table), so regenerating any subset writes the same weights and prompts."""

MODELS = {
    # Gemma 2: sliding and global layers alternate (the window, 8, is shorter than most prompts), scores
    # and final logits soft-capped low enough to bend them, query_pre_attn_scalar not head_dim, GQA, tied
    "gemma2": (
        12,
        "gemma2",
        dict(
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=0.5,
            final_logit_softcapping=8.0,
            random_vectors=True,
            attn_implementation="eager",
        ),
    ),
    # odd sizes, multi-head (no GQA), untied head, transformers' default caps, a 16-token window
    "gemma2_mha_untied": (
        13,
        "gemma2",
        dict(
            hidden_size=40,
            intermediate_size=72,
            num_hidden_layers=2,
            num_attention_heads=5,
            num_key_value_heads=5,
            head_dim=12,
            query_pre_attn_scalar=12,
            sliding_window=16,
            tie_word_embeddings=False,
            random_vectors=True,
            attn_implementation="eager",
        ),
    ),
    # Gemma 3: 5 local layers (rope base 10k, window 10) to 1 global (1M, linear scaling x8), then a local
    # one; per-head (1 + weight) q/k norms; multi-query attention
    "gemma3": (
        14,
        "gemma3_text",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=7,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=10,
            sliding_window_pattern=6,
            rope_theta=1_000_000.0,
            rope_local_base_freq=10_000.0,
            rope_scaling=dict(rope_type="linear", factor=8.0),
            random_vectors=True,
            attn_implementation="eager",
        ),
    ),
    # odd sizes, layer types listed, untied, a final logit cap, scores scaled by a scalar not head_dim
    "gemma3_odd_untied": (
        15,
        "gemma3_text",
        dict(
            hidden_size=36,
            intermediate_size=60,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=10,
            query_pre_attn_scalar=30,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            tie_word_embeddings=False,
            final_logit_softcapping=6.0,
            rope_theta=50_000.0,
            rope_local_base_freq=5_000.0,
            random_vectors=True,
            attn_implementation="eager",
        ),
    ),
}
