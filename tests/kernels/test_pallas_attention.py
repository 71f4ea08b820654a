"""The Pallas kernel (interpret mode on CPU) against the reference over a grid of shapes and dtypes."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import pallas, pallas_tpu, reference

TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}


def ragged_step(rng, page_size, head_dim, groups, dtype, query_block, num_kv_heads=2):
    """A step's inputs: sequences with contexts ending mid-page, a single-token sequence, padding slots."""
    num_pages = 64
    lengths = [1, page_size * 2 + 3, page_size * 3, 5 * page_size + page_size // 2]
    new_tokens = [1, 1, 1, 1] if query_block == 1 else [1, query_block, 2 * query_block - 3, query_block // 2]
    max_pages = -(-max(lengths) // page_size) + 1
    free = list(rng.permutation(np.arange(1, num_pages)))
    page_table = np.zeros((len(lengths) + 1, max_pages), np.int32)  # + a padding row
    token_seq_ids, positions = [], []
    for row, (length, num_new) in enumerate(zip(lengths, new_tokens)):
        page_table[row, :-(-length // page_size)] = [free.pop() for _ in range(-(-length // page_size))]
        padded = -(-num_new // query_block) * query_block
        token_seq_ids += [row] * padded
        positions += list(range(length - num_new, length)) + [-1] * (padded - num_new)
    token_seq_ids += [len(lengths)] * query_block  # a whole padding block
    positions += [-1] * query_block
    num_tokens = len(positions)
    heads = num_kv_heads * groups
    as_dtype = lambda x: jnp.asarray(x, dtype)
    q = as_dtype(rng.standard_normal((num_tokens, heads, head_dim)))
    k_pages = as_dtype(rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim)))
    v_pages = as_dtype(rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim)))
    return (q, k_pages, v_pages, jnp.asarray(page_table), jnp.asarray(token_seq_ids, jnp.int32),
            jnp.asarray(positions, jnp.int32))


GRID = [  # (page_size, head_dim, groups, dtype, query_block): each value of each axis appears
    (8, 64, 1, jnp.float32, 1), (16, 128, 4, jnp.float32, 1), (32, 64, 8, jnp.float32, 1),
    (8, 128, 8, jnp.float32, 16), (16, 64, 1, jnp.float32, 16), (32, 128, 4, jnp.float32, 8),
    (16, 64, 4, jnp.bfloat16, 1), (8, 128, 1, jnp.bfloat16, 16), (32, 64, 8, jnp.bfloat16, 16),
]


@pytest.mark.parametrize("page_size,head_dim,groups,dtype,query_block", GRID)
def test_kernel_matches_reference(page_size, head_dim, groups, dtype, query_block):
    args = ragged_step(np.random.default_rng(page_size + head_dim + groups), page_size, head_dim, groups, dtype,
                       query_block)
    expected = reference.ragged_paged_attention(*args, query_block=query_block)
    got = pallas.ragged_paged_attention(*args, query_block=query_block)  # interpret mode on CPU only
    assert got.dtype == expected.dtype and got.shape == expected.shape
    positions = np.asarray(args[5])
    real = positions >= 0
    np.testing.assert_allclose(np.asarray(got, np.float32)[real], np.asarray(expected, np.float32)[real],
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert np.all(np.asarray(got, np.float32)[~real] == 0), "padding tokens attend to nothing"


@pytest.mark.parametrize("num_splits,query_block,dtype,sliding_window", [
    (2, 1, jnp.float32, None), (3, 1, jnp.bfloat16, None), (4, 16, jnp.float32, None), (3, 1, jnp.float32, 20),
    (1, 16, jnp.float32, 20)])
def test_context_splits_and_sliding_window_match_reference(num_splits, query_block, dtype, sliding_window):
    """Flash-decoding splits of the page table (3 splits do not divide the spans evenly), merged outside."""
    args = ragged_step(np.random.default_rng(num_splits), 8, 64, 4, dtype, query_block)
    expected = reference.ragged_paged_attention(*args, query_block=query_block, sliding_window=sliding_window)
    got = pallas.ragged_paged_attention(*args, query_block=query_block, sliding_window=sliding_window,
                                        num_splits=num_splits)
    real = np.asarray(args[5]) >= 0
    np.testing.assert_allclose(np.asarray(got, np.float32)[real], np.asarray(expected, np.float32)[real],
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert np.all(np.asarray(got, np.float32)[~real] == 0)


def test_split_heuristic_fills_the_device():
    assert pallas.default_num_splits(num_programs=8, num_spans=64, cores=132) == 33  # batch 1, 8 kv heads
    assert pallas.default_num_splits(num_programs=512, num_spans=64, cores=132) == 1  # batch 64: enough programs
    assert pallas.default_num_splits(num_programs=8, num_spans=4, cores=132) == 4  # no more than spans
    assert pallas.default_num_splits(num_programs=8, num_spans=64, cores=0) == 1  # CPU interpret mode
    assert pallas.supported(128, 12, "gpu") and pallas.supported(96, 16, "gpu") is None
    assert pallas.supported(128, 16, "gpu") is None and pallas.supported(96, 12, "cpu") is None
    assert [pallas.cache_head_dim(d, "gpu") for d in (8, 12, 64, 80, 96, 100, 128)] == [16, 16, 64, 128, 128, 128, 128]
    assert pallas.cache_head_dim(96, "cpu") == pallas.cache_head_dim(96, "tpu") == 96


TPU_GRID = [(16, 128, 4, jnp.float32, 1), (8, 64, 1, jnp.float32, 16), (32, 64, 8, jnp.bfloat16, 16)]


@pytest.mark.parametrize("page_size,head_dim,groups,dtype,query_block", TPU_GRID)
def test_tpu_kernel_matches_reference(page_size, head_dim, groups, dtype, query_block):
    """The Mosaic kernel, in Pallas' TPU interpret mode (DMAs and semaphores emulated) off a TPU."""
    args = ragged_step(np.random.default_rng(3 * page_size + groups), page_size, head_dim, groups, dtype, query_block)
    expected = reference.ragged_paged_attention(*args, query_block=query_block)
    got = pallas_tpu.ragged_paged_attention(*args, query_block=query_block)
    real = np.asarray(args[5]) >= 0
    np.testing.assert_allclose(np.asarray(got, np.float32)[real], np.asarray(expected, np.float32)[real],
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert np.all(np.asarray(got, np.float32)[~real] == 0)


def test_tpu_kernel_double_buffering_has_no_dma_races():
    """Pallas' TPU interpreter with its happens-before race detector: the next span's DMAs land in the
    other buffer while this span is read."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    from jax.experimental.pallas import tpu as pltpu

    args = ragged_step(np.random.default_rng(5), 32, 64, 4, jnp.float32, 1)  # 2 pages a span, up to 3 spans
    got = pallas_tpu.ragged_paged_attention(*args, query_block=1,
                                            interpret=pltpu.InterpretParams(detect_races=True))
    assert interpret_pallas_call.races is not None and not interpret_pallas_call.races.races_found
    expected = reference.ragged_paged_attention(*args, query_block=1)
    real = np.asarray(args[5]) >= 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(expected)[real], atol=1e-4, rtol=1e-4)


def test_block_size_heuristic():
    assert pallas.block_sizes(128, 16, jnp.float32) == 4
    assert pallas.block_sizes(128, 16, jnp.bfloat16) == 8
    assert pallas.block_sizes(256, 32, jnp.float32) == 1
    assert pallas.block_sizes(64, 128, jnp.float32) == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_kernel_matches_reference_scatter(dtype):
    rng = np.random.default_rng(7)
    pages = jnp.asarray(rng.standard_normal((12, 8, 2, 64)), dtype)
    k = jnp.asarray(rng.standard_normal((24, 2, 64)), jnp.float32)
    v = k * 3
    # real tokens spread over pages (one ending mid-page), then padding tokens all aimed at reserved slot 0
    slot_ids = jnp.asarray(list(range(8, 21)) + [40, 41, 95] + [0] * 8, jnp.int32)
    expected = reference.write_kv_pages(pages, pages + 1, k, v, slot_ids)
    got = pallas.write_kv_pages(jnp.array(pages), jnp.array(pages) + 1, k, v, slot_ids)
    for want, have in zip(expected, got):
        assert have.dtype == dtype
        np.testing.assert_array_equal(np.asarray(have[1:], np.float32), np.asarray(want[1:], np.float32))


def _consumers(function, args, names):
    """The primitives that consume each of the named inputs inside a jitted function's jaxpr."""
    import jax

    closed = jax.make_jaxpr(function)(*args)
    (outer,) = closed.jaxpr.eqns  # the jit
    inner = outer.params["jaxpr"].jaxpr
    inputs = dict(zip(names, inner.invars))
    return {name: [eqn.primitive.name for eqn in inner.eqns if any(v is var for v in eqn.invars)]
            for name, var in inputs.items()}, inner


@pytest.mark.parametrize("kernel", [pallas, pallas_tpu])
def test_kernels_read_the_page_pool_in_place(kernel):
    """K/V pages go straight into the kernel: no gather, copy or reshape of the pool before it."""
    args = ragged_step(np.random.default_rng(0), 16, 64, 4, jnp.float32, 1)
    consumers, _ = _consumers(lambda *a: kernel.ragged_paged_attention(*a, query_block=1), args,
                              ["q", "k_pages", "v_pages"])
    assert consumers["k_pages"] == ["pallas_call"] and consumers["v_pages"] == ["pallas_call"]


def test_write_kernel_updates_pages_in_place():
    pages = jnp.zeros((4, 8, 2, 64))
    k = jnp.ones((8, 2, 64))
    consumers, inner = _consumers(pallas.write_kv_pages, (pages, pages, k, k, jnp.zeros(8, jnp.int32)),
                                  ["k_pages", "v_pages"])
    assert consumers == {"k_pages": ["pallas_call"], "v_pages": ["pallas_call"]}
    (call,) = [eqn for eqn in inner.eqns if eqn.primitive.name == "pallas_call"]
    assert dict(call.params["input_output_aliases"]) == {3: 0, 4: 1}  # outputs alias the donated pages


LOWERING_GRID = [  # (page_size, head_dim, groups, dtype, query_block, num_splits)
    (16, 128, 4, jnp.bfloat16, 1, 1), (16, 128, 4, jnp.bfloat16, 1, 4), (16, 128, 8, jnp.bfloat16, 16, 1),
    (32, 64, 1, jnp.float32, 1, 2), (8, 64, 4, jnp.float32, 8, 1), (16, 256, 2, jnp.bfloat16, 1, 1)]


@pytest.mark.parametrize("page_size,head_dim,groups,dtype,query_block,num_splits", LOWERING_GRID)
def test_kernels_lower_for_gpu_and_tpu_without_one(page_size, head_dim, groups, dtype, query_block, num_splits):
    """The real (not interpret-mode) lowerings run in Python, so they are checked here: the Triton kernel
    for CUDA (compute capability 9.0 when no GPU is present) and the Mosaic kernel for a TPU v5e."""
    import functools

    import jax
    from jax._src.mesh import AbstractDevice, AbstractMesh

    args = ragged_step(np.random.default_rng(0), page_size, head_dim, groups, dtype, query_block)
    gpu = jax.jit(functools.partial(pallas.ragged_paged_attention, query_block=query_block, num_splits=num_splits,
                                    interpret=False))
    assert "triton" in gpu.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    tpu = jax.jit(functools.partial(pallas_tpu.ragged_paged_attention, query_block=query_block, interpret=False))
    v5e = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="TPU v5 lite", num_cores=1,
                                                                     platform="tpu"))
    with jax.sharding.use_abstract_mesh(v5e):
        assert "tpu_custom_call" in tpu.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    if query_block == 1 and num_splits == 1:  # the write kernel too
        pages, kv = args[1], args[1][:8, 0]
        write = jax.jit(functools.partial(pallas.write_kv_pages, interpret=False))
        assert "triton" in write.trace(pages, pages, kv, kv, jnp.zeros(8, jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()


def _pad_pages(args, width):
    q, k_pages, v_pages, *rest = args
    pad = ((0, 0),) * 3 + ((0, width - k_pages.shape[-1]),)
    return (q, jnp.pad(k_pages, pad), jnp.pad(v_pages, pad), *rest)


def test_what_triton_cannot_lower_is_refused_or_padded():
    """Page sizes that are not powers of two are refused on GPU; head dims that are not lower once the
    pages are padded to cache_head_dim (96 -> 128), and only then."""
    import functools

    import jax

    lower = lambda args: jax.jit(functools.partial(pallas.ragged_paged_attention, query_block=1, interpret=False)
                                 ).trace(*args).lower(lowering_platforms=("cuda",))
    assert pallas.supported(128, 12, "gpu") is not None
    with pytest.raises(ValueError, match="power of 2"):
        lower(ragged_step(np.random.default_rng(0), 12, 128, 4, jnp.bfloat16, 1))
    odd = ragged_step(np.random.default_rng(0), 16, 96, 4, jnp.bfloat16, 1)
    with pytest.raises(ValueError, match="power of 2"):
        lower(odd)
    assert "triton" in lower(_pad_pages(odd, pallas.cache_head_dim(96, "gpu"))).as_text()


@pytest.mark.parametrize("head_dim,query_block,num_splits,dtype", [
    (12, 1, 1, jnp.float32), (12, 16, 1, jnp.float32), (96, 1, 3, jnp.bfloat16), (20, 8, 2, jnp.float32)])
def test_padded_pages_match_the_reference(head_dim, query_block, num_splits, dtype):
    """Pages wider than the head dim, written by the write kernel (zero lanes), read with the real scale."""
    args = ragged_step(np.random.default_rng(head_dim), 8, head_dim, 4, dtype, query_block)
    expected = reference.ragged_paged_attention(*args, query_block=query_block)
    width = pallas.cache_head_dim(head_dim, "gpu")
    q, k_pages, v_pages, page_table, token_seq_ids, positions = _pad_pages(args, width)
    k_pages, v_pages = pallas.write_kv_pages(k_pages, v_pages, args[1][:4, 0], args[2][:4, 0],
                                             jnp.asarray([0, 1, 2, 3], jnp.int32))  # reserved page 0: never read
    assert np.all(np.asarray(k_pages[0, :4, :, head_dim:], np.float32) == 0), "extra lanes written as zeros"
    got = pallas.ragged_paged_attention(q, k_pages, v_pages, page_table, token_seq_ids, positions,
                                        query_block=query_block, num_splits=num_splits)
    assert got.shape == expected.shape
    real = np.asarray(positions) >= 0
    np.testing.assert_allclose(np.asarray(got, np.float32)[real], np.asarray(expected, np.float32)[real],
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
