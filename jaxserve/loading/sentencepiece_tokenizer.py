"""A directory with only a sentencepiece tokenizer.model: sentencepiece encodes, as Llama's tokenizer does
(BOS first unless tokenizer_config.json says otherwise), and pieces decode through the decoder chain
transformers gives the converted model, so decode() and skip_special_tokens read as transformers' do
(special tokens render as their text, not as sentencepiece's empty string)."""

from __future__ import annotations

import dataclasses
import functools
import re

import sentencepiece
from sentencepiece import sentencepiece_model_pb2
from tokenizers import decoders

from jaxserve.loading.tokenizer import Tokenizer, check_unicode, clean_up_tokenization
from jaxserve.loading.tokenizer_config import TokenizerSettings

SENTENCEPIECE_BPE = 2  # ModelProto.TrainerSpec.model_type


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_path: str, settings: TokenizerSettings):
        self.processor = sentencepiece.SentencePieceProcessor()
        try:
            self.processor.Load(model_path)
        except (OSError, RuntimeError) as error:
            raise ValueError(f"malformed tokenizer model {model_path}: {error}") from None
        # sentencepiece ships no stubs for this generated protobuf module, whose classes are made at import time
        proto = sentencepiece_model_pb2.ModelProto()  # pyright: ignore[reportAttributeAccessIssue]
        proto.ParseFromString(self.processor.serialized_model_proto())
        self.add_bos_token = True if settings.add_bos_token is None else settings.add_bos_token
        self.add_eos_token = bool(settings.add_eos_token)
        defaults = {
            name: self.processor.IdToPiece(i)
            for name, i in (
                ("bos_token", self.processor.bos_id()),
                ("eos_token", self.processor.eos_id()),
                ("unk_token", self.processor.unk_id()),
                ("pad_token", self.processor.pad_id()),
            )
            if i >= 0
        }
        settings = _with_default_special_tokens(settings, defaults)
        self._piece_ids = {self.processor.IdToPiece(i): i for i in range(self.processor.GetPieceSize())}
        # tokenizer_config.json's added tokens past the model's pieces (an old ChatML fine-tune's <|im_start|> /
        # <|im_end|> at 32000+), as transformers appends them: ids, text, and special ones skipped when asked
        self._added = {
            token_id: token
            for token, token_id in zip(settings.added_tokens, settings.added_token_ids)
            if token_id >= self.processor.GetPieceSize() and token.content not in self._piece_ids
        }
        self._added_ids = {token.content: token_id for token_id, token in self._added.items()}
        super().__init__(settings)
        named = set(settings.special_tokens.values()) | set(settings.extra_special_tokens)
        named |= {token.content for token in settings.added_tokens}
        # Special tokens written in the text (a chat template's "<s>") encode as themselves, as in transformers.
        matched = sorted(
            (t for t in named | set(self._added_ids) if self.token_to_id(t) is not None), key=len, reverse=True
        )
        self._special_pattern = re.compile("|".join(map(re.escape, matched))) if matched else None
        pieces = self.processor.GetPieceSize()
        # what skip_special_tokens leaves out: control and unknown pieces, the named special tokens and added
        # tokens marked special; an added token marked not special (a reasoning model's <think>) stays in the
        # text, as transformers decodes it
        special = set(settings.special_tokens.values()) | set(settings.extra_special_tokens)
        special |= {token.content for token in settings.added_tokens if token.special}
        self.special_ids = frozenset(
            i
            for i in range(pieces)
            if self.processor.IsControl(i) or self.processor.IsUnknown(i) or self.processor.IdToPiece(i) in special
        ) | {i for i, token in self._added.items() if token.special or token.content in special}
        chain = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if proto.normalizer_spec.add_dummy_prefix:
            chain.append(decoders.Strip(" ", 1, 0))  # the space sentencepiece put before the first word
        self.decoder = decoders.Sequence(chain)
        self.cleans_up_spaces = (
            settings.clean_up_tokenization_spaces and proto.trainer_spec.model_type != SENTENCEPIECE_BPE
        )
        # transformers 5 reads a LlamaTokenizer directory through a Metaspace pre-tokenizer: the "▁" sentencepiece
        # puts before text goes only where text starts (legacy false, the default) or after every special token
        # (legacy true), and never before text that starts with a space. Without that class: sentencepiece's rule.
        self.metaspace = settings.llama_tokenizer_class and bool(proto.normalizer_spec.add_dummy_prefix)
        self.prefix_after_special = bool(settings.legacy)
        unk = self.processor.IdToPiece(self.processor.unk_id()) if self.processor.unk_id() >= 0 else "<unk>"
        self._unk_text, self._unk_length = unk, len(self.processor.EncodeAsIds(unk))

    @property
    def vocab_size(self) -> int:
        return max(self.processor.GetPieceSize(), max(self._added, default=-1) + 1)

    def token_to_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        return self._piece_ids.get(token, self._added_ids.get(token))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_unicode(text)
        token_ids, start = [], 0
        for match in self._special_pattern.finditer(text) if self._special_pattern is not None else ():
            if match.start() > start:
                token_ids += self._encode_text(text[start : match.start()], starts_the_text=start == 0)
            token_ids.append(self.token_to_id(match.group()))
            start = match.end()
        if start < len(text):
            token_ids += self._encode_text(text[start:], starts_the_text=start == 0)
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            token_ids = [self.bos_token_id] + token_ids
        if add_special_tokens and self.add_eos_token and self.eos_token_id is not None:
            token_ids = token_ids + [self.eos_token_id]
        return token_ids

    def _encode_text(self, text: str, starts_the_text: bool) -> list[int]:
        if not self.metaspace or (
            (starts_the_text or self.prefix_after_special) and not text.startswith((" ", "\u2581"))
        ):
            return self.processor.EncodeAsIds(text)
        # no "▁" before it: transformers' own way, the unknown token's text in front then its pieces dropped
        return self.processor.EncodeAsIds(self._unk_text + text)[self._unk_length :]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        size = self.processor.GetPieceSize()
        pieces = [  # added tokens as their text, through the same decoder chain as the pieces (as tokenizers does)
            self.processor.IdToPiece(int(t)) if t < size else self._added[int(t)].content
            for t in token_ids
            if (0 <= t < size or int(t) in self._added) and not (skip_special_tokens and t in self.special_ids)
        ]
        text = self.decoder.decode(pieces)
        return clean_up_tokenization(text) if self.cleans_up_spaces else text

    @functools.cached_property
    def added_token_texts(self) -> dict[int, str]:
        # as transformers' converted tokenizer lists them: the control and unknown pieces (<s>, </s>, <unk>)
        # and the named special ones, then tokenizer_config.json's added tokens (pieces of the model's or past them)
        size = self.processor.GetPieceSize()
        texts = {int(i): self.processor.IdToPiece(int(i)) for i in self.special_ids if i < size}
        added = zip(self.settings.added_token_ids, self.settings.added_tokens)
        return texts | {
            int(token_id): token.content for token_id, token in added if self.token_to_id(token.content) == token_id
        }


def _with_default_special_tokens(settings: TokenizerSettings, defaults: dict[str, str]) -> TokenizerSettings:
    """The model's own bos/eos/unk/pad pieces where tokenizer_config.json names none."""
    special = {**defaults, **settings.special_tokens}
    eos_tokens = settings.eos_tokens or ((special["eos_token"],) if "eos_token" in special else ())
    return dataclasses.replace(settings, special_tokens=special, eos_tokens=eos_tokens)
