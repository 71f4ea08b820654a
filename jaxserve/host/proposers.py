"""Speculative proposers: tokens a sequence will likely generate next, which the target model then
verifies in one step (engine/speculation.py, device/verify_step.py).

A proposer only suggests: whatever it proposes, the output is the target's, so a proposer is judged by
how often it is right and what it costs. `Proposer` is the interface the engine calls once per step for
every row that may speculate; a draft model (a smaller model, or a quantized copy of the target) plugs
in beside `NgramProposer` by implementing it (its own device calls and KV then live behind `propose`
and `forget`).

Plain Python, no JAX.
"""

from __future__ import annotations

from typing import Protocol

from jaxserve.host.request import SequenceState


class Proposer(Protocol):
    def propose(self, seqs: list[SequenceState], max_tokens: list[int]) -> list[list[int]]:
        """Up to max_tokens[i] tokens to follow each sequence's tokens (its prompt and output so far,
        all known to the host); an empty list: no proposal."""
        ...

    def forget(self, seq: SequenceState) -> None:
        """The sequence ended: drop what was kept for it."""
        ...


class NgramIndex:
    """Where each n-gram of a sequence's tokens last ended, for n in [min_n, max_n], grown as tokens
    are appended (each token is indexed once, so a step costs O(max_n) per new token, not O(length))."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.last_end: dict[tuple[int, ...], int] = {}  # n-gram -> index of its last token
        self.num_indexed = 0  # n-grams ending before this index are in last_end

    def extend(self, token_ids: list[int], end: int) -> None:
        """Index every n-gram ending before `end` (the newest token's own n-grams stay out, so that a
        lookup of the suffix finds an earlier occurrence)."""
        for last in range(self.num_indexed, end):
            for n in range(self.min_n, min(self.max_n, last + 1) + 1):
                self.last_end[tuple(token_ids[last - n + 1 : last + 1])] = last
        self.num_indexed = max(self.num_indexed, end)

    def match(self, token_ids: list[int], max_tokens: int) -> tuple[int, list[int]]:
        """(the longest matching suffix's length, the tokens that followed its latest earlier occurrence);
        (0, []) where no suffix of min_n tokens or more occurred before."""
        length = len(token_ids)
        self.extend(token_ids, length - 1)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            last = self.last_end.get(tuple(token_ids[length - n :]))
            if last is not None:
                return n, token_ids[last + 1 : last + 1 + max_tokens]
        return 0, []


class NgramProposer:
    """Prompt lookup (as vLLM's ngram and llama.cpp's lookup decoding): the longest suffix of the
    sequence (prompt_lookup_max tokens down to prompt_lookup_min) that occurred earlier in its prompt or
    output proposes the tokens that followed it there. Free to compute, and right whenever the output
    quotes its context: code edits, retrieval answers, repeated structure."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[int, NgramIndex] = {}  # seq_id -> its index

    def propose(self, seqs: list[SequenceState], max_tokens: list[int]) -> list[list[int]]:
        return [proposal for _, proposal in self.propose_matched(seqs, max_tokens)]

    def propose_matched(self, seqs: list[SequenceState], max_tokens: list[int]) -> list[tuple[int, list[int]]]:
        """Per sequence: (the matched suffix's length, the proposal), as NgramIndex.match."""
        matches = []
        for seq, limit in zip(seqs, max_tokens):
            index = self._indexes.get(seq.seq_id)
            if index is None:
                index = self._indexes[seq.seq_id] = NgramIndex(self.min_n, self.max_n)
            matches.append(index.match(seq.token_ids, limit) if limit > 0 else (0, []))
        return matches

    def forget(self, seq: SequenceState) -> None:
        self._indexes.pop(seq.seq_id, None)
