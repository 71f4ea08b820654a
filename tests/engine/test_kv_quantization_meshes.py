"""An int8 KV cache under tensor and data parallelism (4 fake CPU devices, in a subprocess): the scale pools
split as their values, and greedy outputs equal one device's."""

import pytest

from tests.support.fake_devices import run_on_fake_devices


@pytest.fixture(scope="module")
def results():
    return run_on_fake_devices("tests.support.kv_quantization_meshes_run", devices=4)


@pytest.mark.parametrize("mesh,spec", [("tp2", ["None", "None", "tensor"]), ("tp4", ["None", "None", "tensor"])])
def test_tensor_parallel_scales_split_with_their_heads(results, mesh, spec):
    assert results[mesh]["scales_spec"] == spec
    assert results[mesh]["tokens"] == results["one"]["tokens"]
    assert results[mesh]["compiles_after_warmup"] == 0


def test_data_parallel_ranks_hold_their_own_scales(results):
    assert results["dp2"]["scales_spec"][0] == "data"
    assert results["dp2"]["tokens"] == results["one"]["tokens"]
    assert results["dp2"]["compiles_after_warmup"] == 0


def test_bfloat16_int8_weights_serve_on_a_tensor_parallel_mesh(results):
    outputs = results["tp2_bf16_int8_weights"]
    assert [len(tokens) for tokens in outputs["tokens"]] == [12] * len(results["one"]["tokens"])
    assert outputs["compiles_after_warmup"] == 0
