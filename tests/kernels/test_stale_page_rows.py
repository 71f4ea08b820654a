"""Rows of a page that no query may see (past a sequence's newest key: what the page's last owner left there,
NaN or inf after a request that overflowed) change no output, in every attention implementation: a weight of 0
times such a value is NaN, not 0, unless the kernel keeps them out of its sums."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (
    cpu,
    cpu_latent,
    latent_pallas,
    latent_pallas_tpu,
    latent_reference,
    pallas_gpu,
    pallas_tpu,
    reference,
)
from pallas_kernels.paged_attention.kv_quantization import QuantizedPages, quantize

KERNELS = {
    "reference": reference,
    "cpu": cpu,
    "pallas_gpu": pallas_gpu,  # interpret mode off a GPU
    "pallas_tpu": pallas_tpu,  # Pallas' TPU interpret mode off a TPU
}
LATENT_KERNELS = {
    "reference": latent_reference,
    "cpu": cpu_latent,
    "pallas_gpu": latent_pallas,
    "pallas_tpu": latent_pallas_tpu,
}


def stale_step(rng, stale, page_size=8, num_kv_heads=1, num_heads=2, head_dim=16, query_block=4):
    """Two sequences: a decode block at position 5 and a prefill block at positions 9..11 (plus a padding
    token); every page row past each sequence's newest key, page 0 (padding entries of the table) included, is
    `stale`. Returns (args, clean pools) where the clean pools hold zeros in those rows."""
    shape = (4, page_size, num_kv_heads, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    page_table = np.asarray([[2, 0], [3, 1]], np.int32)
    newest = {2: 5, 3: page_size - 1, 1: 11 - page_size}  # page: its newest written row
    written = np.zeros(shape[:2], bool)
    for page, last in newest.items():
        written[page, : last + 1] = True
    k_stale, v_stale = (np.where(written[..., None, None], x, stale).astype(np.float32) for x in (k, v))
    k_clean, v_clean = (np.where(written[..., None, None], x, 0).astype(np.float32) for x in (k, v))
    positions = [5, -1, -1, -1, 9, 10, 11, -1]
    token_seq_ids = [0] * query_block + [1] * query_block
    q = rng.standard_normal((len(positions), num_heads, head_dim)).astype(np.float32)
    rest = (jnp.asarray(page_table), jnp.asarray(token_seq_ids, jnp.int32), jnp.asarray(positions, jnp.int32))
    return (jnp.asarray(q), k_stale, v_stale, *rest), (k_clean, v_clean)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("stale", [np.nan, np.inf])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_rows_past_the_newest_key_change_nothing(kernel, stale, kv_dtype):
    (q, k_stale, v_stale, *rest), (k_clean, v_clean) = stale_step(np.random.default_rng(0), stale)
    if kv_dtype == "int8":  # a stale row's scale is what is not finite

        def pool(x):
            values, scales = quantize(jnp.asarray(np.nan_to_num(x, nan=0.0, posinf=0.0)), jnp.int8)
            return QuantizedPages(values, jnp.where(jnp.isfinite(jnp.asarray(x)).all(-1), scales, stale))

        k_stale, v_stale, k_clean, v_clean = pool(k_stale), pool(v_stale), pool(k_clean), pool(v_clean)
    else:
        k_stale, v_stale, k_clean, v_clean = (jnp.asarray(x) for x in (k_stale, v_stale, k_clean, v_clean))
    module = KERNELS[kernel]
    got = np.asarray(module.ragged_paged_attention(q, k_stale, v_stale, *rest, query_block=4))
    want = np.asarray(reference.ragged_paged_attention(q, k_clean, v_clean, *rest, query_block=4))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stale", [np.nan, np.inf])
@pytest.mark.parametrize("kernel", sorted(LATENT_KERNELS))
def test_latent_rows_past_the_newest_key_change_nothing(kernel, stale):
    (_, first, second, *rest), (first_clean, second_clean) = stale_step(
        np.random.default_rng(1), stale, num_heads=3, head_dim=8
    )
    q = jnp.asarray(np.random.default_rng(2).standard_normal((8, 3, 16)), jnp.float32)
    module = LATENT_KERNELS[kernel]
    got = np.asarray(
        module.ragged_paged_latent_attention(
            q, jnp.asarray(first), jnp.asarray(second), *rest, query_block=4, scale=0.25
        )
    )
    want = np.asarray(
        latent_reference.ragged_paged_latent_attention(
            q, jnp.asarray(first_clean), jnp.asarray(second_clean), *rest, query_block=4, scale=0.25
        )
    )
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
