"""Quantized weights in the engine (model.quantization, issue 25): int8 / int4 quantized at load from a float
checkpoint track the float model; a GGUF file's Q8_0 / Q4_0 / Q4_1 / K-quant blocks load as they are stored
(bytes) and compute what their dequantized weights compute; nothing compiles after warm-up; bad options and
shapes are refused at start, naming the tensor and the option."""

import os

import jax
import numpy as np
import pytest
from flax import nnx
from gguf import GGMLQuantizationType as T

from jaxserve import LLM, SamplingParams
from jaxserve.loading import quantize_gguf
from jaxserve.loading.default_model import random_llama_weights
from jaxserve.loading.gguf import GGUFFile
from jaxserve.loading.quantize import QuantizationSpec, load_quantized, quantize
from jaxserve.models import llama
from pallas_kernels.matmul import MatmulPlan, quantized_tiles
from pallas_kernels.matmul.kquant import KQuantWeight
from pallas_kernels.matmul.quantized import QuantizedWeight, dequantize, untiled
from tests.support.fixtures import SMALL_ENGINE, fixture_dir
from tests.support.gguf_files import write_gguf

FIXTURE = fixture_dir("llama_gqa")  # hidden 64, mlp 96: K of 64 and 96, groups of 32 divide both
TOKENIZER_MODEL = os.path.join(FIXTURE, "tokenizer.model")
PROMPTS = [[1] + np.random.default_rng(seed).integers(3, 384, size=40).tolist() for seed in range(3)]
SCORE = SamplingParams(max_tokens=0, prompt_logprobs=1)  # teacher-forced: each position's top token
GGUF_CONFIG = dict(
    model_type="llama",
    vocab_size=384,
    hidden_size=256,  # rows of 256: the K-quants' super-blocks
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
GGUF_TYPES = {
    "token_embd": T.Q8_0,
    "attn_q": T.Q8_0,
    "attn_k": T.Q4_0,
    "attn_v": T.Q4_1,
    "attn_output": T.Q4_K,
    "blk.0.ffn_gate": T.IQ4_XS,  # the types below load exactly in a wider layout (not a float copy)
    "blk.1.ffn_gate": T.Q2_K,
    "blk.1.ffn_up": T.IQ4_NL,
    "ffn_gate": T.Q8_0,
    "ffn_up": T.Q4_0,
    "blk.0.ffn_down": T.Q6_K,
    "blk.1.ffn_down": T.Q5_K,
    "output": T.Q3_K,
}


def _engine(model: str, **options) -> LLM:
    return LLM(model, **{**SMALL_ENGINE, "max_num_batched_tokens": 128, **options})


def _scores(llm: LLM) -> list[list[dict[int, float]]]:
    return [output.prompt_logprobs[1:] for output in llm.generate(PROMPTS, SCORE)]


def _kernels(llm: LLM) -> dict[str, object]:
    """The engine's params by name, quantized weights in their [K, N] form (untiled: quantized_tiles.py)."""
    params = llm.engine.runner.params()
    return {".".join(map(str, path)): untiled(variable.get_value()) for path, variable in nnx.to_flat_state(params)}


@pytest.fixture(scope="module")
def float_scores():
    cache = {}

    def scores(name: str):
        if name not in cache:
            cache[name] = _scores(_engine(fixture_dir(name)))
        return cache[name]

    return scores


@pytest.mark.parametrize(
    "name,quantization,min_agreement,max_drift",
    [("llama_gqa", "int8", 0.9, 0.08), ("llama_gqa", "int4", 0.55, 0.6), ("llama_mha_tied", "int8", 0.9, 0.08)],
)
def test_quantized_at_load_tracks_the_float_model(float_scores, name, quantization, min_agreement, max_drift):
    """llama_mha_tied: the embedding, quantized, is also the head (stored [E, V], looked up by columns)."""
    llm = _engine(fixture_dir(name), quantization=quantization)
    kernels = _kernels(llm)
    quantized = {name: weight for name, weight in kernels.items() if isinstance(weight, QuantizedWeight)}
    head = 0 if "lm_head.kernel" not in kernels else 1
    assert len(quantized) == 2 * 7 + 1 + head  # q, k, v, o, gate, up, down per layer, the embedding, the head
    assert quantized["embed_tokens.embedding"].shape == tuple(kernels["embed_tokens.embedding"].shape)
    assert quantized["embed_tokens.embedding"].values.shape[-1] == 384  # stored [E, V]
    assert {weight.bits for weight in quantized.values()} == {8 if quantization == "int8" else 4}
    scores = _scores(llm)
    agreed, drifts = [], []
    for expected_prompt, got_prompt in zip(float_scores(name), scores):
        for expected, got in zip(expected_prompt, got_prompt):
            top = max(expected, key=expected.get)
            agreed.append(top == max(got, key=got.get))
            if top in got:
                drifts.append(abs(got[top] - expected[top]))
    assert np.mean(agreed) >= min_agreement, np.mean(agreed)
    assert np.median(drifts) <= max_drift / 4 and np.max(drifts) <= max_drift
    stats = llm.stats()
    assert stats["num_compiles_after_warmup"] == 0
    float_bytes = sum(np.prod(w.shape) * 4 for w in quantized.values())
    stored_bytes = sum(w.nbytes for w in quantized.values())
    assert stored_bytes < float_bytes / (3.5 if quantization == "int8" else 6)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / "model.gguf")
    write_gguf(path, GGUF_CONFIG, random_llama_weights(GGUF_CONFIG), GGUF_TYPES, tokenizer=("llama", TOKENIZER_MODEL))
    return path


def test_gguf_blocks_load_quantized_and_compute_their_dequantized_values(gguf_path):
    dequantized = _engine(gguf_path)  # quantization none: every tensor dequantized to float32, as before
    # the CPU kernel that keeps x in float (the default quantizes x to int8 per 32 as llama.cpp does: see
    # tests/kernels/test_quantized_int8_dot.py), so that the dequantized values are the oracle to float rounding
    quantized = _engine(gguf_path, quantization="auto", quantized_activations="float")
    kernels = _kernels(quantized)
    tensors = {t.name: t for t in GGUFFile(gguf_path).reader.tensors}
    for layer in range(2):
        for module, gguf_name in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k")):
            weight = kernels[f"layers.{layer}.{module}.kernel"]
            stored = tensors[f"blk.{layer}.{gguf_name}.weight"]
            assert isinstance(weight, QuantizedWeight)
            assert weight.nbytes == stored.n_bytes  # Q8_0 and Q4_0 blocks: the file's bytes exactly
        assert isinstance(kernels[f"layers.{layer}.mlp.down_proj.kernel"], KQuantWeight)  # Q6_K / Q5_K
    head = kernels["lm_head.kernel"]  # Q3_K: 4-bit in groups of 16
    assert isinstance(head, QuantizedWeight) and (head.bits, head.group_size) == (4, 16)
    assert head.nbytes < 1.8 * tensors["output.weight"].n_bytes
    for layer, module, bits in ((0, "gate_proj", 8), (1, "gate_proj", 4), (1, "up_proj", 8)):  # IQ4_XS, Q2_K, IQ4_NL
        weight = kernels[f"layers.{layer}.mlp.{module}.kernel"]
        assert isinstance(weight, QuantizedWeight) and weight.bits == bits
    embedding = kernels["embed_tokens.embedding"]
    assert isinstance(embedding, QuantizedWeight) and embedding.nbytes == tensors["token_embd.weight"].n_bytes
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)
    for a, b in zip(quantized.generate(PROMPTS, params), dequantized.generate(PROMPTS, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert step_a == pytest.approx(step_b, abs=2e-4)
    assert quantized.stats()["num_compiles_after_warmup"] == 0
    assert quantized.stats()["weights_device_bytes"] < 0.6 * dequantized.stats()["weights_device_bytes"]


def test_int4_keeps_the_embedding_and_head_at_int8_when_asked(float_scores):
    """quantization_embedding int8 (llama.cpp's Q4_0 files keep the vocabulary tensors at 6-8 bits): the embedding
    and the untied head int8 per channel, every other projection int4; it tracks the float model at least as
    closely as plain int4 is required to."""
    llm = _engine(FIXTURE, quantization="int4", quantization_embedding="int8")
    quantized = {name: w for name, w in _kernels(llm).items() if isinstance(w, QuantizedWeight)}
    vocabulary = ("embed_tokens.embedding", "lm_head.kernel")
    assert [(quantized[name].bits, quantized[name].group_size) for name in vocabulary] == [(8, 64), (8, 64)]
    assert {w.bits for name, w in quantized.items() if name not in vocabulary} == {4}
    agreed = [
        max(expected, key=expected.get) == max(got, key=got.get)
        for expected_prompt, got_prompt in zip(float_scores("llama_gqa"), _scores(llm))
        for expected, got in zip(expected_prompt, got_prompt)
    ]
    assert np.mean(agreed) >= 0.55
    assert llm.stats()["num_compiles_after_warmup"] == 0
    with pytest.raises(ValueError, match="quantization_embedding must be same or int8, got 'int2'"):
        _engine(FIXTURE, quantization="int4", quantization_embedding="int2")


def test_bad_quantization_options_are_refused_at_start():
    with pytest.raises(ValueError, match="unknown quantization 'int3'.*option quantization"):
        _engine(FIXTURE, quantization="int3")
    with pytest.raises(ValueError, match="quantization_group_size must be"):
        _engine(FIXTURE, quantization="int4", quantization_group_size=48)
    # down_proj's K is 96: groups of 64 do not divide it, 32 do
    with pytest.raises(
        ValueError,
        match=r"layers\.0\.mlp\.down_proj\.kernel.*quantization_group_size 64 \(quantization_group_size 32 divides",
    ):
        _engine(FIXTURE, quantization="int4", quantization_group_size=64)
    # hidden 40: no int4 group divides it, and the message says so instead of suggesting another group size
    with pytest.raises(ValueError, match=r"K = 40 .*\(int4 cannot take it: use int8\)"):
        _engine(fixture_dir("llama_mqa_odd"), quantization="int4")


def test_orbax_checkpoints_save_and_restore_quantized(tmp_path):
    """Saved from an int4 engine, restored by an engine with no quantization option: the same quantized
    arrays (bytes and values), the same outputs."""
    llm = _engine(FIXTURE, quantization="int4")
    llm.save_checkpoint(str(tmp_path / "checkpoint"))
    restored = _engine(str(tmp_path / "checkpoint"))
    saved_kernels, restored_kernels = _kernels(llm), _kernels(restored)
    assert saved_kernels.keys() == restored_kernels.keys()
    for name, weight in saved_kernels.items():
        again = restored_kernels[name]
        assert type(again) is type(weight), name
        for leaf, leaf_again in zip(jax.tree.leaves(weight), jax.tree.leaves(again)):
            assert leaf.dtype == leaf_again.dtype and np.array_equal(np.asarray(leaf), np.asarray(leaf_again))
    assert restored.stats()["weights_device_bytes"] == llm.stats()["weights_device_bytes"]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    expected = [output.outputs[0].token_ids for output in llm.generate(PROMPTS, params)]
    assert [output.outputs[0].token_ids for output in restored.generate(PROMPTS, params)] == expected


def test_orbax_checkpoints_restore_in_another_dtype_and_quantize_when_asked(tmp_path):
    """A quantized checkpoint restored by an engine of another dtype computes in that engine's dtype (its saved
    compute dtype made the projections fall back to flax's Linear, which raised); a float checkpoint restored
    with a quantization option is quantized as it is restored, as a fresh load of the same weights is."""
    params = SamplingParams(max_tokens=6, temperature=0.0)
    _engine(FIXTURE, quantization="int8", dtype="float32").save_checkpoint(str(tmp_path / "int8"))
    as_bfloat16 = _engine(str(tmp_path / "int8"), dtype="bfloat16")
    expected = _engine(FIXTURE, quantization="int8", dtype="bfloat16")
    want = [output.outputs[0].token_ids for output in expected.generate(PROMPTS, params)]
    assert [output.outputs[0].token_ids for output in as_bfloat16.generate(PROMPTS, params)] == want
    _engine(FIXTURE).save_checkpoint(str(tmp_path / "float"))
    for quantization in ("int8", "int4"):
        restored = _engine(str(tmp_path / "float"), quantization=quantization)
        fresh = _engine(FIXTURE, quantization=quantization)
        kernels, fresh_kernels = _kernels(restored), _kernels(fresh)
        assert any(isinstance(weight, QuantizedWeight) for weight in kernels.values())
        for name, weight in fresh_kernels.items():
            for leaf, again in zip(jax.tree.leaves(weight), jax.tree.leaves(kernels[name])):
                assert leaf.dtype == again.dtype and np.array_equal(np.asarray(leaf), np.asarray(again)), name
        assert restored.stats()["weights_device_bytes"] == fresh.stats()["weights_device_bytes"]


def test_a_format_asked_for_keeps_blocks_of_its_bits_and_requantizes_the_rest(gguf_path, monkeypatch):
    """int8 asked of a GGUF file: Q8_0 blocks kept as stored, Q4_0 ones re-quantized to int8 per channel
    from their dequantized values; int4 asked: the reverse."""
    reader = GGUFFile(gguf_path).tensor_reader()

    def load(module: str, shape: tuple[int, int], format: str) -> QuantizedWeight:
        path = ("layers", "0", "self_attn", module, "kernel")
        weight = load_quantized(reader, llama.read_param, path, shape, QuantizationSpec(format), "float32", None)
        assert isinstance(weight, QuantizedWeight)
        return weight

    float_k = reader.read("model.layers.0.self_attn.k_proj.weight").T  # Q4_0, dequantized
    q8 = load("q_proj", (256, 256), "int8")
    assert (q8.bits, q8.group_size) == (8, 32)  # the file's Q8_0
    k8 = load("k_proj", (256, 128), "int8")
    assert (k8.bits, k8.group_size) == (8, 256)  # per channel, from the Q4_0 values
    error = np.abs(np.asarray(dequantize(k8), np.float32) - float_k)
    assert np.all(error <= np.asarray(k8.scales) / 2 + 1e-6)
    assert load("k_proj", (256, 128), "int4").group_size == 32 and load("q_proj", (256, 256), "int4").bits == 4
    # re-quantized a chunk of GGUF rows at a time (16 here): equal to quantizing the whole dequantized tensor
    monkeypatch.setattr(quantize_gguf, "REQUANTIZE_CHUNK_BYTES", 4 * 256 * 16)
    for format, module, shape in (("int8", "k_proj", (256, 128)), ("int4", "q_proj", (256, 256))):
        whole = quantize(
            reader.read(f"model.layers.0.self_attn.{module}.weight").T, QuantizationSpec(format), "float32"
        )
        for leaf, leaf_whole in zip(jax.tree.leaves(load(module, shape, format)), jax.tree.leaves(whole)):
            assert np.array_equal(np.asarray(leaf), leaf_whole), (format, module)


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_a_gpus_plan_serves_the_quantized_engine_as_the_reference_does(monkeypatch, quantization):
    """The one-GPU plan (the Pallas quantized kernel first, quantized_gpu.py; interpret mode here) inside the
    engine's compiled steps, prefill and decode rows: the same greedy tokens and near the same log-probabilities
    as XLA's dots, nothing compiled after warm-up."""
    from jaxserve.engine import builder
    from pallas_kernels.matmul import REFERENCE_PLAN, choose_matmul, quantized_gpu

    kernel, traced = quantized_gpu.quantized_matmul, []
    monkeypatch.setattr(
        quantized_gpu, "quantized_matmul", lambda rows, weight: traced.append(rows.shape) or kernel(rows, weight)
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
    outputs = {}
    for name, plan in (("gpu", choose_matmul("gpu", 1)), ("reference", REFERENCE_PLAN)):
        monkeypatch.setattr(builder, "choose_matmul", lambda *args, plan=plan: plan)
        llm = LLM(FIXTURE, **{**SMALL_ENGINE, "decode_seq_buckets": (1, 8)}, quantization=quantization)
        together = llm.generate(PROMPTS, params)  # decode rows of 8
        alone = llm.generate(PROMPTS[:1], params)  # of 1
        outputs[name] = [o.outputs[0] for o in together + alone]
        assert llm.stats()["num_compiles_after_warmup"] == 0
        if name == "gpu":  # the kernel took decode rows (and int4's single rows), the reference none
            assert any(rows[0] > 1 for rows in traced) and (quantization == "int8") != any(
                rows[0] == 1 for rows in traced
            )
            traced.clear()
    assert not traced
    for gpu, reference in zip(outputs["gpu"], outputs["reference"]):
        assert gpu.token_ids == reference.token_ids
        for got, want in zip(gpu.logprobs, reference.logprobs):
            token = max(want, key=want.get)
            assert abs(got[token] - want[token]) < 1e-3


@pytest.mark.parametrize("name,quantization", [("llama_gqa", "int8"), ("llama_gqa", "int4"), ("gemma3", "int8")])
def test_a_cpu_engine_reads_its_quantized_weights_in_tiles_as_the_same_bits(monkeypatch, name, quantization):
    """A one-device CPU engine moves its quantized projections and embedding (gemma3: tied, the head too) into the
    int8-dot kernel's tiles at load where their shapes allow (pallas_kernels/matmul/quantized_tiles.py; llama_gqa's
    k, v (32 columns), gate and up (96) stay [K, N], joined in one call with the tiled q); the kernel computes
    tiles as the same bits as the [K, N] form, so greedy tokens and every logprob equal an engine that keeps
    [K, N] (test_orbax_checkpoints_save_and_restore_quantized: a tiled engine's checkpoint saves [K, N])."""
    tiled = _engine(fixture_dir(name), quantization=quantization)
    stored = {path: variable.get_value() for path, variable in nnx.to_flat_state(tiled.engine.runner.params())}
    assert quantized_tiles.is_tiled(stored[("embed_tokens", "embedding")])
    if name == "llama_gqa":
        for module, is_tiled in (("q_proj", True), ("k_proj", False), ("o_proj", True)):
            assert quantized_tiles.is_tiled(stored[("layers", 0, "self_attn", module, "kernel")]) == is_tiled
        assert quantized_tiles.is_tiled(stored[("layers", 1, "mlp", "down_proj", "kernel")])
    monkeypatch.setattr(MatmulPlan, "tiles_quantized", property(lambda plan: False))
    kept = _engine(fixture_dir(name), quantization=quantization)
    assert not any(
        quantized_tiles.is_tiled(value)
        for value in jax.tree.leaves(kept.engine.runner.params(), is_leaf=quantized_tiles.is_tiled)
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3)
    for a, b in zip(tiled.generate(PROMPTS, params), kept.generate(PROMPTS, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert tiled.stats()["num_compiles_after_warmup"] == 0
    assert tiled.stats()["weights_device_bytes"] == kept.stats()["weights_device_bytes"]
