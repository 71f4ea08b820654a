"""Run as a subprocess by test_sharding.py, with 8 fake CPU devices set up before JAX starts.

Prints one JSON object: per (fixture, tensor_parallel_size), whether greedy outputs and first-token
logprobs equal transformers', and the partition specs that params and KV pages were given.
"""

import json
import os
import sys

import jax
import numpy as np
from flax import nnx

from jaxserve import LLM, SamplingParams
from tests.support.fake_devices import report_and_exit
from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir

results = {"num_devices": len(jax.devices())}
runs = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
orbax_dirs = [arg.split("=", 1)[1] for arg in sys.argv[1:] if arg.startswith("--orbax=")]
rebalance_dirs = [arg.split("=", 1)[1] for arg in sys.argv[1:] if arg.startswith("--rebalance=")]
uneven_dirs = [arg.split("=", 1)[1] for arg in sys.argv[1:] if arg.startswith("--uneven=")]


def greedy_equal(llm, name):
    prompts = expected(name)["prompts"]
    outputs = llm.generate([p["token_ids"] for p in prompts], SamplingParams(max_tokens=24, temperature=0.0))
    return [o.outputs[0].token_ids == p["greedy_token_ids"] for o, p in zip(outputs, prompts)]


def expert_weight(llm, name="layers.0.mlp.gate_proj"):
    return next(
        v.get_value() for p, v in nnx.to_flat_state(llm.engine.runner.params()) if ".".join(map(str, p)) == name
    )


def experts_per_device(llm):
    """[layers][devices]: how many experts each device holds."""
    stats = llm.stats()
    return [
        np.bincount(devices, minlength=len(stats["expert_device_tokens"])).tolist()
        for devices in stats["expert_devices"]
    ]


for directory in rebalance_dirs:
    # DP=4 x EP: serve, rebalance by what was routed, serve again; the profile and checkpoint go to directory
    ep4 = {**SMALL_ENGINE, "data_parallel_size": 4, "enable_expert_parallel": True}
    llm = LLM(fixture_dir("mixtral_8x"), **ep4)
    before_equal = greedy_equal(llm, "mixtral_8x")
    before = llm.stats()
    llm.rebalance_experts()
    moved = llm.stats()  # the same routed tokens, counted on the devices their experts sit on now
    after_equal = greedy_equal(llm, "mixtral_8x")
    profile = os.path.join(directory, "profile.json")
    with open(profile, "w") as f:
        json.dump({"expert_tokens": before["expert_tokens"]}, f)
    llm.save_checkpoint(os.path.join(directory, "checkpoint"))
    gate = next(
        v.get_value()
        for p, v in nnx.to_flat_state(llm.engine.runner.params())
        if ".".join(map(str, p)) == "layers.0.mlp.gate_proj"
    )
    device0_rows = np.asarray(next(s.data for s in gate.addressable_shards if s.device == jax.devices()[0]))
    restored = LLM(os.path.join(directory, "checkpoint"), **SMALL_ENGINE)  # one device, experts in canonical order
    canonical = np.asarray(
        next(
            v.get_value()
            for p, v in nnx.to_flat_state(restored.engine.runner.params())
            if ".".join(map(str, p)) == "layers.0.mlp.gate_proj"
        )
    )
    device_of = np.asarray(moved["expert_devices"][0])
    at_start = LLM(fixture_dir("mixtral_8x"), **{**ep4, "expert_load_profile": profile})
    at_start_rows = np.asarray(
        next(s.data for s in expert_weight(at_start).addressable_shards if s.device == jax.devices()[0])
    )
    periodic = LLM(fixture_dir("mixtral_8x"), **{**ep4, "expert_rebalance_interval": 3})
    periodic_equal = greedy_equal(periodic, "mixtral_8x")
    results["rebalance"] = {
        "before_equal": before_equal,
        "after_equal": after_equal,
        "before": before["expert_device_tokens"],
        "moved": moved["expert_device_tokens"],
        "before_imbalance": before["expert_device_imbalance"],
        "moved_imbalance": moved["expert_device_imbalance"],
        "expert_devices_layer0": moved["expert_devices"][0],
        "compiles_after_warmup": llm.stats()["num_compiles_after_warmup"],
        "device0_holds_its_experts": bool(np.array_equal(device0_rows, canonical[np.flatnonzero(device_of == 0)])),
        "restored_equal": greedy_equal(restored, "mixtral_8x"),
        "start_up_devices_equal": at_start.stats()["expert_devices"] == moved["expert_devices"],
        "start_up_equal": greedy_equal(at_start, "mixtral_8x"),
        "start_up_rebalances": at_start.stats()["expert_rebalances"],
        "start_up_device0_holds_its_experts": bool(
            np.array_equal(at_start_rows, canonical[np.flatnonzero(device_of == 0)])
        ),
        "periodic_equal": periodic_equal,
        "periodic_rebalances": periodic.stats()["expert_rebalances"],
        "periodic_steps": periodic.stats()["num_steps"],
        "periodic_compiles": periodic.stats()["num_compiles_after_warmup"],
    }
for directory in uneven_dirs:
    # 6 experts over data 2 x tensor 2 (2, 2, 1, 1 per device): rebalance, save, restore onto 1 device and onto
    # 8 (six hold one), and place at start-up from the load profile
    mesh = {**SMALL_ENGINE, "data_parallel_size": 2, "tensor_parallel_size": 2, "enable_expert_parallel": True}
    llm = LLM(fixture_dir("mixtral_6x"), **mesh)
    before_equal, before, before_per_device = greedy_equal(llm, "mixtral_6x"), llm.stats(), experts_per_device(llm)
    llm.rebalance_experts()
    moved, moved_per_device = llm.stats(), experts_per_device(llm)
    after_equal = greedy_equal(llm, "mixtral_6x")
    profile = os.path.join(directory, "profile.json")
    with open(profile, "w") as f:
        json.dump({"expert_tokens": before["expert_tokens"]}, f)
    llm.save_checkpoint(os.path.join(directory, "checkpoint"))
    stored = expert_weight(llm)
    device0_rows = np.asarray(next(s.data for s in stored.addressable_shards if s.device == jax.devices()[0]))
    restored = LLM(os.path.join(directory, "checkpoint"), **SMALL_ENGINE)
    canonical = np.asarray(expert_weight(restored))
    on_device0 = canonical[np.flatnonzero(np.asarray(moved["expert_devices"][0]) == 0)]
    restored_ep8 = LLM(
        os.path.join(directory, "checkpoint"),
        **{**SMALL_ENGINE, "data_parallel_size": 8, "enable_expert_parallel": True},
    )
    at_start = LLM(fixture_dir("mixtral_6x"), **{**mesh, "expert_load_profile": profile})
    at_start_rows = np.asarray(
        next(s.data for s in expert_weight(at_start).addressable_shards if s.device == jax.devices()[0])
    )
    results["uneven"] = {
        "before_equal": before_equal,
        "after_equal": after_equal,
        "before_per_device": before_per_device,
        "moved_per_device": moved_per_device,
        "stored_rows": stored.shape[0],
        "before_imbalance": before["expert_device_imbalance"],
        "moved_imbalance": moved["expert_device_imbalance"],
        "before": before["expert_device_tokens"],
        "moved": moved["expert_device_tokens"],
        "compiles_after_warmup": llm.stats()["num_compiles_after_warmup"],
        "canonical_rows": canonical.shape[0],
        "device0_holds_its_experts_then_zeros": bool(
            np.array_equal(device0_rows[: len(on_device0)], on_device0) and not device0_rows[len(on_device0) :].any()
        ),
        "restored_equal": greedy_equal(restored, "mixtral_6x"),
        "restored_ep8_equal": greedy_equal(restored_ep8, "mixtral_6x"),
        "restored_ep8_per_device": experts_per_device(restored_ep8),
        "start_up_devices_equal": at_start.stats()["expert_devices"] == moved["expert_devices"],
        "start_up_equal": greedy_equal(at_start, "mixtral_6x"),
        "start_up_rebalances": at_start.stats()["expert_rebalances"],
        "start_up_device0_holds_its_experts_then_zeros": bool(
            np.array_equal(at_start_rows[: len(on_device0)], on_device0) and not at_start_rows[len(on_device0) :].any()
        ),
    }
for directory in orbax_dirs:
    # saved from a 2-way tensor-parallel engine, restored onto 4 devices and onto 1
    LLM(fixture_dir("mixtral"), **{**SMALL_ENGINE, "tensor_parallel_size": 2}).save_checkpoint(directory)
    prompts = expected("mixtral")["prompts"]
    for tp in (4, 1):
        llm = LLM(directory, **{**SMALL_ENGINE, "tensor_parallel_size": tp})
        outputs = llm.generate([p["token_ids"] for p in prompts], SamplingParams(max_tokens=24, temperature=0.0))
        spec = next(iter(nnx.to_flat_state(llm.engine.runner.params())))[1].get_value().sharding
        results[f"orbax:{tp}"] = {
            "greedy_equal": [o.outputs[0].token_ids == p["greedy_token_ids"] for o, p in zip(outputs, prompts)],
            "num_devices_holding_embedding": len(spec.device_set),
        }
for run in runs:
    # name:tp[:dp[:ep[:attention_impl]]]
    name, tp, dp, ep, impl = run.split(":") + ["1", "-", "auto"][run.count(":") - 1 :]
    tp, dp, ep = int(tp), int(dp), ep == "ep"
    try:
        llm = LLM(
            fixture_dir(name),
            **{
                **SMALL_ENGINE,
                "tensor_parallel_size": tp,
                "data_parallel_size": dp,
                "enable_expert_parallel": ep,
                "attention_impl": impl,
            },
        )
    except ValueError as error:
        results[run] = {"error": str(error)}
        continue
    prompts = expected(name)["prompts"]
    outputs = llm.generate(
        [p["token_ids"] for p in prompts], SamplingParams(max_tokens=24, temperature=0.0, logprobs=8)
    )
    runner = llm.engine.runner
    flat_params = list(nnx.to_flat_state(runner.params()))
    specs = {
        ".".join(map(str, path)): [str(axis) for axis in variable.get_value().sharding.spec]
        for path, variable in flat_params
    }
    device0 = jax.devices()[0]

    def bytes_on_device0(names, flat_params=flat_params, device0=device0):
        held = total = 0
        for path, variable in flat_params:
            if any(n in ".".join(map(str, path)) for n in names):
                array = variable.get_value()
                total += array.nbytes
                held += sum(s.data.nbytes for s in array.addressable_shards if s.device == device0)
        return held / total

    results[run] = {
        "greedy_equal": [o.outputs[0].token_ids == p["greedy_token_ids"] for o, p in zip(outputs, prompts)],
        "max_logprob_error": max(
            abs(o.outputs[0].logprobs[0][t] - v)
            for o, p in zip(outputs, prompts)
            for t, v in zip(p["first_top_token_ids"], p["first_top_logprobs"])
        ),
        "param_specs": specs,
        "kv_pages_spec": [str(axis) for axis in runner.kv_pages.keys[0].sharding.spec],
        "kv_pages_heads": runner.kv_pages.keys[0].shape[2],
        "num_devices_holding_kv": len(runner.kv_pages.keys[0].sharding.device_set),
        "attention_impl": llm.stats()["attention_impl"],
        "compiles_after_warmup": llm.stats()["num_compiles_after_warmup"],
        "device0_expert_fraction": bytes_on_device0(["gate_proj", "up_proj", "down_proj"]) if ep else None,
        "experts_per_device": experts_per_device(llm) if ep else None,
        "stored_expert_rows": expert_weight(llm).shape[0] if ep else None,
        "device0_attention_fraction": bytes_on_device0(["self_attn"]),
        "device_tokens": llm.stats().get("expert_device_tokens"),
        "device_imbalance": llm.stats().get("expert_device_imbalance"),
    }
report_and_exit(results)
