"""After a step: append sampled tokens, detokenize incrementally, and decide whether a sequence stops."""

from __future__ import annotations

from jaxserve.host.request import FinishReason, Logprob, RequestStatus, SequenceState
from jaxserve.host.stop_strings import find_stop_string
from jaxserve.loading.detokenizer import (
    DetokenizerState,
    detokenize_incrementally,
    flush_detokenizer,
    start_detokenizer,
)
from jaxserve.loading.tokenizer import Tokenizer


def ranked_logprobs(top_token_ids, top_logprobs, token_id: int, logprob, rank) -> dict[int, float]:
    """{token_id: Logprob} for the top tokens (ranked 1, 2, ... in order) plus the chosen one (its own rank); typed
    as the floats they are."""
    logprobs: dict[int, float] = {
        int(t): Logprob(float(v), i + 1) for i, (t, v) in enumerate(zip(top_token_ids, top_logprobs))
    }
    if token_id not in logprobs:
        logprobs[token_id] = Logprob(float(logprob), int(rank))
    return logprobs


def token_logprobs(row: int, sampled, num_top: int) -> dict[int, float]:
    """{token_id: logprob} for the row's top `num_top` tokens plus the sampled one."""
    return ranked_logprobs(
        sampled.top_token_ids[row, :num_top],
        sampled.top_logprobs[row, :num_top],
        int(sampled.token_ids[row]),
        sampled.logprobs[row],
        sampled.ranks[row],
    )


def record_prompt_logprobs(seq: SequenceState, chunk, first_slot: int, scored) -> None:
    """Gather the prompt logprobs a chunk's positions computed (scored: the step's numpy PromptLogprobs; the
    chunk's tokens start at token slot first_slot). Positions already gathered (before a preemption) are
    skipped, so the list grows in prompt order."""
    gathered = seq.prompt_logprobs
    if gathered is None:
        return
    num_top = seq.params.prompt_logprobs or 0
    for position in chunk.scored_positions:
        if position != len(gathered):
            continue
        slot = first_slot + position - chunk.start
        gathered.append(
            ranked_logprobs(
                scored.top_token_ids[slot, :num_top],
                scored.top_logprobs[slot, :num_top],
                seq.prompt_token_ids[position + 1],
                scored.token_logprobs[slot],
                scored.token_ranks[slot],
            )
        )


def _joins_added_tokens(seq: SequenceState, tokenizer: Tokenizer) -> bool:
    """spaces_between_special_tokens False and special tokens kept: the newest output token is an added
    token and so is the output token before it (vLLM's rule; the prompt's last token does not count)."""
    params = seq.params
    if params.skip_special_tokens or params.spaces_between_special_tokens or len(seq.output_token_ids) < 2:
        return False
    added = tokenizer.added_token_texts
    return seq.output_token_ids[-1] in added and seq.output_token_ids[-2] in added


def append_token(
    seq: SequenceState,
    token_id: int,
    logprobs: dict[int, float] | None,
    tokenizer: Tokenizer | None,
    eos_token_ids: frozenset[int],
    max_model_len: int,
    no_token_allowed: bool = False,
) -> FinishReason | None:
    """Record one sampled token; returns the finish reason or None to go on. Before min_tokens output
    tokens nothing stops the sequence but its length (as vLLM). no_token_allowed: the step's processors
    left no token (the sampler's pick is noise): it is dropped and the sequence ends at a dead end."""
    if no_token_allowed:
        if tokenizer is not None and isinstance(seq.detokenizer_state, DetokenizerState):
            skip = seq.params.skip_special_tokens
            seq.text += flush_detokenizer(tokenizer, seq.token_ids, seq.detokenizer_state, skip)
        return FinishReason.GRAMMAR_DEAD_END if seq.grammar is not None else FinishReason.NO_TOKEN_ALLOWED
    seq.output_token_ids.append(token_id)
    if logprobs is not None:
        seq.output_logprobs.append(logprobs)
    reason = None
    may_stop = len(seq.output_token_ids) >= seq.params.min_tokens
    is_eos = not seq.params.ignore_eos and token_id in eos_token_ids
    stopped_by_token = may_stop and (is_eos or token_id in seq.params.stop_token_id_set)
    if stopped_by_token:
        reason = FinishReason.STOP
        seq.stop_reason = None if is_eos else token_id  # vLLM's: EOS is no stop reason, a stop token is
    elif len(seq.output_token_ids) >= seq.params.max_new_tokens or seq.num_tokens >= max_model_len:
        reason = FinishReason.LENGTH
    if seq.waiting_grammar is not None and token_id == seq.params.guided_decoding_after_token:
        seq.grammar, seq.waiting_grammar = seq.waiting_grammar, None  # from the next token (this one is not its)
    elif seq.grammar is not None and reason is None:
        reason = _advance_grammar(seq, token_id)
    elif seq.grammar is not None and reason is FinishReason.STOP and seq.grammar.is_dead_end:
        # llguidance in its error state (a resource limit hit computing the mask) allows EOS alone: the text is
        # not one the grammar accepts
        reason = FinishReason.GRAMMAR_DEAD_END
    if tokenizer is not None:
        state = seq.detokenizer_state
        if not isinstance(state, DetokenizerState):  # None until the first token
            state = seq.detokenizer_state = start_detokenizer(seq.num_prompt_tokens)
        skip = seq.params.skip_special_tokens
        # as vLLM's detokenizer: the EOS or stop token that ends the sequence adds no text (its id stays in the
        # output) unless include_stop_str_in_output
        adds_text = not stopped_by_token or seq.params.include_stop_str_in_output
        token_ids = seq.token_ids if adds_text else seq.token_ids[:-1]
        new_text = detokenize_incrementally(tokenizer, token_ids, state, skip)
        if new_text and adds_text and _joins_added_tokens(seq, tokenizer):
            # as vLLM's fast detokenizer: the bare text, without a space the decoder put before it
            new_text = tokenizer.added_token_texts[token_id]
        if reason is not None:  # the last token: nothing held back waiting for the rest of a character
            new_text += flush_detokenizer(tokenizer, token_ids, state, skip)
        seq.text += new_text
        if seq.params.stop and new_text and may_stop:
            index = find_stop_string(seq, new_text)
            if index != -1:
                # the shortest stop beginning there is the one this text completed (it ends first)
                seq.stop_reason = min(
                    (stop for stop in seq.params.stop if seq.text.startswith(stop, index)), key=len, default=None
                )
                # the stop string reaches the caller only when asked for; what follows it never does
                keep = len(seq.stop_reason) if seq.params.include_stop_str_in_output and seq.stop_reason else 0
                seq.text = seq.text[: index + keep]
                return FinishReason.STOP
    return reason


def _advance_grammar(seq: SequenceState, token_id: int) -> FinishReason | None:
    """The grammar takes the token (it was sampled under the grammar's mask). A grammar with nothing left
    but EOS ends the sequence at once (even with ignore_eos or before min_tokens: nothing else could
    follow); one that could not take the token, or had nothing to offer, ends it as a dead end."""
    grammar = seq.grammar
    if grammar.is_dead_end or not grammar.accept_token(token_id):
        return FinishReason.GRAMMAR_DEAD_END
    return FinishReason.STOP if grammar.is_finished else None


class OutputProcessor:
    """After a step: record the KV each chunk computed (caching newly full pages), then append the
    sampled tokens, detokenize, and finish the sequences that stop."""

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0

    def stats(self) -> dict:
        return {"num_prompt_tokens": self.num_prompt_tokens, "num_generated_tokens": self.num_generated_tokens}

    def process(self, chunks, scheduler, sampled, first_row: int, prompt_logprobs=None) -> set[str]:
        """chunks ran on scheduler's rank; their sampled rows (numpy SamplerOutput fields) start at
        first_row. prompt_logprobs: (numpy PromptLogprobs, each chunk's first token slot) when some chunk
        scored prompt tokens. Returns the ids of the requests that produced a token or finished."""
        progressed = set()
        for index, chunk in enumerate(chunks):
            row, seq = first_row + index, chunk.seq
            scheduler.mark_processed(chunk)
            if seq.is_finished:
                continue  # aborted (or finished) while its step ran: its KV and token go nowhere
            # a flushing sequence's later steps (a decode chain's, engine/decode_chain.py) computed KV past its last
            # token, for tokens it dropped: that KV counts for nothing, and no page holding it is cached
            seq.num_computed_tokens = min(chunk.end, seq.num_tokens)
            if prompt_logprobs is not None and chunk.scored_positions:
                scored, first_slots = prompt_logprobs
                record_prompt_logprobs(seq, chunk, first_slots[index], scored)
            scheduler.cache_full_pages(seq)
            if seq.flushing:  # finished for its caller; the token this chunk sampled is dropped
                if not seq.num_inflight_tokens:
                    scheduler.finish(seq, seq.finish_reason)
                continue
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                self.num_prompt_tokens += chunk.num_tokens
            if seq.params.max_tokens == 0 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                scheduler.finish(seq, FinishReason.LENGTH)  # scored, nothing to generate: its KV is all computed
                progressed.add(seq.request_id)
                continue
            if not chunk.samples_next_token or seq.status is not RequestStatus.RUNNING:
                continue
            num_top = seq.params.logprobs
            logprobs = token_logprobs(row, sampled, num_top) if num_top is not None else None
            reason = append_token(
                seq,
                int(sampled.token_ids[row]),
                logprobs,
                self.tokenizer,
                self.eos_token_ids,
                self.max_model_len,
                bool(sampled.no_token_allowed[row]),
            )
            self.num_generated_tokens += 1
            if reason is not None:
                scheduler.finish_or_flush(seq, reason)
            progressed.add(seq.request_id)
        return progressed
