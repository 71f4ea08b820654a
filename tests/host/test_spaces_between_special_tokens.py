"""vLLM's spaces_between_special_tokens: False (with special tokens kept) writes an added token that follows
another as its bare text, without the space a decoder (WordPiece's) puts before it; everything else as before."""

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from jaxserve.host.output_processor import append_token
from jaxserve.host.request import SamplingParams, SequenceState
from jaxserve.loading.fast_tokenizer import FastTokenizer
from jaxserve.loading.tokenizer_config import TokenizerSettings

HELLO, WORLD, S, A, B = 1, 2, 3, 4, 5


def wordpiece_tokenizer() -> FastTokenizer:
    backend = tokenizers.Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken("<a>", special=True), AddedToken("<b>", special=True)])
    return FastTokenizer(backend, TokenizerSettings())


def generated_text(tokenizer, output_ids: list[int], **params) -> str:
    seq = SequenceState(0, "r", [HELLO, A], SamplingParams(max_tokens=len(output_ids), **params), 0, 0)
    for token_id in output_ids:
        append_token(seq, token_id, None, tokenizer, frozenset(), 64)
    return seq.text


def test_an_added_token_after_another_loses_the_space_the_decoder_puts_before_it():
    tokenizer = wordpiece_tokenizer()
    assert tokenizer.encode("hello<a><b>worlds", add_special_tokens=False) == [HELLO, A, B, WORLD, S]
    assert tokenizer.added_token_texts == {A: "<a>", B: "<b>"}
    outputs = [WORLD, A, B, A, HELLO, B]
    kept = generated_text(tokenizer, outputs, skip_special_tokens=False)
    assert kept == tokenizer.decode([HELLO, A, *outputs])[len("hello <a>") :] == " world <a> <b> <a> hello <b>"
    joined = generated_text(tokenizer, outputs, skip_special_tokens=False, spaces_between_special_tokens=False)
    # as vLLM: only an added token right after an added output token is bare (the prompt's last one does not count)
    assert joined == " world <a><b><a> hello <b>"
    # skipped special tokens: nothing to join, the flag changes nothing (vLLM reads it as True then)
    skipped = generated_text(tokenizer, outputs)
    assert generated_text(tokenizer, outputs, spaces_between_special_tokens=False) == skipped == " world hello"


def test_the_flag_must_be_a_bool():
    with pytest.raises(ValueError, match="spaces_between_special_tokens must be a bool"):
        SamplingParams(spaces_between_special_tokens="no")  # pyright: ignore[reportArgumentType]
