"""Run by tests/models/test_gpt_oss_sharded.py with 8 fake CPU devices: GPT-OSS fixtures under tensor, data x
expert and uneven expert parallelism, and after rebalancing their experts (biases move with their weights);
also any other MoE fixture (Qwen3-30B-A3B's shape over 8 devices).

Prints one JSON object: per run name:tp:dp[:ep], whether greedy tokens and first-token logprobs equal
transformers', the params' partition specs and the compiles after warm-up.
"""

import sys

import numpy as np
from flax import nnx

from jaxserve import LLM, SamplingParams
from tests.support.fake_devices import report_and_exit
from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir


def parity(llm, name):
    prompts = expected(name)["prompts"]
    outputs = llm.generate(
        [p["token_ids"] for p in prompts], SamplingParams(max_tokens=24, temperature=0.0, logprobs=8)
    )
    return {
        "greedy_equal": [o.outputs[0].token_ids == p["greedy_token_ids"] for o, p in zip(outputs, prompts)],
        "max_logprob_error": max(
            abs(o.outputs[0].logprobs[0][t] - v)
            for o, p in zip(outputs, prompts)
            for t, v in zip(p["first_top_token_ids"], p["first_top_logprobs"])
        ),
    }


def stored_bias_rows(llm):
    """layers.0's stored down-projection bias rows, as the host sees them (padding rows are zero); None for
    a model without expert biases."""
    flat = dict(nnx.to_flat_state(llm.engine.runner.params()))
    variable = flat.get(("layers", 0, "mlp", "down_proj_bias"))
    return None if variable is None else np.asarray(variable.get_value())


results = {}
for run in sys.argv[1:]:
    name, tp, dp, *rest = run.split(":")
    ep = rest == ["ep"]
    llm = LLM(
        fixture_dir(name),
        **{
            **SMALL_ENGINE,
            "tensor_parallel_size": int(tp),
            "data_parallel_size": int(dp),
            "enable_expert_parallel": ep,
        },
    )
    outcome = parity(llm, name)
    flat = nnx.to_flat_state(llm.engine.runner.params())
    outcome["param_specs"] = {
        ".".join(map(str, path)): [str(axis) for axis in variable.get_value().sharding.spec] for path, variable in flat
    }
    outcome["attention_impl"] = llm.stats()["attention_impl"]
    if ep:
        before = stored_bias_rows(llm)
        llm.rebalance_experts()
        after = stored_bias_rows(llm)
        outcome["experts_per_device"] = [np.bincount(d).tolist() for d in llm.stats()["expert_devices"]]
        if before is not None and after is not None:
            outcome["bias_rows_moved"] = bool(not np.array_equal(before, after))
            outcome["same_bias_rows"] = sorted(map(tuple, before.round(6).tolist())) == sorted(
                map(tuple, after.round(6).tolist())
            )
        outcome["after_rebalance"] = parity(llm, name)
    outcome["compiles_after_warmup"] = llm.stats()["num_compiles_after_warmup"]
    results[run] = outcome
report_and_exit(results)
