"""Gemma 2/3 and Phi-3 under tensor (and data) parallelism on fake CPU devices, against transformers: the
soft-caps, per-layer windows and ropes, and Phi-3's split fused projections, sharded by the rules table."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.support.multi_device_run", *RUNS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("run", list(RUNS))
def test_sharded_outputs_equal_transformers(results, run):
    outcome = results[run]
    assert "error" not in outcome, outcome
    assert all(outcome["greedy_equal"]), outcome["greedy_equal"]
    assert outcome["max_logprob_error"] < 1e-3
    assert outcome["compiles_after_warmup"] == 0
    assert outcome["attention_impl"] == RUNS[run]
