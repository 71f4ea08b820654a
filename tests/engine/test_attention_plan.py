"""The engine's attention plan end to end: serving from padded pages, the start-up probe's fallback, and
every step executable of an engine lowered for a GPU and a TPU on this CPU machine."""

import contextlib

import jax
from jax._src.mesh import AbstractDevice, AbstractMesh

from jaxserve import LLM
from jaxserve.device.runner import _abstract
from jaxserve.device.step_inputs import all_step_shapes
from jaxserve.engine import attention_plan
from pallas_kernels.paged_attention import pallas_gpu
from tests.support.fixtures import DERIVED_BUCKETS, SMALL_ENGINE, fixture_dir
from tests.support.hf_parity import check_against_hf


def test_engine_serves_from_padded_pages(monkeypatch):
    """What a GPU does for a head dim Triton cannot tile (12 here): pages 16 wide, zero padded."""
    monkeypatch.setattr(attention_plan, "kv_cache_head_dim", lambda impl, platform, head_dim: 16)
    # one decode bucket: the interpret-mode kernel compiles slowly, and outputs do not depend on the bucket
    llm = LLM(fixture_dir("llama_mqa_odd"), **{**SMALL_ENGINE, "attention_impl": "pallas"})
    assert llm.engine.runner.kv_pages.keys[0].shape[-1] == 16
    check_against_hf(llm, "llama_mqa_odd")


def test_auto_falls_back_to_the_reference_when_the_probe_fails(monkeypatch):
    """What an accelerator whose Pallas lowering breaks would see: a warning, then the reference."""
    monkeypatch.setattr(attention_plan, "resolve_attention_impl", lambda *args, **kwargs: "pallas")
    monkeypatch.setattr(attention_plan, "pallas_problem", lambda *args, **kwargs: "LoweringError: no gather")
    llm = LLM(fixture_dir("llama_gqa"), **{**SMALL_ENGINE, "attention_impl": "auto"})
    assert llm.stats()["attention_impl"] == "reference"
    assert llm.engine.describe().attention_impl == "reference"


def _lower_every_step(monkeypatch, llm, platform: str, lowering_platform: str, abstract_mesh=None) -> list[str]:
    """The HLO text of every compiled bucket's step, traced again as `platform` would trace it."""
    runner = llm.engine.runner
    texts = []
    jax.clear_caches()  # the kernels' traces chose interpret mode by the backend: trace them again
    try:
        with monkeypatch.context() as patch:
            patch.setattr(jax, "default_backend", lambda: platform)
            for shape in all_step_shapes(runner.buckets, runner.prefill_query_block):
                inputs = runner.build_inputs([[]], shape)
                with jax.sharding.use_abstract_mesh(abstract_mesh) if abstract_mesh else contextlib.nullcontext():
                    traced = runner._jitted.trace(
                        _abstract(runner.param_leaves),
                        _abstract(runner.kv_pages),
                        _abstract(runner.buffers),
                        _abstract(inputs),
                    )
                    texts.append(traced.lower(lowering_platforms=(lowering_platform,)).as_text())
    finally:
        jax.clear_caches()
    return texts


def test_the_whole_engine_step_lowers_for_a_gpu(monkeypatch):
    """Every step executable of a Mixtral engine with attention_impl="pallas", lowered for CUDA on this
    machine as a GPU engine would build it (padded pages, Triton kernels), not in interpret mode."""
    monkeypatch.setattr(
        attention_plan, "kv_cache_head_dim", lambda impl, platform, head_dim: pallas_gpu.cache_head_dim(head_dim, "gpu")
    )
    # every derived bucket: a 1-row decode lowers its own kernel grid
    # num_scheduler_steps 1: a GPU engine's default (no decode chains: engine/decode_chain.py)
    llm = LLM(
        fixture_dir("mixtral"),
        **{**DERIVED_BUCKETS, "attention_impl": "pallas", "dtype": "bfloat16", "num_scheduler_steps": 1},
    )
    texts = _lower_every_step(monkeypatch, llm, "gpu", "cuda")
    assert len(texts) == llm.stats()["num_executables"]
    assert all("triton" in text for text in texts)


def test_the_whole_engine_step_lowers_for_a_tpu(monkeypatch):
    """The same for a TPU v5e (abstract device): the Mosaic kernel with DMA'd pages, XLA's page writes."""
    llm = LLM(fixture_dir("llama_gqa"), **{**DERIVED_BUCKETS, "attention_impl": "pallas", "dtype": "bfloat16"})
    v5e = AbstractMesh(
        (1,), ("x",), abstract_device=AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    )
    texts = _lower_every_step(monkeypatch, llm, "tpu", "tpu", abstract_mesh=v5e)
    assert texts and all("tpu_custom_call" in text for text in texts)
