"""Expert moves and canonical write-outs on a mesh over several processes (distributed/experts.py) must
move every per-expert array the one-process ones (sharding/expert_placement.py) move: GPT-OSS's expert
biases and a quantized weight's values and scales too. Compared on one process with 8 fake devices, where
both run (tests/support/experts_everywhere_run.py)."""

import pytest

from tests.support.fake_devices import run_on_fake_devices


@pytest.fixture(scope="module")
def results():
    return run_on_fake_devices("tests.support.experts_everywhere_run", devices=8)


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_moe"])
def test_moves_across_processes_move_what_one_process_moves(results, name):
    outcome = results[name]
    assert "error" not in outcome, outcome
    assert outcome["placement_changed"]
    assert outcome["moved_differs"] == []  # GPT-OSS: the biases stayed in their old rows
    assert outcome["canonical_differs"] == []
