"""Tokenizers of Hugging Face's `tokenizers` library: a tokenizer.json, or one built from a GGUF vocabulary.

transformers (5.x) loads a tokenizer.json as the library does and then adjusts it from
tokenizer_config.json; the same adjustments are made here so encode and decode agree with it:
- the config's added tokens, and its named and extra special tokens, are added to the tokenizer's
  added vocabulary (so "<|im_end|>" in text encodes as one token, and skip_special_tokens drops it);
- BOS/EOS follow tokenizer.json's post-processor; a config's add_bos_token / add_eos_token only counts
  where there is no tokenizer.json (a GGUF vocabulary);
- clean_up_tokenization_spaces is honoured except for BPE models, where transformers ignores it.
"""

from __future__ import annotations

import dataclasses
import functools

import tokenizers
from tokenizers import AddedToken, processors

from jaxserve.loading.tokenizer import Tokenizer, check_unicode, clean_up_tokenization
from jaxserve.loading.tokenizer_config import TokenizerSettings


class FastTokenizer(Tokenizer):
    def __init__(self, backend: tokenizers.Tokenizer, settings: TokenizerSettings):
        self.backend = backend
        _add_configured_tokens(backend, settings)
        if settings.add_bos_token is not None or settings.add_eos_token is not None:
            backend.post_processor = _bos_eos_template(backend, settings)
        self.cleans_up_spaces = settings.clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"
        super().__init__(settings)

    @classmethod
    def from_file(cls, path: str, settings: TokenizerSettings) -> FastTokenizer:
        try:
            backend = tokenizers.Tokenizer.from_file(path)
        except Exception as error:  # the library raises a bare Exception for every parse error
            raise ValueError(f"malformed tokenizer file {path}: {error}") from None
        # transformers lets tokenizer.json's post-processor alone decide BOS/EOS.
        return cls(backend, dataclasses.replace(settings, add_bos_token=None, add_eos_token=None))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_unicode(text)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode([int(t) for t in token_ids if t >= 0], skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self.cleans_up_spaces else text

    @functools.cached_property
    def added_token_texts(self) -> dict[int, str]:
        return {token_id: token.content for token_id, token in self.backend.get_added_tokens_decoder().items()}


def _add_configured_tokens(backend: tokenizers.Tokenizer, settings: TokenizerSettings) -> None:
    """The config's added tokens, then its special tokens, as transformers adds them on load."""
    present = {repr(token) for token in backend.get_added_tokens_decoder().values()}
    to_add = [token for token in settings.added_tokens if repr(token) not in present]
    known = {token.content for token in backend.get_added_tokens_decoder().values()} | {t.content for t in to_add}
    named = list(settings.special_tokens.values()) + list(settings.extra_special_tokens)
    to_add += [AddedToken(text, special=True, normalized=False) for text in dict.fromkeys(named) if text not in known]
    if to_add:
        backend.add_tokens(to_add)
    # transformers' post-init marks every named special token special, even one the vocabulary added as plain.
    if named:
        backend.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in dict.fromkeys(named)])


def _added_token(backend: tokenizers.Tokenizer, add: bool | None, token: str | None) -> str | None:
    """The token, when the template is to add it and the vocabulary has it."""
    return token if bool(add) and token is not None and backend.token_to_id(token) is not None else None


def _bos_eos_template(backend: tokenizers.Tokenizer, settings: TokenizerSettings) -> processors.TemplateProcessing:
    bos = _added_token(backend, settings.add_bos_token, settings.special_tokens.get("bos_token"))
    eos = _added_token(backend, settings.add_eos_token, settings.special_tokens.get("eos_token"))
    single = f"{bos + ':0 ' if bos is not None else ''}$A:0{' ' + eos + ':0' if eos is not None else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos is not None else ''} $B:1{' ' + eos + ':1' if eos is not None else ''}"
    special = [(bos, backend.token_to_id(bos))] if bos is not None else []
    special += [(eos, backend.token_to_id(eos))] if eos is not None else []
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
