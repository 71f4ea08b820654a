"""Two engines on disjoint fake CPU devices with different tensor-parallel meshes (a subprocess: the
device count is fixed when JAX starts): greedy outputs through the pair equal transformers'."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNS = ["2:0-1/1:4-4", "1:2-2/2:6-7"]


@pytest.fixture(scope="module")
def results():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.disagg.multi_device_handover", *RUNS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("run", RUNS)
def test_pair_on_disjoint_devices_equals_transformers(results, run):
    assert results["num_devices"] == 8
    result = results[run]
    assert all(result["greedy_equal"]), result
    prefill_devices, decode_devices = result["devices"]
    assert not set(prefill_devices) & set(decode_devices)
    assert result["num_handovers"] > 0 and result["bytes_moved"] > 0
    assert all(result["pages_free"])
