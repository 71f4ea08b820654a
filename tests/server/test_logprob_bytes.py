"""Chat logprobs' `bytes`: a token holding part of a UTF-8 character gives its raw bytes (the tokens of a
character join into it), not the bytes of the U+FFFD its decoded text shows."""

import pytest

from jaxserve.host.grammar import GrammarCompiler
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.server.openai.responses import TokenText, chat_logprobs

FIXTURES = "tests/loading/fixtures/smollm_byte_level", "tests/fixtures/llama_gqa"  # byte-level BPE, sentencepiece
TEXT = "héllo 日本 🦙"


@pytest.mark.parametrize("model_dir", FIXTURES)
def test_partial_character_tokens_carry_their_own_bytes(model_dir):
    tokenizer = Tokenizer.from_model_dir(model_dir)
    assert tokenizer is not None
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    logprobs = [{t: -0.5} for t in token_ids]
    content = chat_logprobs(TokenText(tokenizer, compiler.token_bytes), token_ids, logprobs, 0)["content"]
    partial = [entry for entry in content if "\ufffd" in entry["token"]]
    assert len(partial) >= 9  # é, 日, 本 and 🦙 are each split into byte tokens by both vocabularies
    assert all(entry["bytes"] != list("\ufffd".encode()) for entry in partial)
    joined = b"".join(bytes(entry["bytes"]) for entry in content).decode("utf-8")
    assert joined.replace(" ", "") == TEXT.replace(" ", "")  # sentencepiece's "▁" tokens decode alone as ""
    without_table = chat_logprobs(TokenText(tokenizer), token_ids, logprobs, 0)["content"]
    assert [e["bytes"] for e in without_table if "\ufffd" in e["token"]][0] == list("\ufffd".encode())
