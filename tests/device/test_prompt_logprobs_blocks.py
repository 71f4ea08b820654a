"""How score_prompt_tokens (device/prompt_logprobs.py) cuts a step's token slots into blocks, over a toy head
whose logits are small integers (exact in float32, so any blocking must give the same bits): a step of T slots
with no divisor near the block size keeps blocks of at least MIN_BLOCK_ROWS rows (the last padded) instead of
many tiny ones, and a step that scores no prompt token runs no loop at all."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.device import prompt_logprobs
from jaxserve.device.prompt_logprobs import block_layout, score_prompt_tokens

VOCAB, DIM, TOP = 40, 8, 3


def head():
    weights = jnp.asarray(np.random.default_rng(0).integers(-3, 4, (DIM, VOCAB)), jnp.float32)
    return lambda hidden: hidden @ weights


def step_inputs(num_tokens: int, scored: bool = True):
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.integers(-2, 3, (num_tokens, DIM)), jnp.float32)
    targets = rng.integers(0, VOCAB, num_tokens) if scored else np.full(num_tokens, -1)
    if scored:
        targets[::5] = -1  # some slots not scored
    return hidden, jnp.asarray(targets, jnp.int32)


def blocked_to(monkeypatch, max_rows: int, min_rows: int) -> None:
    monkeypatch.setattr(prompt_logprobs, "BLOCK_LOGITS_BYTES", max_rows * VOCAB * 4)
    monkeypatch.setattr(prompt_logprobs, "MIN_BLOCK_ROWS", min_rows)


@pytest.mark.parametrize(
    "num_tokens, max_rows, expected",
    [
        (64, 64, (1, 64)),  # one block
        (4096, 64, (64, 64)),  # a power of two: its divisors
        (192, 64, (3, 64)),
        (16 * 131, 64, (33, 64)),  # 131 blocks of 16 rows would divide it: padded to 33 blocks of 64 instead
        (134, 64, (3, 64)),  # 67 blocks of 2 rows would divide it
        (2000, 65, (31, 65)),  # the fewest divisor (40 blocks) would leave 50 rows, under the floor
    ],
)
def test_blocks_keep_at_least_the_floor_of_rows(num_tokens, max_rows, expected):
    num_blocks, rows = block_layout(num_tokens, max_rows, min_rows=64)
    assert (num_blocks, rows) == expected
    assert num_blocks * rows >= num_tokens and rows <= max_rows


@pytest.mark.parametrize("num_tokens", [16, 14, 24])  # one block; padded (no divisor of 14 gives 4+ rows); 6 x 4
def test_blocked_scores_equal_the_whole(monkeypatch, num_tokens):
    hidden, targets = step_inputs(num_tokens)
    whole = score_prompt_tokens(head(), hidden, targets, TOP)
    blocked_to(monkeypatch, max_rows=4, min_rows=4)
    blocked = jax.jit(lambda h, t: score_prompt_tokens(head(), h, t, TOP))(hidden, targets)
    for name in ("token_logprobs", "top_logprobs", "top_token_ids", "token_ranks"):
        np.testing.assert_array_equal(getattr(blocked, name), getattr(whole, name), err_msg=name)
    assert np.asarray(blocked.token_logprobs)[np.asarray(targets) < 0].tolist() == [0.0] * int((targets < 0).sum())


def test_a_step_that_scores_nothing_runs_no_loop(monkeypatch):
    blocked_to(monkeypatch, max_rows=4, min_rows=4)
    hidden, targets = step_inputs(64, scored=False)
    jaxpr = jax.make_jaxpr(lambda h, t: score_prompt_tokens(head(), h, t, TOP))(hidden, targets)
    top_level = [equation.primitive.name for equation in jaxpr.eqns]
    assert "cond" in top_level and not {"scan", "while"} & set(top_level), top_level
    scored = score_prompt_tokens(head(), hidden, targets, TOP)
    assert not np.asarray(scored.top_token_ids).any() and not np.asarray(scored.token_ranks).any()
