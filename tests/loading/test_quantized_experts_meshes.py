"""int4 experts under expert parallelism (4 fake CPU devices, in a subprocess: tests/support/
quantized_experts_meshes_run.py): Mixtral's 6 experts spread 2, 2, 1, 1 with padded rows, the quantized
arrays split by experts as the float weights are, moved by a load profile with their scales; greedy outputs
equal one device's, which equal the same model dequantized; and under tensor parallelism 2."""

import pytest

from tests.support.fake_devices import run_on_fake_devices


@pytest.fixture(scope="module")
def results():
    return run_on_fake_devices("tests.support.quantized_experts_meshes_run", devices=4)


def _close(a: list, b: list) -> bool:
    """Per-step logprobs of the same tokens within 2e-4."""
    return all(
        step_a.keys() == step_b.keys() and all(abs(step_a[t] - step_b[t]) <= 2e-4 for t in step_a)
        for prompt_a, prompt_b in zip(a, b)
        for step_a, step_b in zip(prompt_a, prompt_b)
    )


def test_int4_experts_on_one_device_compute_the_dequantized_model(results):
    assert results["one"]["tokens"] == results["dequantized"]["tokens"]
    assert _close(results["one"]["logprobs"], results["dequantized"]["logprobs"])
    assert results["one"]["compiles_after_warmup"] == 0
    assert results["one"]["weights_device_bytes"] < results["dequantized"]["weights_device_bytes"] / 6


def test_int4_experts_spread_over_devices_and_moved_equal_one_device(results):
    ep = results["ep"]
    assert ep["stored_rows"] == 8  # 6 experts padded to 2 per device
    assert ep["values_spec"][0] == ep["scales_spec"][0] == "('data', 'tensor')"
    assert ep["experts_per_device"][0] != ep["experts_per_device"][1]  # the load profile moved experts
    for run in ("ep", "rebalanced"):
        assert results[run]["tokens"] == results["one"]["tokens"], run
        assert _close(results[run]["logprobs"], results["one"]["logprobs"]), run
        assert results[run]["canonical_equal"], run  # canonical_params: one device's quantized arrays exactly
    assert results["rebalanced"]["compiles_after_warmup"] == 0


def test_int4_experts_under_tensor_parallelism_split_with_their_scales(results):
    """gate [X, E, F] splits along its columns (F), values and scales alike; down [X, F, E] along K = F:
    4-bit rows packed two per byte (16 of 32 rows) and one scale group per 32 (1 group: kept whole)."""
    tp = results["tp"]
    assert tp["specs"]["gate_proj"] == {"values": ["None", "None", "tensor"], "scales": ["None", "None", "tensor"]}
    assert tp["specs"]["down_proj"]["values"] == ["None", "tensor", "None"]
    assert tp["specs"]["down_proj"]["scales"] == ["None", "None", "None"]
    assert tp["tokens"] == results["one"]["tokens"]
    assert _close(tp["logprobs"], results["one"]["logprobs"])
    assert tp["compiles_after_warmup"] == 0
