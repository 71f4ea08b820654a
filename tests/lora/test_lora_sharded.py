"""LoRA under tensor (and data x tensor) parallelism on fake CPU devices: the adapter slots placed by the
rules table (A's in axis and B's out axis split as their base kernel's), each adapter's greedy tokens equal
PEFT's in a mixed batch, and reloading compiles nothing."""

import pytest

from tests.support.fake_devices import run_on_fake_devices

MESHES = ("2:2",)  # data:tensor: tensor-parallel adapters, and ranks' tokens laid end to end
BFLOAT16 = "1:4:bfloat16"  # data:tensor:dtype: only what an adapter's load hands the devices


@pytest.fixture(scope="module")
def results():
    return run_on_fake_devices("tests.lora.tp_run", *MESHES, BFLOAT16, devices=4)


@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_adapters_equal_peft(results, mesh):
    outcome = results[mesh]
    assert "error" not in outcome, outcome
    assert all(outcome["greedy_equal"]) and outcome["reloaded_equal"], outcome["greedy_equal"]
    assert outcome["compiles_after_warmup"] == 0


@pytest.mark.parametrize("mesh", MESHES)
def test_slots_are_split_as_their_base_kernels(results, mesh):
    specs = results[mesh]["specs"]
    assert specs["layers.0.self_attn.q_proj.a"] == [None, None, None]  # [embed, slots, rank]: replicated
    assert specs["layers.0.self_attn.q_proj.b"] == [None, None, "tensor"]  # [slots, rank, heads]
    assert specs["layers.0.self_attn.o_proj.a"] == ["tensor", None, None]  # [heads, slots, rank]
    assert specs["layers.0.self_attn.o_proj.b"] == [None, None, None]
    assert specs["layers.1.mlp.down_proj.a"] == ["tensor", None, None]


@pytest.mark.parametrize("mesh", (*MESHES, BFLOAT16))
def test_an_adapter_load_sends_each_device_only_its_shard_in_the_slots_dtype(results, mesh):
    """Not the whole adapter to every device in float32: each new slot value arrives split as its slot
    array, in its dtype (bfloat16 slots: half the bytes of float32)."""
    values = results[mesh]["load"]["values"]
    assert values and "error" not in results[mesh], results[mesh]
    assert all(value["dtype"] == value["slot_dtype"] for value in values), values
    assert all(value["most"] == value["share"] for value in values), values
