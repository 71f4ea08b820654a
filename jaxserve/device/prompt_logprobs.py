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


def score_prompt_tokens(compute_logits, hidden, targets, max_logprobs: int) -> PromptLogprobs:
    """hidden [T, D]; targets [T] int32 (-1: not scored). compute_logits: the model's head, [N, D] -> [N, V]."""
    num_tokens, num_top = targets.shape[0], max(max_logprobs, 1)

    def score(hidden):
        logprobs = row_log_softmax(compute_logits(hidden).astype(jnp.float32))  # alike in any chunking
        top_logprobs, top_token_ids = jax.lax.top_k(logprobs, num_top)
        chosen = jnp.take_along_axis(logprobs, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0]
        scored = targets >= 0
        return PromptLogprobs(
            jnp.where(scored, chosen, 0.0),
            top_logprobs,
            top_token_ids.astype(jnp.int32),
            jnp.where(scored, token_ranks(logprobs, chosen), 0),
        )

    def skip(_):
        return no_prompt_logprobs(num_tokens, num_top)

    return jax.lax.cond(jnp.any(targets >= 0), score, skip, hidden)
