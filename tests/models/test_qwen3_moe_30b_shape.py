"""Qwen3-MoE as Qwen3-30B-A3B's config.json says it (128 experts top 8 renormalized, GQA 32:4, head_dim 128
while hidden / heads is 64), and its structure at small width (fixture qwen3_moe_30b_a3b_shape, which
test_models_vs_hf.py checks on one device and test_gpt_oss_sharded.py over 8 expert-parallel devices)."""

from jaxserve.models import ModelConfig
from tests.support.fixtures import fixture_dir

QWEN3_30B_A3B = dict(
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    max_window_layers=48,
    sliding_window=None,
    use_sliding_window=False,
    rms_norm_eps=1e-06,
    tie_word_embeddings=False,
    attention_bias=False,
)


def test_qwen3_30b_a3b_config():
    config = ModelConfig.from_hf_dict(QWEN3_30B_A3B)
    assert (config.num_experts, config.num_experts_per_token, config.expert_intermediate_size) == (128, 8, 768)
    assert config.normalize_expert_weights and config.qk_norm and not config.attention_bias
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (32, 4, 128)
    assert config.head_dim * config.num_heads != config.hidden_size
    assert config.num_moe_layers == 48 and set(config.layer_types) == {"full_attention"}


def test_the_small_fixture_keeps_the_structure():
    full, small = (
        ModelConfig.from_hf_dict(QWEN3_30B_A3B),
        ModelConfig.from_model_dir(fixture_dir("qwen3_moe_30b_a3b_shape")),
    )
    same = ("num_experts", "num_experts_per_token", "normalize_expert_weights", "num_heads", "num_kv_heads", "head_dim")
    assert {name: getattr(small, name) for name in same} == {name: getattr(full, name) for name in same}
    assert small.head_dim * small.num_heads == 128 * small.hidden_size  # far wider than hidden, as 2x in the full
