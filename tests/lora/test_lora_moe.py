"""LoRA on mixture-of-experts models against transformers + PEFT: adapters on the routed experts (transformers
5's fused 3-D expert params, adapted through PEFT's target_parameters; and the per-expert Linears older PEFT
wrote) with attention adapters, alone and mixed in one batch with the base model; on one device, and with the
experts spread over fake devices (expert parallelism), before and after the experts move between devices;
zero compiles across loads and unloads."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxserve import LLM, SamplingParams
from tests.lora.support import LORA_FIXTURES, adapter_dir, write_adapter
from tests.support.fake_devices import run_on_fake_devices
from tests.support.fixtures import SMALL_ENGINE, fixture_dir

ENGINE = dict(SMALL_ENGINE, prefill_token_buckets=(64,))
EP_CASES = ("qwen3_moe:2:1", "mixtral:1:3")  # 4 experts over 2 devices; over 3 (padded: one holds one expert)


def moe_expected(base: str) -> dict:
    with open(os.path.join(LORA_FIXTURES, "moe_expected.json")) as f:
        return json.load(f)["bases"][base]


def greedy_cases(record: dict):
    """(prompts, wanted tokens per case, cases): every prompt under the base model and each adapter, interleaved."""
    prompts = record["prompts"]
    cases = [(adapter, index) for index in range(len(prompts)) for adapter in (None, *record["greedy_token_ids"])]
    want = [
        record["base_greedy_token_ids"][index] if adapter is None else record["greedy_token_ids"][adapter][index]
        for adapter, index in cases
    ]
    return prompts, want, cases


QWEN3 = moe_expected("qwen3_moe")


@pytest.fixture(scope="module")
def llm():
    adapters = {name: adapter_dir(name) for name in QWEN3["greedy_token_ids"]}
    return LLM(fixture_dir("qwen3_moe"), **ENGINE, lora=dict(adapters=adapters, max_adapters=3, max_rank=4))


def generate(llm, cases, prompts) -> list[list[int]]:
    params = [SamplingParams(max_tokens=12, temperature=0.0, lora=adapter) for adapter, _ in cases]
    return [output.outputs[0].token_ids for output in llm.generate([prompts[i] for _, i in cases], params)]


def test_expert_adapters_change_the_outputs():
    for adapter, outputs in QWEN3["greedy_token_ids"].items():
        assert sum(a != b for a, b in zip(outputs, QWEN3["base_greedy_token_ids"])) >= 3, adapter


def test_mixed_batch_matches_peft(llm):
    prompts, want, cases = greedy_cases(QWEN3)
    assert generate(llm, cases, prompts) == want
    assert llm.stats()["num_compiles_after_warmup"] == 0


def per_expert_layout(fused_dir: str, directory: str, rank: int, num_experts: int) -> str:
    """The fused adapter rewritten as older PEFT wrote it: one Linear per expert (experts.{e}.gate_proj ...)."""
    tensors, config = load_file(os.path.join(fused_dir, "adapter_model.safetensors")), {}
    with open(os.path.join(fused_dir, "adapter_config.json")) as f:
        config = json.load(f)
    out = {name: t for name, t in tensors.items() if ".experts." not in name}
    for name, a in tensors.items():
        if not name.endswith("lora_A.weight") or ".experts." not in name:
            continue
        b = tensors[name.replace("lora_A", "lora_B")]
        layer = name.split(".mlp.")[0]
        kind = "gate_up" if ".base_layer." in name else "down"  # PEFT nests the second target outside the first
        assert (a.shape[1], b.shape[0]) == ((32, 48) if kind == "gate_up" else (24, 32))
        per_a, per_b = a.reshape(num_experts, rank, -1), b.reshape(b.shape[0], rank, num_experts)
        for e in range(num_experts):
            parts = (
                {"down_proj": per_b[:, :, e]}
                if kind == "down"
                else dict(zip(("gate_proj", "up_proj"), np.split(per_b[:, :, e], 2, axis=0)))
            )
            for projection, part in parts.items():
                out[f"{layer}.mlp.experts.{e}.{projection}.lora_A.weight"] = per_a[e]
                out[f"{layer}.mlp.experts.{e}.{projection}.lora_B.weight"] = part
    options = {key: config[key] for key in ("r", "lora_alpha")}
    return write_adapter(
        directory, out, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], **options
    )


def test_per_expert_linears_layout_and_reload_compile_nothing(llm, tmp_path):
    """Older PEFT's per-expert adapter (same weights) gives PEFT's tokens too; unloading and loading adapters
    while serving compiles nothing."""
    name = "qwen3_moe_experts_r4"
    legacy = per_expert_layout(adapter_dir(name), str(tmp_path / "legacy"), rank=4, num_experts=4)
    llm.unload_lora(name)
    llm.load_lora("legacy", legacy)
    prompts = QWEN3["prompts"]
    cases = [("legacy", i) for i in range(len(prompts))] + [(None, 0)]
    want = QWEN3["greedy_token_ids"][name] + [QWEN3["base_greedy_token_ids"][0]]
    assert generate(llm, cases, prompts) == want
    llm.unload_lora("legacy")
    llm.load_lora(name, adapter_dir(name))
    assert llm.stats()["num_compiles_after_warmup"] == 0


def test_bad_expert_adapters_are_refused(llm, tmp_path):
    rng = np.random.default_rng(0)
    prefix = "base_model.model.model.layers.0.mlp.experts"
    cases = {
        "experts.3": (
            {
                f"{prefix}.4.gate_proj.lora_A.weight": rng.normal(size=(2, 32)),
                f"{prefix}.4.gate_proj.lora_B.weight": rng.normal(size=(24, 2)),
            },
            {},
            "4 experts",
        ),
        "rank": (
            {
                f"{prefix}.lora_A.weight": rng.normal(size=(20, 24)),
                f"{prefix}.lora_B.weight": rng.normal(size=(32, 20)),
            },
            dict(r=5, target_parameters=["mlp.experts.down_proj"]),
            "above the slot rank",
        ),
        "shape": (
            {f"{prefix}.lora_A.weight": rng.normal(size=(8, 20)), f"{prefix}.lora_B.weight": rng.normal(size=(32, 8))},
            dict(r=2, target_parameters=["mlp.experts.down_proj"]),
            "another base model",
        ),
        "param": (
            {f"{prefix}.lora_A.weight": rng.normal(size=(8, 24)), f"{prefix}.lora_B.weight": rng.normal(size=(32, 8))},
            dict(r=2, target_parameters=["mlp.experts.w_fused"]),
            "targets parameters",
        ),
    }
    for label, (tensors, config, message) in cases.items():
        path = write_adapter(str(tmp_path / label.replace(".", "_")), tensors, **config)
        with pytest.raises(ValueError, match=message):
            llm.load_lora(label, path)
    prompts = QWEN3["prompts"]
    assert generate(llm, [(None, 1)], prompts) == [QWEN3["base_greedy_token_ids"][1]]  # still serving


@pytest.fixture(scope="module")
def expert_parallel():
    return run_on_fake_devices("tests.lora.moe_run", *EP_CASES, devices=3)


@pytest.mark.parametrize("case", EP_CASES)
def test_expert_parallel_adapters_equal_peft(expert_parallel, case):
    outcome = expert_parallel[case]
    assert "error" not in outcome, outcome
    assert all(outcome["greedy_equal"]), outcome["greedy_equal"]
    assert outcome["moved_experts"] > 0 and all(outcome["greedy_equal_after_moving"]), outcome
    assert outcome["reloaded_equal"] and outcome["compiles_after_warmup"] == 0, outcome
    # every slot array split on its expert rows over all devices, as the expert weights (the rules table)
    assert len(outcome["specs"]) == 6 and all(
        spec == [["data", "tensor"], None, None, None] for spec in outcome["specs"].values()
    ), outcome["specs"]
