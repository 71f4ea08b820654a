"""GGUF files of the DeepSeek, Qwen2-MoE, Qwen3-MoE and GPT-OSS fixtures, written as llama.cpp's converter writes them
(tests/support/gguf_family_files.py): greedy tokens and logprobs equal transformers' recorded ones."""

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file

from jaxserve import LLM
from jaxserve.loading.gguf import GGUFFile
from jaxserve.loading.gguf_families import interleave_columns
from jaxserve.models.config import ModelConfig
from tests.support.fixtures import SMALL_ENGINE, fixture_dir
from tests.support.gguf_family_files import write_family_gguf
from tests.support.hf_parity import check_against_hf


@pytest.mark.parametrize(
    "name, split_kv_b",
    [
        ("deepseek_v3", True),  # q_lora, sigmoid + correction bias, 4 groups keep 2, YaRN, kv_b split per head
        ("qwen2_moe", True),  # shared expert and its gate, a dense layer between MoE layers, q/k/v biases
        ("gpt_oss", True),  # sinks, biases, clamp limit from swiglu_clamp_exp, llama.cpp's sliding pattern
        ("qwen3_moe_30b_a3b_shape", True),  # per-head q/k norms, 128 experts top 8, renormalized
    ],
)
def test_family_gguf_matches_transformers(name, split_kv_b, tmp_path):
    llm = LLM(write_family_gguf(name, str(tmp_path / f"{name}.gguf"), split_kv_b=split_kv_b), **SMALL_ENGINE)
    check_against_hf(llm, name)


@pytest.mark.parametrize(
    "name",
    # gpt_oss_mha_tied: tied, MHA, a layer pattern that is not llama.cpp's (written per layer)
    ["deepseek_v3", "deepseek_v2_grouped", "qwen2_moe", "qwen3_moe_30b_a3b_shape", "gpt_oss", "gpt_oss_mha_tied"],
)
def test_family_gguf_metadata_describes_the_checkpoint(name, tmp_path):
    """The config read back from the metadata is the one config.json gives, every ModelConfig field (V2's
    grouped routing and YaRN mscale 0.707, which GGUF stores as a float32 log multiplier, included)."""
    gguf = GGUFFile(write_family_gguf(name, str(tmp_path / "m.gguf")))
    from_gguf = ModelConfig.from_hf_dict(gguf.hf_config())
    reference = ModelConfig.from_model_dir(fixture_dir(name))
    differing = {
        field: (getattr(from_gguf, field), getattr(reference, field))
        for field in vars(reference)
        if getattr(from_gguf, field) != getattr(reference, field)
    }
    differing.pop("checkpoint_dtype", None)  # the file's storage: these are written as F32 (the bf16 fixture too)
    for field in ("rms_norm_eps", "swiglu_limit"):  # float32 in GGUF
        if field in differing:
            assert differing[field][0] == pytest.approx(differing.pop(field)[1], rel=1e-6)
    assert differing == {}


@pytest.mark.parametrize(
    "name, split_kv_b",
    [
        ("deepseek_v2_lite", False),  # q_proj, tied head, the older converter's whole attn_kv_b
        ("deepseek_v2_grouped", True),  # attention biases, q_lora
        ("deepseek_v3", True),
        ("qwen2_moe", True),
        ("gpt_oss", True),
    ],
)
def test_every_checkpoint_tensor_reads_back(name, split_kv_b, tmp_path):
    """Each tensor of the fixture's safetensors, by its Hugging Face name, from the GGUF file (joined, interleaved,
    per expert), equal; nothing else is in the file."""
    weights = load_file(os.path.join(fixture_dir(name), "model.safetensors"))
    reader = GGUFFile(write_family_gguf(name, str(tmp_path / "m.gguf"), split_kv_b=split_kv_b)).tensor_reader()
    for hf_name, value in weights.items():
        np.testing.assert_array_equal(reader.read(hf_name), value, err_msg=hf_name)
    assert set(reader.names) | set(reader.derived) == set(weights)


def test_qwen3moe_renormalizes_its_top_k_as_llama_cpp_does(tmp_path):
    """The converter writes no norm_topk_prob and llama.cpp's qwen3moe always renormalizes (every released
    Qwen3-MoE says norm_topk_prob: true); the qwen3_moe fixture says false, which GGUF cannot carry."""
    gguf = GGUFFile(write_family_gguf("qwen3_moe", str(tmp_path / "m.gguf")))
    assert ModelConfig.from_hf_dict(gguf.hf_config()).normalize_expert_weights
    assert not ModelConfig.from_model_dir(fixture_dir("qwen3_moe")).normalize_expert_weights


def test_missing_family_tensors_are_named(tmp_path):
    path = write_family_gguf("deepseek_v3", str(tmp_path / "m.gguf"), drop=("blk.2.attn_v_b.weight",))
    with pytest.raises(ValueError, match=r"lacks tensor blk\.2\.attn_v_b\.weight"):
        GGUFFile(path).hf_config()
    path = write_family_gguf("gpt_oss", str(tmp_path / "g.gguf"), drop=("blk.1.attn_sinks.weight",))
    with pytest.raises(ValueError, match=r"lacks tensor blk\.1\.attn_sinks\.weight"):
        GGUFFile(path).hf_config()


def test_missing_family_metadata_is_named(tmp_path, monkeypatch):
    from gguf import GGUFWriter

    monkeypatch.setattr(GGUFWriter, "add_kv_lora_rank", lambda self, value: None)
    path = write_family_gguf("deepseek_v3", str(tmp_path / "m.gguf"))
    with pytest.raises(ValueError, match=r"metadata lacks deepseek2\.attention\.kv_lora_rank"):
        LLM(path, **SMALL_ENGINE)


def test_mxfp4_blocks_dequantize_as_llama_cpp_defines_them():
    """ggml's dequantize_row_mxfp4: one E8M0 byte (2^(e - 128) with the doubled e2m1 table), then 16 bytes whose
    low nibbles are elements 0-15 and high nibbles 16-31."""
    table = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=32)
    exponent = 130
    block = np.array([exponent, *(codes[:16] | (codes[16:] << 4))], np.uint8)[None]
    expected = np.array([table[c] for c in codes], np.float32) * 2.0 ** (exponent - 128)
    np.testing.assert_array_equal(dequantize(block, T.MXFP4).reshape(-1), expected)


def test_mxfp4_gpt_oss_experts_are_interleaved_back(tmp_path):
    """gate / up stored apart as MXFP4 (32-wide rows) come back as transformers' interleaved gate_up_proj."""
    path = write_family_gguf("gpt_oss_mha_tied", str(tmp_path / "q.gguf"), expert_type=T.MXFP4)
    gguf = GGUFFile(path)
    assert gguf.tensors["blk.0.ffn_gate_exps.weight"].tensor_type == T.MXFP4
    reader = gguf.tensor_reader()
    float_reader = GGUFFile(write_family_gguf("gpt_oss_mha_tied", str(tmp_path / "f.gguf"))).tensor_reader()
    gate = float_reader.read("model.layers.1.mlp.experts.gate_up_proj")[..., 0::2]  # [E, X, F]
    up = float_reader.read("model.layers.1.mlp.experts.gate_up_proj")[..., 1::2]

    def rounded(values):  # each [E, X, F] stored as [E, F, X] blocks
        stored = np.ascontiguousarray(values.swapaxes(1, 2))
        return dequantize(quantize(stored, T.MXFP4), T.MXFP4).swapaxes(1, 2)

    fused = reader.read("model.layers.1.mlp.experts.gate_up_proj")
    np.testing.assert_array_equal(fused, interleave_columns(rounded(gate), rounded(up)))
    assert not np.array_equal(fused, interleave_columns(gate, up))  # MXFP4 rounds these weights


@pytest.mark.parametrize(
    "pre, pieces",
    [
        # o200k: a cased word keeps its contraction, digits in threes
        ("gpt-4o", ["Hello", " WORLD's", " ", "123", "45", " ok", " 你好"]),
        # digits first, then CJK runs, then punctuation-led words
        ("deepseek-v3", ["Hello", " WORLD", "'s", " ", "123", "45", " ok", " ", "你好"]),
        # DeepSeek LLM / V2: letters, then ASCII punctuation and letters (":-~"), CJK and digit runs, each in turn
        ("deepseek-llm", ["Hello", " WORLD", "'", "s", " ", "12345", " ok", " ", "你好"]),
        (None, ["Hello", " WORLD", "'s", " 12345", " ok", " 你好"]),  # GPT-2's split: what unknown pres get
    ],
)
def test_the_families_byte_level_splits(pre, pieces):
    """GPT-OSS ("gpt-4o"), DeepSeek-V3 ("deepseek-v3") and DeepSeek-V2 ("deepseek-llm") GGUF vocabularies split text
    as their tokenizer.json (and llama.cpp) do."""
    from jaxserve.loading.gguf_tokenizer import _byte_level, _bytes_to_unicode

    spelling = _bytes_to_unicode()
    backend = _byte_level(sorted(set(spelling.values())), [], pre)
    assert backend.pre_tokenizer is not None
    unspell = {character: byte for byte, character in spelling.items()}
    split = backend.pre_tokenizer.pre_tokenize_str("Hello WORLD's 12345 ok 你好")
    assert [bytes(unspell[c] for c in piece).decode() for piece, _ in split] == pieces
