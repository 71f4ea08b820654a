"""Tensor parallelism on 8 fake CPU devices (a subprocess: the device count is fixed when JAX starts),
and the logical-axis rules."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec

from jaxserve.models import ModelConfig, build_model
from pallas_kernels.matmul import REFERENCE_PLAN
from sharding import param_shardings, partition_spec
from sharding.attention import attention_dispatch
from sharding.expert_placement import canonical_sharding
from sharding.moe import ExpertParallel, expert_dispatch, place_experts, store_experts
from sharding.rules import EXPERT_PARALLEL_RULES, LOGICAL_AXIS_RULES
from tests.support.fake_devices import run_on_fake_devices


@pytest.fixture(scope="module")
def multi_device_results(tmp_path_factory):
    runs = [
        "llama_gqa:2",
        "llama_gqa:4",
        "mixtral:2",
        "llama_mqa_odd:2",
        "mixtral_top1_tied:2",
        "qwen2:2",
        "qwen3:2",
        "llama_gqa:1:2",
        "mixtral:1:4:ep",
        "mixtral:2:2:ep",
        "mixtral_8x:1:8:ep",
        "mixtral:1:8:ep",
        "qwen3_moe:1:4:ep",
        "mixtral_6x:1:4:ep",
        "mixtral_6x:2:2:ep",
        "qwen3_moe_60x:1:8:ep",
        "llama_gqa:2:2:-:pallas",
        "qwen2_moe:2",
        "qwen2_moe:1:4:ep",
        "qwen2_moe:2:2:ep",
        f"--orbax={tmp_path_factory.mktemp('orbax') / 'checkpoint'}",
        f"--rebalance={tmp_path_factory.mktemp('rb')}",
        f"--uneven={tmp_path_factory.mktemp('uneven')}",
    ]
    return run_on_fake_devices("tests.support.multi_device_run", *runs)


@pytest.mark.parametrize(
    "run", ["llama_gqa:2", "llama_gqa:4", "mixtral:2", "llama_mqa_odd:2", "mixtral_top1_tied:2", "qwen2:2", "qwen3:2"]
)
def test_tensor_parallel_outputs_equal_transformers(multi_device_results, run):
    assert multi_device_results["num_devices"] == 8
    outcome = multi_device_results[run]
    assert all(outcome["greedy_equal"]), outcome["greedy_equal"]
    assert outcome["max_logprob_error"] < 1e-3
    assert outcome["compiles_after_warmup"] == 0
    # KV heads that divide over the tensor shards (or are copied until they do): the kernels run per shard;
    # 5 query heads do not split over 2 devices, so XLA partitions the reference there
    assert outcome["attention_impl"] == ("reference" if run == "llama_mqa_odd:2" else "cpu")


@pytest.mark.parametrize(
    "run",
    [
        "llama_gqa:1:2",
        "mixtral:1:4:ep",
        "mixtral:2:2:ep",
        "mixtral_8x:1:8:ep",
        "qwen3_moe:1:4:ep",
        "llama_gqa:2:2:-:pallas",
        "mixtral:1:8:ep",
        "mixtral_6x:1:4:ep",
        "mixtral_6x:2:2:ep",
        "qwen3_moe_60x:1:8:ep",
    ],
)
def test_data_and_expert_parallel_outputs_equal_transformers(multi_device_results, run):
    """Attention per data-parallel rank over its own pages (and per tensor shard over its KV heads, here
    also with the Pallas kernels); experts spread over every device, evenly or not (4 experts on 8 devices,
    6 on 4, 6 on data 2 x tensor 2, 60 on 8)."""
    outcome = multi_device_results[run]
    assert all(outcome["greedy_equal"]), outcome["greedy_equal"]
    assert outcome["max_logprob_error"] < 1e-3 and outcome["compiles_after_warmup"] == 0
    assert outcome["kv_pages_spec"][0] == "data", "each rank holds its own range of pages"
    # and with 2 tensor shards per rank, each holds one of the 2 KV heads of its pages
    assert outcome["kv_pages_spec"][2] == (
        "tensor" if run in ("mixtral:2:2:ep", "mixtral_6x:2:2:ep", "llama_gqa:2:2:-:pallas") else "None"
    )
    assert outcome["attention_impl"] == ("pallas" if run.endswith("pallas") else "cpu")


@pytest.mark.parametrize("run", ["qwen2_moe:2", "qwen2_moe:1:4:ep", "qwen2_moe:2:2:ep"])
def test_qwen2_moe_shared_expert_and_dense_layer_sharded_equal_transformers(multi_device_results, run):
    """Qwen2-MoE under TP 2, EP 4 and DP 2 x EP over TP 2: the shared expert splits over the tensor shards as
    a dense MLP does; its 5 routed experts spread 2, 1, 1, 1 in each of the two MoE layers (the dense middle
    layer has none, so load counts have two rows)."""
    outcome = multi_device_results[run]
    assert all(outcome["greedy_equal"]), outcome["greedy_equal"]
    assert outcome["max_logprob_error"] < 1e-3 and outcome["compiles_after_warmup"] == 0
    specs = outcome["param_specs"]
    tensor_split = run != "qwen2_moe:1:4:ep"
    assert specs["layers.0.mlp.shared_expert.gate_proj.kernel"] == ["None", "tensor" if tensor_split else "None"]
    assert specs["layers.1.mlp.down_proj.kernel"] == ["tensor" if tensor_split else "None", "None"]
    if run.endswith(":ep"):
        assert outcome["experts_per_device"] == [[2, 1, 1, 1]] * 2
        assert outcome["stored_expert_rows"] == 8
        assert specs["layers.0.mlp.gate_proj"][0] == "('data', 'tensor')"


def test_expert_parallel_placement(multi_device_results):
    ep8 = multi_device_results["mixtral_8x:1:8:ep"]
    assert ep8["device0_expert_fraction"] == pytest.approx(1 / 8)
    assert ep8["device0_attention_fraction"] == 1.0  # attention replicated on every rank
    assert ep8["param_specs"]["layers.0.mlp.gate_proj"][0] == "('data', 'tensor')"
    assert len(ep8["device_tokens"]) == 8 and sum(ep8["device_tokens"]) > 0 and ep8["device_imbalance"] >= 1.0


@pytest.mark.parametrize(
    "run, per_device, rows",
    [
        ("mixtral:1:8:ep", [1] * 4 + [0] * 4, 8),
        ("mixtral_6x:1:4:ep", [2, 2, 1, 1], 8),
        ("mixtral_6x:2:2:ep", [2, 2, 1, 1], 8),
        ("qwen3_moe_60x:1:8:ep", [8] * 4 + [7] * 4, 64),
    ],
)
def test_experts_that_do_not_divide_the_devices_are_spread_unevenly(multi_device_results, run, per_device, rows):
    """As vLLM: the first X mod D devices hold one more expert; the weights are padded to ceil(X / D) rows
    per device, so each device still holds 1/D of them, and only real experts are counted."""
    outcome = multi_device_results[run]
    assert all(layer == per_device for layer in outcome["experts_per_device"])
    assert outcome["stored_expert_rows"] == rows
    assert outcome["device0_expert_fraction"] == pytest.approx(1 / len(per_device))
    assert len(outcome["device_tokens"]) == len(per_device)
    if run == "mixtral:1:8:ep":  # devices that hold no expert receive no tokens
        assert outcome["device_tokens"][4:] == [0] * 4 and sum(outcome["device_tokens"]) > 0


def test_rebalancing_experts_moves_weights_without_recompiling(multi_device_results):
    """Placed by the routed load, at run time and at start-up from a profile: device loads even out,
    outputs stay transformers', nothing recompiles, and checkpoints keep the canonical expert order."""
    outcome = multi_device_results["rebalance"]
    assert all(outcome["before_equal"]) and all(outcome["after_equal"]) and outcome["compiles_after_warmup"] == 0
    assert sum(outcome["moved"]) == sum(outcome["before"])
    assert outcome["moved_imbalance"] < outcome["before_imbalance"]
    assert outcome["expert_devices_layer0"] != [0, 0, 1, 1, 2, 2, 3, 3]  # the contiguous start moved
    assert outcome["device0_holds_its_experts"]
    assert all(outcome["restored_equal"]) and all(outcome["start_up_equal"])
    # laid out where the profile puts them as they were read: no rebalance (no copy of the experts) at start-up
    assert outcome["start_up_devices_equal"] and outcome["start_up_rebalances"] == 0
    assert outcome["start_up_device0_holds_its_experts"]
    # every 3 steps, by the load routed since the last move: still transformers' tokens, still no compile
    assert all(outcome["periodic_equal"]) and outcome["periodic_compiles"] == 0
    assert 1 <= outcome["periodic_rebalances"] <= outcome["periodic_steps"] // 3


def test_params_and_pages_are_sharded_by_the_rules(multi_device_results):
    gqa2 = multi_device_results["llama_gqa:2"]["param_specs"]
    assert gqa2["layers.0.self_attn.q_proj.kernel"] == ["None", "tensor"]  # heads split
    assert gqa2["layers.0.self_attn.o_proj.kernel"] == ["tensor", "None"]  # its input side
    assert gqa2["layers.0.mlp.down_proj.kernel"] == ["tensor", "None"]
    assert gqa2["layers.0.input_layernorm.weight"] == ["None"]
    assert multi_device_results["llama_gqa:2"]["kv_pages_spec"][2] == "tensor"
    # 2 KV heads cannot be split 4 ways: their projections are replicated, the 4 query heads are not, and
    # the cache stores each KV head twice so that each device holds the one head its query head reads
    gqa4 = multi_device_results["llama_gqa:4"]
    assert gqa4["param_specs"]["layers.0.self_attn.k_proj.kernel"] == ["None", "None"]
    assert gqa4["param_specs"]["layers.0.self_attn.q_proj.kernel"] == ["None", "tensor"]
    assert gqa4["kv_pages_spec"] == ["None", "None", "tensor", "None"] and gqa4["kv_pages_heads"] == 4
    moe = multi_device_results["mixtral:2"]["param_specs"]
    assert moe["layers.0.mlp.gate_proj"] == ["None", "None", "tensor"]  # each expert's columns
    # 5 heads do not split over 2 devices
    assert multi_device_results["llama_mqa_odd:2"]["param_specs"]["layers.0.self_attn.q_proj.kernel"] == [
        "None",
        "None",
    ]
    qwen2 = multi_device_results["qwen2:2"]["param_specs"]  # q/k/v biases split with their heads; o_proj has none
    assert qwen2["layers.0.self_attn.k_proj.bias"] == ["tensor"] and "layers.0.self_attn.o_proj.bias" not in qwen2
    assert multi_device_results["qwen3:2"]["param_specs"]["layers.0.self_attn.q_norm.weight"] == ["None"]


def test_rebalancing_uneven_experts_saves_and_restores_onto_other_meshes(multi_device_results):
    """6 experts on data 2 x tensor 2: placed by load, the extra experts may go to any device but counts stay
    2, 2, 1, 1; outputs stay transformers' without a compile; the checkpoint holds exactly the 6 experts in
    canonical order and restores onto 1 device and onto 8 (six holding one each)."""
    outcome = multi_device_results["uneven"]
    assert all(outcome["before_equal"]) and all(outcome["after_equal"]) and outcome["compiles_after_warmup"] == 0
    assert all(layer == [2, 2, 1, 1] for layer in outcome["before_per_device"])
    assert all(sorted(layer) == [1, 1, 2, 2] for layer in outcome["moved_per_device"])
    assert outcome["moved_per_device"] != outcome["before_per_device"]  # the load chose other devices for the pairs
    assert sum(outcome["moved"]) == sum(outcome["before"]) and outcome["moved_imbalance"] < outcome["before_imbalance"]
    assert outcome["stored_rows"] == 8 and outcome["canonical_rows"] == 6
    assert outcome["device0_holds_its_experts_then_zeros"]
    assert all(outcome["restored_equal"]) and all(outcome["restored_ep8_equal"])
    assert all(layer == [1] * 6 + [0] * 2 for layer in outcome["restored_ep8_per_device"])
    assert outcome["start_up_devices_equal"] and all(outcome["start_up_equal"])
    assert outcome["start_up_rebalances"] == 0 and outcome["start_up_device0_holds_its_experts_then_zeros"]


def test_orbax_checkpoint_restores_onto_another_mesh(multi_device_results):
    assert all(multi_device_results["orbax:4"]["greedy_equal"])
    assert all(multi_device_results["orbax:1"]["greedy_equal"])
    assert multi_device_results["orbax:4"]["num_devices_holding_embedding"] == 4


def test_orbax_checkpoint_round_trip_on_one_device(tmp_path):
    from jaxserve import LLM
    from tests.support.fixtures import SMALL_ENGINE, fixture_dir
    from tests.support.hf_parity import check_against_hf

    LLM(fixture_dir("llama_bf16"), **SMALL_ENGINE).save_checkpoint(str(tmp_path / "saved"))
    restored = LLM(str(tmp_path / "saved"), **{**SMALL_ENGINE, "dtype": "auto"})
    assert restored.stats()["dtype"] == "float32"  # as it was saved, not as the original checkpoint
    check_against_hf(restored, "llama_bf16")
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        restored.save_checkpoint(str(tmp_path / "saved"))


def test_partition_spec_rules():
    mesh = SimpleNamespace(shape={"data": 1, "tensor": 2})
    assert partition_spec(("embed", "heads"), mesh, {"heads": 4}) == PartitionSpec(None, "tensor")
    assert partition_spec(("embed", "heads"), mesh, {"heads": 3}) == PartitionSpec(None, None)
    with pytest.raises(ValueError, match="both map to mesh axis 'tensor'"):
        partition_spec(("heads", "mlp"), mesh, {"heads": 4, "mlp": 8})
    with pytest.raises(ValueError, match="no sharding rule"):
        partition_spec(("nonsense",), mesh)
    assert set(LOGICAL_AXIS_RULES) >= {
        "batch",
        "sequence",
        "heads",
        "kv_heads",
        "head_dim",
        "embed",
        "mlp",
        "vocab",
        "expert",
    }


def abstract_params(config: ModelConfig, experts=None):
    model = nnx.eval_shape(
        lambda: build_model(
            config,
            "float32",
            write_and_attend=attention_dispatch("reference"),
            matmul=REFERENCE_PLAN,
            experts=experts or expert_dispatch(),
        )
    )
    return nnx.state(model, nnx.Param)


def test_every_param_declares_its_logical_axes():
    """Read back from the params themselves: Megatron splits by the rules, on a 2-way tensor mesh."""
    config = ModelConfig(
        model_type="qwen3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        attention_bias=True,
        attention_output_bias=True,
        qk_norm=True,
    )
    shardings = param_shardings(
        abstract_params(config), AbstractMesh((1, 2), ("data", "tensor")), config.logical_axis_sizes()
    )
    specs = {".".join(map(str, path)): sharding.spec for path, sharding in shardings.items()}
    assert specs["layers.0.self_attn.q_proj.kernel"] == PartitionSpec(None, "tensor")
    assert specs["layers.0.self_attn.q_proj.bias"] == PartitionSpec("tensor")
    assert specs["layers.0.self_attn.o_proj.kernel"] == PartitionSpec("tensor", None)
    assert specs["layers.0.self_attn.o_proj.bias"] == PartitionSpec(None)
    assert specs["layers.0.self_attn.q_norm.weight"] == PartitionSpec(None)
    assert specs["layers.0.mlp.down_proj.kernel"] == PartitionSpec("tensor", None)
    assert specs["embed_tokens.embedding"] == PartitionSpec("tensor", None)
    assert specs["lm_head.kernel"] == PartitionSpec(None, "tensor")
    assert param_shardings(abstract_params(config), None, config.logical_axis_sizes()) == {}


def test_expert_columns_that_do_not_split_are_replicated():
    """A Mixtral whose expert MLP width (90) does not divide over 4 tensor shards (found by tools/fuzz_vs_hf.py)."""
    mesh = AbstractMesh((1, 4), ("data", "tensor"))
    for width, expected in ((90, PartitionSpec(None, None, None)), (96, PartitionSpec(None, "tensor", None))):
        config = ModelConfig(
            model_type="mixtral",
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=width,
            num_layers=1,
            num_heads=8,
            num_kv_heads=4,
            head_dim=8,
            num_experts=3,
            num_experts_per_token=1,
        )
        shardings = param_shardings(abstract_params(config), mesh, config.logical_axis_sizes())
        assert shardings[("layers", 0, "mlp", "down_proj")].spec == expected
        assert shardings[("layers", 0, "mlp", "gate_proj")].spec == PartitionSpec(None, None, expected[1])


def test_experts_that_do_not_divide_are_placed_floor_or_ceil_per_device():
    device_of, slot_of, order = place_experts(None, 6, 4)  # the first 6 mod 4 devices hold one more
    assert device_of.tolist() == [0, 0, 1, 1, 2, 3] and slot_of.tolist() == [0, 1, 0, 1, 0, 0]
    assert order.tolist() == [0, 1, 2, 3, 4, -1, 5, -1]  # 2 rows per device, padding after each device's experts
    device_of, _, order = place_experts(None, 3, 8)  # fewer experts than devices: five hold none
    assert device_of.tolist() == [0, 1, 2] and len(order) == 8 and (order < 0).sum() == 5
    load = np.asarray([100.0, 90.0, 1.0, 1.0, 1.0, 1.0])  # two hot experts: each alone on a device
    device_of, slot_of, order = place_experts(load, 6, 4)
    counts = np.bincount(device_of, minlength=4)
    assert sorted(counts) == [1, 1, 2, 2] and counts[device_of[0]] == counts[device_of[1]] == 1
    rng = np.random.default_rng(0)
    for num_experts, num_devices in ((60, 8), (16, 3), (7, 4), (8, 4)):
        for load in (None, rng.random(num_experts)):
            device_of, slot_of, order = (np.asarray(a) for a in place_experts(load, num_experts, num_devices))
            floor, extra = divmod(num_experts, num_devices)
            assert sorted(np.bincount(device_of, minlength=num_devices), reverse=True) == [floor + 1] * extra + [
                floor
            ] * (num_devices - extra)
            rows_per_device = -(-num_experts // num_devices)
            assert len(order) == num_devices * rows_per_device
            assert (order[device_of * rows_per_device + slot_of] == np.arange(num_experts)).all()
            assert sorted(order[order >= 0]) == list(range(num_experts))
    stored = store_experts(np.arange(6.0)[:, None] + 1, place_experts(None, 6, 4)[2])
    assert stored[:, 0].tolist() == [1, 2, 3, 4, 5, 0, 6, 0]


def test_uneven_expert_weights_are_padded_and_split_over_every_device():
    """6 experts on data 2 x tensor 2: 8 stored rows, 2 per device; read and saved as 6 rows split on another axis."""
    mesh = AbstractMesh((2, 2), ("data", "tensor"))
    config = ModelConfig(
        model_type="mixtral",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        num_experts=6,
        num_experts_per_token=2,
    )
    params = abstract_params(config, ExpertParallel(mesh))
    gate = params["layers"][0]["mlp"]["gate_proj"]
    assert gate.get_value().shape == (8, 32, 48)
    shardings = param_shardings(params, mesh, config.logical_axis_sizes(), EXPERT_PARALLEL_RULES)
    assert shardings[("layers", 0, "mlp", "gate_proj")].spec == PartitionSpec(("data", "tensor"), None, None)
    assert canonical_sharding((6, 32, 48), mesh).spec == PartitionSpec(None, None, ("data", "tensor"))
    assert canonical_sharding((6, 30, 30), mesh).spec == PartitionSpec()  # nothing divides: replicated


@pytest.fixture(scope="module")
def expert_parallel_results():
    return run_on_fake_devices("tests.support.ep_run", timeout=600)


@pytest.mark.parametrize(
    "run",
    [
        "random:2",
        "random:8",
        "skewed:2",
        "skewed:8",
        "random:3:16",
        "random:4:6",
        "random:8:60",
        "random:8:6",
        "skewed:4:6",
    ],
)
def test_expert_parallel_layer_equals_dense_math(expert_parallel_results, run):
    """All-to-all dispatch and combine over 2 to 8 devices, 16 experts or as many as named (16 on 3, 6 on 4,
    60 on 8 and 6 on 8 do not divide), with contiguous and rebalanced placements; and the grouped matmuls
    of one device, which share their expert math."""
    assert expert_parallel_results[run]["local_max_error"] < 1e-4
    devices, num_experts = (int(n) for n in (run.split(":")[1:] + ["16"])[:2])
    floor, extra = divmod(num_experts, devices)
    for placement in ("blocks", "balanced"):
        outcome = expert_parallel_results[run][placement]
        assert outcome["max_error"] < 1e-4
        # floor or ceil experts per device; contiguous blocks give the first X mod D devices the extra one
        assert sorted(outcome["experts_per_device"], reverse=True) == [floor + 1] * extra + [floor] * (devices - extra)
        if placement == "blocks":
            assert outcome["experts_per_device"] == [floor + 1] * extra + [floor] * (devices - extra)
        assert outcome["stored_rows"] == devices * -(-num_experts // devices) and outcome["padding_rows_zero"]
        assert outcome["devices_holding_expert_weights"] == devices  # each holds 1/devices of the rows


def test_skewed_routing_leaves_experts_empty_and_rebalancing_evens_devices(expert_parallel_results):
    skewed = expert_parallel_results["skewed:8"]
    assert skewed["empty_experts"] == 14
    assert skewed["blocks"]["imbalance"] == 8.0  # both hot experts on one device
    assert skewed["balanced"]["imbalance"] == 4.0  # the best two hot experts allow on 8 devices
    random = expert_parallel_results["random:8"]
    assert random["balanced"]["imbalance"] <= random["blocks"]["imbalance"]
    # 6 on 4: the two hot experts first shared a device; by load each sits on one of the devices holding one
    uneven = expert_parallel_results["skewed:4:6"]
    assert uneven["blocks"]["imbalance"] == 4.0 and uneven["balanced"]["imbalance"] == 2.0
    assert (
        expert_parallel_results["random:8:60"]["balanced"]["imbalance"]
        < expert_parallel_results["random:8:60"]["blocks"]["imbalance"]
    )
    assert "do not divide" in expert_parallel_results["unpadded_error"]  # weights must come padded


def test_expert_load_profiles_are_validated(tmp_path, llama_llm):
    from jaxserve import LLM
    from sharding.expert_placement import read_load_profile
    from tests.support.fixtures import SMALL_ENGINE, fixture_dir

    assert read_load_profile([1, 2, 3, 4], 2, 4).tolist() == [[1, 2, 3, 4], [1, 2, 3, 4]]  # one row: every layer
    (tmp_path / "stats.json").write_text(json.dumps({"expert_tokens": [[0, 5], [7, 1]], "num_steps": 3}))
    assert read_load_profile(str(tmp_path / "stats.json"), 2, 2).tolist() == [[0, 5], [7, 1]]
    for bad, message in (
        ([[1, 2]], r"shape \(1, 2\)"),
        ([-1, 2], ">= 0"),
        ([[1, "x"]], "must be numbers"),
        (str(tmp_path / "missing.json"), "cannot read"),
        ({"tokens": [1, 2]}, "expert_tokens"),
    ):
        with pytest.raises(ValueError, match=message):
            if isinstance(bad, dict):
                (tmp_path / "bad.json").write_text(json.dumps(bad))
                bad = str(tmp_path / "bad.json")
            read_load_profile(bad, 2, 2)
    with pytest.raises(ValueError, match="expert_load_profile places experts on devices: it needs"):
        LLM(fixture_dir("mixtral"), **SMALL_ENGINE, expert_load_profile=str(tmp_path / "stats.json"))
    with pytest.raises(ValueError, match="expert_rebalance_interval places experts on devices"):
        LLM(fixture_dir("mixtral"), **SMALL_ENGINE, expert_rebalance_interval=100)
    with pytest.raises(ValueError, match="expert_rebalance_interval must be >= 0"):
        LLM(fixture_dir("mixtral"), **SMALL_ENGINE, expert_rebalance_interval=-1)
    with pytest.raises(ValueError, match="rebalance_experts needs"):
        llama_llm.rebalance_experts([1.0])
