"""What the device keeps for each running sequence between steps, at its token buffer entry
(device/rank_layout.py): its newest sampled token (which a step planned before the previous one ended
reads from here), and for the penalties its output tokens' counts and its prompt's tokens.

Each data-parallel rank has its own entries (its scheduler's, and a scratch entry last), and only its rows
read and write them: the buffers are [ranks, entries per rank, ...], the rank axis split over the data-parallel
devices by the rules table ("data_ranks"), so that a device holds only its rank's entries ([E, V] counts: on
dp 8 with 256 rows each and a 152k vocabulary, 156 MB a device instead of 1.25 GB). A step's rows and tokens
lie end to end by rank (rank_layout.py) and name rank-local entries; every read and write below is batched
over the rank axis (vmap), which XLA partitions without a collective: each device touches its own part.

The step updates them (`record`); the host writes an entry's counts and prompt tokens when a sequence
with penalties starts running there (`reset_entry`), from what it knows of the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxserve.arrays import HostOrDeviceArray
from sharding import partition_spec

# Legend: R = data-parallel ranks, E = token buffer entries per rank, V = vocab, W = ceil(V / 32); S and T: a
# step's rows and tokens (R times each rank's, laid end to end).


@jax.tree_util.register_dataclass
@dataclass
class SequenceBuffers:
    newest_token_ids: HostOrDeviceArray  # [R, E] int32
    output_counts: HostOrDeviceArray  # [R, E, V] int32: how often each token was sampled (penalties)
    prompt_tokens: HostOrDeviceArray  # [R, E, W] int32 bitmask of the prompt's tokens (repetition penalty)

    @classmethod
    def zeros(cls, num_ranks: int, entries_per_rank: int, vocab_size: int) -> SequenceBuffers:
        return cls(
            newest_token_ids=np.zeros((num_ranks, entries_per_rank), np.int32),
            output_counts=np.zeros((num_ranks, entries_per_rank, vocab_size), np.int32),
            prompt_tokens=np.zeros((num_ranks, entries_per_rank, -(-vocab_size // 32)), np.int32),
        )

    def newest_tokens(self, sources):
        """[T] rank-local entries (each rank's tokens' own) -> their newest tokens [T]."""
        return _per_rank(lambda newest, index: newest[index], self.newest_token_ids, sources)

    def record(self, entries, token_ids) -> SequenceBuffers:
        """Each row's sampled token becomes its entry's newest and is counted. Rows that sample for
        nobody point at their rank's scratch entry, which nobody reads."""

        def one_rank(newest, counts, rank_entries, rank_tokens):
            return newest.at[rank_entries].set(rank_tokens), counts.at[rank_entries, rank_tokens].add(1)

        newest, counts = jax.vmap(one_rank)(
            jnp.asarray(self.newest_token_ids), jnp.asarray(self.output_counts), *rows_by_rank(self, entries, token_ids)
        )
        return SequenceBuffers(newest_token_ids=newest, output_counts=counts, prompt_tokens=self.prompt_tokens)


def rows_by_rank(buffers: SequenceBuffers, *row_arrays):
    """[S, ...] arrays of a step (rank r's rows the r-th of R equal parts) -> [R, S / R, ...]."""
    num_ranks = jnp.asarray(buffers.newest_token_ids).shape[0]
    return tuple(array.reshape(num_ranks, -1, *array.shape[1:]) for array in row_arrays)


def _per_rank(read, per_rank_array, entries):
    """read(rank's part, its rows' entries) for every rank; the results laid end to end as the rows are."""
    array = jnp.asarray(per_rank_array)
    out = jax.vmap(read)(array, entries.reshape(array.shape[0], -1))
    return out.reshape(-1, *out.shape[2:])


def reset_entry(buffers: SequenceBuffers, entry, output_counts, prompt_tokens) -> SequenceBuffers:
    """entry: a scalar, the whole buffer's (RankLayout.buffer_entry); output_counts [V] int32; prompt_tokens
    [W] int32 bitmask."""
    entries_per_rank = jnp.asarray(buffers.newest_token_ids).shape[1]
    rank, index = entry // entries_per_rank, entry % entries_per_rank
    return SequenceBuffers(
        newest_token_ids=buffers.newest_token_ids,
        output_counts=jnp.asarray(buffers.output_counts).at[rank, index].set(output_counts),
        prompt_tokens=jnp.asarray(buffers.prompt_tokens).at[rank, index].set(prompt_tokens),
    )


def gather_entries(buffers: SequenceBuffers, entries) -> tuple[jax.Array, jax.Array]:
    """[S, V] output counts and [S, W] prompt bitmasks of the rows' rank-local entries (inside the step)."""
    take = lambda part, index: part[index]  # noqa: E731
    return _per_rank(take, buffers.output_counts, entries), _per_rank(take, buffers.prompt_tokens, entries)


def sequence_buffers_shardings(buffers: SequenceBuffers, mesh: Mesh) -> SequenceBuffers:
    """Each array's rank axis split over the data-parallel devices (the rules table's "data_ranks"), the rest
    of it whole on each of them."""
    return jax.tree.map(
        lambda array: NamedSharding(mesh, partition_spec(("data_ranks",) + (None,) * (array.ndim - 1), mesh)),
        buffers,
    )
