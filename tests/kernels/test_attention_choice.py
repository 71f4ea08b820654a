"""Which implementation serves a step (resolve_attention_impl, the start-up probe) and the sizes the
Pallas kernels choose for it (spans, context splits, cache head dim)."""

import jax.numpy as jnp
import pytest

from pallas_kernels import cpu_library, ragged_paged_attention
from pallas_kernels.paged_attention import pallas_gpu, resolve_attention_impl
from pallas_kernels.paged_attention.pallas_layout import block_sizes
from pallas_kernels.paged_attention.probe import pallas_problem


def test_unknown_attention_impl_is_rejected():
    q = jnp.zeros((1, 1, 2))
    pages = jnp.zeros((2, 1, 1, 2))
    with pytest.raises(ValueError, match="attention_impl"):
        ragged_paged_attention(
            q,
            pages,
            pages,
            jnp.zeros((1, 1), jnp.int32),
            jnp.zeros(1, jnp.int32),
            jnp.zeros(1, jnp.int32),
            query_block=1,
            impl="cuda-magic",
        )


def test_auto_falls_back_to_reference_without_a_compiler(monkeypatch, tmp_path):
    cpu_library.load.cache_clear()
    cpu_library.register.cache_clear()
    try:
        with monkeypatch.context() as patch:
            patch.setattr(cpu_library, "CACHE_DIR", str(tmp_path))
            patch.setattr(cpu_library.shutil, "which", lambda name: None)
            assert resolve_attention_impl("auto", "cpu", jnp.float32) == "reference"
            assert resolve_attention_impl("auto", "cpu", jnp.bfloat16) == "reference"
    finally:
        cpu_library.load.cache_clear()
        cpu_library.register.cache_clear()
    # the C++ kernels serve float32 and 16-bit pages (issue #16: bfloat16 is what most checkpoints are)
    assert resolve_attention_impl("auto", "cpu", jnp.float32) == "cpu"
    assert resolve_attention_impl("auto", "cpu", jnp.bfloat16) == "cpu"
    assert resolve_attention_impl("auto", "cpu", jnp.float16) == "cpu"
    assert resolve_attention_impl("auto", "cpu", jnp.float64) == "reference"
    with pytest.raises(ValueError, match="needs the CPU platform and one of"):
        resolve_attention_impl("cpu", "cpu", jnp.float64)
    with pytest.raises(ValueError, match="needs the CPU platform and one of"):
        resolve_attention_impl("cpu", "gpu", jnp.float32)


def test_auto_takes_pallas_on_accelerators_where_the_kernel_fits():
    for platform in ("gpu", "tpu"):
        assert resolve_attention_impl("auto", platform, jnp.bfloat16, head_dim=128, page_size=16) == "pallas"
    # Triton wants power-of-two tiles: a head dim that is not gets wider (padded) pages, a page size that is
    # not keeps the reference under auto and is refused when asked for
    assert resolve_attention_impl("auto", "gpu", jnp.bfloat16, head_dim=96, page_size=16) == "pallas"
    assert resolve_attention_impl("auto", "gpu", jnp.bfloat16, head_dim=128, page_size=12) == "reference"
    with pytest.raises(ValueError, match="needs a power-of-two page_size, got 12"):
        resolve_attention_impl("pallas", "gpu", jnp.bfloat16, head_dim=128, page_size=12)
    assert resolve_attention_impl("pallas", "cpu", jnp.float32, head_dim=96, page_size=12) == "pallas"  # interpret
    assert (
        resolve_attention_impl("auto", "gpu", jnp.bfloat16, partitioned=True, head_dim=128, page_size=16) == "reference"
    )


def test_start_up_probe_checks_the_kernels_against_the_reference(monkeypatch):
    # the kernels agree for GQA and both step kinds (here in interpret mode; on a GPU, as lowered)
    assert pallas_problem(8, 2, 64, 16, jnp.float32, query_blocks=(1, 16)) is None
    # odd sizes, on pages padded as the engine would allocate them on a GPU
    assert pallas_problem(5, 1, 12, 8, jnp.bfloat16, query_blocks=(1, 4), cache_head_dim=16) is None
    # a float32 model's 16-bit cache (cache.kv_dtype): the matmuls in 16 bits, checked at 16-bit tolerance
    assert pallas_problem(4, 2, 16, 8, jnp.float32, query_blocks=(1,), page_dtype=jnp.float16) is None
    with monkeypatch.context() as patch:
        patch.setattr(pallas_gpu, "ragged_paged_attention", lambda q, *args, **kwargs: q * 2)
        assert "differ from the reference" in pallas_problem(4, 4, 16, 8, jnp.float32, query_blocks=(1,))

        def fails_to_lower(*args, **kwargs):
            raise NotImplementedError("Unimplemented primitive in Pallas GPU lowering: gather")

        patch.setattr(pallas_gpu, "ragged_paged_attention", fails_to_lower)
        assert pallas_problem(4, 4, 16, 8, jnp.float32, query_blocks=(1,)).startswith("NotImplementedError: ")


def test_split_heuristic_fills_the_device():
    assert pallas_gpu.default_num_splits(num_programs=8, num_spans=64, cores=132) == 33  # batch 1, 8 kv heads
    assert pallas_gpu.default_num_splits(num_programs=512, num_spans=64, cores=132) == 1  # batch 64: enough
    assert pallas_gpu.default_num_splits(num_programs=8, num_spans=4, cores=132) == 4  # no more than spans
    assert pallas_gpu.default_num_splits(num_programs=8, num_spans=64, cores=0) == 1  # CPU interpret mode
    assert pallas_gpu.supported(128, 12, "gpu") and pallas_gpu.supported(96, 16, "gpu") is None
    assert pallas_gpu.supported(128, 16, "gpu") is None and pallas_gpu.supported(96, 12, "cpu") is None
    assert [pallas_gpu.cache_head_dim(d, "gpu") for d in (8, 12, 64, 80, 96, 100, 128)] == [
        16,
        16,
        64,
        128,
        128,
        128,
        128,
    ]
    assert pallas_gpu.cache_head_dim(96, "cpu") == pallas_gpu.cache_head_dim(96, "tpu") == 96


def test_block_size_heuristic():
    assert block_sizes(128, 16, jnp.float32) == 4
    assert block_sizes(128, 16, jnp.bfloat16) == 8
    assert block_sizes(256, 32, jnp.float32) == 1
    assert block_sizes(64, 128, jnp.float32) == 1
