"""A directory with only a sentencepiece tokenizer.model: sentencepiece encodes, as Llama's tokenizer does
(BOS first unless tokenizer_config.json says otherwise), and pieces decode through the decoder chain
transformers gives the converted model, so decode() and skip_special_tokens read as transformers' do
(special tokens render as their text, not as sentencepiece's empty string)."""

from __future__ import annotations

import dataclasses
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
        super().__init__(settings)
        named = set(settings.special_tokens.values()) | set(settings.extra_special_tokens)
        named |= {token.content for token in settings.added_tokens}
        # Special tokens written in the text (a chat template's "<s>") encode as themselves, as in transformers.
        matched = sorted((t for t in named if t in self._piece_ids), key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, matched))) if matched else None
        self.special_ids = frozenset(
            i
            for i in range(self.vocab_size)
            if self.processor.IsControl(i) or self.processor.IsUnknown(i) or self.processor.IdToPiece(i) in named
        )
        chain = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if proto.normalizer_spec.add_dummy_prefix:
            chain.append(decoders.Strip(" ", 1, 0))  # the space sentencepiece put before the first word
        self.decoder = decoders.Sequence(chain)
        self.cleans_up_spaces = (
            settings.clean_up_tokenization_spaces and proto.trainer_spec.model_type != SENTENCEPIECE_BPE
        )

    @property
    def vocab_size(self) -> int:
        return self.processor.GetPieceSize()

    def token_to_id(self, token: str | None) -> int | None:
        return self._piece_ids.get(token) if token is not None else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_unicode(text)
        token_ids, start = [], 0
        for match in self._special_pattern.finditer(text) if self._special_pattern is not None else ():
            if match.start() > start:
                token_ids += self.processor.EncodeAsIds(text[start : match.start()])
            token_ids.append(self._piece_ids[match.group()])
            start = match.end()
        if start < len(text):
            token_ids += self.processor.EncodeAsIds(text[start:])
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            token_ids = [self.bos_token_id] + token_ids
        if add_special_tokens and self.add_eos_token and self.eos_token_id is not None:
            token_ids = token_ids + [self.eos_token_id]
        return token_ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        size = self.vocab_size
        pieces = [
            self.processor.IdToPiece(int(t))
            for t in token_ids
            if 0 <= t < size and not (skip_special_tokens and t in self.special_ids)
        ]
        text = self.decoder.decode(pieces)
        return clean_up_tokenization(text) if self.cleans_up_spaces else text


def _with_default_special_tokens(settings: TokenizerSettings, defaults: dict[str, str]) -> TokenizerSettings:
    """The model's own bos/eos/unk/pad pieces where tokenizer_config.json names none."""
    special = {**defaults, **settings.special_tokens}
    eos_tokens = settings.eos_tokens or ((special["eos_token"],) if "eos_token" in special else ())
    return dataclasses.replace(settings, special_tokens=special, eos_tokens=eos_tokens)
