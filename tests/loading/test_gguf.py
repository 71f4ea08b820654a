"""GGUF files, written from the committed fixtures as llama.cpp would write them: exact against
transformers in float32, quantized ones against a safetensors checkpoint of the same dequantized
weights, and bad files refused before anything loads."""

import dataclasses
import json
import os
import shutil
import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from safetensors.numpy import load_file, save_file

from jaxserve import LLM, SamplingParams
from jaxserve.loading.gguf import GGUFFile
from jaxserve.loading.model_source import open_model
from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir
from tests.support.gguf_files import write_gguf
from tests.support.hf_parity import check_against_hf

TOKENIZER_MODEL = os.path.join(fixture_dir("llama_gqa"), "tokenizer.model")
GGUF_ARCHITECTURES = {  # HF model_type -> llama.cpp's architecture, where it is not "llama"
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
}


def fixture_gguf(name: str, path: str, quant_types: dict | None = None) -> str:
    directory = fixture_dir(name)
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    architecture = GGUF_ARCHITECTURES.get(config["model_type"], "llama")
    write_gguf(
        path,
        config,
        load_file(os.path.join(directory, "model.safetensors")),
        quant_types or {},
        architecture=architecture,
        tokenizer=("llama", TOKENIZER_MODEL),
    )
    return path


@pytest.mark.parametrize(
    "name",
    [
        "llama_gqa",
        "llama_mqa_odd",
        "mixtral",
        "qwen3",
        "gemma2_mha_untied",
        "gemma3",
        "phi3",
        "phi3_longrope_long",
        "phi3_longrope_short",
    ],
)
def test_float32_gguf_matches_transformers(name, tmp_path):
    """The llama converter's permuted query/key rows are undone; Llama 3 rope scaling is read back from
    rope_freqs (llama_mqa_odd); Mixtral's stacked experts are split; Qwen3's per-head q/k norms are found.
    Gemma's norms lose the converter's +1, its soft-caps, windows and (Gemma 3) local and global ropes come
    from the metadata; Phi-3's fused tensors, partial rotary and LongRoPE factor tensors are read (these
    fixtures' query_pre_attn_scalar equals head_dim, as llama.cpp assumes)."""
    llm = LLM(fixture_gguf(name, str(tmp_path / f"{name}.gguf")), **SMALL_ENGINE)
    check_against_hf(llm, name)
    for prompt in expected(name)["prompts"]:
        if prompt["text"] is not None:  # the embedded vocabulary tokenizes as tokenizer.model does
            assert llm.get_tokenizer().encode(prompt["text"]) == prompt["token_ids"]


def test_yarn_scaling_and_mlp_biases_are_read_from_the_metadata(tmp_path):
    """A llama with YaRN rope scaling and MLP biases, as llama.cpp's converter writes it (rope.scaling.type yarn,
    its factor, original context and betas; blk.N.ffn_*.bias): served as the Hugging Face directory of the same
    weights is (both were dropped: logprob errors 0.5-1 against transformers)."""
    with open(os.path.join(fixture_dir("llama_gqa"), "config.json")) as f:
        config = json.load(f)
    scaling = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=16.0, beta_slow=2.0)
    config.update(rope_scaling=scaling, mlp_bias=True, max_position_embeddings=128)
    rng = np.random.default_rng(0)
    weights = dict(load_file(os.path.join(fixture_dir("llama_gqa"), "model.safetensors")))
    for layer in range(config["num_hidden_layers"]):
        for kind, size in (("gate", config["intermediate_size"]), ("up", config["intermediate_size"])):
            weights[f"model.layers.{layer}.mlp.{kind}_proj.bias"] = rng.normal(size=size).astype(np.float32)
        weights[f"model.layers.{layer}.mlp.down_proj.bias"] = rng.normal(size=config["hidden_size"]).astype(np.float32)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    with open(hf_dir / "config.json", "w") as f:
        json.dump(config, f)
    save_file(weights, str(hf_dir / "model.safetensors"))
    shutil.copy(TOKENIZER_MODEL, hf_dir / "tokenizer.model")
    gguf_path = str(tmp_path / "yarn.gguf")
    write_gguf(gguf_path, config, weights, {}, tokenizer=("llama", TOKENIZER_MODEL))
    params = SamplingParams(max_tokens=0, prompt_logprobs=5)
    prompts = [[1] + np.random.default_rng(seed).integers(3, 384, size=60).tolist() for seed in range(2)]
    want = [o.prompt_logprobs for o in LLM(str(hf_dir), **SMALL_ENGINE).generate(prompts, params)]
    got = [o.prompt_logprobs for o in LLM(gguf_path, **SMALL_ENGINE).generate(prompts, params)]
    for got_prompt, want_prompt in zip(got, want):
        for got_position, want_position in zip(got_prompt[1:], want_prompt[1:]):
            assert got_position.keys() == want_position.keys()
            np.testing.assert_allclose(list(got_position.values()), list(want_position.values()), atol=1e-5)


QUANTIZED_CONFIG = dict(
    model_type="llama",
    vocab_size=384,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    torch_dtype="float32",
)
QUANT_TYPES = {
    "token_embd": T.Q8_0,
    "attn_q": T.Q4_K,
    "attn_k": T.Q6_K,
    "attn_v": T.Q4_0,
    "attn_output": T.Q4_1,
    "ffn_gate": T.F16,
    "ffn_up": T.BF16,
    "blk.0.ffn_down": T.Q5_K,
    "blk.1.ffn_down": T.Q5_0,
    "output": T.Q6_K,
}


def test_quantized_gguf_matches_its_dequantized_weights(tmp_path):
    """Every supported quantization (256-wide rows for the k-quants), against a safetensors checkpoint
    of the very weights the GGUF dequantizes to."""
    from jaxserve.loading.default_model import random_llama_weights

    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    write_gguf(
        str(gguf_dir / "model.gguf"),
        QUANTIZED_CONFIG,
        random_llama_weights(QUANTIZED_CONFIG),
        QUANT_TYPES,
        tokenizer=("llama", TOKENIZER_MODEL),
    )
    gguf = GGUFFile(str(gguf_dir / "model.gguf"))
    assert {t.tensor_type for t in gguf.reader.tensors} >= set(QUANT_TYPES.values())
    reader = gguf.tensor_reader()
    weights = {name: np.ascontiguousarray(reader.read(name)) for name in reader.names}
    assert all(np.isfinite(w).all() for w in weights.values())
    reference_dir = tmp_path / "safetensors"
    reference_dir.mkdir()
    save_file(weights, str(reference_dir / "model.safetensors"))
    (reference_dir / "config.json").write_text(json.dumps(QUANTIZED_CONFIG))

    prompts = [[1] + np.random.default_rng(seed).integers(3, 384, size=n).tolist() for seed, n in enumerate((4, 30))]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=4)
    from_gguf = LLM(str(gguf_dir), **SMALL_ENGINE).generate(prompts, params)  # a directory holding one .gguf
    reference = LLM(str(reference_dir), **SMALL_ENGINE).generate(prompts, params)
    for a, b in zip(from_gguf, reference):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert step_a == pytest.approx(step_b, abs=1e-5)


def test_gguf_metadata_becomes_the_config(tmp_path):
    source = open_model(fixture_gguf("llama_mqa_odd", str(tmp_path / "m.gguf"), {"ffn": T.F16}))
    config = source.config
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.num_layers) == (5, 1, 12, 3)
    assert config.attention_bias and not config.tie_word_embeddings
    assert source.checkpoint_dtype == "float32" and source.name == "m.gguf"
    assert source.tokenizer.eos_token_ids == {2} and source.tokenizer.bos_token_id == 1
    # save_checkpoint copies these files: the saved checkpoint must describe the same model and tokenizer
    from jaxserve.loading.tokenizer import Tokenizer
    from jaxserve.models import ModelConfig

    assert ModelConfig.from_model_dir(source.description_dir) == config
    described = Tokenizer.from_model_dir(source.description_dir)
    for text in ("Hello world", "<s>hi</s> ünïcode", "def f(x):\n    return x"):
        assert described.encode(text) == source.tokenizer.encode(text)
    assert described.eos_token_ids == source.tokenizer.eos_token_ids
    assert open_model(fixture_gguf("llama_mha_tied", str(tmp_path / "t.gguf"))).config.tie_word_embeddings


@pytest.mark.parametrize(
    "theta, head_dim, scaling",
    [
        (
            500000.0,
            128,
            dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
        ),
        (
            500000.0,
            64,
            dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
        ),
        (
            10000.0,
            64,
            dict(factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0, original_max_position_embeddings=512),
        ),
    ],
)
def test_llama3_rope_scaling_is_read_back_from_rope_freqs(theta, head_dim, scaling):
    """Llama 3.1 (8B/70B), Llama 3.2 (1B/3B), and unusual frequency factors."""
    from jaxserve.loading.gguf_rope import llama3_divisors, llama3_rope_scaling
    from tests.support.gguf_files import llama3_rope_factors

    factors = llama3_rope_factors(scaling, theta, head_dim)
    found = llama3_rope_scaling(factors, theta, head_dim)
    wavelengths = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    np.testing.assert_allclose(llama3_divisors(found, wavelengths), factors, rtol=1e-5)
    assert found["factor"] == scaling["factor"] and found["rope_type"] == "llama3"
    assert llama3_rope_scaling(np.ones(head_dim // 2, np.float32), theta, head_dim) is None
    with pytest.raises(ValueError, match="no Llama 3"):
        llama3_rope_scaling(factors[::-1].copy(), theta, head_dim)


def test_qwen2_gguf_reads_back_its_checkpoint(tmp_path):
    """Qwen2 (q/k/v biases, tied embeddings; not permuted) tensor for tensor. Its sliding window is not in
    GGUF metadata, as llama.cpp runs it with full attention, so there is no engine run against transformers."""
    weights = load_file(os.path.join(fixture_dir("qwen2"), "model.safetensors"))
    gguf = GGUFFile(fixture_gguf("qwen2", str(tmp_path / "qwen2.gguf")))
    reader = gguf.tensor_reader()
    assert set(reader.names) == set(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(reader.read(name), value, err_msg=name)
    config = open_model(gguf.path).config
    assert config.model_type == "qwen2" and config.attention_bias and config.tie_word_embeddings
    assert config.sliding_window is None


def _patch_tensor_type(path: str, tensor_name: str, type_id: int) -> None:
    """Overwrite one tensor's type in the tensor-info table: name (u64 length + bytes), n_dims (u32),
    dims (u64 each), type (u32)."""
    data = bytearray(open(path, "rb").read())
    name = tensor_name.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    open(path, "wb").write(bytes(data))


def test_bad_gguf_files_raise_value_errors_naming_them(tmp_path):
    good = fixture_gguf("llama_gqa", str(tmp_path / "good.gguf"))
    size = os.path.getsize(good)

    def refused(path, match):
        with pytest.raises(ValueError, match=match) as error:
            open_model(path)
        assert os.path.basename(path) in str(error.value)

    for name, cut in (("truncated.gguf", size - 1000), ("header_only.gguf", 200)):
        open(tmp_path / name, "wb").write(open(good, "rb").read()[:cut])
        refused(str(tmp_path / name), "malformed GGUF")
    unknown = fixture_gguf("llama_gqa", str(tmp_path / "unknown_type.gguf"))
    _patch_tensor_type(unknown, "blk.0.attn_q.weight", 99)
    refused(unknown, "malformed GGUF")
    unsupported = fixture_gguf("llama_gqa", str(tmp_path / "iq.gguf"))
    _patch_tensor_type(unsupported, "output_norm.weight", int(T.I32))  # same size as F32; not a weight type
    refused(unsupported, r"output_norm\.weight has type I32")
    # a tensor of the wrong shape, found when the weights are read: the file and the tensor named
    with open(os.path.join(fixture_dir("llama_gqa"), "config.json")) as f:
        config = json.load(f)
    weights = dict(load_file(os.path.join(fixture_dir("llama_gqa"), "model.safetensors")))
    for hf_name in ("model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        short = str(tmp_path / f"short_{hf_name.split('.')[-2]}.gguf")
        write_gguf(short, config, {**weights, hf_name: weights[hf_name][:-3]}, {}, tokenizer=("llama", TOKENIZER_MODEL))
        with pytest.raises(ValueError, match=r"(v_proj|down_proj)") as error:
            LLM(short, **SMALL_ENGINE)
        assert os.path.basename(short) in str(error.value)
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        fixture_gguf("llama_gqa", str(two / name))
    with pytest.raises(ValueError, match="several GGUF files"):
        open_model(str(two))


@pytest.mark.parametrize("name", ["gemma2", "gemma2_mha_untied", "gemma3_odd_untied", "phi3", "phi3_longrope_short"])
def test_gemma_and_phi3_gguf_describe_their_checkpoint(name, tmp_path):
    """Tensor for tensor (Gemma's norms less the converter's +1) and field for field (soft-caps, windows,
    layer types, ropes, rotary dims, LongRoPE factors), but for Gemma's
    query_pre_attn_scalar: GGUF has none, and llama.cpp scales by head_dim (these are not 27B models)."""
    from jaxserve.models import ModelConfig

    weights = load_file(os.path.join(fixture_dir(name), "model.safetensors"))
    path = fixture_gguf(name, str(tmp_path / f"{name}.gguf"))
    reader = GGUFFile(path).tensor_reader()
    assert set(reader.names) == set(weights)
    for hf_name, value in weights.items():
        np.testing.assert_allclose(reader.read(hf_name), value, rtol=0, atol=1e-6, err_msg=hf_name)
    config = open_model(path).config
    reference = ModelConfig.from_model_dir(fixture_dir(name))
    if reference.query_pre_attention_scalar is not None:
        reference = dataclasses.replace(reference, query_pre_attention_scalar=float(reference.head_dim))
    if reference.model_type == "gemma3_text":  # the converter writes no layer pattern; llama.cpp's is 5 : 1
        pattern = tuple(
            "full_attention" if layer % 6 == 5 else "sliding_attention" for layer in range(reference.num_layers)
        )
        reference = dataclasses.replace(reference, layer_types=pattern)
    scaling = dataclasses.replace(  # GGUF stores the factors and the epsilon as float32
        reference.rope_scaling,
        short_factor=tuple(float(f) for f in np.asarray(reference.rope_scaling.short_factor, np.float32)),
        long_factor=tuple(float(f) for f in np.asarray(reference.rope_scaling.long_factor, np.float32)),
    )
    assert config.rms_norm_eps == pytest.approx(reference.rms_norm_eps, rel=1e-6)
    assert config == dataclasses.replace(reference, rms_norm_eps=config.rms_norm_eps, rope_scaling=scaling)
