"""Where each data-parallel rank's part sits in the arrays that one step shares.

Every data-parallel rank has its own scheduler over its own KV pages and its own token buffer entries; a step
runs every rank's chunks at once, their inputs laid end to end so that splitting each array evenly over
the ranks hands each rank its own part. This is the one place that says where those parts are:

    KV pool rows      rank r's local page p is row r * pages_per_rank + p
    step rows         rank r's chunks are rows [r * S, (r + 1) * S) of a step of S rows per rank
    step tokens       rank r's tokens are [r * T, (r + 1) * T) of a step of T tokens per rank
    token buffer      rank r's own part: its entries_per_rank entries, then its scratch entry; a step names
                      rank-local entries, a reset the whole buffer's entry r * buffer_entries_per_rank + i

Plain arithmetic, no JAX: the engine, the runner, the step inputs and the KV handovers all read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankLayout:
    num_ranks: int
    pages_per_rank: int  # each rank's KV pages, the reserved page 0 included
    entries_per_rank: int  # each rank's scheduler hands out this many token buffer entries (its max_num_seqs)

    @property
    def total_pages(self) -> int:
        return self.num_ranks * self.pages_per_rank

    @property
    def buffer_entries_per_rank(self) -> int:
        """Each rank's part of the token buffer: its scheduler's entries and its scratch entry."""
        return self.entries_per_rank + 1

    @property
    def scratch_entry(self) -> int:
        """Where a rank's rows that sample nothing anyone reads write their token (rank-local)."""
        return self.entries_per_rank

    def buffer_entry(self, rank: int, index: int) -> int:
        """Rank r's local entry as an entry of the whole token buffer (ranks' parts end to end)."""
        return rank * self.buffer_entries_per_rank + index

    def pool_pages(self, rank: int, pages: list[int]) -> list[int]:
        """Rank-local page ids as rows of the whole KV pool."""
        return [rank * self.pages_per_rank + page for page in pages]

    def rows(self, rank: int, num_seqs_per_rank: int) -> slice:
        """Rank r's rows in a step's per-row arrays (inputs and sampled outputs)."""
        return slice(rank * num_seqs_per_rank, (rank + 1) * num_seqs_per_rank)

    def first_token(self, rank: int, num_tokens_per_rank: int) -> int:
        return rank * num_tokens_per_rank
