"""After a step: append sampled tokens, detokenize incrementally, and decide whether a sequence stops."""

from __future__ import annotations

from jaxserve.host.request import Sequence
from jaxserve.loading.tokenizer import Tokenizer, detokenize_incrementally, start_detokenizer


def token_logprobs(row: int, fetched: dict, num_top: int) -> dict[int, float]:
    """{token_id: logprob} for the row's top `num_top` tokens plus the sampled one."""
    logprobs = {int(t): float(v) for t, v in
                zip(fetched["top_token_ids"][row, :num_top], fetched["top_logprobs"][row, :num_top])}
    logprobs[int(fetched["token_ids"][row])] = float(fetched["logprobs"][row])
    return logprobs


def _find_stop_string(seq: Sequence, num_new_chars: int) -> int:
    """Index in seq.text where a stop string begins, looking only where the new text could complete one."""
    best = -1
    for stop in seq.params.stop:
        search_from = max(0, len(seq.text) - num_new_chars - len(stop) + 1)
        index = seq.text.find(stop, search_from)
        if index != -1 and (best == -1 or index < best):
            best = index
    return best


def append_token(seq: Sequence, token_id: int, logprobs: dict[int, float] | None, tokenizer: Tokenizer | None,
                 eos_token_ids: frozenset[int], max_model_len: int) -> str | None:
    """Record one sampled token; returns the finish reason ("stop" or "length") or None to go on."""
    seq.output_token_ids.append(token_id)
    if logprobs is not None:
        seq.output_logprobs.append(logprobs)
    if tokenizer is not None:
        if seq.detokenizer_state is None:
            seq.detokenizer_state = start_detokenizer(seq.num_prompt_tokens)
        new_text = detokenize_incrementally(tokenizer, seq.token_ids, seq.detokenizer_state)
        seq.text += new_text
        if seq.params.stop and new_text:
            index = _find_stop_string(seq, len(new_text))
            if index != -1:
                seq.text = seq.text[:index]  # the stop string never reaches the caller
                return "stop"
    if token_id in seq.params.stop_token_ids or (not seq.params.ignore_eos and token_id in eos_token_ids):
        return "stop"
    if len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None
