"""Llama fixtures: GQA, multi-head tied, multi-query with odd sizes and llama3 rope scaling, bf16 on disk.

name: (seed, transformers model type, config overrides). A seed is fixed per fixture (it was its position
in make_fixtures.py's one table), so regenerating any subset writes the same weights and prompts."""

MODELS = {
    "llama_gqa": (
        0,
        "llama",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
        ),
    ),
    "llama_mha_tied": (
        1,
        "llama",
        dict(
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=3,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
        ),
    ),
    "llama_mqa_odd": (
        2,
        "llama",
        dict(
            hidden_size=40,
            intermediate_size=72,
            num_hidden_layers=3,
            num_attention_heads=5,
            num_key_value_heads=1,
            head_dim=12,
            attention_bias=True,
            rope_theta=70000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "llama_bf16": (
        3,
        "llama",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            torch_dtype="bfloat16",
        ),
    ),
}
