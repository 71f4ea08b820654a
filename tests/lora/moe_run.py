"""Run as a subprocess by test_lora_moe.py, with fake CPU devices set up before JAX starts.

For each case "base:dp:tp" (dp x tp devices, experts spread over all of them), an engine over a tiny MoE
fixture with its PEFT adapters on the routed experts (tests/lora/fixtures/moe_expected.json): greedy tokens of
every prompt under the base model and each adapter, mixed in one batch, compared with PEFT's; again after the
experts were moved between devices (their adapter slots must move with them) and after an adapter was
unloaded and loaded into another slot (written in the moved layout); the partition specs of the expert slots;
compiles after warm-up. Prints one JSON object.
"""

import json
import sys

import jax
import numpy as np

from jaxserve import LLM, SamplingParams
from tests.lora.test_lora_moe import ENGINE, greedy_cases, moe_expected
from tests.support.fake_devices import results_per_case


def expert_slot_specs(llm) -> dict:
    specs = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(llm.engine.runner.params())[0]:
        names = [str(getattr(key, "key", getattr(key, "name", ""))) for key in path]
        if names[:4] == ["layers", "0", "mlp", "lora"]:
            specs[".".join(names[4:6])] = [axis for axis in leaf.sharding.spec]
    return specs


def run(case: str) -> dict:
    base, data, tensor = case.split(":")
    record = moe_expected(base)
    adapters = list(record["greedy_token_ids"])
    llm = LLM(
        f"tests/fixtures/{base}",
        **ENGINE,
        lora=dict(adapters={name: f"tests/lora/fixtures/{name}" for name in adapters}, max_adapters=3, max_rank=4),
        data_parallel_size=int(data),
        tensor_parallel_size=int(tensor),
        enable_expert_parallel=True,
    )
    prompts, want, cases = greedy_cases(record)
    max_tokens = len(want[0])

    def generate(chosen):
        outputs = llm.generate(
            [prompts[index] for _, index in chosen],
            [SamplingParams(max_tokens=max_tokens, temperature=0.0, lora=adapter) for adapter, _ in chosen],
        )
        return [output.outputs[0].token_ids for output in outputs]

    equal = [got == tokens for got, tokens in zip(generate(cases), want)]
    balancer = llm.engine.parts.experts
    before = balancer.expert_devices.copy()
    num_layers, num_experts = before.shape
    balancer.rebalance(np.tile(np.arange(num_experts, 0, -1) ** 3, (num_layers, 1)))  # heaviest first: moves them
    moved = int((balancer.expert_devices != before).sum())
    equal_moved = [got == tokens for got, tokens in zip(generate(cases), want)]
    llm.unload_lora(adapters[0])
    llm.load_lora("again", f"tests/lora/fixtures/{adapters[0]}")  # another slot, written in the moved layout
    again = generate([("again", index) for index in range(len(prompts))])
    return dict(
        num_devices=len(jax.devices()),
        greedy_equal=equal,
        moved_experts=moved,
        greedy_equal_after_moving=equal_moved,
        reloaded_equal=again == record["greedy_token_ids"][adapters[0]],
        specs=expert_slot_specs(llm),
        compiles_after_warmup=llm.stats()["num_compiles_after_warmup"],
    )


print(json.dumps(results_per_case(run, sys.argv[1:])))
