"""The engine's side of the sampling controls (host/sampling_controls.py), penalties and guided decoding
(host/grammar.py): what a request needs is worked out once at admission, and before each dispatch the
step's rows get what depends on the tokens so far.

Before a dispatch:
- a sequence with penalties that starts running at a token buffer entry gets that entry's output
  counts and prompt bitmask written on the device (device/sequence_buffers.py);
- a sequence with a grammar, or with multi-token bad words, gets the next token's bitmask row or bans,
  which depend on the token it sampled last. With overlapped steps that token may still be on the
  device: the engine then processes the step in flight before planning the next (`waits_for_tokens`),
  so such steps give up overlap (the device waits for the host's postprocessing and planning).
"""

from __future__ import annotations

import threading

import numpy as np

from jaxserve.device.rank_layout import RankLayout
from jaxserve.device.runner import StepRunner
from jaxserve.host.grammar import CompiledGrammar, GrammarCompiler
from jaxserve.host.request import SamplingParams, SequenceState
from jaxserve.host.sampling_controls import SamplingControls, dynamic_bans, pack_bitmask, sampling_controls
from jaxserve.host.schedule import ScheduledChunk
from jaxserve.loading.tokenizer import Tokenizer


class RowConstraints:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        max_bias_entries: int,
        layout: RankLayout,
        runner: StepRunner,
    ):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_bias_entries = max_bias_entries
        self.layout = layout
        self.runner = runner
        self.mask_words = -(-vocab_size // 32)
        self._grammars: GrammarCompiler | None = None  # built on first use: ~1 s for a large vocabulary
        self._grammars_lock = threading.Lock()
        self._penalty_owner: dict[int, int] = {}  # token buffer entry -> seq_id whose counts it holds
        self.num_penalty_resets = 0

    # -- admission (validate runs on server handler threads; the rest on the engine loop) --------------

    def validate(self, params: SamplingParams) -> None:
        """ValueError naming the problem; compiles the grammar (once, cached) off the engine loop."""
        sampling_controls(params, self.tokenizer, self.eos_token_ids, self.vocab_size, self.max_bias_entries)
        if params.guided_decoding is not None:
            self.grammars().check(params.guided_decoding)

    def prepare(self, params: SamplingParams) -> tuple[SamplingControls | None, CompiledGrammar | None]:
        """What every sequence of a validated request shares: its controls and its compiled grammar."""
        controls = sampling_controls(params, self.tokenizer, self.eos_token_ids, self.vocab_size, self.max_bias_entries)
        compiled = None
        if params.guided_decoding is not None:
            # validate compiled it already, so this is a cache hit; an evicted grammar compiles again here
            compiled = self.grammars().compile_async(params.guided_decoding).result()
        return controls, compiled

    @staticmethod
    def attach(seq: SequenceState, controls: SamplingControls | None, compiled: CompiledGrammar | None) -> None:
        seq.controls = controls
        seq.grammar = compiled.new_matcher() if compiled is not None else None
        if seq.grammar is not None and seq.params.guided_decoding_after_token is not None:
            seq.grammar, seq.waiting_grammar = None, seq.grammar  # output_processor.append_token starts it

    def grammars(self) -> GrammarCompiler:
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("guided decoding needs the model's tokenizer, and this model has none")
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._grammars

    def token_bytes(self, token_id: int) -> bytes | None:
        """A token's own bytes (logprobs' `bytes` of a token holding part of a character), from the grammar
        engine's byte table; None where there is none (no tokenizer, one the grammar engine cannot read)."""
        try:
            return self.grammars().token_bytes(token_id)
        except ValueError:
            return None

    # -- each step ----------------------------------------------------------------------------------

    @staticmethod
    def waits_for_tokens(seq: SequenceState) -> bool:
        """Its next row depends on a token the host has not seen yet."""
        return RowConstraints.reads_each_token(seq) and seq.num_pending_tokens > 0

    @staticmethod
    def reads_each_token(seq: SequenceState) -> bool:
        """Each of its rows depends on the tokens before it on the host (a grammar's mask, a bad word's ban)."""
        return (
            seq.grammar is not None
            or seq.waiting_grammar is not None  # the next token may start it: its mask then applies at once
            or (seq.controls is not None and bool(seq.controls.multi_token_bad_words))
        )

    def before_dispatch(self, per_rank_chunks: list[list[ScheduledChunk]]) -> None:
        grammar_rows: list[ScheduledChunk] = []
        for rank, chunks in enumerate(per_rank_chunks):
            for chunk in chunks:
                seq = chunk.seq
                entry = self.layout.buffer_entry(rank, seq.token_buffer_entry)
                if seq.params.has_penalties and self._penalty_owner.get(entry) != seq.seq_id:
                    self._reset_penalty_state(entry, seq)
                self._penalty_owner[entry] = seq.seq_id
                if not chunk.samples_next_token:
                    continue
                if seq.grammar is not None:
                    grammar_rows.append(chunk)
                if seq.controls is not None and seq.controls.multi_token_bad_words:
                    seq.next_token_bans = tuple(dynamic_bans(seq.controls, seq.output_token_ids))
        if grammar_rows:
            self._fill_grammar_masks(grammar_rows)

    def _reset_penalty_state(self, entry: int, seq: SequenceState) -> None:
        counts = np.bincount(np.asarray(seq.output_token_ids, np.int64), minlength=self.vocab_size)
        prompt = pack_bitmask(seq.prompt_token_ids, self.mask_words)
        self.runner.reset_sequence_buffers(entry, counts[: self.vocab_size].astype(np.int32), prompt)
        self.num_penalty_resets += 1

    def _fill_grammar_masks(self, chunks: list[ScheduledChunk]) -> None:
        """Each row's mask for its next token, and a verify row's for every position after its proposals
        (draft_token_masks: the grammar advanced through the proposals before it, engine/speculation.py)."""
        grammars = self.grammars()
        first_rows = np.cumsum([0] + [1 + len(chunk.draft_token_ids) for chunk in chunks])
        bitmask = grammars.allocate_bitmask(int(first_rows[-1]))
        grammars.fill_verify_bitmasks(
            [(chunk.seq.grammar, int(first), chunk.draft_token_ids) for chunk, first in zip(chunks, first_rows)],
            bitmask,
        )
        for chunk, first, end in zip(chunks, first_rows, first_rows[1:]):
            seq = chunk.seq
            masks = bitmask[first:end, : self.mask_words].copy()
            if seq.controls is not None and seq.controls.allowed_mask is not None:
                masks &= seq.controls.allowed_mask
            seq.next_token_mask = masks[0]
            seq.draft_token_masks = masks[1:] if chunk.draft_token_ids else None

    def stats(self) -> dict:
        grammars = self._grammars
        return {
            "num_penalty_resets": self.num_penalty_resets,
            "num_grammars_compiled": grammars.num_compiles if grammars is not None else 0,
            "num_grammars_cached": grammars.num_cached_grammars if grammars is not None else 0,
        }
