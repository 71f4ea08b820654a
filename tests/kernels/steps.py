"""Attention steps to feed the kernels, and how their outputs are compared with the reference."""

import jax.numpy as jnp
import numpy as np

TOLERANCE = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 3e-2, jnp.dtype(jnp.float16): 5e-3}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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


def ragged_step(rng, page_size, head_dim, groups, dtype, query_block, num_kv_heads=2):
    """A step's inputs: sequences with contexts ending mid-page, a single-token sequence, padding slots."""
    num_pages = 64
    lengths = [1, page_size * 2 + 3, page_size * 3, 5 * page_size + page_size // 2]
    new_tokens = [1, 1, 1, 1] if query_block == 1 else [1, query_block, 2 * query_block - 3, query_block // 2]
    max_pages = cdiv(max(lengths), page_size) + 1
    free = list(rng.permutation(np.arange(1, num_pages)))
    page_table = np.zeros((len(lengths) + 1, max_pages), np.int32)  # + a padding row
    token_seq_ids, positions = [], []
    for row, (length, num_new) in enumerate(zip(lengths, new_tokens)):
        page_table[row, : cdiv(length, page_size)] = [free.pop() for _ in range(cdiv(length, page_size))]
        padded = cdiv(num_new, query_block) * query_block
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
    return (
        q,
        k_pages,
        v_pages,
        jnp.asarray(page_table),
        jnp.asarray(token_seq_ids, jnp.int32),
        jnp.asarray(positions, jnp.int32),
    )


def pad_pages(args, width):
    """A step's K/V pages zero padded to `width` lanes, as the engine allocates them for the Triton kernel."""
    q, k_pages, v_pages, *rest = args
    pad = ((0, 0),) * 3 + ((0, width - k_pages.shape[-1]),)
    return (q, jnp.pad(k_pages, pad), jnp.pad(v_pages, pad), *rest)


def assert_matches_on_real_tokens(got, expected, positions, tolerance):
    """Close to the reference for real tokens; zeros for padding tokens (they attend to nothing)."""
    real = np.asarray(positions) >= 0
    np.testing.assert_allclose(
        np.asarray(got, np.float32)[real], np.asarray(expected, np.float32)[real], atol=tolerance, rtol=tolerance
    )
    assert np.all(np.asarray(got, np.float32)[~real] == 0), "padding tokens attend to nothing"
