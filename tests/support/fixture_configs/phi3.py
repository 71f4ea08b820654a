"""Phi-3 fixtures: fused projections, sliding windows, LongRoPE with short and with long factors.

name: (seed, transformers model type, config overrides). A seed is fixed per fixture (it was its position
in make_fixtures.py's one table), so regenerating any subset writes the same weights and prompts."""

MODELS = {
    # Phi-3 mini's shape: fused qkv_proj / gate_up_proj, multi-head, a sliding window on every layer
    "phi3": (
        16,
        "phi3",
        dict(
            pad_token_id=0,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            sliding_window=12,
            random_vectors=True,
        ),
    ),
    # Phi-3.5 / Phi-4-mini's rope: LongRoPE over 3/4 of each head (partial_rotary_factor), GQA 3:1, tied. The
    # engine's max_model_len (128) is within the pretraining length (256): short factors, and cos / sin
    # scaled for max_position_embeddings 1024
    "phi3_longrope_short": (
        17,
        "phi3",
        dict(
            pad_token_id=0,
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=1,
            max_position_embeddings=1024,
            original_max_position_embeddings=256,
            partial_rotary_factor=0.75,
            rope_scaling=dict(
                type="longrope", short_factor=[1.0, 1.2, 1.5, 2.0, 3.0, 4.0], long_factor=[2, 3, 5, 8, 13, 21]
            ),
            tie_word_embeddings=True,
            random_vectors=True,
        ),
    ),
    # max_model_len (128) beyond the pretraining length (32): long factors for every position, chosen once;
    # transformers is recorded with its long factors forced (force_long_rope), as the engine serves them
    "phi3_longrope_long": (
        18,
        "phi3",
        dict(
            pad_token_id=0,
            hidden_size=40,
            intermediate_size=56,
            num_hidden_layers=2,
            num_attention_heads=5,
            num_key_value_heads=1,
            original_max_position_embeddings=32,
            rope_scaling=dict(
                type="su",
                short_factor=[1.0, 1.1, 1.3, 1.6],
                long_factor=[1.0, 3.0, 7.0, 15.0],
                original_max_position_embeddings=32,
            ),
            random_vectors=True,
            force_long_rope=True,
        ),
    ),
}
