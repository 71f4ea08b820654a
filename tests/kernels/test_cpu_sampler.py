"""The C++ sampler draw (pallas_kernels/sampling/cpu_sampler.cc) on each instruction path this CPU runs, against
the rules computed in float64: for every row it returns the token that the inverse CDF of the row's nucleus
(tokens in vocabulary order) gives at the reference's uniform for the row's seed and token index (so the kernel's
threefry is JAX's), except where that uniform lies within rounding of a token's edge, and never a token outside
the nucleus; greedy rows take the first argmax; a row is drawn alike alone and among others."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.device.sampler import row_uniforms
from pallas_kernels import cpu_library
from pallas_kernels.sampling import cpu
from tests.device.test_sampling_draws import nucleus_reference, sampling_inputs


def random_seeds(rng, rows: int):
    """[S, 2] uint32 seeds and [S] int32 token indices, and the reference's uniforms for them."""
    seeds = rng.integers(0, 2**32, (rows, 2), dtype=np.uint64).astype(np.uint32)
    token_indices = rng.integers(0, 100_000, rows).astype(np.int32)
    uniforms = np.asarray(row_uniforms(sampling_inputs(rows, seeds=seeds, token_indices=token_indices)))
    return seeds, token_indices, uniforms


def expected_token(row, temperature, top_k, top_p, min_p, uniform):
    """(token, distance of the uniform from the nearest edge of the nucleus' CDF, the nucleus) in float64."""
    if temperature == 0:
        return int(np.argmax(row)), 1.0, None
    scaled = (row / np.float32(temperature)).astype(np.float32)
    keep = nucleus_reference(scaled, top_k, top_p, min_p)
    weights = np.where(keep, np.exp(scaled.astype(np.float64) - scaled.max()), 0.0)
    ends = np.cumsum(weights) / weights.sum()
    return int(np.searchsorted(ends, uniform, side="right")), float(np.min(np.abs(ends - uniform))), keep


@pytest.mark.parametrize("path", cpu_library.runnable_paths())
def test_each_path_draws_the_token_of_the_rules_and_the_uniform(path):
    rng = np.random.default_rng(0)
    draw = jax.jit(lambda *args: cpu.sample_tokens(*args, path=path))
    checked = near_edges = 0
    # vocabularies past and under a block of 256 and a vector, and a tail of each
    for trial, vocab_size in enumerate([1500, 37, 4099, 256, 1500, 700] * 4):
        rows = 8
        logits = rng.standard_normal((rows, vocab_size)) * rng.uniform(0.05, 6)
        if trial % 3 == 0:
            logits = np.round(logits * 4) / 4  # ties, some at the nucleus' edge
        logits = logits.astype(np.float32)
        if trial % 4 == 1:
            logits[:, ::5] = -np.inf  # banned tokens
        top_k = rng.choice([0, 0, 1, 5, 40, 49, 100, 5000], rows).astype(np.int32)
        top_p = rng.choice([1.0, 0.9, 0.5, 0.99, 1e-6], rows).astype(np.float32)
        min_p = rng.choice([0.0, 0.0, 0.05, 0.5], rows).astype(np.float32)
        temperature = rng.choice([1.0, 0.7, 1.9, 0.0], rows).astype(np.float32)
        for _ in range(6):
            seeds, token_indices, uniforms = random_seeds(rng, rows)
            tokens = np.asarray(draw(logits, temperature, top_k, top_p, min_p, seeds, token_indices))
            for r in range(rows):
                want, edge, keep = expected_token(
                    logits[r], temperature[r], int(top_k[r]), float(top_p[r]), float(min_p[r]), float(uniforms[r])
                )
                checked += 1
                if keep is not None:
                    assert keep[tokens[r]], (trial, r)  # never a token outside the nucleus
                if tokens[r] != want:
                    assert edge < 1e-5, (trial, r, tokens[r], want)
                    near_edges += 1
    assert checked == 24 * 8 * 6 and near_edges <= 3


@pytest.mark.parametrize("path", cpu_library.runnable_paths())
def test_greedy_rows_and_rows_with_one_or_no_possible_token(path):
    rows, vocab_size = 9, 1000
    logits = np.full((rows, vocab_size), -np.inf, np.float32)
    logits[0, [3, 700, 999]] = 2.0  # tied maxima: the first
    logits[1, 999] = 1.0  # the maximum in the last (partial) block
    logits[2, 123] = 0.0  # one possible token, drawn at any temperature
    logits[4, :10] = 1.0  # ten alike: the uniform's tenth
    logits[5, 17] = np.inf  # +inf: its first, as argmax
    logits[6:8, [300, 301, 990]] = [1.0, np.nan, 5.0]  # a NaN (a broken model): its first, as jnp.argmax, greedy or not
    logits[8, [5, 9]] = [20.0, 30.0]  # a temperature so small that both overflow: still the argmax
    temperature = np.array([0.0, 0.0, 1.5, 1.0, 1.0, 0.8, 0.0, 1.0, 2e-38], np.float32)  # row 3: none possible -> 0
    ones, zeros = np.ones(rows, np.float32), np.zeros(rows, np.float32)
    seeds, token_indices, uniforms = random_seeds(np.random.default_rng(1), rows)
    tokens = cpu.sample_tokens(
        logits, temperature, np.zeros(rows, np.int32), ones, zeros, seeds, token_indices, path=path
    )
    assert np.asarray(tokens).tolist() == [3, 999, 123, 0, int(uniforms[4] * 10), 17, 301, 301, 9]
    assert int(np.asarray(jnp.argmax(jnp.asarray(logits[6])))) == 301  # the reference's rule for a NaN


def test_a_row_is_drawn_alike_alone_and_among_any_rows():
    rng = np.random.default_rng(3)
    rows, vocab_size = 37, 3000
    logits = (rng.standard_normal((rows, vocab_size)) * rng.uniform(0.1, 5, (rows, 1))).astype(np.float32)
    params = (
        rng.choice([0.0, 0.6, 1.0], rows).astype(np.float32),
        rng.choice([0, 3, 50], rows).astype(np.int32),
        rng.choice([1.0, 0.8, 0.95], rows).astype(np.float32),
        rng.choice([0.0, 0.1], rows).astype(np.float32),
        *random_seeds(rng, rows)[:2],
    )
    together = np.asarray(cpu.sample_tokens(jnp.asarray(logits), *params))
    for r in range(0, rows, 6):
        alone = cpu.sample_tokens(jnp.asarray(logits[r : r + 1]), *(p[r : r + 1] for p in params))
        assert int(alone[0]) == together[r]


def test_bad_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match="one parameter a row"):
        wrong = jnp.zeros(3)  # three rows' parameters for two rows of logits
        cpu.sample_tokens(jnp.zeros((2, 10)), wrong, wrong, wrong, wrong, jnp.zeros((2, 2)), jnp.zeros(2))
