"""The pure-jax.numpy specification of ragged paged attention (see the package docstring)."""

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.kv_quantization import gather_dequantized, is_quantized, write_quantized

KEYS_PER_SPAN = 64  # keys gathered per online-softmax step: large enough for real matmuls, small enough for cache

# Legend: T = query tokens, N = query blocks, B = tokens per block, H = query heads, K = kv heads,
# G = query heads per kv head, D = head dim, S = sequences, P = pages per sequence, L = keys in a span.


def write_kv_pages(k_pages, v_pages, k, v, kv_indices):
    """Scatter this step's keys/values [T, K, D] into the pages [num_pages, page_size, K, D].

    kv_indices[t] = page * page_size + offset; padding tokens write to the reserved page 0.
    Quantized pools (kv_quantization.QuantizedPages) get the rows quantized with their scales.
    """
    if is_quantized(k_pages):
        return write_quantized(k_pages, k, kv_indices), write_quantized(v_pages, v, kv_indices)
    page_size = k_pages.shape[1]
    pages, offsets = kv_indices // page_size, kv_indices % page_size
    k_pages = k_pages.at[pages, offsets].set(k.astype(k_pages.dtype), mode="promise_in_bounds")
    v_pages = v_pages.at[pages, offsets].set(v.astype(v_pages.dtype), mode="promise_in_bounds")
    return k_pages, v_pages


def ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    page_table,
    token_seq_ids,
    positions,
    *,
    query_block: int,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks=None,
):
    """q [T, H, D]; pages [num_pages, page_size, K, D]; page_table [S, P]; token_seq_ids, positions [T].

    Returns [T, H, D] in q's dtype; softmax in float32 whatever the input dtype.
    sliding_window: a query at position p sees keys p - window < key <= p (None or 0: every earlier key);
    logits_soft_cap: scaled scores become cap * tanh(score / cap) before the softmax (None or 0: as they are);
    sinks: [H] attention sinks (GPT-OSS), one learned logit per query head that joins each softmax's
    denominator with no value (None: none).
    Pages may be quantized (kv_quantization.QuantizedPages): each span is widened and scaled as it is read.

    Walks the pages in spans of KEYS_PER_SPAN keys with an online softmax, as a kernel would: only
    one span of pages is gathered at a time, and spans past the step's longest context are skipped,
    so the cost follows the real context lengths rather than the page bucket.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_groups = num_heads // num_kv_heads
    num_blocks = num_tokens // query_block
    pages_per_span = max(1, KEYS_PER_SPAN // page_size)
    span = pages_per_span * page_size

    block_pages = page_table[token_seq_ids[::query_block]]  # [N, P]
    block_pages = jnp.pad(block_pages, ((0, 0), (0, -block_pages.shape[1] % pages_per_span)))
    queries = q.reshape(num_blocks, query_block, num_kv_heads, num_groups, head_dim)
    queries = queries.astype(jnp.float32) * (head_dim**-0.5)
    query_positions = positions.reshape(num_blocks, query_block)[:, :, None]  # [N, B, 1]
    newest_positions = query_positions.max(axis=1)  # [N, 1]: keys past a block's newest were never written

    def attend_span(index, carry):
        running_max, denominator, accumulator = carry  # [N, K, G, B], [N, K, G, B], [N, K, G, B, D]
        pages = jax.lax.dynamic_slice_in_dim(block_pages, index * pages_per_span, pages_per_span, axis=1)
        keys = gather_dequantized(k_pages, pages).reshape(num_blocks, span, num_kv_heads, head_dim)
        values = gather_dequantized(v_pages, pages).reshape(num_blocks, span, num_kv_heads, head_dim)
        # a page's rows past the block's newest key hold whatever its last owner left (NaN or inf, even), and a
        # weight of 0 times them is not 0: zeroed, so only written keys reach the sums
        written = index * span + jnp.arange(span)[None, :] <= newest_positions  # [N, L]
        values = jnp.where(written[:, :, None, None], values, 0)
        scores = jnp.einsum("nbkgd,nlkd->nkgbl", queries, keys, preferred_element_type=jnp.float32)
        if logits_soft_cap:
            scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
        key_positions = index * span + jnp.arange(span)[None, None, :]  # [1, 1, L]
        visible = key_positions <= query_positions
        if sliding_window:
            visible &= key_positions > query_positions - sliding_window
        scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
        new_max = jnp.maximum(running_max, scores.max(axis=-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # rows that have seen no key yet
        rescale = jnp.exp(running_max - safe_max)
        weights = jnp.exp(scores - safe_max[..., None])
        denominator = denominator * rescale + weights.sum(axis=-1)
        accumulator = accumulator * rescale[..., None] + jnp.einsum(
            "nkgbl,nlkd->nkgbd",
            weights.astype(jnp.promote_types(values.dtype, q.dtype)),  # float32 weights for 16-bit pages, float32 q
            values,
            preferred_element_type=jnp.float32,
        )
        return new_max, denominator, accumulator

    stats_shape = (num_blocks, num_kv_heads, num_groups, query_block)
    init = (
        jnp.full(stats_shape, -jnp.inf, jnp.float32),
        jnp.zeros(stats_shape, jnp.float32),
        jnp.zeros(stats_shape + (head_dim,), jnp.float32),
    )
    if sinks is not None:  # the sink as a first key of weight exp(sink) and a zero value
        sink_max = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, num_kv_heads, num_groups, 1), stats_shape)
        init = (sink_max, jnp.ones(stats_shape, jnp.float32), init[2])
    num_spans = jnp.minimum((jnp.max(positions) + span) // span, block_pages.shape[1] // pages_per_span)
    _, denominator, accumulator = jax.lax.fori_loop(0, num_spans, attend_span, init)
    out = accumulator / jnp.where(denominator > 0, denominator, 1.0)[..., None]  # padding rows saw nothing
    return out.transpose(0, 3, 1, 2, 4).reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
