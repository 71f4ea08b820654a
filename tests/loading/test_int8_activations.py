"""A GGUF file's Q8_0 / Q4_0 (and Q5_0 / Q5_1) blocks served with the CPU kernel's default int8 activations (x quantized per 32 k,
as llama.cpp's q8_0 vec_dot does) against the same engine with float activations (the dequantized product to
float rounding, tests/loading/test_quantization.py): the activations' rounding moves log-probabilities a
little, and greedy tokens only where the float engine's top two were close."""

import os

import numpy as np
import pytest
from flax import nnx
from gguf import GGMLQuantizationType as T

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.loading.default_model import random_llama_weights
from jaxserve.server.config_file import load_config
from pallas_kernels.matmul import quantized_cpu, quantized_tiles
from tests.support.fixtures import SMALL_ENGINE, fixture_dir
from tests.support.gguf_files import write_gguf

TOKENIZER_MODEL = os.path.join(fixture_dir("llama_gqa"), "tokenizer.model")
PROMPTS = [[1] + np.random.default_rng(seed).integers(3, 384, size=40).tolist() for seed in range(5)]
# odd-ish sizes for the kernel: K of 96 (three 32-chunks per row) and 160; 6 heads of 16, GQA 3:1
CONFIG = dict(
    model_type="llama",
    vocab_size=384,
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
    torch_dtype="float32",
)

# every projection's blocks kept: Q8_0 and Q4_0 (the kernel's layouts this file is about); the embedding and the head
# Q5_0 / Q5_1, which the int8 engine holds in the kernel's 5-bit tiles (N = 384: whole tiles of 64 columns)
TYPES = {"token_embd": T.Q5_0, "attn_q": T.Q8_0, "attn_k": T.Q8_0, "attn_v": T.Q4_0, "attn_output": T.Q4_0}
TYPES |= {"ffn_gate": T.Q8_0, "ffn_up": T.Q4_0, "ffn_down": T.Q8_0, "output": T.Q5_1}


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / "model.gguf")
    write_gguf(path, CONFIG, random_llama_weights(CONFIG), TYPES, tokenizer=("llama", TOKENIZER_MODEL))
    return path


def test_int8_activations_stay_close_to_float_activations(gguf_path):
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    outputs = {}
    for activations in ("float", "int8"):
        options = {**SMALL_ENGINE, "max_num_batched_tokens": 128, "quantized_activations": activations}
        llm = LLM(gguf_path, **options, quantization="auto")
        flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(llm.engine.runner.params())}
        five_bit = [flat["embed_tokens.embedding"], flat["lm_head.kernel"]]
        # (float activations: the K-quant kernel reads the planes; int8: the int8-dot kernel, 5-bit tiles)
        assert [quantized_tiles.is_tiled(w) and w.bits == 5 for w in five_bit] == [activations == "int8"] * 2
        outputs[activations] = [output.outputs[0] for output in llm.generate(PROMPTS, params)]
        assert llm.stats()["num_compiles_after_warmup"] == 0
        del llm
    drifts, agreed = [], 0
    for float_out, int8_out in zip(outputs["float"], outputs["int8"], strict=True):
        for position, (float_step, int8_step) in enumerate(zip(float_out.logprobs, int8_out.logprobs)):
            token = float_out.token_ids[position]
            if token in int8_step:
                drifts.append(abs(int8_step[token] - float_step[token]))
            if int8_out.token_ids[position] != token:
                # a different greedy token only where the float engine's top two were within the drift
                top_two = sorted(float_step.values(), reverse=True)[:2]
                assert top_two[0] - top_two[1] < 0.1, (position, float_step, int8_step)
                break  # the texts differ from here on
            agreed += 1
    assert agreed >= 0.75 * sum(len(out.token_ids) for out in outputs["float"])
    # the activations' rounding: ~0.4% of a 32-block's largest |x| per element, through two layers
    assert len(drifts) >= 12 and np.max(drifts) < 0.1 and np.median(drifts) < 0.03, drifts


def _custom_call_targets(runner) -> set[str]:
    """The quantized kernels' custom-call names in a runner's compiled steps."""
    names = (quantized_cpu.target(None, activations) for activations in quantized_cpu.KERNELS)
    texts = [executable.as_text() for executable in runner.executables.values()]
    return {name for name in names if any(f'custom_call_target="{name}"' in text for text in texts)}


def test_the_option_reaches_the_target_and_a_self_draft():
    """quantized_activations is an engine option (no environment variable): the target's quantized
    projections and its int8 self-draft's are compiled with the kernel it names; a bad value is refused at
    start, naming the option."""
    speculative = {"method": "draft", "draft_quantization": "int8", "num_speculative_tokens": 2}
    speculative |= {"speculative_max_batch_size": 2}
    engine = {**SMALL_ENGINE, "max_num_seqs": 2, "decode_seq_buckets": (2,)}
    llm = LLM(
        fixture_dir("llama_gqa"), **engine, quantization="int8", quantized_activations="float", speculative=speculative
    )
    assert _custom_call_targets(llm.engine.runner) == {quantized_cpu.target(None, "float")}
    assert _custom_call_targets(llm.engine.parts.draft.runner) == {quantized_cpu.target(None, "float")}
    with pytest.raises(ValueError, match="quantized_activations"):
        EngineConfig.from_options(quantized_activations="fp8")
    config = load_config(overrides=["model.quantization=int8", "model.quantized_activations=float"])
    assert config.engine.quantized_activations == "float" and config.engine.quantization == "int8"
    with pytest.raises(ValueError, match="quantized_activations"):
        load_config(overrides=["model.quantized_activations=int4"])
