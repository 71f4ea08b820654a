"""Text <-> token ids, as transformers' tokenizer for the same files does it.

A model directory's tokenizer.json is read by Hugging Face's `tokenizers` (FastTokenizer); a directory
with only a sentencepiece tokenizer.model keeps sentencepiece (SentencePieceTokenizer); a GGUF file's
embedded vocabulary becomes a FastTokenizer too (gguf_tokenizer.py). Each honours what
tokenizer_config.json says (tokenizer_config.py) and exposes what the engine stops on
(`eos_token_ids`) and what chat templates read (`special_tokens`, `chat_template`).
"""

from __future__ import annotations

import abc
import os

from jaxserve.loading.detokenizer import DetokenizerState, detokenize_incrementally, start_detokenizer  # noqa: F401  (the engine's output processor imports them from here)
from jaxserve.loading.tokenizer_config import TokenizerSettings, read_tokenizer_settings


class Tokenizer(abc.ABC):
    """The interface both backends (fast_tokenizer.py, sentencepiece_tokenizer.py) implement; they set up
    their backend, then call __init__."""

    settings: TokenizerSettings

    def __init__(self, settings: TokenizerSettings):
        self.settings = settings
        self.special_tokens = dict(settings.special_tokens)  # "bos_token" -> "<s>", as chat templates read them
        self.chat_template = settings.chat_template
        self.chat_template_source = settings.chat_template_source
        self.bos_token_id = self.token_to_id(self.special_tokens.get("bos_token"))
        self.eos_token_id = self.token_to_id(self.special_tokens.get("eos_token"))
        eos = set(settings.config_eos_token_ids)
        eos.update(i for i in (self.token_to_id(t) for t in settings.eos_tokens) if i is not None)
        # Every id generation stops on: config.json's and generation_config.json's EOS ids and the
        # tokenizer's own EOS token(s) (a chat model's end-of-turn token is often only the latter).
        self.eos_token_ids = frozenset(eos)

    @classmethod
    def from_model_dir(cls, model_dir: str) -> Tokenizer | None:
        """The directory's tokenizer.json (preferred) or tokenizer.model; None when it has neither
        (token-id prompts only). Raises ValueError naming the file when one is malformed."""
        from jaxserve.loading.fast_tokenizer import FastTokenizer  # the backends subclass this class
        from jaxserve.loading.sentencepiece_tokenizer import SentencePieceTokenizer

        json_path = os.path.join(model_dir, "tokenizer.json")
        model_path = os.path.join(model_dir, "tokenizer.model")
        if not os.path.isfile(json_path) and not os.path.isfile(model_path):
            return None
        settings = read_tokenizer_settings(model_dir)
        if os.path.isfile(json_path):
            return FastTokenizer.from_file(json_path, settings)
        return SentencePieceTokenizer(model_path, settings)

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @abc.abstractmethod
    def token_to_id(self, token: str | None) -> int | None: ...

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens: BOS/EOS as the tokenizer's rule says (off for rendered chat templates,
        which write their own)."""

    @abc.abstractmethod
    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """Ids outside the vocabulary are left out."""

    @property
    @abc.abstractmethod
    def added_token_texts(self) -> dict[int, str]:
        """Every added token's id -> its text (transformers' added_tokens_decoder: special tokens and plain
        added ones): what vLLM's spaces_between_special_tokens=False writes for one that follows another."""


def check_unicode(text: str, what: str = "the text") -> None:
    """ValueError naming the first lone UTF-16 surrogate in text. JSON can carry one ("\\ud800" is valid
    JSON) but it is no Unicode character: the tokenizers' native code refuses it with an error that
    names nothing, and no response holding it can be encoded as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{what} holds a lone UTF-16 surrogate (U+{ord(text[error.start]):04X} at character {error.start}), "
            f"which is not valid Unicode: surrogates must come in high-low pairs"
        ) from None


def clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of spaces before punctuation (WordPiece-era; never applied to BPE)."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text
