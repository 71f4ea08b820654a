"""SentencePiece tokenization as Hugging Face's Llama tokenizer does it, and incremental detokenization."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import sentencepiece

# How many tokens before the newest ones are re-decoded, so that merges across the boundary
# (a leading space, a multi-byte character split over tokens) come out right.
DETOKENIZE_CONTEXT_TOKENS = 5


class Tokenizer:
    def __init__(self, model_path: str, add_bos_token: bool = True, add_eos_token: bool = False):
        self.processor = sentencepiece.SentencePieceProcessor()
        try:
            self.processor.Load(model_path)
        except (OSError, RuntimeError) as error:
            raise ValueError(f"malformed tokenizer model {model_path}: {error}") from None
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.bos_token_id = self.processor.bos_id() if self.processor.bos_id() >= 0 else None
        self.eos_token_id = self.processor.eos_id() if self.processor.eos_id() >= 0 else None

    @classmethod
    def from_model_dir(cls, model_dir: str) -> "Tokenizer | None":
        """The directory's tokenizer.model, or None when it has none (token-id prompts only)."""
        model_path = os.path.join(model_dir, "tokenizer.model")
        if not os.path.isfile(model_path):
            return None
        options = {}
        config_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.isfile(config_path):
            try:
                with open(config_path) as f:
                    tokenizer_config = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ValueError(f"malformed tokenizer_config.json in {model_dir!r}: {error}") from None
            for key in ("add_bos_token", "add_eos_token"):
                if isinstance(tokenizer_config.get(key), bool):
                    options[key] = tokenizer_config[key]
        return cls(model_path, **options)

    @property
    def vocab_size(self) -> int:
        return self.processor.GetPieceSize()

    def encode(self, text: str) -> list[int]:
        token_ids = list(self.processor.EncodeAsIds(text))
        if self.add_bos_token and self.bos_token_id is not None:
            token_ids = [self.bos_token_id] + token_ids
        if self.add_eos_token and self.eos_token_id is not None:
            token_ids = token_ids + [self.eos_token_id]
        return token_ids

    def decode(self, token_ids: list[int]) -> str:
        size = self.vocab_size
        return self.processor.DecodeIds([t for t in token_ids if 0 <= t < size])


@dataclass
class DetokenizerState:
    prefix_offset: int
    read_offset: int


def start_detokenizer(num_prompt_tokens: int) -> DetokenizerState:
    return DetokenizerState(max(num_prompt_tokens - DETOKENIZE_CONTEXT_TOKENS, 0), num_prompt_tokens)


def detokenize_incrementally(tokenizer: Tokenizer, token_ids: list[int], state: DetokenizerState) -> str:
    """The text that token_ids[state.read_offset:] add, decoded in the context of the tokens before them.

    Holds text back while it ends in an incomplete UTF-8 sequence (decoded as U+FFFD).
    """
    prefix_text = tokenizer.decode(token_ids[state.prefix_offset:state.read_offset])
    full_text = tokenizer.decode(token_ids[state.prefix_offset:])
    if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
        return ""
    state.prefix_offset = state.read_offset
    state.read_offset = len(token_ids)
    return full_text[len(prefix_text):]
