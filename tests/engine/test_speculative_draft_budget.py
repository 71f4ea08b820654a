"""Where devices report their free memory (GPU, TPU), the target's and the draft's KV pools come out of one
budget measured once both models' weights are in memory (engine/kv_budget.py `kv_budgets`): the draft's pool at
most a quarter of the target's, both within 90% of what the weights left. Sized one after the other, the
target's pool took 90% of the memory before the draft's weights loaded, so a draft larger than the rest failed
to load. A CPU reports no free memory: here a fake device of LIMIT bytes (tests/support/fake_device_memory.py)."""

import logging

import pytest

import jaxserve.engine.kv_budget as kv_budget
from jaxserve import LLM, SamplingParams
from tests.engine.test_speculative import ENGINE
from tests.support.fake_device_memory import device_of
from tests.support.fixtures import fixture_dir

LIMIT = 3 * 2**19  # 1.5 MiB: the weights take ~0.56 MB, the pools what the budget gives (not their rows' caps)


@pytest.fixture(scope="module")
def llm():
    with device_of(LIMIT):
        return LLM(
            fixture_dir("llama_gqa"),
            **{**ENGINE, "num_pages": None},
            speculative={"method": "draft", "draft_quantization": "int8", "num_speculative_tokens": 4},
        )


def runners(llm) -> list:
    return [llm.engine.runner, llm.engine.speculation.proposer.runner]


def test_both_pools_share_one_budget_taken_after_both_models_loaded(llm):
    target, draft = (runner.stats() for runner in runners(llm))
    free_after_weights = LIMIT - target["weights_device_bytes"] - draft["weights_device_bytes"]
    pools = target["kv_cache_device_bytes"] + draft["kv_cache_device_bytes"]
    scratch = max(runner.largest_scratch_bytes() for runner in runners(llm))
    # within the budget, the largest step's scratch beside them (test_kv_budget_scratch.py), nothing left idle
    assert pools <= 0.9 * free_after_weights
    assert 0.8 * free_after_weights <= pools + scratch <= free_after_weights
    draft_page_bytes = draft["kv_cache_device_bytes"] / llm.stats()["speculative_draft_kv_pages_total"]
    assert draft["kv_cache_device_bytes"] <= target["kv_cache_device_bytes"] / 4 + 2 * draft_page_bytes


def test_the_engine_serves_and_speculates_within_it(llm):
    outputs = llm.generate(["one two three one two three"] * 3, SamplingParams(max_tokens=12, temperature=0.0))
    assert all(len(output.outputs[0].token_ids) == 12 for output in outputs)
    stats = llm.stats()
    assert stats["speculative_num_draft_tokens"] > 0 and stats["num_compiles_after_warmup"] == 0
    assert stats["speculative_draft_kv_pages_free"] == stats["speculative_draft_kv_pages_total"]


def test_a_step_whose_scratch_exceeds_what_the_pools_left_is_named_at_start(llm, monkeypatch, caplog):
    scratch = max(runner.largest_scratch_bytes() for runner in runners(llm))
    assert scratch > 0
    for free, warned in ((scratch - 1, True), (scratch, False)):
        monkeypatch.setattr(kv_budget, "measured_free_bytes", lambda mesh=None, free=free: free)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jaxserve.engine"):
            kv_budget.warn_if_scratch_does_not_fit(runners(llm), None)
        assert ("max_num_batched_tokens" in caplog.text) == warned
