"""Verification on the device (device/verify_step.py) against exact target probabilities: on a tiny vocabulary
with known logits, the tokens a verify row emits are distributed as sampling token by token from the target
(temperature, top-k / top-p, penalties counting the proposals before each position), whatever the proposal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.device.sampling_inputs import neutral_sampling_inputs
from jaxserve.device.sequence_buffers import SequenceBuffers
from jaxserve.device.verify_step import accepted_lengths, counts_with_drafts, record_accepted, verify

VOCAB, WIDTH = 6, 3  # W = k + 1 with k = 2


def sampling_rows(num_rows: int, temperature: float, top_k: int = 0, top_p: float = 1.0, presence: float = 0.0):
    """S * W sampling rows: row s's position i samples output token i with row s's seed."""
    n = num_rows * WIDTH
    seeds = np.stack([np.zeros(num_rows, np.uint32), np.arange(num_rows, dtype=np.uint32) + 7], axis=1)
    return neutral_sampling_inputs(
        n,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seeds=np.repeat(seeds, WIDTH, axis=0),
        token_indices=np.tile(np.arange(WIDTH, dtype=np.int32), num_rows),
        presence_penalty=presence,
    )


def target_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """The target's distribution as plain sampling defines it (numpy)."""
    scaled = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-scaled)
    keep = np.zeros(len(scaled), bool)
    probs_sorted = np.exp(scaled[order] - scaled[order].max())
    if top_k:
        probs_sorted[top_k:] = 0
    probs_sorted /= probs_sorted.sum()
    mass_before = np.cumsum(probs_sorted) - probs_sorted
    keep[order] = (mass_before < top_p) & (probs_sorted > 0)
    keep[order[0]] = True
    p = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    return p / p.sum()


def chi_square_ok(counts, probs, num):
    """Pearson's statistic over the cells with expected counts >= 5, against a loose bound (p ~ 1e-4)."""
    expected = probs * num
    cells = expected >= 5
    statistic = (((counts - expected) ** 2)[cells] / expected[cells]).sum()
    assert counts[~cells].sum() <= max(5, 3 * expected[~cells].sum() + 3)  # rare cells stay rare
    dof = max(int(cells.sum()) - 1, 1)
    return statistic < dof + 6 * np.sqrt(2 * dof) + 10, statistic


@pytest.mark.parametrize(
    "temperature, top_k, top_p, presence",
    [(1.0, 0, 1.0, 0.0), (0.7, 4, 1.0, 0.0), (1.3, 0, 0.85, 0.0), (1.0, 0, 1.0, 1.5)],
    ids=["plain", "top_k", "top_p", "presence"],
)
def test_emitted_tokens_follow_the_target(temperature, top_k, top_p, presence):
    num_rows = 4000
    rng = np.random.default_rng(0)
    base = rng.normal(0, 1.2, size=(WIDTH, VOCAB)).astype(np.float32)  # logits at positions 0, 1, 2
    drafts = np.tile(np.array([[int(np.argmax(base[0])), 2]], np.int32), (num_rows, 1))
    logits = jnp.asarray(np.tile(base, (num_rows, 1)))
    sampling = sampling_rows(num_rows, temperature, top_k, top_p, presence)
    counts = jnp.zeros((num_rows, VOCAB), jnp.int32)
    prompt = jnp.zeros((num_rows, 1), jnp.int32)
    run = jax.jit(lambda logits, sampling, drafts: verify(logits, sampling, drafts, lambda: (counts, prompt), 0))
    sampled, accepted = run(logits, sampling, drafts)
    samples = np.asarray(sampled.token_ids).reshape(num_rows, WIDTH)
    accepted = np.asarray(accepted)

    first = samples[:, 0]  # always emitted: the target's own first token
    p0 = target_probs(base[0], temperature, top_k, top_p)
    ok, statistic = chi_square_ok(np.bincount(first, minlength=VOCAB), p0, num_rows)
    assert ok, (statistic, p0)
    # the proposal is accepted exactly when the target's token equals it: with probability p0(d)
    assert (accepted >= 1).tolist() == (first == drafts[:, 0]).tolist()
    assert abs((accepted >= 1).mean() - p0[drafts[0, 0]]) < 4 * np.sqrt(p0[drafts[0, 0]] / num_rows) + 0.01

    # after an accepted first proposal, the second emitted token follows the target given that proposal
    # (presence: the proposal counts as output before position 1)
    logits1 = base[1] - presence * (np.arange(VOCAB) == drafts[0, 0])
    p1 = target_probs(logits1, temperature, top_k, top_p)
    after = samples[accepted >= 1, 1]
    ok, statistic = chi_square_ok(np.bincount(after, minlength=VOCAB), p1, len(after))
    assert len(after) > 300 and ok, (statistic, p1)


def test_greedy_rows_accept_the_longest_prefix_equal_to_the_argmax():
    logits = np.full((2 * WIDTH, VOCAB), -1.0, np.float32)
    for position, token in enumerate([3, 1, 4]):  # row 0's argmax at positions 0, 1, 2
        logits[position, token] = 5.0
    for position, token in enumerate([2, 2, 5]):
        logits[WIDTH + position, token] = 5.0
    drafts = np.array([[3, 1], [2, 0]], np.int32)  # row 0: both accepted (bonus 4); row 1: one accepted
    sampling = sampling_rows(2, temperature=0.0)
    counts, prompt = jnp.zeros((2, VOCAB), jnp.int32), jnp.zeros((2, 1), jnp.int32)
    sampled, accepted = verify(jnp.asarray(logits), sampling, drafts, lambda: (counts, prompt), 0)
    assert np.asarray(accepted).tolist() == [2, 1]
    assert np.asarray(sampled.token_ids).reshape(2, WIDTH).tolist() == [[3, 1, 4], [2, 2, 5]]


def test_padding_proposals_and_dead_ends_accept_nothing_after_them():
    samples = jnp.asarray([3, 1, 4, 2, 2, 5, 1, 1, 1])
    drafts = jnp.asarray([[3, -1], [2, 2], [1, 1]])
    no_token = jnp.asarray([False, False, False, False, False, False, False, True, False])
    assert np.asarray(accepted_lengths(samples, no_token, drafts)).tolist() == [1, 2, 1]


def test_counts_and_buffers_follow_the_accepted_tokens():
    drafts = jnp.asarray([[4, 5]])
    counts = np.asarray(counts_with_drafts(jnp.zeros((1, VOCAB), jnp.int32), drafts))
    assert counts.tolist() == [[0] * 6, [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1]]
    buffers = SequenceBuffers.zeros(1, 3, VOCAB)
    updated = record_accepted(buffers, jnp.asarray([1, 2]), jnp.asarray([4, 5, 0, 3, 3, 3]), jnp.asarray([2, 0]))
    assert np.asarray(updated.newest_token_ids).tolist() == [[0, 0, 3]]
    assert np.asarray(updated.output_counts).tolist() == [[[0] * 6, [1, 0, 0, 0, 1, 1], [0, 0, 0, 1, 0, 0]]]


def test_two_ranks_record_into_their_own_entries():
    """Rows laid end to end by rank name their rank's own entries: rank 1's row at entry 1 is rank 1's."""
    buffers = SequenceBuffers.zeros(2, 3, VOCAB)
    updated = record_accepted(buffers, jnp.asarray([1, 1]), jnp.asarray([4, 5, 0, 3, 3, 3]), jnp.asarray([2, 0]))
    assert np.asarray(updated.newest_token_ids).tolist() == [[0, 0, 0], [0, 3, 0]]
    counts = np.asarray(updated.output_counts)
    assert counts[0].tolist() == [[0] * 6, [1, 0, 0, 0, 1, 1], [0] * 6]
    assert counts[1].tolist() == [[0] * 6, [0, 0, 0, 1, 0, 0], [0] * 6]
