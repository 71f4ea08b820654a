"""The step's logits processors against plain numpy statements of their rules."""

import jax.numpy as jnp
import numpy as np

from jaxserve.device.logits_processors import (
    NO_LIMIT,
    apply_bias,
    apply_bitmask,
    apply_penalties,
    count_sampled,
    unpack_bitmask,
)


def pack(allowed: np.ndarray) -> np.ndarray:
    """[S, V] bool -> llguidance's [S, ceil(V / 32)] int32 words, bit b of word w for token 32 w + b."""
    rows, vocab = allowed.shape
    padded = np.zeros((rows, -(-vocab // 32) * 32), bool)
    padded[:, :vocab] = allowed
    words = (padded.reshape(rows, -1, 32) * (1 << np.arange(32, dtype=np.uint64))).sum(-1)
    return words.astype(np.uint32).view(np.int32)


def test_bitmask_keeps_exactly_the_allowed_tokens():
    rng = np.random.default_rng(0)
    allowed = rng.random((3, 70)) < 0.3
    allowed[2] = True  # an unconstrained row: all bits set
    assert (np.asarray(unpack_bitmask(jnp.asarray(pack(allowed)), 70)) == allowed).all()
    logits = rng.standard_normal((3, 70)).astype(np.float32)
    masked = np.asarray(apply_bitmask(jnp.asarray(logits), jnp.asarray(pack(allowed))))
    assert (masked == np.where(allowed, logits, -np.inf)).all()


def test_bias_applies_until_its_output_index_and_ignores_padding():
    logits = np.zeros((2, 10), np.float32)
    token_ids = np.array([[3, 5, -1], [3, -1, -1]], np.int32)
    values = np.array([[2.0, -np.inf, 7.0], [-1.5, 9.0, 9.0]], np.float32)
    until = np.array([[NO_LIMIT, 4, NO_LIMIT], [NO_LIMIT, NO_LIMIT, NO_LIMIT]], np.int32)
    for index, banned in ((3, True), (4, False)):
        out = np.asarray(apply_bias(*map(jnp.asarray, (logits, token_ids, values, until, np.array([index, 0])))))
        expected = np.zeros((2, 10), np.float32)
        expected[0, 3], expected[1, 3] = 2.0, -1.5
        if banned:
            expected[0, 5] = -np.inf
        assert (out == expected).all(), (index, out)


def test_penalties_follow_openai_and_transformers():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((2, 40)).astype(np.float32) * 3
    counts = rng.integers(0, 3, (2, 40)).astype(np.int32)
    prompt = rng.random((2, 40)) < 0.2
    presence, frequency, repetition = np.array([0.5, 0.0]), np.array([0.25, 0.0]), np.array([1.3, 1.0])
    out = np.asarray(
        apply_penalties(
            *map(jnp.asarray, (logits, counts, pack(prompt))),
            *(jnp.asarray(x, jnp.float32) for x in (presence, frequency, repetition)),
        )
    )
    expected = logits.copy()
    for row in range(2):
        seen = (counts[row] > 0) | prompt[row]
        r = repetition[row]
        expected[row] = np.where(seen, np.where(expected[row] > 0, expected[row] / r, expected[row] * r), expected[row])
        expected[row] -= frequency[row] * counts[row] + presence[row] * (counts[row] > 0)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert (out[1] == logits[1]).all()  # neutral penalties change nothing


def test_sampled_tokens_are_counted_per_entry():
    counts = jnp.zeros((4, 8), jnp.int32)
    counts = count_sampled(counts, jnp.array([0, 2, 3, 3]), jnp.array([5, 1, 7, 7]))
    expected = np.zeros((4, 8), np.int32)
    expected[0, 5] = expected[2, 1] = 1
    expected[3, 7] = 2  # two rows on the scratch entry
    assert (np.asarray(counts) == expected).all()
