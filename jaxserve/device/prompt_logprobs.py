"""Prompt logprobs inside the prefill step: every prompt position a row wants scored has its logits
computed from the hidden states the step already holds, and the log-softmax gathered at the prompt's
next token, with the top K. A step where no row wants them skips all of it (lax.cond), so plain steps
compute only the one position per row they sample from; the outputs keep one fixed shape either way.

The host names the target of each token slot (device/step_inputs.py: the prompt token that follows
the position, or -1) and reads the rows back by slot (host/output_processor.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.arrays import HostOrDeviceArray
from jaxserve.device.sampler import token_ranks
from jaxserve.models.layers import row_log_softmax
from pallas_kernels.matmul.row_blocks import ROW_INVARIANT_ROWS

# Legend: T = token slots of the step, V = vocab, K = max_logprobs (at least 1).


@jax.tree_util.register_dataclass
@dataclass
class PromptLogprobs:
    token_logprobs: HostOrDeviceArray  # [T] float32: log p(target | the tokens before it); 0 where no target
    top_logprobs: HostOrDeviceArray  # [T, K] float32
    top_token_ids: HostOrDeviceArray  # [T, K] int32
    token_ranks: HostOrDeviceArray  # [T] int32: the target's rank (1: the most likely); 0 where no target


def no_prompt_logprobs(num_tokens: int, num_top: int) -> PromptLogprobs:
    """The outputs of a step that scores no prompt token (one shape either way)."""
    return PromptLogprobs(
        jnp.zeros((num_tokens,), jnp.float32),
        jnp.zeros((num_tokens, num_top), jnp.float32),
        jnp.zeros((num_tokens, num_top), jnp.int32),
        jnp.zeros((num_tokens,), jnp.int32),
    )


# A block's float32 logits (and their log-softmax) stay within about this many bytes: a prefill of 8192 token
# slots over a 128k vocabulary would otherwise hold 4 GB of them at once, in every prefill executable, beside a KV
# cache that was sized before anything compiled.
BLOCK_LOGITS_BYTES = 32 * 2**20
# ... and take at least this many rows: the CPU kernels compute a row of a call of up to 64 rows as a one-row call
# does (pallas_kernels/matmul/row_blocks.py), and the head of fewer rows can take another kernel path than a
# prefill chunk's (1-2 ulps in the scores at 4 rows)
MIN_BLOCK_ROWS = ROW_INVARIANT_ROWS


def score_prompt_tokens(compute_logits, hidden, targets, max_logprobs: int) -> PromptLogprobs:
    """hidden [T, D]; targets [T] int32 (-1: not scored). compute_logits: the model's head, [N, D] -> [N, V].

    The slots are scored a block at a time (lax.map), and a block with no target is skipped (a step with none
    runs no loop at all). A block takes every num_blocks-th slot (slot t in block t % num_blocks): a
    data-parallel mesh splits T into contiguous runs a rank, and a strided block keeps each rank's rows on its
    own devices (where block_layout pads T, the padding's rank's rows move). Every computation here is row by
    row, so a position scores alike in any block (and any chunking of its prompt)."""
    num_tokens, num_top = targets.shape[0], max(max_logprobs, 1)

    def score(hidden, targets):
        logprobs = row_log_softmax(compute_logits(hidden).astype(jnp.float32))
        top_logprobs, top_token_ids = jax.lax.top_k(logprobs, num_top)
        chosen = jnp.take_along_axis(logprobs, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]
        scored = targets >= 0
        return PromptLogprobs(
            jnp.where(scored, chosen, 0.0),
            top_logprobs,
            top_token_ids.astype(jnp.int32),
            jnp.where(scored, token_ranks(logprobs, chosen), 0),
        )

    def score_if_asked(hidden, targets):
        skip = lambda *_: no_prompt_logprobs(targets.shape[0], num_top)  # noqa: E731
        return jax.lax.cond(jnp.any(targets >= 0), score, skip, hidden, targets)

    vocab_size = jax.eval_shape(compute_logits, jax.ShapeDtypeStruct((1, hidden.shape[1]), hidden.dtype)).shape[1]
    max_rows = max(MIN_BLOCK_ROWS, BLOCK_LOGITS_BYTES // (4 * vocab_size))
    num_blocks, rows = block_layout(num_tokens, max_rows, MIN_BLOCK_ROWS)
    if num_blocks == 1:
        return score_if_asked(hidden, targets)
    padding = num_blocks * rows - num_tokens  # slots that score nothing, where no divisor of T fits

    def strided(x):  # [T, ...] -> [num_blocks, rows, ...]: block j holds slots j, j + num_blocks, ...
        return jnp.swapaxes(x.reshape(rows, num_blocks, *x.shape[1:]), 0, 1)

    def unstrided(x):  # the inverse
        return jnp.swapaxes(x, 0, 1).reshape(num_blocks * rows, *x.shape[2:])[:num_tokens]

    def blocked(hidden, targets):
        hidden = jnp.pad(hidden, ((0, padding), (0, 0)))
        targets = jnp.pad(targets, (0, padding), constant_values=-1)
        scored = jax.lax.map(lambda block: score_if_asked(*block), (strided(hidden), strided(targets)))
        return jax.tree.map(unstrided, scored)

    # a step that scores no prompt token (every decode step) runs no loop: on a GPU each of the map's
    # iterations, skipped or not, costs the host a round trip for its loop and cond predicates
    skip_all = lambda *_: no_prompt_logprobs(num_tokens, num_top)  # noqa: E731
    return jax.lax.cond(jnp.any(targets >= 0), blocked, skip_all, hidden, targets)


def block_layout(num_tokens: int, max_rows: int, min_rows: int) -> tuple[int, int]:
    """(blocks, rows a block) for num_tokens slots: one block if they fit; else the fewest blocks of at most
    max_rows and at least min_rows rows that split them evenly (bucket sizes are multiples of 64 or small, so a
    divisor is near); else (a token budget like 16 x 131, whose divisors would give 131 blocks of 16 rows)
    blocks of max_rows rows, the last slots padding."""
    if num_tokens <= max_rows:
        return 1, num_tokens
    fewest = -(-num_tokens // max_rows)
    for num_blocks in range(fewest, num_tokens // min_rows + 1):
        if num_tokens % num_blocks == 0:
            return num_blocks, num_tokens // num_blocks
    return fewest, max_rows
