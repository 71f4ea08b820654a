"""SentencePiece encoding and incremental detokenization."""

import numpy as np

from tests.support.fixtures import fixture_dir
from jaxserve.loading.tokenizer import Tokenizer, detokenize_incrementally, start_detokenizer


def test_incremental_detokenization_equals_full_decode():
    tokenizer = Tokenizer.from_model_dir(fixture_dir("llama_gqa"))
    rng = np.random.default_rng(0)
    texts = ["héllo wörld — ünïcode ✓ 日本語 text", "def forward(self, x):\n    return x * 2"]
    for text in texts:
        prompt = tokenizer.encode("Say:")
        output = tokenizer.encode(text)[1:]  # without BOS
        state, pieces, token_ids = start_detokenizer(len(prompt)), [], list(prompt)
        for token_id in output:
            token_ids.append(token_id)
            pieces.append(detokenize_incrementally(tokenizer, token_ids, state))
        # sentencepiece encodes text with a leading "▁", which reads as a space after the prompt
        assert "".join(pieces) == " " + text
    # random token streams (byte fallback pieces that never complete a character) never raise
    token_ids = [1]
    state = start_detokenizer(1)
    for token_id in rng.integers(0, tokenizer.vocab_size, size=200):
        token_ids.append(int(token_id))
        detokenize_incrementally(tokenizer, token_ids, state)


def test_bos_follows_tokenizer_config(tmp_path):
    import shutil

    shutil.copy(fixture_dir("llama_gqa") + "/tokenizer.model", tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text('{"add_bos_token": false}')
    assert Tokenizer.from_model_dir(str(tmp_path)).encode("hi")[0] != 1
    assert Tokenizer.from_model_dir(fixture_dir("llama_gqa")).encode("hi")[0] == 1
