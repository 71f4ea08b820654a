"""SamplingParams.prompt_logprobs: scored inside the prefill chunks, equal to a one-chunk prefill of the whole
prompt (chunked, batched, after a preemption-free cache hit), to the decode step's logprobs of the same
tokens, and to transformers' where the fixtures record them; max_tokens 0 ends a request after its prefill."""

import json
import math
import os

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.device import prompt_logprobs
from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir

TOLERANCE = 0.0  # float32, the same math in a different chunking
HF_TOLERANCE = 1e-3  # as tests/support/hf_parity.py
NUM_TOP = 5


def scoring(num_top: int = NUM_TOP, **overrides) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 0, "prompt_logprobs": num_top, **overrides})


@pytest.fixture(scope="module")
def whole_prompt_llm():
    """The reference: every prompt here fits one prefill chunk, and nothing is served from a cache."""
    return LLM(
        fixture_dir("llama_gqa"),
        **{**SMALL_ENGINE, "max_num_batched_tokens": 128, "enable_prefix_caching": False, "max_num_seqs": 4},
    )


@pytest.fixture(scope="module")
def chunked_llm():
    """16-token prefill chunks and 8-token pages: a long prompt is scored across many chunk boundaries."""
    return LLM(fixture_dir("llama_gqa"), **{**SMALL_ENGINE, "max_num_batched_tokens": 16, "page_size": 8})


def prompts() -> list[list[int]]:
    """The fixtures' prompts (1 to 70 tokens), each followed by transformers' greedy continuation."""
    return [p["token_ids"] + p["greedy_token_ids"] for p in expected("llama_gqa")["prompts"]]


def assert_close(actual: list, reference: list, tolerance: float = TOLERANCE) -> None:
    assert len(actual) == len(reference)
    assert actual[0] is None and reference[0] is None
    for position, (got, want) in enumerate(zip(actual[1:], reference[1:]), start=1):
        assert got.keys() == want.keys(), f"position {position}: top tokens differ"
        for token_id, logprob in want.items():
            assert got[token_id] == pytest.approx(logprob, abs=tolerance, rel=0), (
                f"position {position}, token {token_id}"
            )


@pytest.fixture(scope="module")
def reference(whole_prompt_llm):
    outputs = whole_prompt_llm.generate(prompts(), scoring())
    assert whole_prompt_llm.stats()["num_compiles_after_warmup"] == 0
    return [output.prompt_logprobs for output in outputs]


def test_shape_follows_vllm(reference):
    for token_ids, scored in zip(prompts(), reference):
        assert len(scored) == len(token_ids) and scored[0] is None
        for token_id, entry in zip(token_ids[1:], scored[1:]):
            assert token_id in entry and NUM_TOP <= len(entry) <= NUM_TOP + 1
            assert all(value <= 0 for value in entry.values())
            top = sorted(entry.values(), reverse=True)[:NUM_TOP]
            # the top-k are the distribution's largest: nothing outside them exceeds the smallest
            assert entry[token_id] <= top[0] + 1e-6
            assert math.fsum(math.exp(v) for v in top) <= 1 + 1e-5


def test_last_position_matches_transformers(reference):
    # transformers' log-softmax after each fixture prompt scores the continuation's first token
    for prompt, scored in zip(expected("llama_gqa")["prompts"], reference):
        entry = scored[len(prompt["token_ids"])]
        for token_id, logprob in zip(prompt["first_top_token_ids"][:NUM_TOP], prompt["first_top_logprobs"]):
            assert entry[token_id] == pytest.approx(logprob, abs=HF_TOLERANCE)


def test_greedy_continuation_is_the_top_token(reference):
    # transformers' greedy tokens, scored as prompt: each is the most likely where it stands
    for prompt, scored in zip(expected("llama_gqa")["prompts"], reference):
        start = len(prompt["token_ids"])
        for offset, token_id in enumerate(prompt["greedy_token_ids"]):
            entry = scored[start + offset]
            assert entry[token_id] == pytest.approx(max(entry.values()), abs=HF_TOLERANCE)


def test_chunked_prefill_scores_across_chunk_boundaries(chunked_llm, reference):
    outputs = chunked_llm.generate(prompts(), scoring())
    for output, scored in zip(outputs, reference):
        assert output.outputs[0].token_ids == [] and output.outputs[0].finish_reason == "length"
        assert_close(output.prompt_logprobs, scored)
    assert chunked_llm.stats()["num_compiles_after_warmup"] == 0


def test_cached_prompt_is_recomputed_for_its_scores(chunked_llm, reference):
    token_ids = prompts()[7]  # 94 tokens: eleven full 8-token pages
    chunked_llm.generate([token_ids], SamplingParams(max_tokens=1, temperature=0.0))  # caches its pages
    again = chunked_llm.generate([token_ids], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert again.num_cached_tokens >= 88 and again.prompt_logprobs is None
    scored = chunked_llm.generate([token_ids], scoring(max_tokens=1, temperature=0.0))[0]
    assert scored.num_cached_tokens == 0  # its prefill claims no cached page
    assert_close(scored.prompt_logprobs, reference[7])
    assert scored.outputs[0].token_ids == again.outputs[0].token_ids
    # the scoring run left the cache as it was: a later plain request still hits it
    assert chunked_llm.generate([token_ids], SamplingParams(max_tokens=1))[0].num_cached_tokens >= 88


def test_batched_with_other_requests(chunked_llm, reference):
    all_prompts = prompts()
    params = [
        scoring(max_tokens=3, temperature=0.0, n=2) if i % 2 else SamplingParams(max_tokens=3, temperature=0.0)
        for i in range(len(all_prompts))
    ]
    outputs = chunked_llm.generate(all_prompts, params)
    for i, (output, scored) in enumerate(zip(outputs, reference)):
        if i % 2:
            assert_close(output.prompt_logprobs, scored)
            assert len(output.outputs) == 2 and all(len(c.token_ids) <= 3 for c in output.outputs)
        else:
            assert output.prompt_logprobs is None
    assert chunked_llm.stats()["num_compiles_after_warmup"] == 0


def test_prompt_scores_equal_the_decode_steps_logprobs(chunked_llm):
    # the same tokens scored two ways: sampled one at a time by decode steps, then as a prompt
    prompt = expected("llama_gqa")["prompts"][5]["token_ids"]
    generated = chunked_llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, logprobs=NUM_TOP))[0]
    completion = generated.outputs[0]
    scored = chunked_llm.generate([prompt + completion.token_ids], scoring())[0].prompt_logprobs
    for offset, decoded in enumerate(completion.logprobs):
        entry = scored[len(prompt) + offset]
        for token_id, logprob in decoded.items():
            assert entry[token_id] == pytest.approx(logprob, abs=TOLERANCE, rel=0)


def test_top_zero_gives_the_token_alone_and_max_tokens_zero_generates_nothing(chunked_llm, reference):
    token_ids = prompts()[4]
    output = chunked_llm.generate([token_ids], scoring(num_top=0, n=2))[0]
    assert [c.token_ids for c in output.outputs] == [[], []]
    assert [c.finish_reason for c in output.outputs] == ["length", "length"]
    for token_id, entry, full in zip(token_ids[1:], output.prompt_logprobs[1:], reference[4][1:]):
        assert list(entry) == [token_id] and entry[token_id] == pytest.approx(full[token_id], abs=TOLERANCE, rel=0)
    stats = chunked_llm.stats()
    assert stats["num_running"] == 0 and stats["kv_pages_free"] == stats["kv_pages_total"]


def test_one_token_prompt_has_only_none(chunked_llm):
    output = chunked_llm.generate([[1]], scoring(max_tokens=2, temperature=0.0))[0]
    assert output.prompt_logprobs == [None] and len(output.outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "kwargs,message", [(dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(max_tokens=-1), "max_tokens")]
)
def test_bad_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_more_than_max_logprobs_is_refused(chunked_llm):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        chunked_llm.generate([[1, 2, 3]], scoring(num_top=21))


def test_max_logprobs_past_the_vocabulary_is_refused_at_start():
    with pytest.raises(ValueError, match=r"max_logprobs \(100000\) exceeds the model's vocabulary"):
        LLM(fixture_dir("llama_gqa"), **SMALL_ENGINE, max_logprobs=100000)


def largest_prefill_temp_bytes(llm) -> tuple[int, int]:
    """(token slots, XLA's temporary bytes) of the engine's largest prefill executable."""
    runner = llm.engine.runner
    shape = max((s for s in runner.executables if s.kind == "prefill"), key=lambda s: s.num_tokens)
    return shape.num_tokens, runner.executables[shape].memory_analysis().temp_size_in_bytes


def test_scored_a_block_at_a_time_alike_and_within_the_blocks_memory(monkeypatch, whole_prompt_llm, reference):
    # 8-row blocks: a 128-slot prefill scores its prompt in 16 strided blocks (device/prompt_logprobs.py)
    with open(os.path.join(fixture_dir("llama_gqa"), "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    monkeypatch.setattr(prompt_logprobs, "BLOCK_LOGITS_BYTES", 8 * vocab_size * 4)
    monkeypatch.setattr(prompt_logprobs, "MIN_BLOCK_ROWS", 8)
    blocked = LLM(
        fixture_dir("llama_gqa"),
        **{**SMALL_ENGINE, "max_num_batched_tokens": 128, "enable_prefix_caching": False, "max_num_seqs": 4},
    )
    for output, scored in zip(blocked.generate(prompts(), scoring()), reference):
        assert_close(output.prompt_logprobs, scored)
    assert blocked.stats()["num_compiles_after_warmup"] == 0
    num_tokens, temp_bytes = largest_prefill_temp_bytes(blocked)
    whole_tokens, whole_temp_bytes = largest_prefill_temp_bytes(whole_prompt_llm)
    assert num_tokens == whole_tokens == 128
    # the step's whole logits [T, V] float32 are never held: at least that much less scratch than in one block
    assert temp_bytes + num_tokens * vocab_size * 4 <= whole_temp_bytes
