"""Gemma 2/3 and Phi-3 under tensor (and data) parallelism on fake CPU devices, against transformers: the
soft-caps, per-layer windows and ropes, and Phi-3's split fused projections, sharded by the rules table."""

import pytest

from tests.support.fake_devices import run_on_fake_devices

# name:tp[:dp]. gemma3 has one KV head (copied per tensor shard); the 3 and 5 query heads of the LongRoPE
# fixtures do not split over 2 shards (XLA partitions the reference there); gemma2 also runs data-parallel
# with the Pallas kernels.
RUNS = {
    "gemma2:2": "cpu",
    "gemma3:2": "cpu",
    "gemma3_odd_untied:2": "cpu",
    "phi3:2": "cpu",
    "phi3_longrope_short:2": "reference",
    "phi3_longrope_long:2": "reference",
    "gemma2:2:2:-:pallas": "pallas",
}


@pytest.fixture(scope="module")
def results():
    return run_on_fake_devices("tests.support.multi_device_run", *RUNS, timeout=1200)


@pytest.mark.parametrize("run", list(RUNS))
def test_sharded_outputs_equal_transformers(results, run):
    outcome = results[run]
    assert "error" not in outcome, outcome
    assert all(outcome["greedy_equal"]), outcome["greedy_equal"]
    assert outcome["max_logprob_error"] < 1e-3
    assert outcome["compiles_after_warmup"] == 0
    assert outcome["attention_impl"] == RUNS[run]
