"""One sequence's place in its grammar (host/grammar.py compiles the grammars): which tokens may come next,
written as a row of the packed bitmask the sampler applies, and the tokens sampled so far.

The bitmask is llguidance's layout: int32 words, bit b of word w set when token 32 * w + b is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import numpy as np


@dataclass(frozen=True)
class MaskLayout:
    """What every matcher of one engine shares: the vocabulary the masks span and the tokens that end."""

    vocab_size: int  # the model's: logits have this many columns
    num_grammar_tokens: int  # llguidance's vocabulary: max(model's, tokenizer's); the masks span it
    eos_token_ids: frozenset[int]

    @property
    def num_mask_words(self) -> int:
        return (self.num_grammar_tokens + 31) // 32

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        """[num_rows, num_mask_words] int32, every token allowed: the rows of unconstrained sequences."""
        return np.full((num_rows, self.num_mask_words), -1, dtype=np.int32)

    def check_bitmask(self, bitmask: np.ndarray) -> None:
        """llguidance writes through a raw pointer: a wrong array must fail here, not corrupt memory."""
        if (
            not isinstance(bitmask, np.ndarray)
            or bitmask.dtype != np.int32
            or bitmask.ndim != 2
            or bitmask.shape[1] != self.num_mask_words
            or not bitmask.flags["C_CONTIGUOUS"]
            or not bitmask.flags["WRITEABLE"]
        ):
            described = (
                f"{bitmask.dtype} array of shape {bitmask.shape}"
                if isinstance(bitmask, np.ndarray)
                else type(bitmask).__name__
            )
            raise ValueError(
                f"the grammar bitmask must be a writable C-contiguous int32 array of shape [rows, "
                f"{self.num_mask_words}], got a {described}"
            )

    def eos_row(self) -> np.ndarray:
        row = np.zeros(self.num_mask_words, dtype=np.uint32)
        for token_id in self.eos_token_ids:
            row[token_id // 32] |= np.uint32(1 << (token_id % 32))
        return row.view(np.int32)

    def clear_beyond_vocab(self, rows: np.ndarray) -> None:
        """A tokenizer larger than the model (rare) could allow ids the logits do not have."""
        if self.num_grammar_tokens <= self.vocab_size:
            return
        first_word, first_bit = divmod(self.vocab_size, 32)
        if first_bit:
            rows.view(np.uint32)[..., first_word] &= np.uint32((1 << first_bit) - 1)
            first_word += 1
        rows[..., first_word:] = 0


class GrammarMatcher:
    """Made by CompiledGrammar.new_matcher(). Not thread-safe: one sequence, driven by the engine's thread.

    A sequence whose grammar reaches a dead end (a token the grammar refuses was accepted, no token can
    continue it, or llguidance hit a resource limit) reports `is_dead_end` with `dead_end_reason`; the
    engine finishes it with that reason rather than sampling on.
    """

    def __init__(self, matcher: llguidance.LLMatcher, layout: MaskLayout):
        self._matcher = matcher
        self.layout = layout
        self._num_accepted_tokens = 0
        # EOS is kept out of llguidance: it counts an EOS in rollback only when more text could have followed.
        self._ended_by_eos = False
        self._dead_end_reason: str | None = None

    @property
    def is_accepting(self) -> bool:
        """The text so far is complete: EOS is allowed now."""
        return self._ended_by_eos or (self._matcher.is_accepting() and not self.is_dead_end)

    @property
    def is_finished(self) -> bool:
        """EOS was accepted, or nothing but EOS can follow (the engine may end the sequence right away)."""
        return self._ended_by_eos or (self._matcher.is_stopped() and not self.is_dead_end)

    @property
    def is_dead_end(self) -> bool:
        return self.dead_end_reason is not None

    @property
    def dead_end_reason(self) -> str | None:
        if self._dead_end_reason is None and self._matcher.is_error():
            self._dead_end_reason = f"the grammar reached a dead end: {self._matcher.get_error()}"
        return self._dead_end_reason

    @property
    def num_accepted_tokens(self) -> int:
        return self._num_accepted_tokens

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Writes bitmask[row]: the tokens allowed next."""
        self.layout.check_bitmask(bitmask)
        if not 0 <= row < bitmask.shape[0]:
            raise ValueError(f"row {row} is outside the bitmask's {bitmask.shape[0]} rows")
        if self._ended_by_eos:
            bitmask[row] = self.layout.eos_row()
            return
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)
        self.note_filled(bitmask[row : row + 1])

    def note_filled(self, rows: np.ndarray, marks_dead_end: bool = True) -> None:
        """After llguidance wrote this matcher's row (alone or in a batch): trim it, see whether it is empty.
        marks_dead_end False: a row ahead of the sequence (a verify row's position after proposals it may
        reject), whose emptiness is the sequence's dead end only if the target accepts those proposals."""
        self.layout.clear_beyond_vocab(rows)
        if not marks_dead_end:
            return
        if self._dead_end_reason is None and not self._matcher.is_error() and not rows.any():
            self._dead_end_reason = "the grammar reached a dead end: no token of the vocabulary can continue it"

    def accept_token(self, token_id: int) -> bool:
        """Advances past a sampled token. False (and a dead end from then on) when the grammar refuses it."""
        if self.is_dead_end:
            return False
        if self._ended_by_eos:
            self._dead_end_reason = f"the grammar reached a dead end: token {token_id} after EOS"
            return False
        if not 0 <= token_id < self.layout.vocab_size:
            self._dead_end_reason = (
                f"the grammar reached a dead end: token {token_id} is outside the vocabulary "
                f"({self.layout.vocab_size} tokens)"
            )
            return False
        if token_id in self.layout.eos_token_ids and self._matcher.is_accepting():
            self._ended_by_eos = True
        elif not self._matcher.consume_token(token_id):
            return False  # llguidance is in its error state now: dead_end_reason says why
        self._num_accepted_tokens += 1
        return True

    def num_acceptable_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of token_ids, from the first, the grammar would accept (speculative drafts); no state changes."""
        if self.is_dead_end or self._ended_by_eos:
            return 0
        return self._matcher.validate_tokens([int(t) for t in token_ids])

    def copy(self) -> GrammarMatcher:
        """An independent matcher at the same place (llguidance's deep copy: a few microseconds)."""
        twin = GrammarMatcher(self._matcher.deep_copy(), self.layout)
        twin._num_accepted_tokens, twin._ended_by_eos = self._num_accepted_tokens, self._ended_by_eos
        twin._dead_end_reason = self._dead_end_reason
        return twin

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next (llguidance's fast-forward: the bytes that only one continuation
        allows, tokenized canonically; [] where the next token is a choice). Speculation proposes them: the
        model may still spell those bytes with other tokens, which verification then rejects."""
        if self.is_dead_end or self._ended_by_eos:
            return []
        return [int(t) for t in self._matcher.compute_ff_tokens()]

    def rollback(self, num_tokens: int) -> None:
        """Forgets the last num_tokens accepted tokens (rejected speculative ones). A dead end stays one."""
        if not 0 <= num_tokens <= self._num_accepted_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._num_accepted_tokens} were accepted")
        if self.is_dead_end:
            raise ValueError(f"cannot roll back a grammar at a dead end ({self.dead_end_reason})")
        self._num_accepted_tokens -= num_tokens
        if num_tokens and self._ended_by_eos:
            self._ended_by_eos = False
            num_tokens -= 1
        if num_tokens and not self._matcher.rollback(num_tokens):
            self._dead_end_reason = f"the grammar could not roll back {num_tokens} tokens"

    @property
    def llguidance_matcher(self) -> llguidance.LLMatcher:
        """For the batched fill (GrammarCompiler.fill_bitmasks), which hands matchers to llguidance's executor."""
        return self._matcher

    @property
    def ended_by_eos(self) -> bool:
        return self._ended_by_eos
