"""Tokenizers against transformers (its outputs recorded by tests/support/record_tokenizers.py), and
incremental detokenization against full decodes."""

import functools
import json
import os
import shutil
import tempfile

import numpy as np
import pytest

from jaxserve.loading.detokenizer import flush_detokenizer
from jaxserve.loading.gguf import GGUFFile
from jaxserve.loading.gguf_tokenizer import gguf_tokenizer
from jaxserve.loading.tokenizer import Tokenizer, detokenize_incrementally, start_detokenizer
from tests.support import record_tokenizers
from tests.support.fixtures import fixture_dir
from tests.support.gguf_files import write_gguf

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
JSON_TOKENIZERS = ["qwen_byte_level", "smollm_byte_level", "llama_metaspace"]
GGUF_TOKENIZERS = list(record_tokenizers.GGUF_TOKENIZERS)  # vocabularies embedded in GGUF files
SENTENCEPIECE_DIR = fixture_dir("llama_gqa")
FAST_TOKENIZERS = JSON_TOKENIZERS + GGUF_TOKENIZERS


def recorded(name: str) -> dict:
    with open(os.path.join(FIXTURES, name, "expected.json")) as f:
        return json.load(f)


@functools.cache
def load(name: str) -> Tokenizer:
    if name in GGUF_TOKENIZERS:
        directory = tempfile.mkdtemp()
        try:
            return gguf_tokenizer(GGUFFile(record_tokenizers.write_tokenizer_gguf(name, directory)))
        finally:
            shutil.rmtree(directory)
    return Tokenizer.from_model_dir(SENTENCEPIECE_DIR if name == "sentencepiece" else os.path.join(FIXTURES, name))


@pytest.mark.parametrize("name", FAST_TOKENIZERS)
def test_encode_and_special_tokens_match_transformers(name):
    tokenizer, expected = load(name), recorded(name)
    for case in expected["encodings"]:
        assert tokenizer.encode(case["text"], case["add_special_tokens"]) == case["ids"], case
    assert tokenizer.bos_token_id == expected["bos_token_id"]
    assert tokenizer.eos_token_id == expected["eos_token_id"]
    assert tokenizer.vocab_size == expected["vocab_size"]
    assert tokenizer.special_tokens == expected["special_tokens"]


@pytest.mark.parametrize("name", FAST_TOKENIZERS + ["sentencepiece"])
def test_decode_matches_transformers(name):
    tokenizer = load(name)
    for case in recorded(name)["decodes"]:
        assert tokenizer.decode(case["ids"], case["skip_special_tokens"]) == case["text"], case


def test_sentencepiece_encodes_like_transformers_apart_from_bos():
    # transformers 5 adds no BOS for a directory without tokenizer_config.json; Llama's rule (and
    # llama.cpp's, and these fixtures' recorded prompts) puts BOS first, which jaxserve keeps.
    tokenizer = load("sentencepiece")
    for case in recorded("sentencepiece")["encodings"]:
        if not case["add_special_tokens"]:
            assert tokenizer.encode(case["text"], add_special_tokens=False) == case["ids"], case
    assert tokenizer.encode("hi")[0] == tokenizer.bos_token_id == 1


def test_eos_token_ids_join_config_generation_config_and_tokenizer():
    # qwen_byte_level: config.json eos 0, generation_config.json [2, 0], tokenizer eos "<|im_end|>" (2)
    assert load("qwen_byte_level").eos_token_ids == {0, 2}
    assert load("llama_metaspace").eos_token_ids == {2}
    assert load("sentencepiece").eos_token_ids == {2}


def test_gguf_byte_level_vocabulary_tokenizes_as_its_tokenizer_json(tmp_path):
    """llama.cpp's "smollm" pre-tokenizer splits digits one by one, as SmolLM's tokenizer.json does
    (transformers' GGUF loader knows no split for it, and keeps digits together)."""
    source = os.path.join(FIXTURES, "smollm_byte_level", "tokenizer.json")
    path = str(tmp_path / "smollm.gguf")
    write_gguf(
        path,
        dict(num_hidden_layers=1, hidden_size=64, intermediate_size=96, num_attention_heads=4),
        {},
        {},
        tokenizer=("gpt2:smollm", source),
    )
    from_gguf, from_json = gguf_tokenizer(GGUFFile(path)), load("smollm_byte_level")
    for text in record_tokenizers.TEXTS:
        assert from_gguf.encode(text) == from_json.encode(text), text
    assert from_gguf.encode("12345") == [from_gguf.token_to_id(digit) for digit in "12345"]
    assert from_gguf.eos_token_ids == {from_gguf.token_to_id("<|im_end|>")}


def stream(tokenizer, prompt_ids, output_ids, skip_special_tokens=True) -> list[str]:
    token_ids, state, pieces = list(prompt_ids), start_detokenizer(len(prompt_ids)), []
    for token_id in output_ids:
        token_ids.append(token_id)
        pieces.append(detokenize_incrementally(tokenizer, token_ids, state, skip_special_tokens))
    pieces.append(flush_detokenizer(tokenizer, token_ids, state, skip_special_tokens))
    return pieces


@pytest.mark.parametrize("name", FAST_TOKENIZERS + ["sentencepiece"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenization_equals_full_decode(name, skip_special_tokens):
    """Streamed text, token by token, equals decoding prompt + output and cutting the prompt's text off;
    multi-byte characters split over byte-level tokens come out whole."""
    tokenizer = load(name)
    texts = ["héllo wörld — ünïcode ✓ 日本語 text", "emoji 🙂🎉 and 👩‍👩‍👧", "def forward(self, x):\n    return x"]
    sequences = [(tokenizer.encode("Say:"), tokenizer.encode(text, add_special_tokens=False)) for text in texts]
    rng = np.random.default_rng(0)
    for ids in (case["ids"] for case in recorded(name)["decodes"][::2]):
        split = int(rng.integers(1, len(ids))) if len(ids) > 1 else 1
        sequences.append((ids[:split], ids[split:] + rng.integers(0, tokenizer.vocab_size, 4).tolist()))
    for prompt_ids, output_ids in sequences:
        full = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens)
        prompt = tokenizer.decode(prompt_ids, skip_special_tokens)
        pieces = stream(tokenizer, prompt_ids, output_ids, skip_special_tokens)
        # Invalid UTF-8 (random byte tokens) can rewrite text already streamed: byte fallback turns a
        # run of byte tokens into one U+FFFD per byte once the run turns out invalid. Valid text streams exactly.
        if "\ufffd" not in full and full.startswith(prompt):
            assert "".join(pieces) == full[len(prompt) :], (prompt_ids, output_ids)


def test_byte_level_streams_whole_characters():
    tokenizer = load("qwen_byte_level")
    output_ids = tokenizer.encode("👩‍👩‍👧日本", add_special_tokens=False)
    pieces = stream(tokenizer, tokenizer.encode("x"), output_ids)
    assert len(output_ids) > 4 and "".join(pieces) == "👩‍👩‍👧日本"
    assert "" in pieces  # some tokens carried only part of a character, and were held back


def test_sentencepiece_stream_keeps_the_leading_space():
    tokenizer = load("sentencepiece")
    text = "héllo wörld — ünïcode ✓ 日本語 text"
    output_ids = tokenizer.encode(text)[1:]  # without BOS
    assert "".join(stream(tokenizer, tokenizer.encode("Say:"), output_ids)) == " " + text


def test_sentencepiece_bos_follows_tokenizer_config(tmp_path):
    shutil.copy(os.path.join(SENTENCEPIECE_DIR, "tokenizer.model"), tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text('{"add_bos_token": false}')
    assert Tokenizer.from_model_dir(str(tmp_path)).encode("hi")[0] != 1


def test_malformed_files_raise_value_errors_naming_them(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_model_dir(str(tmp_path))
    (tmp_path / "tokenizer.json").unlink()
    shutil.copy(os.path.join(SENTENCEPIECE_DIR, "tokenizer.model"), tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json"):
        Tokenizer.from_model_dir(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": 7}')
    with pytest.raises(ValueError, match=r"tokenizer_config\.json"):
        Tokenizer.from_model_dir(str(tmp_path))
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "tokenizer.model").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match=r"tokenizer\.model"):
        Tokenizer.from_model_dir(str(tmp_path))
    (tmp_path / "tokenizer.model").unlink()
    assert Tokenizer.from_model_dir(str(tmp_path)) is None  # no tokenizer: token-id prompts only


def test_gguf_named_chat_templates_exclude_the_converters_list_of_names(tmp_path):
    """llama.cpp's converter writes tokenizer.chat_template, tokenizer.chat_template.NAME and tokenizer.chat_templates
    (the names): the list was read as a template named "s"."""
    config = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=96, num_attention_heads=4)
    templates = [
        {"name": "default", "template": "A{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "B"},
    ]
    path = str(tmp_path / "named.gguf")
    write_gguf(path, config, {}, {}, tokenizer=("llama", os.path.join(SENTENCEPIECE_DIR, "tokenizer.model")),
               chat_template=templates)  # fmt: skip
    assert "tokenizer.chat_templates" in GGUFFile(path).metadata
    tokenizer = gguf_tokenizer(GGUFFile(path))
    assert tokenizer.settings.chat_template == {"default": templates[0]["template"], "tool_use": "B"}


def write_llama_tokenizer_dir(directory, config: dict) -> str:
    shutil.copy(os.path.join(SENTENCEPIECE_DIR, "tokenizer.model"), os.path.join(directory, "tokenizer.model"))
    base = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({**base, **config}, f)
    return str(directory)


def test_a_sentencepiece_model_with_added_chat_tokens_reads_as_transformers_does(tmp_path):
    """An old ChatML fine-tune without tokenizer.json: <|im_start|> / <|im_end|> past the model's 384 pieces, listed
    in tokenizer_config.json only. Expected: transformers 5.25's LlamaTokenizer on the same directory."""
    special = {"special": True, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
    added = {"384": {"content": "<|im_start|>", **special}, "385": {"content": "<|im_end|>", **special}}
    tokenizer = Tokenizer.from_model_dir(
        write_llama_tokenizer_dir(tmp_path, {"eos_token": "<|im_end|>", "added_tokens_decoder": added})
    )
    assert (tokenizer.vocab_size, tokenizer.eos_token_id, tokenizer.token_to_id("<|im_start|>")) == (386, 385, 384)
    chat = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode(chat) == [
        1,
        384,
        302,
        297,
        263,
        13,
        303,
        295,
        385,
        13,
        384,
        296,
        297,
        297,
        295,
        297,
        292,
        296,
        294,
        292,
        13,
    ]
    assert tokenizer.encode("a<|im_end|>b") == [1, 262, 385, 304]
    assert tokenizer.decode([384, 290, 385, 303]) == "<|im_start|> <|im_end|>h"
    assert tokenizer.decode([384, 290, 385, 303], skip_special_tokens=True) == "h"


@pytest.mark.parametrize(
    "legacy, expected",
    [
        (None, [[1, 262, 1, 304], [1, 1, 264, 299, 299, 298], [1, 290]]),  # transformers 5's default: legacy false
        (False, [[1, 262, 1, 304], [1, 1, 264, 299, 299, 298], [1, 290]]),
        (True, [[1, 262, 1, 265], [1, 1, 290, 264, 299, 299, 298], [1, 290]]),
    ],
)
def test_llama_tokenizer_class_places_the_word_prefix_as_transformers_does(tmp_path, legacy, expected):
    """A LlamaTokenizer directory: no "▁" after a special token unless legacy, none doubled before a leading space
    (sentencepiece alone gives " " -> "▁▁"). Expected: transformers 5.25's encodings."""
    config = {} if legacy is None else {"legacy": legacy}
    tokenizer = Tokenizer.from_model_dir(write_llama_tokenizer_dir(tmp_path, config))
    assert [tokenizer.encode(text) for text in ("a<s>b", "<s>hello", " ")] == expected


def test_added_tokens_marked_not_special_stay_in_the_decoded_text(tmp_path):
    """A reasoning fine-tune's <think> / </think> (added, special: false): transformers 5.25 decodes them with
    skip_special_tokens too ('a<think>b</think>c'); they were dropped as special, so the think reasoning parsers
    could not find them in the engine's text."""
    flags = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
    added = {
        "384": {"content": "<think>", "special": False, **flags},
        "385": {"content": "</think>", "special": False, **flags},
    }
    tokenizer = Tokenizer.from_model_dir(write_llama_tokenizer_dir(tmp_path, {"added_tokens_decoder": added}))
    ids = tokenizer.encode("a<think>b</think>c", add_special_tokens=False)
    assert ids == [262, 384, 304, 385, 301]  # transformers 5.25's
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a<think>b</think>c"
    assert tokenizer.decode([1, *ids], skip_special_tokens=True) == "a<think>b</think>c"  # BOS still skipped
