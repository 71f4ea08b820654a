"""Mixtral fixtures: experts that divide the fake devices and experts that do not (3, 4, 6, 8), top 1 and 2.

name: (seed, transformers model type, config overrides). A seed is fixed per fixture (it was its position
in make_fixtures.py's one table), so regenerating any subset writes the same weights and prompts."""

MODELS = {
    "mixtral": (
        4,
        "mixtral",
        dict(
            hidden_size=48,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_theta=1e6,
        ),
    ),
    "mixtral_top1_tied": (
        5,
        "mixtral",
        dict(
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_local_experts=3,
            num_experts_per_tok=1,
            tie_word_embeddings=True,
        ),
    ),
    # eight experts: enough to spread one per device over 8 devices
    "mixtral_8x": (
        6,
        "mixtral",
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
    ),
    # six experts do not divide 4 devices (they hold 2, 2, 1, 1) nor 8 (two hold none)
    "mixtral_6x": (
        10,
        "mixtral",
        dict(
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=6,
            num_experts_per_tok=2,
        ),
    ),
}
