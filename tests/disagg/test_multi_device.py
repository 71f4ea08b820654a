"""Two engines on disjoint fake CPU devices with different tensor-parallel meshes (a subprocess: the
device count is fixed when JAX starts): greedy outputs through the pair equal transformers'."""

import pytest

from tests.support.fake_devices import run_on_fake_devices

RUNS = ["2:0-1/1:4-4", "1:2-2/2:6-7"]


@pytest.fixture(scope="module")
def results():
    return run_on_fake_devices("tests.disagg.multi_device_handover", *RUNS)


@pytest.mark.parametrize("run", RUNS)
def test_pair_on_disjoint_devices_equals_transformers(results, run):
    assert results["num_devices"] == 8
    result = results[run]
    assert all(result["greedy_equal"]), result
    prefill_devices, decode_devices = result["devices"]
    assert not set(prefill_devices) & set(decode_devices)
    assert result["num_handovers"] > 0 and result["bytes_moved"] > 0
    assert all(result["pages_free"])
