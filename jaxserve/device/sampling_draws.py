"""The sampler's random draws and its top-k / top-p / min-p nucleus, each row on its own: what a row samples
depends on its logits, its seed and its token's index alone, so a decode step, a verify step and any batch
give it alike (every sum here is elementwise adds, a reduce_window or layers.tree_sum, whose order no row count
changes).

- `inverse_cdf`: one uniform a row picks the token where the running mass passes it, in two levels (blocks
  of 128, then within the chosen block), so a draw over the vocabulary is one exp pass and small scans.
- `top_candidates`: the K most likely tokens in a stable sort's order (ties: the lower id first), found
  through the maxima of blocks of 16: the top K tokens lie in the K blocks with the highest maxima.
- `nucleus_from_candidates`: the top-k / top-p / min-p set within the candidates, and whether it ends
  inside them (else the caller sorts the whole row).

Why not Gumbel-max over the vocabulary and a sort of the row, as the sampler did: at 64 rows of a
49152-token vocabulary on a 2-core CPU the Gumbel noise (threefry over [S, V]) cost 22 ms a step, a sort
640 ms, next to a 65 ms greedy step; lax.top_k(256) over the row 11 ms, through the blocks ~2 ms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.models.layers import long_row_sum, tree_sum

# Legend: S = rows sampled, N = entries a row draws from, V = vocab, K = candidates.

DRAW_BLOCK = 128  # inverse_cdf's first level
CANDIDATE_BLOCK = 16  # top_candidates' blocks: smaller blocks gather fewer entries for the final top-k
CANDIDATES = 256  # top-k / top-p / min-p sets that end within the 256 most likely tokens skip the sort


def inclusive_scan(x):
    """Prefix sums over the last axis. jnp.cumsum is XLA's reduce_window here: each sum on its own in a fixed order
    (so every row alike whatever the rows), and a fifth of an associative scan's compile time."""
    return jnp.cumsum(x, axis=-1)


def first_where(mask, otherwise):
    """[S, N] bool -> [S] int32: each row's first index where mask holds, `otherwise` [S] where none does. (A min
    over indices: XLA compiles it several times faster than an argmax, a variadic reduce.)"""
    size = mask.shape[-1]
    first = jnp.min(jnp.where(mask, jnp.arange(size, dtype=jnp.int32), size), axis=-1)
    return jnp.where(first < size, first, otherwise).astype(jnp.int32)


def last_positive(probs):
    """[S, N] -> [S] int32: each row's last index with a positive entry (0 where none)."""
    return jnp.maximum(jnp.max(jnp.where(probs > 0, jnp.arange(probs.shape[-1], dtype=jnp.int32), -1), axis=-1), 0)


def draw_within(probs, uniforms):
    """probs [S, N] (unnormalized, >= 0), uniforms [S] in [0, 1) -> [S] int32: index i with probability
    probs_i / sum(probs), in one level (a few hundred entries: a row's candidates). Never an index of zero
    probability (see inverse_cdf)."""
    ends = inclusive_scan(probs)
    target = uniforms * ends[:, -1]
    return first_where((ends > target[:, None]) & (probs > 0), last_positive(probs))


def inverse_cdf(logits, uniforms):
    """logits [S, N] float32 (-inf: never drawn), uniforms [S] in [0, 1) -> [S] int32: index i of each row with
    probability softmax(row)_i. A row with no finite logit gets index 0. Never an index of zero probability:
    prefix sums in another order can round up at one, so the first index past the target must also be positive
    (else the last positive one: rounding at the row's end)."""
    num_rows, size = logits.shape
    block = min(DRAW_BLOCK, size)
    padded = jnp.pad(logits, ((0, 0), (0, -size % block)), constant_values=-jnp.inf)
    top = jnp.max(padded, axis=-1, keepdims=True)
    probs = jnp.exp(padded - jnp.where(jnp.isfinite(top), top, 0.0)).reshape(num_rows, -1, block)  # [S, B, block]
    block_sums = tree_sum(probs)[..., 0]  # [S, B]
    ends = inclusive_scan(block_sums)
    target = uniforms * ends[:, -1]
    chosen = first_where((ends > target[:, None]) & (block_sums > 0), last_positive(block_sums))
    starts = ends - block_sums
    start = jnp.take_along_axis(starts, chosen[:, None], axis=1)[:, 0]
    within = jnp.take_along_axis(probs, chosen[:, None, None], axis=1)[:, 0]  # [S, block]
    within_ends = inclusive_scan(within)
    index = first_where((within_ends > (target - start)[:, None]) & (within > 0), last_positive(within))
    return jnp.minimum(chosen * block + index, size - 1)


def top_candidates(logits, count: int):
    """logits [S, V] -> (values [S, K] descending, ids [S, K] int32), K = min(count, V): the row's K largest,
    ties in id order, as lax.top_k over the row gives them. Any of a row's top K tokens lies in one of the K blocks
    with the highest maxima (ties: lower blocks first): each block above it holds a token above it, and fewer
    than K are. Those blocks, gathered in vocabulary order (so ties stay in id order), hold K * 16 entries."""
    num_rows, vocab_size = logits.shape
    count = min(count, vocab_size)
    num_blocks = -(-vocab_size // CANDIDATE_BLOCK)
    if num_blocks <= 2 * count:  # a small vocabulary: the blocks would gather most of it
        ids = jax.lax.top_k(logits, count)[1].astype(jnp.int32)
        return jnp.take_along_axis(logits, ids, axis=1), ids
    padded = jnp.pad(logits, ((0, 0), (0, -vocab_size % CANDIDATE_BLOCK)), constant_values=-jnp.inf)
    blocks = padded.reshape(num_rows, num_blocks, CANDIDATE_BLOCK)
    _, best_blocks = jax.lax.top_k(blocks.max(axis=-1), count)
    best_blocks = jnp.sort(best_blocks, axis=-1)  # [S, K] in vocabulary order
    gathered = jnp.take_along_axis(blocks, best_blocks[:, :, None], axis=1).reshape(num_rows, -1)
    _, positions = jax.lax.top_k(gathered, count)
    ids = jnp.take_along_axis(best_blocks, positions // CANDIDATE_BLOCK, axis=1) * CANDIDATE_BLOCK
    ids = jnp.minimum(ids + positions % CANDIDATE_BLOCK, vocab_size - 1).astype(jnp.int32)
    # the values read back by id (the same numbers): where exp and a scan consumed top_k's own values output,
    # XLA:CPU's step took 36 ms over [64, 256] candidates instead of 1
    return jnp.take_along_axis(logits, ids, axis=1), ids


def nucleus_from_candidates(values, logits, top_k, top_p, min_p):
    """values [S, K]: a row's K most likely (scaled) logits, descending; logits [S, V] the whole rows -> (keep
    [S, K] bool, resolved [S] bool). The nucleus (every rule alike for tokens of equal logit, so a tie is kept or
    left whole): top-k keeps the tokens at least as likely as the k-th; top-p, over the distribution
    renormalized to those, keeps a token when the tokens strictly more likely hold less than top_p of the mass;
    min-p keeps those at least min_p times as likely as the most likely, which stays in any case. Each rule keeps
    a prefix of the candidates; `resolved`: the nucleus ends within them, so no token past them is in it (else
    nucleus_by_thresholds decides the row)."""
    num_rows, num_candidates = values.shape
    every_candidate = num_candidates == logits.shape[-1]
    rank = jnp.arange(num_candidates)[None, :]
    kth = jnp.take_along_axis(values, jnp.clip(top_k - 1, 0, num_candidates - 1)[:, None], axis=1)
    by_k = (top_k[:, None] <= 0) | (top_k[:, None] > num_candidates) | (values >= kth)
    exps = jnp.exp(values - values[:, :1])
    by_k_reaches_past = (top_k > 0) & by_k[:, -1]  # the top-k set's mass is not all in the candidates
    # shifted by the row's own max (the same value as values[:, :1]), so that this pass over the row does not wait
    # on the candidates
    whole = long_row_sum(jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)))[:, 0]
    mass = jnp.where(top_k > 0, tree_sum(jnp.where(by_k, exps, 0.0))[:, 0], whole)
    probs = jnp.where(by_k, exps, 0.0) / mass[:, None]
    before = inclusive_scan(probs) - probs  # mass ranked before each candidate
    by_p = (before < top_p[:, None]) | (top_p[:, None] >= 1)  # 1: every token, whatever the rounding
    prefix = by_k & by_p & (exps >= min_p[:, None]) | (rank == 0)
    # the prefix up to its first miss, then every candidate as likely as its last: top-k and min-p keep ties whole
    # already, and a tie's first candidate has the strictly more likely before it, so top-p keeps it whole too
    cut = first_where(~prefix, jnp.full((num_rows,), num_candidates))
    last = jnp.take_along_axis(values, (cut - 1)[:, None], axis=1)
    keep = values >= last
    if every_candidate:  # nothing past them
        return keep, jnp.ones(keep.shape[:1], jnp.bool_)
    return keep, ~keep[:, -1] & ~by_k_reaches_past


def float_keys(x):
    """float32 -> uint32 in the same order (-0.0 taken as 0.0), for searching thresholds by halving."""
    bits = jax.lax.bitcast_convert_type(x + 0.0, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def lowest_key_where(holds, keys):
    """The smallest t in [0, max key] with holds(t) [S] bool, per row, for a predicate false at 0 and monotone
    (once true for t, true above): 32 halvings of the uint32 range."""
    high = keys.max(axis=-1)
    low = jnp.zeros_like(high)

    def halve(_, bounds):
        low, high = bounds
        middle = low + (high - low) // 2
        yes = holds(middle)
        return jnp.where(yes, low, middle), jnp.where(yes, middle, high)

    _, high = jax.lax.fori_loop(0, 32, halve, (low, high))
    return high


def nucleus_by_thresholds(logits, top_k, top_p, min_p):
    """nucleus_from_candidates' rules over whole rows [S, V] -> keep [S, V] bool, found as logit thresholds by
    halving (each halving one pass over the row): for rows whose nucleus passes the candidates (flat
    distributions, top_k above them), where a sort of a 49152-token row cost XLA:CPU 10 ms."""
    keys = float_keys(logits)
    exps = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
    # top-k: the k-th most likely's key, the lowest t with fewer than k tokens above it
    k_key = jax.lax.cond(
        jnp.any(top_k > 0),
        lambda: lowest_key_where(lambda t: jnp.sum(keys > t[:, None], axis=-1) < top_k, keys),
        lambda: jnp.zeros(keys.shape[:1], jnp.uint32),
    )
    by_k = (top_k[:, None] <= 0) | (keys >= k_key[:, None])
    exps = jnp.where(by_k, exps, 0.0)
    goal = top_p * long_row_sum(exps)[:, 0]
    # top-p: the lowest t with less than top_p of the mass above it
    p_key = lowest_key_where(lambda t: long_row_sum(jnp.where(keys > t[:, None], exps, 0.0))[:, 0] < goal, keys)
    most_likely = keys == keys.max(axis=-1, keepdims=True)
    by_p = (keys >= p_key[:, None]) | (top_p[:, None] >= 1)
    return by_k & by_p & (exps >= min_p[:, None]) | most_likely
