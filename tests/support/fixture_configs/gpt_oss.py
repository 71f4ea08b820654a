"""GPT-OSS fixtures: sinks, sliding and full layers, biases, YaRN, experts even and uneven under EP.

name: (seed, transformers model type, config overrides). A seed is fixed per fixture (it was its position
in make_fixtures.py's one table), so regenerating any subset writes the same weights and prompts."""

MODELS = {
    # GPT-OSS: sinks, sliding (short windows, so that they matter here) and full layers, biases everywhere,
    # YaRN; GQA with an odd head dim and a clamp low enough to bite; MHA tied with transformers' default rope;
    # six experts (uneven under EP 4) with a truncated YaRN and a sliding-heavy pattern
    "gpt_oss": (
        20,
        "gpt_oss",
        dict(
            hidden_size=40,
            intermediate_size=24,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=10,
            num_local_experts=5,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=0.3,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                beta_fast=8.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=32,
            ),
            initializer_range=0.1,
            random_vectors=True,
        ),
    ),
    "gpt_oss_mha_tied": (
        21,
        "gpt_oss",
        dict(
            hidden_size=32,
            intermediate_size=20,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=3,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
            layer_types=["full_attention", "sliding_attention"],
            tie_word_embeddings=True,
            initializer_range=0.1,
            random_vectors=True,
        ),
    ),
    "gpt_oss_6x": (
        22,
        "gpt_oss",
        dict(
            hidden_size=48,
            intermediate_size=28,
            num_hidden_layers=4,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=6,
            num_experts_per_tok=3,
            sliding_window=12,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters=dict(
                rope_type="yarn", rope_theta=50000.0, factor=8.0, original_max_position_embeddings=48, truncate=True
            ),
            initializer_range=0.1,
            random_vectors=True,
        ),
    ),
}
