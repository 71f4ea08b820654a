"""DeepSeek-V2 / V2-Lite / V3 and Kimi-K2 configs as the Hub writes them, and the tiny transformers-written
fixtures (tests/support/make_deepseek_fixtures.py) served from the latent cache: parity with the Pallas latent
kernel, KV bytes per token, the prefix cache, zero compiles after warm-up. Greedy and logprob parity of every
fixture on one device with the default kernels is test_models_vs_hf.py's (it runs each fixture directory)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.models import ModelConfig
from jaxserve.models.grouped_routing import GroupedRouting
from jaxserve.models.mla import softmax_scale
from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir
from tests.support.hf_parity import check_against_hf

DEEPSEEK_V2_LITE = dict(
    model_type="deepseek_v2",
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    topk_method="greedy",
    n_group=1,
    topk_group=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    scoring_func="softmax",
    rope_theta=10000,
    rope_scaling=dict(
        type="yarn",
        factor=40,
        beta_fast=32,
        beta_slow=1,
        mscale=0.707,
        mscale_all_dim=0.707,
        original_max_position_embeddings=4096,
    ),
    max_position_embeddings=163840,
)
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    moe_layer_freq=1,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_group=8,
    topk_group=4,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rope_theta=10000,
    rope_scaling=dict(
        type="yarn",
        factor=40,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
        original_max_position_embeddings=4096,
    ),
    max_position_embeddings=163840,
)
KIMI_K2 = {
    **DEEPSEEK_V3,
    "model_type": "kimi_k2",
    "n_routed_experts": 384,
    "num_attention_heads": 64,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.827,
    "rope_scaling": dict(DEEPSEEK_V3["rope_scaling"], factor=32.0),
}


def test_v2_lite_config():
    config = ModelConfig.from_hf_dict(DEEPSEEK_V2_LITE)
    assert config.is_latent_attention and config.q_lora_rank == 0 and config.num_kv_heads == 1
    assert (config.head_dim, config.rotary_dim, config.v_head_dim) == (192, 64, 128)
    assert config.kv_cache_head_dim == 288  # (512 + 64) / 2 lanes per pool
    assert (config.num_experts, config.num_experts_per_token, config.expert_intermediate_size) == (64, 6, 1408)
    assert config.shared_expert_intermediate_size == 2 * 1408 and not config.shared_expert_gated
    assert config.dense_layers == (0,) and config.num_moe_layers == 26
    assert (config.expert_scoring, config.expert_group_scoring) == ("softmax", "none")
    assert not config.normalize_expert_weights and config.rope_interleave
    assert config.rope_scaling.rope_type == "yarn" and config.rope_scaling.mscale_all_dim == pytest.approx(0.707)
    mscale = 0.1 * 0.707 * math.log(40) + 1.0
    assert softmax_scale(config) == pytest.approx(192**-0.5 * mscale**2)


def test_v3_and_kimi_k2_configs():
    v3 = ModelConfig.from_hf_dict(DEEPSEEK_V3)
    assert (v3.q_lora_rank, v3.kv_lora_rank, v3.num_expert_groups, v3.num_expert_groups_kept) == (1536, 512, 8, 4)
    assert (v3.expert_scoring, v3.expert_group_scoring, v3.routed_scaling_factor) == ("sigmoid", "top2_sum", 2.5)
    assert v3.expert_score_correction_bias and v3.normalize_expert_weights
    assert v3.dense_layers == (0, 1, 2) and v3.shared_expert_intermediate_size == 2048
    kimi = ModelConfig.from_hf_dict(KIMI_K2)
    assert (kimi.num_experts, kimi.num_expert_groups, kimi.dense_layers) == (384, 1, (0,))
    assert kimi.routed_scaling_factor == pytest.approx(2.827)


def test_moe_layer_freq_keeps_dense_layers_between():
    config = ModelConfig.from_hf_dict({**DEEPSEEK_V2_LITE, "num_hidden_layers": 6, "moe_layer_freq": 2})
    assert config.dense_layers == (0, 1, 3, 5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(n_group=5, topk_group=2, topk_method="group_limited_greedy"), "split evenly"),
        (dict(topk_method="noaux_tc"), "unsupported topk_method"),
        (dict(qk_rope_head_dim=63), "even"),
        (dict(n_group=8, topk_group=1, topk_method="group_limited_greedy", num_experts_per_tok=9), "exceeds"),
        (dict(kv_lora_rank=0), "kv_lora_rank"),
    ],
)
def test_bad_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict({**DEEPSEEK_V2_LITE, **overrides})


def test_grouped_routing_keeps_the_best_groups_and_weighs_without_the_bias():
    # 2 tokens, 8 experts in 4 groups of 2, top 2 from the best 2 groups ranked by their two best scores
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8)), jnp.float32) * 3
    bias = jnp.asarray([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 0.0], jnp.float32)
    routing = GroupedRouting(
        top_k=2,
        scoring="sigmoid",
        group_scoring="top2_sum",
        num_groups=4,
        num_groups_kept=2,
        normalize=True,
        scaling_factor=2.5,
    )
    weights, ids = routing(logits, bias)
    scores = 1 / (1 + np.exp(-np.asarray(logits)))
    choice = scores + np.asarray(bias)
    for token in range(2):
        groups = choice[token].reshape(4, 2).sum(-1)  # two best of a group of two: both
        kept = np.argsort(-groups)[:2]
        allowed = [e for e in range(8) if e // 2 in kept]
        best = sorted(allowed, key=lambda e: -choice[token, e])[:2]
        assert sorted(np.asarray(ids[token]).tolist()) == sorted(best)
        assert 6 in best  # the bias chose it...
        chosen = scores[token, np.asarray(ids[token])]
        np.testing.assert_allclose(np.asarray(weights[token]), 2.5 * chosen / chosen.sum(), rtol=1e-6)  # ...not weighed


@pytest.fixture(scope="module")
def v3_pallas():
    return LLM(fixture_dir("deepseek_v3"), **{**SMALL_ENGINE, "attention_impl": "pallas", "page_size": 8})


def test_pallas_latent_kernel_matches_transformers(v3_pallas):
    assert v3_pallas.stats()["attention_impl"] == "pallas"
    check_against_hf(v3_pallas, "deepseek_v3")
    assert v3_pallas.stats()["num_compiles_after_warmup"] == 0


def test_cache_holds_the_latent_not_full_kv(v3_pallas):
    config = ModelConfig.from_model_dir(fixture_dir("deepseek_v3"))
    latent = config.num_layers * (config.kv_lora_rank + config.qk_rope_head_dim) * 4  # float32
    full = config.num_layers * config.num_heads * (config.head_dim + config.v_head_dim) * 4
    stats = v3_pallas.stats()
    assert stats["kv_cache_bytes_per_token"] == latent == 3 * 24 * 4
    assert full / latent > 4
    assert stats["kv_cache_device_bytes"] == stats["kv_cache_bytes_per_token"] * 8 * (stats["kv_pages_total"] + 1)


def test_prefix_cache_reuses_latent_pages(v3_pallas):
    prompt = expected("deepseek_v3")["prompts"][-1]  # 70 tokens: 8 full pages of 8
    params = SamplingParams(max_tokens=24, temperature=0.0)
    first, again = (v3_pallas.generate([prompt["token_ids"]], params)[0] for _ in range(2))
    assert again.num_cached_tokens >= 64
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == prompt["greedy_token_ids"]
    assert v3_pallas.stats()["num_compiles_after_warmup"] == 0


def test_latent_pages_hand_over_from_prefill_to_decode():
    """Disaggregation moves the latent halves as any model's pages (device/page_copies.py stacks key and value
    pools alike; the host tier uses the same copies): a prefill engine and a decode engine in one process give
    transformers' greedy tokens, compiling nothing while serving."""
    from jaxserve.disagg.handover import DisaggregatedPair

    engines = [LLM(fixture_dir("deepseek_v2_lite"), role=role, **SMALL_ENGINE).engine for role in ("prefill", "decode")]
    pair = DisaggregatedPair(*engines)
    prompts = expected("deepseek_v2_lite")["prompts"]
    outputs = pair.generate([p["token_ids"] for p in prompts], SamplingParams(max_tokens=12, temperature=0.0))
    assert [o.outputs[0].token_ids for o in outputs] == [p["greedy_token_ids"][:12] for p in prompts]
    assert pair.stats.num_handovers == sum(len(o.outputs[0].token_ids) > 1 for o in outputs) > 0
    assert [engine.runner.num_compiles_after_warmup for engine in engines] == [0, 0]
