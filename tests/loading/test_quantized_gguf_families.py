"""A GGUF file's quantized blocks kept as stored for every family's name mapping (loading/quantize_gguf.py's
Blocks through the family's own read_param), not only Llama's: Mixtral's stacked expert tensors (ffn_*_exps)
become quantized experts, Phi-3's fused attn_qkv / ffn_up split along the output rows keep their blocks,
DeepSeek's experts (deepseek2) alike. `auto` computes what the dequantized load (`none`) computes, and the
weights' bytes are the file's."""

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jaxserve import LLM, SamplingParams
from jaxserve.loading.gguf import GGUFFile
from jaxserve.loading.quantize import QuantizationSpec, load_quantized
from jaxserve.models import CHECKPOINT_NAMES
from pallas_kernels.matmul.quantized import QuantizedWeight, dequantize
from tests.support.fixtures import SMALL_ENGINE, fixture_dir
from tests.support.gguf_family_files import write_family_gguf
from tests.support.gguf_files import write_gguf
from tests.support.quantized_twin import params_by_path

TOKENIZER = ("llama", os.path.join(fixture_dir("llama_gqa"), "tokenizer.model"))
PROMPTS = [[1] + np.random.default_rng(seed).integers(3, 384, size=24).tolist() for seed in range(3)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)
BASE = dict(vocab_size=384, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
MIXTRAL = dict(
    BASE,
    model_type="mixtral",
    hidden_size=64,
    intermediate_size=256,  # the experts' K for down: one Q4_K super-block
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
)
MIXTRAL_TYPES = {  # fragment -> type, first match wins; the routers (ffn_gate_inp) stay F32 as llama.cpp keeps them
    "blk.0.ffn_gate_exps": T.Q4_0,
    "blk.0.ffn_up_exps": T.Q8_0,
    "blk.0.ffn_down_exps": T.Q4_K,
    "blk.1.ffn_gate_exps": T.Q8_0,
    "blk.1.ffn_up_exps": T.Q4_0,
    "blk.1.ffn_down_exps": T.Q8_0,
    "attn_output": T.Q8_0,
    "attn_": T.Q4_0,
    "token_embd": T.Q8_0,
    "output.weight": T.Q8_0,
}
PHI3 = dict(
    BASE,
    model_type="phi3",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    original_max_position_embeddings=4096,
    rope_parameters=dict(rope_theta=10000.0, rope_type="default", partial_rotary_factor=1.0),
    sliding_window=None,
    tie_word_embeddings=False,
)
PHI3_TYPES = {"attn_qkv": T.Q8_0, "ffn_up": T.Q4_0, "ffn_down": T.Q4_1, "attn_output": T.Q8_0}


def _matrix(rng, rows, columns):
    return (rng.standard_normal((rows, columns)) * 0.1).astype(np.float32)


def _common_weights(rng, config) -> dict:
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    weights = {
        "model.embed_tokens.weight": _matrix(rng, 384, hidden),
        "model.norm.weight": np.ones(hidden, np.float32),
        "lm_head.weight": _matrix(rng, 384, hidden),
    }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        weights[prefix + "input_layernorm.weight"] = np.ones(hidden, np.float32)
        weights[prefix + "post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
        weights[prefix + "self_attn.o_proj.weight"] = _matrix(rng, hidden, heads * head_dim)
        if config["model_type"] == "phi3":
            weights[prefix + "self_attn.qkv_proj.weight"] = _matrix(rng, (heads + 2 * kv) * head_dim, hidden)
            weights[prefix + "mlp.gate_up_proj.weight"] = _matrix(rng, 2 * config["intermediate_size"], hidden)
            weights[prefix + "mlp.down_proj.weight"] = _matrix(rng, hidden, config["intermediate_size"])
            continue
        for name, rows in (("q_proj", heads * head_dim), ("k_proj", kv * head_dim), ("v_proj", kv * head_dim)):
            weights[prefix + f"self_attn.{name}.weight"] = _matrix(rng, rows, hidden)
        weights[prefix + "block_sparse_moe.gate.weight"] = _matrix(rng, config["num_local_experts"], hidden)
        for expert in range(config["num_local_experts"]):
            moe = prefix + f"block_sparse_moe.experts.{expert}."
            weights[moe + "w1.weight"] = _matrix(rng, config["intermediate_size"], hidden)
            weights[moe + "w3.weight"] = _matrix(rng, config["intermediate_size"], hidden)
            weights[moe + "w2.weight"] = _matrix(rng, hidden, config["intermediate_size"])
    return weights


def _write(path, config, types, architecture="llama") -> str:
    write_gguf(path, config, _common_weights(np.random.default_rng(0), config), types, architecture, TOKENIZER)
    return path


def _engine(path: str, **options) -> LLM:
    """The oracle here is the dequantized float model, so the CPU kernel that keeps x in float: the default
    one rounds x to int8 per 32 values as llama.cpp does (tests/kernels/test_quantized_int8_dot.py and
    tests/loading/test_int8_activations.py test that arithmetic)."""
    return LLM(path, **{**SMALL_ENGINE, "max_num_seqs": 4}, quantized_activations="float", **options)


def _tensor_bytes(path: str) -> int:
    return sum(int(tensor.n_bytes) for tensor in GGUFFile(path).reader.tensors)


def _same_outputs(a: LLM, b: LLM) -> None:
    for got, want in zip(a.generate(PROMPTS, GREEDY), b.generate(PROMPTS, GREEDY)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for step_got, step_want in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert step_got == pytest.approx(step_want, abs=2e-4)


def test_mixtral_expert_blocks_are_kept_and_compute_the_dequantized_model(tmp_path):
    path = _write(str(tmp_path / "mixtral.gguf"), MIXTRAL, MIXTRAL_TYPES)
    kept, dequantized = _engine(path, quantization="auto"), _engine(path)
    params = params_by_path(kept)
    expected_bits = {(0, "gate_proj"): 4, (0, "up_proj"): 8, (0, "down_proj"): 4, (1, "gate_proj"): 8}
    for (layer, name), bits in expected_bits.items():
        weight = params[("layers", layer, "mlp", name)]
        assert isinstance(weight, QuantizedWeight) and weight.bits == bits, (layer, name)
        assert weight.values.shape[0] == 4 and weight.group_size == 32
    assert not isinstance(params[("layers", 0, "mlp", "gate", "kernel")], QuantizedWeight)  # the F32 router
    _same_outputs(kept, dequantized)
    stats = kept.stats()
    assert stats["num_compiles_after_warmup"] == 0
    # the file's bytes within 10%: Q8_0 / Q4_0 exactly, layer 0's Q4_K experts at 4/3 of theirs, F32 as stored
    assert abs(stats["weights_device_bytes"] / _tensor_bytes(path) - 1) < 0.1


def test_phi3_fused_blocks_split_along_their_output_rows(tmp_path):
    path = _write(str(tmp_path / "phi3.gguf"), PHI3, PHI3_TYPES, architecture="phi3")
    kept, dequantized = _engine(path, quantization="auto"), _engine(path)
    params = params_by_path(kept)
    tensors = {tensor.name: tensor for tensor in GGUFFile(path).reader.tensors}
    for layer in range(2):
        attention = [params[("layers", layer, "self_attn", name, "kernel")] for name in ("q_proj", "k_proj", "v_proj")]
        mlp = [params[("layers", layer, "mlp", name, "kernel")] for name in ("gate_proj", "up_proj")]
        assert [w.shape for w in attention] == [(64, 64), (64, 32), (64, 32)]
        assert all(isinstance(w, QuantizedWeight) for w in attention + mlp)
        assert [w.bits for w in attention + mlp] == [8, 8, 8, 4, 4]
        # the split keeps every byte of the fused tensor, once
        assert sum(w.nbytes for w in attention) == tensors[f"blk.{layer}.attn_qkv.weight"].n_bytes
        assert sum(w.nbytes for w in mlp) == tensors[f"blk.{layer}.ffn_up.weight"].n_bytes
    _same_outputs(kept, dequantized)
    assert kept.stats()["num_compiles_after_warmup"] == 0
    assert abs(kept.stats()["weights_device_bytes"] / _tensor_bytes(path) - 1) < 0.1


def test_deepseek2_experts_keep_their_blocks(tmp_path):
    """llama.cpp's deepseek2 mapping (another family's read_param, DeepSeek's MoENames): Q8_0 expert stacks
    (gate / up contract over the hidden size 64) load as [X, K, N] blocks equal to their dequantized values."""
    path = write_family_gguf("deepseek_v3", str(tmp_path / "deepseek.gguf"), expert_type=T.Q8_0)
    gguf = GGUFFile(path)
    reader, read_param = gguf.tensor_reader(), CHECKPOINT_NAMES["deepseek_v3"]
    layer = next(int(n.split(".")[1]) for n in gguf.tensors if n.endswith("ffn_gate_exps.weight"))
    path_of = ("layers", str(layer), "mlp", "gate_proj")
    float_value = np.asarray(read_param(reader, path_of, (16, 64, 16)))
    weight = load_quantized(reader, read_param, path_of, float_value.shape, QuantizationSpec("auto"), "float32", None)
    assert isinstance(weight, QuantizedWeight) and (weight.bits, weight.group_size) == (8, 32)
    assert weight.nbytes == gguf.tensors[f"blk.{layer}.ffn_gate_exps.weight"].data.nbytes
    np.testing.assert_array_equal(np.asarray(dequantize(weight)), float_value)
    # down contracts over 16 (no 32-wide blocks): written F32, so `auto` leaves it float
    down = ("layers", str(layer), "mlp", "down_proj")
    assert load_quantized(reader, read_param, down, (16, 16, 64), QuantizationSpec("auto"), "float32", None) is None
