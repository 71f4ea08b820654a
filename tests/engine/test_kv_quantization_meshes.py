"""An int8 KV cache under tensor and data parallelism (4 fake CPU devices, in a subprocess): the scale pools
split as their values, and greedy outputs equal one device's."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def results():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.support.kv_quantization_meshes_run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mesh,spec", [("tp2", ["None", "None", "tensor"]), ("tp4", ["None", "None", "tensor"])])
def test_tensor_parallel_scales_split_with_their_heads(results, mesh, spec):
    assert results[mesh]["scales_spec"] == spec
    assert results[mesh]["tokens"] == results["one"]["tokens"]
    assert results[mesh]["compiles_after_warmup"] == 0


def test_data_parallel_ranks_hold_their_own_scales(results):
    assert results["dp2"]["scales_spec"][0] == "data"
    assert results["dp2"]["tokens"] == results["one"]["tokens"]
    assert results["dp2"]["compiles_after_warmup"] == 0
