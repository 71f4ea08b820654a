"""The real (not interpret-mode) lowerings of the Pallas kernels, checked on this CPU machine: the
Triton kernels for CUDA and the Mosaic kernel for a TPU v5e, and what Triton cannot lower."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice, AbstractMesh

from pallas_kernels.paged_attention import pallas_gpu, pallas_tpu
from tests.kernels.steps import pad_pages, ragged_step

LOWERING_GRID = [  # (page_size, head_dim, groups, dtype, query_block, num_splits)
    (16, 128, 4, jnp.bfloat16, 1, 1),
    (16, 128, 4, jnp.bfloat16, 1, 4),
    (16, 128, 8, jnp.bfloat16, 16, 1),
    (32, 64, 1, jnp.float32, 1, 2),
    (8, 64, 4, jnp.float32, 8, 1),
    (16, 256, 2, jnp.bfloat16, 1, 1),
]


@pytest.mark.parametrize("page_size,head_dim,groups,dtype,query_block,num_splits", LOWERING_GRID)
def test_kernels_lower_for_gpu_and_tpu_without_one(page_size, head_dim, groups, dtype, query_block, num_splits):
    """The lowerings run in Python, so they are checked here: the Triton kernel for CUDA (compute
    capability 9.0 when no GPU is present) and the Mosaic kernel for a TPU v5e."""
    args = ragged_step(np.random.default_rng(0), page_size, head_dim, groups, dtype, query_block)
    gpu = jax.jit(
        functools.partial(
            pallas_gpu.ragged_paged_attention, query_block=query_block, num_splits=num_splits, interpret=False
        )
    )
    assert "triton" in gpu.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    tpu = jax.jit(functools.partial(pallas_tpu.ragged_paged_attention, query_block=query_block, interpret=False))
    v5e = AbstractMesh(
        (1,), ("x",), abstract_device=AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
    )
    with jax.sharding.use_abstract_mesh(v5e):
        assert "tpu_custom_call" in tpu.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    if query_block == 1 and num_splits == 1:  # the write kernel too
        pages, kv = args[1], args[1][:8, 0]
        write = jax.jit(functools.partial(pallas_gpu.write_kv_pages, interpret=False))
        assert (
            "triton"
            in write.trace(pages, pages, kv, kv, jnp.zeros(8, jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        )


def test_what_triton_cannot_lower_is_refused_or_padded():
    """Page sizes that are not powers of two are refused on GPU; head dims that are not lower once the
    pages are padded to cache_head_dim (96 -> 128), and only then."""
    lower = lambda args: (
        jax.jit(functools.partial(pallas_gpu.ragged_paged_attention, query_block=1, interpret=False))
        .trace(*args)
        .lower(lowering_platforms=("cuda",))
    )
    assert pallas_gpu.supported(128, 12, "gpu") is not None
    with pytest.raises(ValueError, match="power of 2"):
        lower(ragged_step(np.random.default_rng(0), 12, 128, 4, jnp.bfloat16, 1))
    odd = ragged_step(np.random.default_rng(0), 16, 96, 4, jnp.bfloat16, 1)
    with pytest.raises(ValueError, match="power of 2"):
        lower(odd)
    assert "triton" in lower(pad_pages(odd, pallas_gpu.cache_head_dim(96, "gpu"))).as_text()
