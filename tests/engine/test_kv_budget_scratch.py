"""The KV pool is sized before anything compiles (the executables take its shape), within 90% of the free
device memory; where the largest compiled step's scratch (a long prefill's activations) needs more than the
pool left, that step would fail for want of memory when it first ran, while serving. Where the engine sized
the pool from measured free memory, it sizes it again smaller by the shortfall and compiles again
(engine/builder.py, engine/kv_budget.py `scratch_shortfall`); a pool the user sized is kept, with a warning at
start. On the CPU, a fake device of LIMIT bytes (tests/support/fake_device_memory.py)."""

import logging
from types import SimpleNamespace
from typing import Any, cast

import pytest

import jaxserve.engine.kv_budget as kv_budget
from jaxserve import LLM, SamplingParams
from jaxserve.config import EngineConfig
from tests.support.fake_device_memory import device_of
from tests.support.fixtures import SMALL_ENGINE, fixture_dir

LIMIT = 3 * 2**19  # 1.5 MiB: weights ~0.44 MB; 90% of the rest for the pool leaves less than a 256-slot prefill's
# ~0.9 MB of scratch
ENGINE = {**SMALL_ENGINE, "max_num_batched_tokens": 256, "max_model_len": 256, "page_size": 4}


def build(caplog, **overrides):
    with device_of(LIMIT) as free, caplog.at_level(logging.INFO, logger="jaxserve.engine"):
        llm = LLM(fixture_dir("llama_gqa"), **{**ENGINE, **overrides})
        return llm, free()


def test_a_pool_that_leaves_too_little_scratch_is_sized_again(caplog):
    llm, free = build(caplog)
    runner = llm.engine.runner
    assert "sized again" in caplog.text and "max_num_batched_tokens" not in caplog.text  # no warning left
    assert runner.largest_scratch_bytes() <= free  # the largest step finds its scratch
    pool_bytes = runner.stats()["kv_cache_device_bytes"]
    assert pool_bytes < 0.9 * (LIMIT - runner.stats()["weights_device_bytes"]) - runner.largest_scratch_bytes() / 2
    outputs = llm.generate([list(range(1, 200))], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(outputs[0].outputs[0].token_ids) == 4 and llm.stats()["num_compiles_after_warmup"] == 0


def test_a_pool_the_user_sized_is_kept_and_named(caplog):
    llm, _ = build(caplog, kv_cache_memory_gib=0.9 * (LIMIT - 443648) / 2**30)
    assert "sized again" not in caplog.text and "max_num_batched_tokens" in caplog.text
    assert llm.engine.runner.stats()["kv_cache_device_bytes"] > 0.8 * (LIMIT - 443648)


@pytest.mark.parametrize("limit_factor", [100])
def test_a_pool_with_room_to_spare_is_not_touched(caplog, limit_factor):
    with device_of(LIMIT * limit_factor), caplog.at_level(logging.INFO, logger="jaxserve.engine"):
        LLM(fixture_dir("llama_gqa"), **{**ENGINE, "max_num_seqs": 1})
    assert "sized again" not in caplog.text and "max_num_batched_tokens" not in caplog.text


def test_a_pool_capped_by_what_its_rows_can_use_is_sized_below_that(caplog):
    # 2 sequences of 64 pages, no prefix cache: the pool is capped at 129 pages (~0.26 MB), far under the
    # measured budget, and still leaves too little for the scratch; smaller means smaller than what was made,
    # not the measured budget less the shortfall (which would make the same capped pool again)
    capped_pages = 2 * 64 + 1
    llm, free = build(caplog, max_num_seqs=2, enable_prefix_caching=False)
    runner = llm.engine.runner
    assert "sized again" in caplog.text and "max_num_batched_tokens" not in caplog.text
    assert runner.layout.total_pages < capped_pages and runner.largest_scratch_bytes() <= free


def test_a_process_group_of_one_process_sizes_the_pool_again_too(monkeypatch):
    # jax.distributed with num_processes 1 is one process: its own measure is the only one (several processes
    # are left alone: each would decide on its own measure)
    monkeypatch.setattr(kv_budget, "measured_free_bytes", lambda mesh=None: 1000)
    runner: Any = SimpleNamespace(largest_scratch_bytes=lambda: 2000)
    config = EngineConfig.from_options()
    for group, shortfall in ((None, 1100), (SimpleNamespace(is_multiprocess=False), 1100)):
        assert kv_budget.scratch_shortfall(runner, config, None, cast(Any, group), 0) == shortfall
    assert kv_budget.scratch_shortfall(runner, config, None, cast(Any, SimpleNamespace(is_multiprocess=True)), 0) == 0


def test_a_pool_below_one_sequence_is_named_at_start(caplog):
    llm, _ = build(caplog, num_pages=8)  # 28 tokens a rank against max_model_len 256
    assert "fewer than one sequence of max_model_len 256" in caplog.text
    assert llm.stats()["kv_pages_total"] == 7
