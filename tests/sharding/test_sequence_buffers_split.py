"""The sequence buffers (device/sequence_buffers.py: [rows, V] output counts, prompt bitmasks, newest tokens)
split by data-parallel rank as the batch rows are, on fake CPU devices: a device holds only its rank's entries,
and penalised greedy tokens, whose counts and bitmasks are read and reset there, equal one device's."""

import pytest

from tests.support.fake_devices import run_on_fake_devices

MESHES = ("2:2", "4:1")  # data:tensor


@pytest.fixture(scope="module")
def results():
    return run_on_fake_devices("tests.support.sequence_buffers_run", *MESHES, devices=4)


@pytest.mark.parametrize("mesh", MESHES)
def test_each_device_holds_only_its_ranks_entries(results, mesh):
    outcome = results[mesh]
    assert "error" not in outcome, outcome
    ranks = int(mesh.split(":")[0])
    for name, array in outcome["buffers"].items():
        assert array["spec"][:1] == ["data"], (name, array)
        assert array["most"] * ranks == array["whole"], (name, array)


@pytest.mark.parametrize("mesh", MESHES)
def test_penalised_greedy_tokens_equal_one_device(results, mesh):
    outcome = results[mesh]
    assert "error" not in outcome, outcome
    assert outcome["rounds"] == results["one_device"]
    assert outcome["compiles_after_warmup"] == 0
