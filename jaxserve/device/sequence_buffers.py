"""What the device keeps for each running sequence between steps, at its token buffer entry
(device/rank_layout.py): its newest sampled token (which a step planned before the previous one ended
reads from here), and for the penalties its output tokens' counts and its prompt's tokens.

The step updates them (`record`); the host writes an entry's counts and prompt tokens when a sequence
with penalties starts running there (`reset_entry`), from what it knows of the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.arrays import HostOrDeviceArray

# Legend: E = token buffer entries, V = vocab, W = ceil(V / 32).


@jax.tree_util.register_dataclass
@dataclass
class SequenceBuffers:
    newest_token_ids: HostOrDeviceArray  # [E] int32
    output_counts: HostOrDeviceArray  # [E, V] int32: how often each token was sampled (penalties)
    prompt_tokens: HostOrDeviceArray  # [E, W] int32 bitmask of the prompt's tokens (repetition penalty)

    @classmethod
    def zeros(cls, num_entries: int, vocab_size: int) -> SequenceBuffers:
        return cls(
            newest_token_ids=np.zeros(num_entries, np.int32),
            output_counts=np.zeros((num_entries, vocab_size), np.int32),
            prompt_tokens=np.zeros((num_entries, -(-vocab_size // 32)), np.int32),
        )

    def record(self, entries, token_ids) -> SequenceBuffers:
        """Each row's sampled token becomes its entry's newest and is counted. Rows that sample for
        nobody point at the scratch entry, which nobody reads."""
        return SequenceBuffers(
            newest_token_ids=jnp.asarray(self.newest_token_ids).at[entries].set(token_ids),
            output_counts=jnp.asarray(self.output_counts).at[entries, token_ids].add(1),
            prompt_tokens=self.prompt_tokens,
        )


def reset_entry(buffers: SequenceBuffers, entry, output_counts, prompt_tokens) -> SequenceBuffers:
    """entry: a scalar; output_counts [V] int32; prompt_tokens [W] int32 bitmask."""
    return SequenceBuffers(
        newest_token_ids=buffers.newest_token_ids,
        output_counts=jnp.asarray(buffers.output_counts).at[entry].set(output_counts),
        prompt_tokens=jnp.asarray(buffers.prompt_tokens).at[entry].set(prompt_tokens),
    )


def gather_entries(buffers: SequenceBuffers, entries) -> tuple[jax.Array, jax.Array]:
    """[S, V] output counts and [S, W] prompt bitmasks of the rows' entries (inside the step: jax arrays)."""
    return jnp.asarray(buffers.output_counts)[entries], jnp.asarray(buffers.prompt_tokens)[entries]
