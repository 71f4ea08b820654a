"""The pure-jax.numpy specification of ragged paged attention (see the package docstring)."""

import jax
import jax.numpy as jnp

# Legend: T = query tokens, N = query blocks, B = tokens per block, H = query heads, K = kv heads,
# G = query heads per kv head, D = head dim, S = sequences, P = pages per sequence, L = P * page_size.


def write_kv_pages(k_pages, v_pages, k, v, slot_ids):
    """Scatter this step's keys/values [T, K, D] into the pages [num_pages, page_size, K, D].

    slot_ids[t] = page * page_size + offset; padding tokens write to the reserved page 0.
    """
    page_size = k_pages.shape[1]
    pages, offsets = slot_ids // page_size, slot_ids % page_size
    k_pages = k_pages.at[pages, offsets].set(k.astype(k_pages.dtype), mode="promise_in_bounds")
    v_pages = v_pages.at[pages, offsets].set(v.astype(v_pages.dtype), mode="promise_in_bounds")
    return k_pages, v_pages


def ragged_paged_attention(q, k_pages, v_pages, page_table, token_seq_ids, positions, *,
                           query_block: int, sliding_window: int | None = None):
    """q [T, H, D]; pages [num_pages, page_size, K, D]; page_table [S, P]; token_seq_ids, positions [T].

    Returns [T, H, D] in q's dtype; softmax in float32 whatever the input dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_groups = num_heads // num_kv_heads
    num_blocks = num_tokens // query_block
    pages_per_seq = page_table.shape[1]
    context_len = pages_per_seq * page_size

    block_pages = page_table[token_seq_ids[::query_block]]  # [N, P]
    keys = k_pages[block_pages].reshape(num_blocks, context_len, num_kv_heads, head_dim)
    values = v_pages[block_pages].reshape(num_blocks, context_len, num_kv_heads, head_dim)
    queries = q.reshape(num_blocks, query_block, num_kv_heads, num_groups, head_dim)

    scores = jnp.einsum("nbkgd,nlkd->nkgbl", queries, keys, preferred_element_type=jnp.float32)
    scores = scores * (head_dim ** -0.5)
    query_positions = positions.reshape(num_blocks, query_block)[:, :, None]  # [N, B, 1]
    key_positions = jnp.arange(context_len)[None, None, :]  # [1, 1, L]
    visible = key_positions <= query_positions
    if sliding_window:
        visible &= key_positions > query_positions - sliding_window
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("nkgbl,nlkd->nbkgd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
