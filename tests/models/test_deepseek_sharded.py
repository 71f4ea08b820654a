"""DeepSeek fixtures on 8 fake CPU devices (a subprocess: the device count is fixed when JAX starts): tensor
parallelism (each shard a whole copy of the one latent head, its slice of the query heads), data parallelism
with experts spread over every device (evenly and not), and experts re-placed while serving."""

import pytest

from tests.support.fake_devices import run_on_fake_devices

RUNS = ["deepseek_v3:2:1", "deepseek_v2_lite:2:2:ep", "deepseek_v3_kimi:1:4:ep"]


@pytest.fixture(scope="module")
def results():
    return run_on_fake_devices("tests.support.deepseek_multi_device_run", *RUNS)


@pytest.mark.parametrize("run", RUNS)
def test_sharded_outputs_equal_transformers(results, run):
    assert results["num_devices"] == 8
    outcome = results[run]
    assert all(outcome["greedy_equal"]), outcome["greedy_equal"]
    assert outcome["max_logprob_error"] < 1e-3 and outcome["compiles_after_warmup"] == 0
    assert outcome["attention_impl"] == "cpu"  # the per-shard path, not XLA's partitioner


def test_tensor_shards_each_hold_a_copy_of_the_latent(results):
    outcome = results["deepseek_v3:2:1"]
    assert outcome["kv_pages_spec"] == ["None", "None", "tensor", "None"]
    assert outcome["kv_pages_shape"][2:] == [2, 12]  # one copy per shard of half of 16 + 8 lanes
    assert outcome["kv_cache_bytes_per_token"] == 2 * 288  # both copies; each device holds one


@pytest.mark.parametrize(
    "run, devices, fraction", [("deepseek_v2_lite:2:2:ep", 4, 1 / 4), ("deepseek_v3_kimi:1:4:ep", 4, None)]
)
def test_experts_spread_and_move_without_recompiles(results, run, devices, fraction):
    outcome = results[run]
    assert outcome["kv_pages_spec"][0] == "data"
    per_device = [sum(device == d for device in outcome["expert_devices"][0]) for d in range(devices)]
    if fraction is not None:
        assert outcome["device0_expert_fraction"] == pytest.approx(fraction)
        assert per_device == [2, 2, 2, 2]
    else:  # 10 experts on 4 devices: two hold 3, two hold 2 (rows padded to 3 each)
        assert sorted(per_device) == [2, 2, 3, 3]
        assert outcome["device0_expert_fraction"] == pytest.approx(1 / 4)
    assert outcome["rebalanced"]["rebalances"] == 1 and all(outcome["rebalanced"]["greedy_equal"])
