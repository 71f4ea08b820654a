"""Per-row changes to the logits before sampling, inside the compiled step: a grammar's or an
allowed-token list's bitmask, logit bias (and bans, which are biases of -inf), and the presence,
frequency and repetition penalties.

Every input is a fixed-shape per-row array, so any mix of requests runs in the executables compiled at
warm-up; a step in which no row uses a processor skips it (`lax.cond`), so plain rows pay nothing but
the inputs' transfer. Semantics follow vLLM (presence and frequency over the output tokens, as OpenAI)
and transformers (repetition over prompt and output: a positive logit divided, a negative multiplied).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Legend: S = rows sampled in the step, V = vocab, W = ceil(V / 32) mask words, B = bias entries per
# row, E = token buffer entries (one per running sequence, device/rank_layout.py).

NO_LIMIT = 2**31 - 1  # a bias entry's `until` when it applies to every output token


def unpack_bitmask(bitmask, vocab_size: int):
    """[S, W] int32, bit b of word w = token 32 w + b allowed -> [S, V] bool (llguidance's layout)."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].astype(jnp.bool_)


def apply_bitmask(logits, bitmask):
    """Tokens whose bit is clear get -inf. A row with every bit set is unchanged."""
    return jnp.where(unpack_bitmask(bitmask, logits.shape[-1]), logits, -jnp.inf)


def apply_bias(logits, token_ids, values, until, token_indices):
    """Add values[s, b] to token token_ids[s, b] of row s while the row samples an output token before
    index until[s, b] (min_tokens' bans of EOS and stop tokens end there; logit_bias never: NO_LIMIT).
    Entries with token id -1 are padding."""
    active = (token_ids >= 0) & (token_indices[:, None] < until)
    rows = jnp.broadcast_to(jnp.arange(logits.shape[0])[:, None], token_ids.shape)
    columns = jnp.where(active, token_ids, logits.shape[-1])  # out of range: dropped
    return logits.at[rows, columns].add(jnp.where(active, values, 0.0), mode="drop")


def apply_penalties(logits, output_counts, prompt_mask, presence, frequency, repetition):
    """output_counts [S, V] int32: how often each token was sampled so far; prompt_mask [S, W]: the
    prompt's tokens. presence/frequency subtract from the logits of output tokens (OpenAI); repetition
    (transformers) divides positive and multiplies negative logits of prompt or output tokens."""
    counts = output_counts.astype(jnp.float32)
    seen = (output_counts > 0) | unpack_bitmask(prompt_mask, logits.shape[-1])
    penalised = jnp.where(logits > 0, logits / repetition[:, None], logits * repetition[:, None])
    logits = jnp.where(seen, penalised, logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (output_counts > 0)


def count_sampled(output_counts, entries, token_ids):
    """Add each row's sampled token to its sequence's output counts. Rows that sample for nobody point
    at the scratch entry, whose counts nobody reads; an entry is reset when a sequence with penalties
    starts running in it (device/sequence_buffers.py)."""
    return output_counts.at[entries, token_ids].add(1)


def process_logits(logits, sampling, penalty_state_of_rows):
    """All processors, each skipped when no row of the step uses it: penalties first (on the model's
    logits, as vLLM and transformers order them), then biases and bans, then the allowed-token mask.
    penalty_state_of_rows: () -> the rows' [S, V] output counts and [S, W] prompt bitmasks, gathered
    only when some row has penalties."""

    def penalise(logits):
        counts, prompt = penalty_state_of_rows()
        return apply_penalties(
            logits, counts, prompt, sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty
        )

    def every_processor(logits):
        logits = jax.lax.cond(uses_penalties(sampling), penalise, lambda x: x, logits)
        bias = (sampling.bias_token_ids, sampling.bias_values, sampling.bias_until, sampling.token_indices)
        logits = jax.lax.cond(uses_bias(sampling), lambda x: apply_bias(x, *bias), lambda x: x, logits)
        return jax.lax.cond(
            uses_bitmask(sampling), lambda x: apply_bitmask(x, sampling.allowed_tokens), lambda x: x, logits
        )

    # A skipped processor's cond returns its [S, V] input, which XLA copies out of the conditional (the model's
    # logits stay live for the logprobs): one cond around all three, so a step without processors copies once
    # (12.6 MB at 64 rows of a 49152-token vocabulary), not three times.
    uses_any = uses_penalties(sampling) | uses_bias(sampling) | uses_bitmask(sampling)
    return jax.lax.cond(uses_any, every_processor, lambda x: x, logits)


def uses_penalties(sampling):
    return jnp.any(
        (sampling.presence_penalty != 0) | (sampling.frequency_penalty != 0) | (sampling.repetition_penalty != 1)
    )


def uses_bias(sampling):
    return jnp.any(sampling.bias_token_ids >= 0)


def uses_bitmask(sampling):
    return jnp.any(sampling.allowed_tokens != -1)
