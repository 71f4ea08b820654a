"""Run by tests/distributed/test_experts_everywhere.py on 8 fake CPU devices: the multi-process expert moves
(distributed/experts.py: one jitted gather per array, which every process runs) against the one-process ones
(sharding/expert_placement.py) on the same params, for GPT-OSS (expert biases; 5 experts on 8 devices: padding
rows) and Qwen3-MoE with int8 experts (a quantized weight's values and scales). Prints one JSON line: per
model, the params whose arrays differ after a move, and after writing out in canonical order."""

import jax
import numpy as np
from flax import nnx

from jaxserve import LLM
from jaxserve.distributed.experts import canonical_everywhere, rebalance_everywhere
from sharding.expert_placement import canonical_params, device_of_experts, rebalance
from tests.support.fake_devices import report_and_exit
from tests.support.fixtures import SMALL_ENGINE, fixture_dir

MODELS = {"gpt_oss": {}, "qwen3_moe": {"quantization": "int8"}}


def differing(expected, got) -> list[str]:
    """Paths (with the array inside a quantized weight) whose values differ, or that only one side has."""
    flat_expected = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree.leaves_with_path(expected)}
    flat_got = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree.leaves_with_path(got)}
    return sorted(
        path
        for path in flat_expected.keys() | flat_got.keys()
        if path not in flat_expected
        or path not in flat_got
        or not np.array_equal(np.asarray(flat_expected[path]), np.asarray(flat_got[path]))
    )


def main() -> None:
    results = {}
    for name, options in MODELS.items():
        llm = LLM(
            fixture_dir(name),
            **{**SMALL_ENGINE, "data_parallel_size": 2, "tensor_parallel_size": 4, "enable_expert_parallel": True},
            **options,
        )
        config = llm.engine.parts.source.config
        load = np.random.default_rng(0).random((config.num_moe_layers, config.num_experts)) ** 4 * 100
        state = llm.engine.runner.params()
        moved = rebalance(state, load)
        try:
            moved_everywhere = rebalance_everywhere(state, load)
        except Exception as error:  # noqa: BLE001 (the test names it)
            results[name] = {"error": f"{type(error).__name__}: {error}"}
            continue
        results[name] = {
            "placement_changed": not np.array_equal(device_of_experts(state), device_of_experts(moved)),
            "moved_differs": differing(nnx.to_pure_dict(moved), nnx.to_pure_dict(moved_everywhere)),
            "canonical_differs": differing(
                nnx.to_pure_dict(canonical_params(moved)), nnx.to_pure_dict(canonical_everywhere(moved))
            ),
        }
    report_and_exit(results)


if __name__ == "__main__":
    main()
