"""Quantized mixture-of-experts weights (issue 25): `model.quantization: int8` on MoE models stores each
layer's stacked experts as a QuantizedWeight with a leading expert axis; the grouped expert matmul reads it
(pallas_kernels/matmul/quantized_experts.py) and computes what the same model with those weights
dequantized computes. Expert parallelism on fake devices: tests/loading/test_quantized_experts_meshes.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.loading.quantize import QuantizationSpec, quantize_int4, quantize_int8, stack
from pallas_kernels.matmul.quantized import QuantizedWeight, dequantize
from pallas_kernels.matmul.quantized_experts import grouped_matmul
from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir
from tests.support.quantized_twin import dequantized_twin, params_by_path

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)


def _with_mins(weight: np.ndarray, group: int) -> QuantizedWeight:
    """A Q4_1-like layout (4-bit nibbles with per-group scale and min), as GGUF's Q4_1 / Q4_K give."""
    depth, columns = weight.shape
    grouped = weight.reshape(depth // group, group, columns)
    low, high = grouped.min(axis=1), grouped.max(axis=1)
    scale = np.maximum(high - low, 1e-6) / 15
    q = np.clip(np.rint((grouped - low[:, None]) / scale[:, None]), 0, 15).astype(np.uint8).reshape(depth, columns)
    packed = (q[0::2] | (q[1::2] << 4)).astype(np.uint8)
    return QuantizedWeight(packed, scale.astype(np.float16), low.astype(np.float16), bits=4, group_size=group)


@pytest.mark.parametrize("layout", ["int8", "int4", "int4_mins"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_matmul_is_ragged_dot_over_the_dequantized_experts(layout, dtype):
    """Groups of 5, 0 (an expert no row was routed to), 9 and 3 rows, and 3 rows past the groups (zero)."""
    rng = np.random.default_rng(0)
    experts = rng.standard_normal((4, 64, 24)).astype(np.float32) * 0.1
    quantize = {
        "int8": lambda w: quantize_int8(w, dtype),
        "int4": lambda w: quantize_int4(w, 32, dtype),
        "int4_mins": lambda w: _with_mins(w, 32),
    }[layout]
    weight = jax.tree.map(jnp.asarray, stack([quantize(w) for w in experts]))
    assert weight.shape == (4, 64, 24)
    rows = jnp.asarray(rng.standard_normal((20, 64)), dtype)
    group_sizes = jnp.asarray([5, 0, 9, 3], jnp.int32)
    got = jax.jit(grouped_matmul)(rows, weight, group_sizes)
    want = jax.lax.ragged_dot(rows, dequantize(weight, dtype), group_sizes, preferred_element_type=jnp.float32)
    assert got.dtype == rows.dtype
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tolerance)
    assert not np.asarray(got[17:]).any()


def _engine(name: str, **options) -> LLM:
    """The oracle here is the dequantized float model, so the CPU kernel that keeps x in float: the default
    one rounds x to int8 per 32 values as llama.cpp does (tests/kernels/test_quantized_int8_dot.py and
    tests/loading/test_int8_activations.py test that arithmetic)."""
    return LLM(fixture_dir(name), **SMALL_ENGINE, quantized_activations="float", **options)


@pytest.mark.parametrize(
    "name",
    # odd sizes (36 / 20), a gated shared expert beside the routed ones (Mixtral: the GGUF and mesh tests)
    ["qwen2_moe"],
)
def test_int8_experts_compute_the_dequantized_model(name, tmp_path):
    """Also: an orbax checkpoint of the quantized engine restores its quantized experts array for array."""
    quantized = _engine(name, quantization="int8")
    params = params_by_path(quantized)
    experts = {path: value for path, value in params.items() if path[-1] in ("gate_proj", "up_proj", "down_proj")}
    experts = {path: value for path, value in experts.items() if len(value.shape) == 3}
    assert experts and all(isinstance(value, QuantizedWeight) and value.bits == 8 for value in experts.values())
    for path, value in experts.items():
        assert value.values.dtype == jnp.int8 and value.scales.shape == (value.shape[0], 1, value.shape[2]), path
    for path, value in params.items():  # routers and expert biases stay float
        if path[-1] in ("gate_proj_bias", "up_proj_bias", "down_proj_bias") or path[-2:] == ("gate", "kernel"):
            assert not isinstance(value, QuantizedWeight), path

    twin = dequantized_twin(quantized, _engine(name))
    prompts = [p["token_ids"] for p in expected(name)["prompts"]][:4]
    for got, want in zip(quantized.generate(prompts, GREEDY), twin.generate(prompts, GREEDY)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for step_got, step_want in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert step_got == pytest.approx(step_want, abs=2e-4)
    stats = quantized.stats()
    assert stats["num_compiles_after_warmup"] == 0
    # every expert weight byte is one int8 value plus a float32 scale per (expert, column)
    expert_bytes = sum(value.nbytes for value in experts.values())
    assert expert_bytes == sum(np.prod(v.shape) + 4 * v.shape[0] * v.shape[2] for v in experts.values())
    float_experts = sum(4 * np.prod(value.shape) for value in experts.values())
    # the float twin holds every expert as float32 (and the other quantized params as float too)
    assert twin.stats()["weights_device_bytes"] - stats["weights_device_bytes"] >= float_experts - expert_bytes

    quantized.save_checkpoint(str(tmp_path / "checkpoint"))
    restored = _restored_params(str(tmp_path / "checkpoint"))
    for path, value in experts.items():
        again = restored[path]
        assert isinstance(again, QuantizedWeight) and (again.bits, again.group_size) == (value.bits, value.group_size)
        for leaf, leaf_again in zip(jax.tree.leaves(value), jax.tree.leaves(again)):
            assert leaf.dtype == leaf_again.dtype and np.array_equal(np.asarray(leaf), np.asarray(leaf_again))


def test_deepseek_int8_keeps_mla_kv_b_proj_float():
    """MLA reads kv_b_proj's kernel in place ([rank, heads, dims], absorbed into the query and output), so it
    stays float; the routed and shared experts and the other projections are int8. (Loaded only: serving
    DeepSeek int8 compiles for ~30 s of CPU; the quantized experts' math is checked on Qwen2-MoE above.)"""
    params = _loaded_params(fixture_dir("deepseek_v2_lite"), QuantizationSpec("int8"))
    assert not isinstance(params[("layers", 0, "self_attn", "kv_b_proj", "kernel")], QuantizedWeight)
    assert isinstance(params[("layers", 0, "self_attn", "o_proj", "kernel")], QuantizedWeight)
    moe_layers = [path[1] for path in params if path[-1] == "gate_proj" and len(params[path].shape) == 3]
    assert moe_layers and all(
        isinstance(params[("layers", layer, "mlp", name)], QuantizedWeight)
        for layer in moe_layers
        for name in ("gate_proj", "up_proj", "down_proj")
    )
    assert isinstance(params[("layers", moe_layers[0], "mlp", "shared_expert", "gate_proj", "kernel")], QuantizedWeight)


def _restored_params(directory: str) -> dict:
    """The params an engine would restore from an orbax checkpoint (the engine's own loading, no compiling)."""
    return _loaded_params(directory, QuantizationSpec())


def _loaded_params(directory: str, quantization) -> dict:
    """The params the engine's own loading gives (no compiling)."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine.attention_plan import choose_attention
    from jaxserve.engine.builder import _load_model
    from jaxserve.loading.model_source import open_model

    source = open_model(directory)
    attention = choose_attention(source.config, EngineConfig.from_options(attention_impl="reference"), "float32", None)
    model = _load_model(source, "float32", attention, None, False, quantization)
    return {path: variable.get_value() for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_int4_groups_must_divide_the_expert_depth():
    """Qwen3-MoE's experts contract over 32 (gate / up) and 24 (down): groups of 32 do not divide 24."""
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj \[4, 24, 32\].*quantization_group_size 32"):
        _engine("qwen3_moe", quantization="int4")
