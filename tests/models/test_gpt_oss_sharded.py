"""GPT-OSS against transformers on 8 fake CPU devices (a subprocess: the device count is fixed when JAX starts):
sinks split with their query heads under tensor parallelism; expert biases stored, split and moved row by row
with their experts under expert parallelism (evenly and not), before and after rebalancing."""

import pytest

from tests.support.fake_devices import run_on_fake_devices

# TP 2; data 2 x tensor 2 with the experts over all 4; Qwen3-30B-A3B's shape with its 128 experts over 8 devices
RUNS = ["gpt_oss:2:1", "gpt_oss_6x:2:2:ep", "qwen3_moe_30b_a3b_shape:1:8:ep"]
GPT_OSS_RUNS = RUNS[:2]


@pytest.fixture(scope="module")
def sharded_results():
    return run_on_fake_devices("tests.support.gpt_oss_sharded_run", *RUNS)


@pytest.mark.parametrize("run", RUNS)
def test_sharded_gpt_oss_equals_transformers(sharded_results, run):
    outcome = sharded_results[run]
    assert all(outcome["greedy_equal"]), outcome["greedy_equal"]
    assert outcome["max_logprob_error"] < 1e-3
    assert outcome["compiles_after_warmup"] == 0


def test_sinks_split_with_the_query_heads(sharded_results):
    for run in GPT_OSS_RUNS:
        specs = sharded_results[run]["param_specs"]
        assert specs["layers.0.self_attn.sinks"] == ["tensor"]
        assert specs["layers.0.self_attn.q_proj.kernel"] == ["None", "tensor"]
    assert sharded_results["gpt_oss:2:1"]["attention_impl"] == "cpu"  # the C++ kernel per shard, with sinks


def test_expert_biases_live_and_move_with_their_experts(sharded_results):
    # 6 experts on 4 devices: 2, 2, 1, 1 (padded to 8 stored rows, split over every device); rebalancing by
    # the routed load moves rows, biases with their weights, and the outputs stay transformers'
    uneven = sharded_results["gpt_oss_6x:2:2:ep"]
    assert uneven["param_specs"]["layers.0.mlp.gate_proj_bias"] == ["('data', 'tensor')", "None"]
    assert uneven["param_specs"]["layers.0.mlp.down_proj_bias"] == ["('data', 'tensor')", "None"]
    assert all(sorted(counts, reverse=True) == [2, 2, 1, 1] for counts in uneven["experts_per_device"])
    assert uneven["same_bias_rows"] and uneven["bias_rows_moved"]
    assert all(uneven["after_rebalance"]["greedy_equal"])
    assert uneven["after_rebalance"]["max_logprob_error"] < 1e-3


def test_qwen3_30b_a3b_shape_spreads_128_experts_over_8_devices(sharded_results):
    outcome = sharded_results["qwen3_moe_30b_a3b_shape:1:8:ep"]
    assert all(counts == [16] * 8 for counts in outcome["experts_per_device"])
    assert outcome["param_specs"]["layers.0.mlp.gate_proj"][0] == "('data', 'tensor')"
    assert all(outcome["after_rebalance"]["greedy_equal"])
