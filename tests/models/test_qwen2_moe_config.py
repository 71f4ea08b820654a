"""Qwen2-MoE configs as the Hub writes them (Qwen1.5-MoE-A2.7B's, transformers 4's layout without layer_types):
which layers have experts, the shared expert's width, routing and the attention's biases and windows."""

import pytest

from jaxserve.models import ModelConfig

QWEN15_MOE_A27B = dict(
    model_type="qwen2_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    num_experts=60,
    num_experts_per_tok=4,
    moe_intermediate_size=1408,
    shared_expert_intermediate_size=5632,
    norm_topk_prob=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    use_sliding_window=False,
    sliding_window=32768,
    max_window_layers=21,
    rope_theta=1000000.0,
)


def test_qwen15_moe_a27b_config():
    config = ModelConfig.from_hf_dict(QWEN15_MOE_A27B)
    assert (config.num_experts, config.num_experts_per_token, config.expert_intermediate_size) == (60, 4, 1408)
    assert config.shared_expert_intermediate_size == 5632 and not config.normalize_expert_weights
    assert config.dense_layers == () and config.num_moe_layers == 24
    assert config.attention_bias and not config.attention_output_bias
    assert config.sliding_window is None and set(config.layer_types) == {"full_attention"}
    assert config.logical_axis_sizes()["shared_expert_mlp"] == 5632


@pytest.mark.parametrize(
    "overrides, dense",
    [
        (dict(decoder_sparse_step=2), (0, 2, 4)),
        (dict(mlp_only_layers=[1, 3]), (1, 3)),
        (dict(decoder_sparse_step=3, mlp_only_layers=[2]), (0, 1, 2, 3, 4)),
    ],
)
def test_dense_layers_from_sparse_step_and_mlp_only_layers(overrides, dense):
    config = ModelConfig.from_hf_dict({**QWEN15_MOE_A27B, "num_hidden_layers": 6, **overrides})
    assert config.dense_layers == dense
    assert config.num_moe_layers == 6 - len(dense)
    assert [config.layer_is_moe(layer) for layer in range(6)] == [layer not in dense for layer in range(6)]


def test_sliding_window_on_even_layers_below_max_window_layers_and_qkv_bias_off():
    config = ModelConfig.from_hf_dict(
        {
            **QWEN15_MOE_A27B,
            "num_hidden_layers": 6,
            "use_sliding_window": True,
            "sliding_window": 64,
            "max_window_layers": 4,
            "qkv_bias": False,
        }
    )
    assert config.sliding_window == 64
    assert config.layer_types == ("sliding_attention", "full_attention") * 2 + ("full_attention",) * 2
    assert not config.attention_bias


def test_a_moe_family_whose_layers_are_all_dense_serves_as_the_dense_model(tmp_path):
    """mlp_only_layers covering every layer (transformers accepts it): nothing routes, so the expert balancer is not
    built (its first step raised a broadcast error). Its outputs are a Qwen2 model's with the same weights."""
    import json
    import os
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxserve import LLM, SamplingParams
    from tests.support.fixtures import fixture_dir

    source = fixture_dir("qwen2_moe")
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    weights = load_file(os.path.join(source, "model.safetensors"))
    dense_mlp = {k.split("mlp.")[1]: v for k, v in weights.items() if k.startswith("model.layers.1.mlp.")}
    for layer in (0, 2):  # layer 1 is dense in the fixture: its MLP stands in for the others'
        weights = {k: v for k, v in weights.items() if not k.startswith(f"model.layers.{layer}.mlp.")}
        weights |= {f"model.layers.{layer}.mlp.{name}": value for name, value in dense_mlp.items()}
    variants = {
        "all_dense_moe": {**config, "mlp_only_layers": [0, 1, 2]},
        "qwen2": {**config, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
    }
    outputs = {}
    for name, variant in variants.items():
        directory = tmp_path / name
        directory.mkdir()
        with open(directory / "config.json", "w") as f:
            json.dump(variant, f)
        shutil.copy(os.path.join(source, "tokenizer.model"), directory / "tokenizer.model")
        save_file(weights, str(directory / "model.safetensors"))
        llm = LLM(str(directory), dtype="float32", max_model_len=64, max_num_seqs=2, show_progress=False)
        outputs[name] = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0, logprobs=1))[0]
        assert llm.stats()["num_compiles_after_warmup"] == 0
    moe, dense = (outputs[name].outputs[0] for name in variants)
    assert moe.token_ids == dense.token_ids and len(moe.token_ids) == 6
    assert moe.logprobs == dense.logprobs
