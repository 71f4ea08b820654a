"""Rows past what a CPU kernel takes in one call go to it in blocks of that many (64 for the quantized kernels, 256
for the float one), so that a prefill chunk's row is the bits a decode row's is.

Every CPU projection kernel computes a row of a call of up to ROW_INVARIANT_ROWS rows (the float kernel: up to its
MATMUL_MAX_ROWS) exactly as a one-row call does (the K cut and the order of K's sums are the one-row call's:
tests/kernels/test_*rows*.py). Above that the kernels had their own plans (the int8 dot's per-weight plan, XLA's
GEMMs), so a prompt position computed in a prefill chunk of 128 rows rounded differently from the same position in
a chunk of 40, or in a decode step. Speculation changes how a step's token budget is shared (a verify row takes
k + 1 tokens where a decode row took one), hence where prompts are cut into chunks; with bfloat16 or int8
activations a 1e-7 difference in a prompt's KV then flips a greedy near-tie later (issue 26: greedy outputs
identical with speculation on and off).

The cost: the weights are read once per block of a prefill chunk instead of once per chunk (measured in
docs/notes/speculative.md, session 16; the float kernel's 256-row blocks since session 20,
docs/notes/cpu-kernels.md); decode and verify steps (at most 64 rows) are unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import jax.numpy as jnp

ROW_INVARIANT_ROWS = 64  # the kernels' rows are alike up to here (the largest decode bucket by default)

_VERIFY_ROWS = contextvars.ContextVar("verify_rows", default=False)


def in_row_blocks(compute: Callable[..., tuple], rows, *more_rows, block: int = ROW_INVARIANT_ROWS) -> tuple:
    """compute(rows [m, K], *more_rows [m, ...]) -> ([m, N_i], ...) over rows [M, K] (and more arrays of the same M
    rows, cut alike: a gated call's gate and up) in blocks of `block` rows, joined."""
    num_rows = rows.shape[0]
    if num_rows <= block:
        return compute(rows, *more_rows)
    parts = [
        compute(*(array[start : start + block] for array in (rows, *more_rows))) for start in range(0, num_rows, block)
    ]
    return tuple(jnp.concatenate(outputs, axis=0) for outputs in zip(*parts, strict=True))


@contextlib.contextmanager
def verify_rows() -> Iterator[None]:
    """While a speculative verify step is traced (device/verify_step.py). Where the plan sends a dtype's larger
    calls to XLA (bfloat16 on AMX CPUs: XLA's AMX dots run batches twice as fast as the kernel), a verify step's
    rows still go to the kernel, as many at a time as it serves: a verify row is then computed as a decode row of
    a batch of up to that many sequences is, the batches speculation runs on by default
    (speculative_max_batch_size 8)."""
    token = _VERIFY_ROWS.set(True)
    try:
        yield
    finally:
        _VERIFY_ROWS.reset(token)


def tracing_verify_rows() -> bool:
    return _VERIFY_ROWS.get()


__all__ = ["ROW_INVARIANT_ROWS", "in_row_blocks", "tracing_verify_rows", "verify_rows"]
