"""cache.kv_dtype int8 / float8_e4m3, and the float32 fixture's cache in bfloat16 / float16, on the llama_gqa
fixture: teacher-forced greedy agreement with the float32 cache, prefix-cache and host-tier hits that give what no
cache gives (the scales travel with the pages), the bytes a token takes, no compiles after warm-up, bad options
refused."""

import json
import shutil

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.device.page_copies import host_pages_to_array
from jaxserve.models.kv_pages import KVPages
from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir

ENGINE = {**SMALL_ENGINE, "max_model_len": 256, "page_size": 8}
KV_DTYPES = ("int8", "float8_e4m3", "bfloat16", "float16")
QUANTIZED = ("int8", "float8_e4m3")  # values plus a float32 scale per token-head; the others plain 16-bit pages
# Teacher-forced top-1 agreement with the float cache over the fixture's prompts and continuations. The tiny
# random model's logits are nearly flat (top-2 gaps of a few 1e-3), so a quantized cache may flip a few near ties.
MIN_AGREEMENT = {"int8": 0.97, "float8_e4m3": 0.9, "bfloat16": 0.98, "float16": 0.99}
# largest |logprob difference| of the chosen tokens
# (measured: int8 0.017, bfloat16 0.0045, float16 0.0008; agreement 0.992 / 0.997 / 1.0 of 395 positions)
MAX_LOGPROB_DRIFT = {"int8": 0.02, "float8_e4m3": 0.1, "bfloat16": 0.01, "float16": 0.002}


def scored_prompts() -> list[list[int]]:
    return [p["token_ids"] + p["greedy_token_ids"] for p in expected("llama_gqa")["prompts"]]


@pytest.fixture(scope="module")
def float_llm():
    return LLM(fixture_dir("llama_gqa"), **ENGINE)


@pytest.fixture(scope="module", params=KV_DTYPES)
def quantized_llm(request):
    """A small page pool and a host tier, so that prefix pages are demoted and promoted."""
    return LLM(fixture_dir("llama_gqa"), **{**ENGINE, "kv_dtype": request.param, "num_pages": 16, "swap_space": 0.01})


def top_tokens(llm) -> list[list[tuple[int, float]]]:
    """Per prompt, per position after the first: (the top token, the logprob of the prompt's own token)."""
    outputs = llm.generate(scored_prompts(), SamplingParams(max_tokens=0, prompt_logprobs=1))
    rows = []
    for prompt, output in zip(scored_prompts(), outputs):
        scored = output.prompt_logprobs[1:]
        rows.append([(max(entry, key=entry.get), entry[token]) for token, entry in zip(prompt[1:], scored)])
    return rows


def test_teacher_forced_agreement_with_the_float_cache(float_llm, quantized_llm):
    kv_dtype = quantized_llm.engine.config.cache.kv_dtype
    want, got = top_tokens(float_llm), top_tokens(quantized_llm)
    pairs = [(w, g) for want_row, got_row in zip(want, got) for w, g in zip(want_row, got_row)]
    agreement = np.mean([w[0] == g[0] for w, g in pairs])
    drift = max(abs(w[1] - g[1]) for w, g in pairs)
    assert agreement >= MIN_AGREEMENT[kv_dtype], f"{kv_dtype}: top-1 agreement {agreement:.3f}"
    assert 0 < drift <= MAX_LOGPROB_DRIFT[kv_dtype], f"{kv_dtype}: logprob drift {drift}"
    assert quantized_llm.stats()["num_compiles_after_warmup"] == 0


def test_prefix_and_host_tier_hits_give_the_uncached_output(quantized_llm):
    rng = np.random.default_rng(5)
    prefix = [1] + rng.integers(3, 384, size=47).tolist()  # 6 full pages of 8
    prompt = prefix + [5, 6, 7]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = quantized_llm.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0
    device_hit = quantized_llm.generate([prompt], params)[0]
    assert device_hit.num_cached_tokens == 48
    assert device_hit.outputs[0].token_ids == first.outputs[0].token_ids

    allocator, runner = quantized_llm.engine.schedulers[0].allocator, quantized_llm.engine.runner
    saved = host_pages_to_array(runner.read_pages(allocator.find_cached_prefix(prefix, len(prefix)).pages))
    head_dim, kv_dtype = runner.kv_pages.keys[0].shape[-1], quantized_llm.engine.config.cache.kv_dtype
    if kv_dtype in QUANTIZED:
        assert saved.dtype == np.uint8 and saved.shape[-1] == head_dim + 4, "values and their scale's bytes"
    else:
        assert saved.dtype.name == kv_dtype and saved.shape[-1] == head_dim, "the 16-bit pages as they are"
    # unrelated prompts fill the 15 usable pages and demote every page of the prefix to the host tier
    quantized_llm.generate([[1] + rng.integers(3, 384, size=60).tolist() for _ in range(3)], params)
    assert allocator.find_cached_prefix(prefix, len(prefix)).pages == []
    host_hit = quantized_llm.generate([prompt], params)[0]
    assert host_hit.num_cached_tokens == 48 and quantized_llm.stats()["host_tier_hit_tokens"] >= 48
    assert host_hit.outputs[0].token_ids == first.outputs[0].token_ids
    promoted = allocator.find_cached_prefix(prefix, len(prefix)).pages
    np.testing.assert_array_equal(host_pages_to_array(runner.read_pages(promoted)), saved)
    assert quantized_llm.stats()["num_compiles_after_warmup"] == 0


def test_a_token_takes_values_plus_scales(float_llm, quantized_llm):
    config = float_llm.engine.model_config
    layers, heads, head_dim = config.num_layers, config.num_kv_heads, config.head_dim
    assert float_llm.stats()["kv_cache_bytes_per_token"] == 2 * layers * heads * head_dim * 4
    quantized = quantized_llm.engine.config.cache.kv_dtype in QUANTIZED
    bytes_per_token_head = head_dim + 4 if quantized else head_dim * 2
    assert quantized_llm.stats()["kv_cache_bytes_per_token"] == 2 * layers * heads * bytes_per_token_head


def test_pages_per_budget_about_double_bfloat16():
    """A 128-wide head (as the default model's): int8 pages take 132 / 256 of bfloat16's bytes."""
    bf16, int8 = (KVPages.bytes_per_page(32, 16, 8, 128, "bfloat16", kv_dtype) for kv_dtype in ("auto", "int8"))
    budget = 2**30
    assert budget // int8 / (budget // bf16) == pytest.approx(256 / 132, rel=1e-3)


def test_bad_kv_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_dtype 'int4'"):
        EngineConfig.from_options(kv_dtype="int4")
    with pytest.raises(ValueError, match="kv_dtype 'fp8'"):
        EngineConfig(cache={"kv_dtype": "fp8"})  # type: ignore[arg-type]  # a config file's cache section
    assert EngineConfig.from_options(kv_dtype="float8_e4m3").cache.kv_dtype == "float8_e4m3"
    assert EngineConfig(cache={"kv_dtype": "int8"}).cache.kv_dtype == "int8"  # type: ignore[arg-type]


def test_a_sixteen_bit_cache_is_for_float32_models():
    """bfloat16 / float16 pages halve a float32 model's cache; a 16-bit model's other 16-bit type is refused."""
    with pytest.raises(ValueError, match="kv_dtype='float16' with model dtype bfloat16"):
        EngineConfig.from_options(dtype="bfloat16", kv_dtype="float16")  # named: refused before anything loads
    assert EngineConfig.from_options(dtype="bfloat16", kv_dtype="bfloat16").cache.kv_dtype == "bfloat16"
    with pytest.raises(ValueError, match="kv_dtype='bfloat16' with model dtype float16"):
        LLM(fixture_dir("llama_gqa"), **{**SMALL_ENGINE, "dtype": "float16", "kv_dtype": "bfloat16"})
    f32, f16 = (KVPages.bytes_per_page(32, 16, 8, 128, "float32", kv_dtype) for kv_dtype in ("auto", "float16"))
    assert f16 * 2 == f32


def test_a_checkpoints_own_sixteen_bit_dtype_refuses_the_other_before_loading(tmp_path, monkeypatch):
    """dtype auto on a float16 checkpoint: a bfloat16 cache is refused from its config, before any weight is read."""
    from jaxserve.engine import builder

    checkpoint = tmp_path / "llama_f16"
    shutil.copytree(fixture_dir("llama_gqa"), checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "dtype": "float16"}))

    def load_model(*args, **kwargs):
        raise AssertionError("the weights were loaded before the cache's dtype was checked")

    monkeypatch.setattr(builder, "_load_model", load_model)
    with pytest.raises(ValueError, match="kv_dtype='bfloat16' with model dtype float16"):
        LLM(str(checkpoint), **{**SMALL_ENGINE, "dtype": "auto", "kv_dtype": "bfloat16"})


def test_latent_attention_models_refuse_a_quantized_cache():
    with pytest.raises(ValueError, match="kv_dtype='int8' is not served for multi-head latent attention"):
        LLM(fixture_dir("deepseek_v2_lite"), **{**SMALL_ENGINE, "kv_dtype": "int8"})
