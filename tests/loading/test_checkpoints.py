"""Reading Hugging Face model directories: configs of every shape, and clear errors for broken ones."""

import json
import os
import shutil

import pytest

from jaxserve import LLM, ModelConfig
from jaxserve.config import EngineConfig
from tests.support.fixtures import SMALL_ENGINE, fixture_dir


def copy_fixture(tmp_path, name="llama_gqa"):
    target = tmp_path / name
    shutil.copytree(fixture_dir(name), target)
    return target


def edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_unknown_model_type(tmp_path):
    directory = copy_fixture(tmp_path)
    edit_config(directory, model_type="gpt2")
    with pytest.raises(ValueError, match="unknown model type 'gpt2'.*supported: llama, mistral, mixtral, qwen2, qwen3"):
        LLM(str(directory), **SMALL_ENGINE)


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"), **SMALL_ENGINE)
    directory = copy_fixture(tmp_path)
    os.remove(directory / "model.safetensors")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(directory), **SMALL_ENGINE)
    os.remove(directory / "config.json")
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(directory), **SMALL_ENGINE)


def test_malformed_files(tmp_path):
    directory = copy_fixture(tmp_path)
    (directory / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ValueError, match="malformed checkpoint file"):
        LLM(str(directory), **SMALL_ENGINE)
    (directory / "config.json").write_text("{ nope")
    with pytest.raises(ValueError, match="malformed config.json"):
        LLM(str(directory), **SMALL_ENGINE)


def test_checkpoint_that_does_not_match_its_config(tmp_path):
    directory = copy_fixture(tmp_path)
    edit_config(directory, num_hidden_layers=3)
    with pytest.raises(ValueError, match="missing tensor 'model.layers.2"):
        LLM(str(directory), **SMALL_ENGINE)
    edit_config(directory, num_hidden_layers=2, intermediate_size=100)
    with pytest.raises(ValueError, match="shape"):
        LLM(str(directory), **SMALL_ENGINE)


def test_sharded_checkpoint_with_index(tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = copy_fixture(tmp_path)
    tensors = load_file(str(directory / "model.safetensors"))
    os.remove(directory / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for filename, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(directory / filename))
        weight_map.update({k: filename for k in keys})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    from tests.support.hf_parity import check_against_hf

    check_against_hf(LLM(str(directory), **SMALL_ENGINE), "llama_gqa")


def test_config_variants_are_read():
    legacy = ModelConfig.from_hf_dict(
        dict(
            model_type="llama",
            vocab_size=10,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            rope_theta=123.0,
            rope_scaling=dict(type="linear", factor=2.0),
            torch_dtype="bfloat16",
            eos_token_id=[2, 5],
        )
    )
    assert legacy.num_kv_heads == 2 and legacy.head_dim == 4 and legacy.rope_theta == 123.0
    assert legacy.rope_scaling.rope_type == "linear" and legacy.rope_scaling.factor == 2.0
    assert legacy.checkpoint_dtype == "bfloat16" and legacy.eos_token_ids == (2, 5)
    modern = ModelConfig.from_hf_dict(
        dict(
            model_type="mixtral",
            vocab_size=10,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=6,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
            dtype="float16",
        )
    )
    assert modern.head_dim == 6 and modern.rope_theta == 1e6 and modern.num_experts == 4
    assert modern.checkpoint_dtype == "float16"
    with pytest.raises(ValueError, match="rope scaling type"):
        ModelConfig.from_hf_dict(
            dict(
                legacy_dict := dict(
                    model_type="llama",
                    vocab_size=10,
                    hidden_size=8,
                    intermediate_size=16,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                ),
                rope_scaling=dict(type="dynamic", factor=2.0),
            )
        )
    with pytest.raises(ValueError, match="multiple of"):
        ModelConfig.from_hf_dict(dict(legacy_dict, num_key_value_heads=3, num_attention_heads=4))


def test_qwen_configs_are_read_as_transformers_reads_them():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=4, num_attention_heads=2)
    # Hub Qwen2 configs carry a window that use_sliding_window (default false) leaves off
    qwen2 = ModelConfig.from_hf_dict(dict(base, model_type="qwen2", sliding_window=32, max_window_layers=2))
    assert qwen2.sliding_window is None and qwen2.layer_types == ("full_attention",) * 4
    assert (qwen2.attention_bias, qwen2.attention_output_bias, qwen2.qk_norm) == (True, False, False)
    sliding = ModelConfig.from_hf_dict(
        dict(base, model_type="qwen2", sliding_window=32, max_window_layers=2, use_sliding_window=True)
    )
    assert [sliding.layer_sliding_window(layer) for layer in range(4)] == [None, None, 32, 32]
    listed = ModelConfig.from_hf_dict(
        dict(
            base,
            model_type="qwen3",
            sliding_window=8,
            use_sliding_window=True,
            layer_types=["sliding_attention", "full_attention"] * 2,
        )
    )
    assert [listed.layer_sliding_window(layer) for layer in range(4)] == [8, None, 8, None] and listed.qk_norm
    assert not listed.attention_bias and not listed.attention_output_bias
    moe = ModelConfig.from_hf_dict(
        dict(
            base,
            model_type="qwen3_moe",
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=4,
            norm_topk_prob=True,
        )
    )
    assert (moe.num_experts, moe.expert_intermediate_size, moe.normalize_expert_weights) == (6, 4, True)
    assert moe.logical_axis_sizes()["expert_mlp"] == 4 and moe.logical_axis_sizes()["mlp"] == 16
    with pytest.raises(ValueError, match="dense MLP layers between the MoE layers"):
        ModelConfig.from_hf_dict(dict(base, model_type="qwen3_moe", mlp_only_layers=[1]))
    with pytest.raises(ValueError, match="layer_types must be 4 of"):
        ModelConfig.from_hf_dict(dict(base, model_type="qwen3", layer_types=["full_attention"]))


def test_every_supported_model_type_has_checkpoint_names():
    from jaxserve.models import CHECKPOINT_NAMES
    from jaxserve.models.config import SUPPORTED_MODEL_TYPES

    assert set(CHECKPOINT_NAMES) == set(SUPPORTED_MODEL_TYPES)


def test_engine_config_validation():
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig.from_options(dtype="int8")
    with pytest.raises(ValueError, match="multiple of prefill_query_block"):
        EngineConfig.from_options(max_num_batched_tokens=100, prefill_query_block=16)
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig.from_options(page_size=0)


@pytest.mark.parametrize(
    "name, router, per_expert, expert_names",
    [
        ("mixtral", "block_sparse_moe.gate", "block_sparse_moe.experts.{}.{}.weight", ("w1", "w3", "w2")),
        ("qwen3_moe", "mlp.gate", "mlp.experts.{}.{}.weight", ("gate_proj", "up_proj", "down_proj")),
    ],
)
def test_moe_with_fused_expert_tensors(tmp_path, name, router, per_expert, expert_names):
    """transformers >= 5 names experts mlp.experts.gate_up_proj [X, 2F, E] / down_proj [X, E, F]."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    directory = copy_fixture(tmp_path, name)
    tensors = load_file(str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    fused = {k: v for k, v in tensors.items() if ".experts." not in k and router not in k}
    gate, up, down = expert_names
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        expert = (prefix + per_expert).format
        experts = range(config["num_local_experts"])
        fused[prefix + "mlp.gate.weight"] = tensors[prefix + router + ".weight"]
        fused[prefix + "mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([tensors[expert(e, gate)], tensors[expert(e, up)]]) for e in experts]
        )
        fused[prefix + "mlp.experts.down_proj"] = np.stack([tensors[expert(e, down)] for e in experts])
    save_file(fused, str(directory / "model.safetensors"))
    from tests.support.hf_parity import check_against_hf

    check_against_hf(LLM(str(directory), **SMALL_ENGINE), name)
