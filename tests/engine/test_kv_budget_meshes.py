"""The KV budget (kv_cache_memory_gib, by default 90% of a device's free memory) is one device's memory: on a
mesh each device holds only its KV heads' share of every page, so a tensor-parallel rank buys as many more
pages as devices split each page, and every device fills its budget as one device does (4 fake CPU devices,
in a subprocess). Sizing whole pages against one device's budget left (tp - 1) / tp of every device's KV
memory unused on a real GPU or TPU slice."""

import pytest

from tests.support.fake_devices import run_on_fake_devices


@pytest.fixture(scope="module")
def results():
    return run_on_fake_devices("tests.support.kv_budget_meshes_run", devices=4)


def test_one_device_fills_its_budget(results):
    one = results["one"]
    assert one["budget_bytes"] * 0.9 <= one["max_device_bytes"] <= one["budget_bytes"]


@pytest.mark.parametrize("mesh", ["tp2", "dp2_tp2"])
def test_every_device_of_a_mesh_fills_the_same_budget(results, mesh):
    got = results[mesh]
    assert got["budget_bytes"] * 0.9 <= got["max_device_bytes"] <= got["budget_bytes"]
    # the two tensor shards each hold half of every page: a rank holds twice the pages of one device
    assert got["pages_per_rank"] in (2 * results["one"]["pages_per_rank"] - 1, 2 * results["one"]["pages_per_rank"])


def test_the_budget_is_the_least_free_memory_of_the_engines_own_devices():
    """Not the first device of the machine: an engine on parallel.device_ids 4-7 beside one on 0-3 sizes its
    cache from its own devices, the fullest of them."""
    from types import SimpleNamespace

    from jaxserve.device.runner import kv_cache_bytes_available

    def device(limit, used):
        return SimpleNamespace(memory_stats=lambda: {"bytes_limit": limit, "bytes_in_use": used})

    mesh = SimpleNamespace(local_devices=[device(1000, 100), device(1000, 500), device(1000, 200)])
    assert kv_cache_bytes_available(None, mesh) == 450
    assert kv_cache_bytes_available(0.5, mesh) == 2**29  # as configured
    assert (
        kv_cache_bytes_available(None, SimpleNamespace(local_devices=[SimpleNamespace(memory_stats=lambda: None)]))
        == 2**30
    )
