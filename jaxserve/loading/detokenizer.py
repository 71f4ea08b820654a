"""Incremental detokenization: the text each sampled token adds, equal in sum to decoding the whole sequence.

A token's text depends on its neighbours: sentencepiece and metaspace vocabularies drop the space of the
first token of a decode, byte-level vocabularies split one character's UTF-8 bytes over several tokens.
So the new tokens are decoded together with a few tokens before them, and only the text beyond what
those earlier tokens decode to alone is emitted; text ending in an incomplete character (decoded as
U+FFFD) is held back until the character completes or the sequence ends.
"""

from __future__ import annotations

from dataclasses import dataclass

# How many prompt tokens before the first generated one are decoded with it, so that merges across the
# boundary (a leading space, a multi-byte character split over tokens) come out right.
DETOKENIZE_CONTEXT_TOKENS = 5
MAX_UTF8_CONTINUATION_BYTES = 3


@dataclass
class DetokenizerState:
    prefix_offset: int  # token_ids[prefix_offset:read_offset]: the context, already emitted
    read_offset: int  # token_ids[read_offset:]: not yet emitted


def start_detokenizer(num_prompt_tokens: int) -> DetokenizerState:
    return DetokenizerState(max(num_prompt_tokens - DETOKENIZE_CONTEXT_TOKENS, 0), num_prompt_tokens)


def _context_text(tokenizer, token_ids: list[int], state: DetokenizerState, skip_special_tokens: bool) -> str:
    """The context's text, the context first widened to start on a character: decoded from inside one, its
    bytes read as U+FFFD and, with byte fallback, so does the rest of that run of byte tokens."""
    for _ in range(MAX_UTF8_CONTINUATION_BYTES):
        prefix_text = tokenizer.decode(token_ids[state.prefix_offset : state.read_offset], skip_special_tokens)
        if state.prefix_offset == 0 or not prefix_text.startswith("\ufffd"):
            return prefix_text
        state.prefix_offset -= 1
    return tokenizer.decode(token_ids[state.prefix_offset : state.read_offset], skip_special_tokens)


def detokenize_incrementally(
    tokenizer, token_ids: list[int], state: DetokenizerState, skip_special_tokens: bool = True
) -> str:
    """The text that token_ids[state.read_offset:] add; advances state past them unless held back."""
    prefix_text = _context_text(tokenizer, token_ids, state, skip_special_tokens)
    full_text = tokenizer.decode(token_ids[state.prefix_offset :], skip_special_tokens)
    if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
        return ""
    state.prefix_offset = state.read_offset
    state.read_offset = len(token_ids)
    return full_text[len(prefix_text) :]


def flush_detokenizer(
    tokenizer, token_ids: list[int], state: DetokenizerState, skip_special_tokens: bool = True
) -> str:
    """When a sequence ends: the text still held back (an incomplete character reads as U+FFFD, as in a
    full decode)."""
    prefix_text = _context_text(tokenizer, token_ids, state, skip_special_tokens)
    full_text = tokenizer.decode(token_ids[state.prefix_offset :], skip_special_tokens)
    state.prefix_offset = state.read_offset = len(token_ids)
    return full_text[len(prefix_text) :]
