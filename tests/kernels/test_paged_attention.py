"""Engine-level attention tests: an engine serving from padded pages, the probe's fallback, and the whole
engine step lowered for a GPU and a TPU. They build an LLM, so they belong with the engine's tests
(tests/engine); the kernel tests are beside them: test_kernels_vs_reference.py, test_kernel_lowering.py,
test_attention_choice.py and test_pages_in_place.py."""


def test_engine_serves_from_padded_pages(monkeypatch):
    """What a GPU does for a head dim Triton cannot tile (12 here): pages 16 wide, zero padded."""
    from tests.support.fixtures import SMALL_ENGINE, fixture_dir
    from jaxserve import LLM
    from jaxserve.engine import engine
    from tests.support.hf_parity import check_against_hf

    monkeypatch.setattr(engine, "kv_cache_head_dim", lambda impl, platform, head_dim: 16)
    llm = LLM(fixture_dir("llama_mqa_odd"), **{**SMALL_ENGINE, "attention_impl": "pallas"})
    assert llm.engine.runner.kv_pages.keys[0].shape[-1] == 16
    check_against_hf(llm, "llama_mqa_odd")


def test_auto_falls_back_to_the_reference_when_the_probe_fails(monkeypatch):
    """What an accelerator whose Pallas lowering breaks would see: a warning, then the reference."""
    from tests.support.fixtures import SMALL_ENGINE, fixture_dir
    from jaxserve import LLM
    from jaxserve.engine import engine

    monkeypatch.setattr(engine, "resolve_attention_impl", lambda *args, **kwargs: "pallas")
    monkeypatch.setattr(engine, "pallas_problem", lambda *args, **kwargs: "LoweringError: no gather")
    llm = LLM(fixture_dir("llama_gqa"), **{**SMALL_ENGINE, "attention_impl": "auto"})
    assert llm.stats()["attention_impl"] == "reference"


def test_the_whole_engine_step_lowers_for_a_gpu(monkeypatch):
    """Every step executable of a Mixtral engine with attention_impl="pallas", lowered for CUDA on this
    machine as a GPU engine would build it (padded pages, Triton kernels), not in interpret mode."""
    import jax

    from tests.support.fixtures import SMALL_ENGINE, fixture_dir
    from jaxserve import LLM
    from jaxserve.engine import engine
    from jaxserve.device.step_inputs import build_ranked_inputs
    from jaxserve.device.runner import _abstract
    from pallas_kernels.paged_attention import pallas

    monkeypatch.setattr(engine, "kv_cache_head_dim", lambda impl, platform, head_dim: pallas.cache_head_dim(
        head_dim, "gpu"))
    llm = LLM(fixture_dir("mixtral"), **{**SMALL_ENGINE, "attention_impl": "pallas", "dtype": "bfloat16"})
    runner = llm.engine.runner
    jax.clear_caches()  # the kernels' traces chose interpret mode by the backend: trace them again
    try:
        with monkeypatch.context() as patch:
            patch.setattr(jax, "default_backend", lambda: "gpu")
            for shape in runner.all_shapes():
                inputs = build_ranked_inputs([[]], shape, runner.page_size)
                lowered = runner._jitted.trace(_abstract(runner.param_leaves), _abstract(runner.kv_pages),
                                               _abstract(inputs)).lower(lowering_platforms=("cuda",))
                assert "triton" in lowered.as_text()
    finally:
        jax.clear_caches()


def test_the_whole_engine_step_lowers_for_a_tpu(monkeypatch):
    """The same for a TPU v5e (abstract device): the Mosaic kernel with DMA'd pages, XLA's page writes."""
    import jax
    from jax._src.mesh import AbstractDevice, AbstractMesh

    from tests.support.fixtures import SMALL_ENGINE, fixture_dir
    from jaxserve import LLM
    from jaxserve.device.step_inputs import build_ranked_inputs
    from jaxserve.device.runner import _abstract

    llm = LLM(fixture_dir("llama_gqa"), **{**SMALL_ENGINE, "attention_impl": "pallas", "dtype": "bfloat16"})
    runner = llm.engine.runner
    v5e = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="TPU v5 lite", num_cores=1,
                                                                     platform="tpu"))
    jax.clear_caches()
    try:
        with monkeypatch.context() as patch:
            patch.setattr(jax, "default_backend", lambda: "tpu")
            for shape in runner.all_shapes():
                inputs = build_ranked_inputs([[]], shape, runner.page_size)
                with jax.sharding.use_abstract_mesh(v5e):
                    lowered = runner._jitted.trace(_abstract(runner.param_leaves), _abstract(runner.kv_pages),
                                                   _abstract(inputs)).lower(lowering_platforms=("tpu",))
                assert "tpu_custom_call" in lowered.as_text()
    finally:
        jax.clear_caches()
