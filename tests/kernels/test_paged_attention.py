"""The paged attention reference against plain dense causal attention."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention, write_kv_pages


def dense_attention(q, k, v, sliding_window=None):
    """q [T, H, D], k/v [T, K, D] of one sequence, causal."""
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(q.shape[-1])
    t = np.arange(q.shape[0])
    visible = t[None, :] <= t[:, None]
    if sliding_window:
        visible &= t[None, :] > t[:, None] - sliding_window
    scores = np.where(visible[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs, v)


@pytest.mark.parametrize("impl", ["reference", "cpu", "pallas"])
@pytest.mark.parametrize("num_heads,num_kv_heads,page_size,query_block,sliding_window", [
    (4, 4, 8, 1, None), (8, 2, 16, 4, None), (6, 1, 4, 8, None), (4, 2, 8, 4, 5), (4, 2, 4, 1, 70)])
def test_ragged_paged_attention_matches_dense(num_heads, num_kv_heads, page_size, query_block, sliding_window, impl):
    rng = np.random.default_rng(0)
    head_dim, num_pages = 16, 80
    # (context already cached, new query tokens) per sequence: a decode, a fresh prompt, a later chunk.
    layout = [(9, 1), (0, 11), (13, 6), (0, 1)] if query_block > 1 else [(9, 1), (20, 1), (0, 1), (150, 1)]
    k_pages = jnp.zeros((num_pages, page_size, num_kv_heads, head_dim))
    v_pages = jnp.zeros_like(k_pages)
    free_pages = list(rng.permutation(np.arange(1, num_pages)))
    max_pages = 40
    page_table = np.zeros((len(layout) + 1, max_pages), np.int32)  # one padding row
    tokens_q, token_seq_ids, positions, slot_ids, expected = [], [], [], [], []
    for row, (num_cached, num_new) in enumerate(layout):
        total = num_cached + num_new
        pages = [free_pages.pop() for _ in range(-(-total // page_size))]
        page_table[row, :len(pages)] = pages
        q = rng.standard_normal((total, num_heads, head_dim)).astype(np.float32)
        k = rng.standard_normal((total, num_kv_heads, head_dim)).astype(np.float32)
        v = rng.standard_normal((total, num_kv_heads, head_dim)).astype(np.float32)
        slots = np.array([pages[p // page_size] * page_size + p % page_size for p in range(total)], np.int32)
        # the cached context is written by earlier steps, the new tokens by this one (below)
        k_pages, v_pages = write_kv_pages(k_pages, v_pages, k[:num_cached], v[:num_cached], slots[:num_cached])
        padded = -(-num_new // query_block) * query_block
        pad = padded - num_new
        tokens_q.append(np.concatenate([q[num_cached:], np.zeros((pad, num_heads, head_dim), np.float32)]))
        token_seq_ids += [row] * padded
        positions += list(range(num_cached, total)) + [-1] * pad
        slot_ids += list(slots[num_cached:]) + [0] * pad
        new_k = np.concatenate([k[num_cached:], np.zeros((pad, num_kv_heads, head_dim), np.float32)])
        new_v = np.concatenate([v[num_cached:], np.zeros((pad, num_kv_heads, head_dim), np.float32)])
        expected.append((len(positions) - padded, num_new, dense_attention(q, k, v, sliding_window)[num_cached:]))
        tokens_q[-1] = (tokens_q[-1], new_k, new_v)
    # a whole padding block at the end
    q_all = np.concatenate([t[0] for t in tokens_q] + [np.zeros((query_block, num_heads, head_dim), np.float32)])
    k_new = np.concatenate([t[1] for t in tokens_q] + [np.zeros((query_block, num_kv_heads, head_dim), np.float32)])
    v_new = np.concatenate([t[2] for t in tokens_q] + [np.zeros((query_block, num_kv_heads, head_dim), np.float32)])
    token_seq_ids += [len(layout)] * query_block
    positions += [-1] * query_block
    slot_ids += [0] * query_block
    k_pages, v_pages = write_kv_pages(k_pages, v_pages, jnp.asarray(k_new), jnp.asarray(v_new),
                                      jnp.asarray(slot_ids, jnp.int32))
    out = ragged_paged_attention(jnp.asarray(q_all), k_pages, v_pages, jnp.asarray(page_table),
                                 jnp.asarray(token_seq_ids, jnp.int32), jnp.asarray(positions, jnp.int32),
                                 query_block=query_block, sliding_window=sliding_window, impl=impl)
    out = np.asarray(out)
    assert np.all(np.isfinite(out))
    for start, num_new, reference in expected:
        np.testing.assert_allclose(out[start:start + num_new], reference, rtol=2e-5, atol=2e-5)


def test_unknown_attention_impl_is_rejected():
    q = jnp.zeros((1, 1, 2))
    pages = jnp.zeros((2, 1, 1, 2))
    with pytest.raises(ValueError, match="attention_impl"):
        ragged_paged_attention(q, pages, pages, jnp.zeros((1, 1), jnp.int32), jnp.zeros(1, jnp.int32),
                               jnp.zeros(1, jnp.int32), query_block=1, impl="cuda-magic")


def test_bfloat16_attention_is_close_to_float32():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((4, 4, 8)).astype(np.float32)
    pages = rng.standard_normal((3, 4, 2, 8)).astype(np.float32)
    args = (jnp.asarray([[1, 2]], jnp.int32), jnp.zeros(4, jnp.int32), jnp.asarray([3, 4, 5, 6], jnp.int32))
    f32 = ragged_paged_attention(jnp.asarray(q), jnp.asarray(pages), jnp.asarray(pages), *args, query_block=4)
    bf16 = ragged_paged_attention(jnp.asarray(q, jnp.bfloat16), jnp.asarray(pages, jnp.bfloat16),
                                  jnp.asarray(pages, jnp.bfloat16), *args, query_block=4)
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(bf16, np.float32), np.asarray(f32), atol=5e-2)


def test_auto_falls_back_to_reference_without_a_compiler(monkeypatch, tmp_path):
    from pallas_kernels.paged_attention import cpu, resolve_attention_impl

    cpu._register.cache_clear()
    try:
        with monkeypatch.context() as patch:
            patch.setattr(cpu, "CACHE_DIR", str(tmp_path))
            patch.setattr(cpu.shutil, "which", lambda name: None)
            assert resolve_attention_impl("auto", "cpu", jnp.float32) == "reference"
    finally:
        cpu._register.cache_clear()
    assert resolve_attention_impl("auto", "cpu", jnp.float32) == "cpu"
    assert resolve_attention_impl("auto", "cpu", jnp.bfloat16) == "reference"
    with pytest.raises(ValueError, match="needs the CPU platform and float32"):
        resolve_attention_impl("cpu", "cpu", jnp.bfloat16)


def test_auto_takes_pallas_on_accelerators_where_the_kernel_fits():
    from pallas_kernels.paged_attention import resolve_attention_impl

    for platform in ("gpu", "tpu"):
        assert resolve_attention_impl("auto", platform, jnp.bfloat16, head_dim=128, page_size=16) == "pallas"
    # Triton wants power-of-two tiles: a head dim that is not gets wider (padded) pages, a page size that is
    # not keeps the reference under auto and is refused when asked for
    assert resolve_attention_impl("auto", "gpu", jnp.bfloat16, head_dim=96, page_size=16) == "pallas"
    assert resolve_attention_impl("auto", "gpu", jnp.bfloat16, head_dim=128, page_size=12) == "reference"
    with pytest.raises(ValueError, match="needs a power-of-two page_size, got 12"):
        resolve_attention_impl("pallas", "gpu", jnp.bfloat16, head_dim=128, page_size=12)
    assert resolve_attention_impl("pallas", "cpu", jnp.float32, head_dim=96, page_size=12) == "pallas"  # interpret
    assert resolve_attention_impl("auto", "gpu", jnp.bfloat16, partitioned=True, head_dim=128, page_size=16) == \
        "reference"


def test_start_up_probe_checks_the_kernels_against_the_reference(monkeypatch):
    from pallas_kernels.paged_attention import pallas
    from pallas_kernels.paged_attention.probe import pallas_problem

    # the kernels agree for GQA and both step kinds (here in interpret mode; on a GPU, as lowered)
    assert pallas_problem(8, 2, 64, 16, jnp.float32, query_blocks=(1, 16)) is None
    # odd sizes, on pages padded as the engine would allocate them on a GPU
    assert pallas_problem(5, 1, 12, 8, jnp.bfloat16, query_blocks=(1, 4), cache_head_dim=16) is None
    with monkeypatch.context() as patch:
        patch.setattr(pallas, "ragged_paged_attention", lambda q, *args, **kwargs: q * 2)
        assert "differ from the reference" in pallas_problem(4, 4, 16, 8, jnp.float32, query_blocks=(1,))

        def fails_to_lower(*args, **kwargs):
            raise NotImplementedError("Unimplemented primitive in Pallas GPU lowering: gather")

        patch.setattr(pallas, "ragged_paged_attention", fails_to_lower)
        assert pallas_problem(4, 4, 16, 8, jnp.float32, query_blocks=(1,)).startswith("NotImplementedError: ")


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
