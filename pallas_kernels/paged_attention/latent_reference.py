"""The pure-jax.numpy specification of ragged paged latent attention (DeepSeek's MLA, see latent.py).

One cache head per token holds an entry of 2C lanes ([latent | rope key | zero padding]): its first C
lanes in the key pool, its last C in the value pool. Every query head scores the whole entry and reads
it back as its value, so the output has the entry's 2C lanes (the model keeps the latent's).
"""

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.reference import KEYS_PER_SPAN
from pallas_kernels.paged_attention.reference import write_kv_pages as _write_halves

# Legend: T = query tokens, N = query blocks, B = tokens per block, H = query heads, C = lanes per pool
# (half an entry), S = sequences, P = pages per sequence, L = keys in a span.


def write_latent_pages(first_pages, second_pages, entries, kv_indices):
    """entries [T, 1, 2C] -> their halves into row kv_indices[t] of the pools [num_pages, page_size, 1, C]."""
    half = first_pages.shape[-1]
    entries = jnp.pad(entries, ((0, 0), (0, 0), (0, 2 * half - entries.shape[-1])))
    return _write_halves(first_pages, second_pages, entries[..., :half], entries[..., half:], kv_indices)


def ragged_paged_latent_attention(
    q, first_pages, second_pages, page_table, token_seq_ids, positions, *, query_block: int, scale: float
):
    """q [T, H, 2C]; pools [num_pages, page_size, 1, C]; page_table [S, P]; token_seq_ids, positions [T].

    Returns softmax(scale * q . entry) @ entry per head: [T, H, 2C] in q's dtype, softmax in float32.
    Causal by absolute position; padding tokens (position -1) see nothing and come out as zeros. Walks
    the pages in spans with an online softmax as reference.ragged_paged_attention does.
    """
    num_tokens, num_heads, width = q.shape
    _, page_size, num_cache_heads, half = first_pages.shape
    if num_cache_heads != 1 or width != 2 * half:
        raise ValueError(
            f"latent attention reads one cache head of q's width / 2, got {first_pages.shape}, q {q.shape}"
        )
    num_blocks = num_tokens // query_block
    pages_per_span = max(1, KEYS_PER_SPAN // page_size)
    span = pages_per_span * page_size

    block_pages = page_table[token_seq_ids[::query_block]]  # [N, P]
    block_pages = jnp.pad(block_pages, ((0, 0), (0, -block_pages.shape[1] % pages_per_span)))
    queries = q.reshape(num_blocks, query_block, num_heads, width).astype(jnp.float32) * scale
    query_positions = positions.reshape(num_blocks, query_block)[:, None, :, None]  # [N, 1, B, 1]
    newest_positions = positions.reshape(num_blocks, query_block).max(axis=1, keepdims=True)  # [N, 1]

    def attend_span(index, carry):
        running_max, denominator, accumulator = carry  # [N, H, B], [N, H, B], [N, H, B, 2C]
        pages = jax.lax.dynamic_slice_in_dim(block_pages, index * pages_per_span, pages_per_span, axis=1)
        entries = jnp.concatenate(
            [first_pages[pages].reshape(num_blocks, span, half), second_pages[pages].reshape(num_blocks, span, half)],
            axis=-1,
        )  # [N, L, 2C]
        # rows past the block's newest key hold whatever the page's last owner left (NaN, even): zeroed
        written = index * span + jnp.arange(span)[None, :] <= newest_positions  # [N, L]
        entries = jnp.where(written[:, :, None], entries, 0)
        scores = jnp.einsum("nbhc,nlc->nhbl", queries, entries, preferred_element_type=jnp.float32)
        key_positions = index * span + jnp.arange(span)[None, None, None, :]  # [1, 1, 1, L]
        scores = jnp.where(key_positions <= query_positions, scores, -jnp.inf)
        new_max = jnp.maximum(running_max, scores.max(axis=-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # rows that have seen no key yet
        rescale = jnp.exp(running_max - safe_max)
        weights = jnp.exp(scores - safe_max[..., None])
        denominator = denominator * rescale + weights.sum(axis=-1)
        accumulator = accumulator * rescale[..., None] + jnp.einsum(
            "nhbl,nlc->nhbc", weights.astype(entries.dtype), entries, preferred_element_type=jnp.float32
        )
        return new_max, denominator, accumulator

    stats_shape = (num_blocks, num_heads, query_block)
    init = (
        jnp.full(stats_shape, -jnp.inf, jnp.float32),
        jnp.zeros(stats_shape, jnp.float32),
        jnp.zeros(stats_shape + (width,), jnp.float32),
    )
    num_spans = jnp.minimum((jnp.max(positions) + span) // span, block_pages.shape[1] // pages_per_span)
    _, denominator, accumulator = jax.lax.fori_loop(0, num_spans, attend_span, init)
    out = accumulator / jnp.where(denominator > 0, denominator, 1.0)[..., None]  # padding rows saw nothing
    return out.transpose(0, 2, 1, 3).reshape(num_tokens, num_heads, width).astype(q.dtype)
