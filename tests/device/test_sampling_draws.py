"""The sampler's draws (device/sampling_draws.py) against numpy: the candidates are lax.top_k's, ties in id
order; the nucleus from the candidates and from thresholds over whole rows are the rules' own sets (ties kept
or left whole); a draw follows the row's distribution and never lands on a token of zero probability; and the
sampler's rows come out alike whichever path (candidates, whole rows) their neighbours take."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.device import sampling_draws
from jaxserve.device.sampler import sample
from jaxserve.device.sampling_inputs import neutral_sampling_inputs
from tests.device.test_verify_step import chi_square_ok


def nucleus_reference(row, top_k: int, top_p: float, min_p: float):
    """The rules in float64: top-k keeps tokens at least as likely as the k-th; top-p (over the top-k set's
    distribution) those whose strictly more likely tokens hold less than top_p; min-p those at least min_p
    times as likely as the most likely, which stays."""
    x = np.asarray(row, np.float64)
    exps = np.exp(x - x.max())
    by_k = np.ones(len(x), bool) if top_k <= 0 else x >= np.sort(x)[::-1][min(top_k, len(x)) - 1]
    mass = np.where(by_k, exps, 0.0)
    descending = np.sort(x)[::-1]
    running = np.concatenate([[0.0], np.cumsum(np.sort(mass)[::-1])])  # mass of the i most likely
    more_likely = running[np.searchsorted(-descending, -x, side="left")] / mass.sum()  # of the strictly more likely
    by_p = np.ones(len(x), bool) if top_p >= 1 else more_likely < top_p
    return by_k & by_p & (exps >= min_p) | (x == x.max())


@pytest.mark.parametrize("vocab_size, count", [(5000, 64), (300, 256), (1000, 8), (4099, 40)])
def test_candidates_are_top_k_with_ties_in_id_order(vocab_size, count):
    rng = np.random.default_rng(vocab_size)
    tied = rng.integers(0, 40, (5, vocab_size)).astype(np.float32)
    spread = rng.standard_normal((5, vocab_size)).astype(np.float32)
    for logits in (tied, spread):
        values, ids = sampling_draws.top_candidates(jnp.asarray(logits), count)
        want_values, want_ids = jax.lax.top_k(jnp.asarray(logits), min(count, vocab_size))
        assert np.array_equal(values, want_values) and np.array_equal(ids, want_ids)
        stable = np.argsort(-logits, axis=1, kind="stable")[:, : min(count, vocab_size)]
        assert np.array_equal(ids, stable)


def test_nucleus_from_candidates_and_from_thresholds_are_the_rules_sets():
    rng = np.random.default_rng(0)
    vocab_size, count, rows = 1500, 48, 8
    thresholds = jax.jit(sampling_draws.nucleus_by_thresholds)
    resolved_rows = unresolved_rows = 0
    for trial in range(24):
        logits = rng.standard_normal((rows, vocab_size)) * rng.uniform(0.05, 6)
        if trial % 3 == 0:
            logits = np.round(logits * 4) / 4  # ties, some at the nucleus' edge
        logits = jnp.asarray(logits, jnp.float32)
        top_k = jnp.asarray(rng.choice([0, 0, 1, 5, 40, 48, 49, 100, 5000], rows), jnp.int32)
        top_p = jnp.asarray(rng.choice([1.0, 0.9, 0.5, 0.99, 1e-6], rows), jnp.float32)
        min_p = jnp.asarray(rng.choice([0.0, 0.0, 0.05, 0.5], rows), jnp.float32)
        values, ids = sampling_draws.top_candidates(logits, count)
        keep, resolved = sampling_draws.nucleus_from_candidates(values, logits, top_k, top_p, min_p)
        whole = np.asarray(thresholds(logits, top_k, top_p, min_p))
        for r in range(rows):
            want = nucleus_reference(logits[r], int(top_k[r]), float(top_p[r]), float(min_p[r]))
            assert np.array_equal(whole[r], want), (trial, r)
            if resolved[r]:
                resolved_rows += 1
                mine = np.zeros(vocab_size, bool)
                mine[np.asarray(ids[r])[np.asarray(keep[r])]] = True
                assert np.array_equal(mine, want), (trial, r)
            else:  # the nucleus reaches the last candidate, or top-k's set does
                unresolved_rows += 1
                row, k = np.asarray(logits[r]), int(top_k[r])
                k_set = k > 0 and (k >= count or (row >= np.sort(row)[::-1][k - 1]).sum() >= count)
                assert want.sum() >= count or k_set
    assert resolved_rows > 50 and unresolved_rows > 20  # both paths exercised


def test_a_draw_follows_the_distribution_and_skips_impossible_tokens():
    rng = np.random.default_rng(1)
    vocab_size, num = 700, 20000
    logits = (rng.standard_normal(vocab_size) * 2).astype(np.float32)
    logits[::7] = -np.inf
    uniforms = jax.random.uniform(jax.random.key(3), (num,))
    draws = np.asarray(
        jax.jit(sampling_draws.inverse_cdf)(jnp.broadcast_to(jnp.asarray(logits), (num, vocab_size)), uniforms)
    )
    assert not np.isin(draws, np.arange(0, vocab_size, 7)).any()
    probs = np.exp(logits - logits.max())
    ok, statistic = chi_square_ok(np.bincount(draws, minlength=vocab_size), probs / probs.sum(), num)
    assert ok, statistic
    # a uniform just below 1 lands on the last possible token; a row with one possible token gets it
    edge = np.full((3, vocab_size), -np.inf, np.float32)
    edge[0, 5], edge[1, 699], edge[2, :3] = 0.0, 3.0, 1.0
    drawn = sampling_draws.inverse_cdf(jnp.asarray(edge), jnp.asarray([0.9999999, 0.9999999, 0.9999999]))
    assert np.asarray(drawn).tolist() == [5, 699, 2]


def sampling_inputs(rows: int, **per_row):
    """Rows at temperature 1, each its own seed, no filter or processor, with `per_row` set instead."""
    seeds = np.stack([np.zeros(rows, np.uint32), np.arange(rows, dtype=np.uint32)], axis=1)
    return neutral_sampling_inputs(rows, **{"temperature": 1.0, "seeds": seeds, **per_row})


@pytest.mark.parametrize("cpu_kernel", [False, True])
def test_a_row_samples_alike_whatever_path_its_neighbours_take(cpu_kernel):
    """Row 0 (a peaked row: its nucleus is within the candidates) samples the same token in a step alone, beside
    a flat row (whose nucleus needs whole-row thresholds), beside a greedy row and beside a row without filter;
    with the reference and with the CPU kernel."""
    rng = np.random.default_rng(2)
    vocab_size = 3000
    peaked = rng.standard_normal(vocab_size).astype(np.float32) * 6
    flat = rng.standard_normal(vocab_size).astype(np.float32) * 0.1
    run = jax.jit(lambda logits, inputs: sample(logits, inputs, 0, candidates=32, cpu_kernel=cpu_kernel).token_ids)
    for token_index in range(6):
        alone = run(jnp.asarray(peaked[None]), sampling_inputs(1, top_p=[0.9], token_indices=[token_index]))
        for neighbour, params in [
            (flat, dict(top_p=[0.9, 0.9])),
            (flat, dict(temperature=[1.0, 0.0], top_p=[0.9, 1.0])),
            (flat, dict(top_p=[0.9, 1.0])),
            (peaked, dict(top_p=[0.9, 0.3], top_k=[0, 100])),
        ]:
            pair = run(
                jnp.asarray(np.stack([peaked, neighbour])),
                sampling_inputs(2, token_indices=[token_index] * 2, **params),
            )
            assert int(pair[0]) == int(alone[0])


@pytest.mark.parametrize("cpu_kernel", [False, True])
@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 0.8, 0.0), (300, 0.95, 0.0), (0, 1.0, 0.02), (20, 1.0, 0.0)])
def test_sampled_tokens_follow_the_nucleus_distribution(top_k, top_p, min_p, cpu_kernel):
    """Through `sample` with few candidates, so that flat rows take the whole-row thresholds: each row's tokens
    are distributed as its nucleus renormalized; the CPU kernel's too."""
    rng = np.random.default_rng(4)
    vocab_size, num = 400, 6000
    base = np.sort(rng.standard_normal(vocab_size).astype(np.float32) * 0.8)[::-1].copy()
    rng.shuffle(base)
    inputs = sampling_inputs(num, top_k=[top_k] * num, top_p=[top_p] * num, min_p=[min_p] * num)
    inputs.seeds[:, 0] = 11
    tokens = jax.jit(lambda logits: sample(logits, inputs, 0, candidates=16, cpu_kernel=cpu_kernel).token_ids)(
        jnp.broadcast_to(jnp.asarray(base), (num, vocab_size))
    )
    keep = nucleus_reference(base, top_k, top_p, min_p)
    probs = np.where(keep, np.exp(base - base.max()), 0.0)
    assert keep.sum() > 16  # past the candidates: the whole-row path
    ok, statistic = chi_square_ok(np.bincount(np.asarray(tokens), minlength=vocab_size), probs / probs.sum(), num)
    assert ok and not np.isin(np.asarray(tokens), np.flatnonzero(~keep)).any(), statistic


@pytest.mark.parametrize("cpu_kernel", [False, True])
def test_rows_without_a_distribution_take_their_argmax_on_both_samplers(cpu_kernel):
    """A temperature so small that the division overflows (+inf ties would hide the argmax), +inf or NaN logits
    (a broken model: the first NaN, as jnp.argmax) and a row of no finite logit: the row's argmax, sampled or
    greedy, with or without a filter, alike in the reference and the CPU kernel."""
    logits = np.zeros((9, 1000), np.float32)
    logits[0, 3] = 5.0
    logits[[1, 2], 5], logits[[1, 2], 9] = 20.0, 30.0
    logits[[3, 4], 17] = logits[[3, 4], 40] = np.inf
    logits[[5, 6], 300], logits[[5, 6], 301], logits[[5, 6], 990] = 1.0, np.nan, 5.0
    logits[7, :] = -np.inf
    logits[8, 700] = 1.0  # a plain row beside them: greedy
    temperature = [2e-38, 2e-38, 2e-38, 0.8, 0.0, 1.0, 0.0, 1.0, 0.0]
    inputs = sampling_inputs(9, temperature=temperature, top_p=[1, 1, 0.9, 1, 1, 0.5, 1, 1, 1])
    tokens = sample(jnp.asarray(logits), inputs, 0, cpu_kernel=cpu_kernel).token_ids
    assert np.asarray(tokens).tolist() == [3, 9, 9, 17, 17, 301, 301, 0, 700]
