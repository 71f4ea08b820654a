"""Run by tests/models/test_deepseek_sharded.py with 8 fake CPU devices (set before JAX starts): DeepSeek fixtures
under tensor, data and expert parallelism. Prints one JSON object keyed by run (name:tp:dp[:ep]): whether greedy
outputs and first-token logprobs equal transformers', compiles after warm-up, the KV pool's partition spec and
heads, and how much of the routed experts' and the attention's weights device 0 holds."""

import sys

import jax
from flax import nnx

from jaxserve import LLM, SamplingParams
from tests.support.fake_devices import report_and_exit
from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir


def fraction_on_device0(flat_params, predicate) -> float:
    held = total = 0
    for path, variable in flat_params:
        if predicate(".".join(map(str, path))):
            array = variable.get_value()
            total += array.nbytes
            held += sum(s.data.nbytes for s in array.addressable_shards if s.device == jax.devices()[0])
    return held / total


def routed_expert(name: str) -> bool:
    return name.split(".")[-1] in ("gate_proj", "up_proj", "down_proj")  # stacked [X, ...]: no ".kernel"


def run(spec: str) -> dict:
    name, tp, dp, *ep = spec.split(":")
    llm = LLM(
        fixture_dir(name),
        **{
            **SMALL_ENGINE,
            "max_num_seqs": 4,  # fewer buckets to compile on each mesh: one decode bucket
            "decode_seq_buckets": (4,),
            "tensor_parallel_size": int(tp),
            "data_parallel_size": int(dp),
            "enable_expert_parallel": bool(ep),
        },
    )
    prompts = expected(name)["prompts"]
    outputs = llm.generate(
        [p["token_ids"] for p in prompts], SamplingParams(max_tokens=24, temperature=0.0, logprobs=8)
    )
    rebalanced = None
    if ep:  # experts moved to even out the load just routed: values change places, no shape does
        llm.rebalance_experts()
        again = llm.generate([p["token_ids"] for p in prompts], SamplingParams(max_tokens=24, temperature=0.0))
        rebalanced = {
            "greedy_equal": [o.outputs[0].token_ids == p["greedy_token_ids"] for o, p in zip(again, prompts)],
            "rebalances": llm.stats()["expert_rebalances"],
        }
    runner = llm.engine.runner
    flat_params = list(nnx.to_flat_state(runner.params()))
    stats = llm.stats()
    return {
        "greedy_equal": [o.outputs[0].token_ids == p["greedy_token_ids"] for o, p in zip(outputs, prompts)],
        "max_logprob_error": max(
            abs(o.outputs[0].logprobs[0][t] - v)
            for o, p in zip(outputs, prompts)
            for t, v in zip(p["first_top_token_ids"], p["first_top_logprobs"])
        ),
        "compiles_after_warmup": stats["num_compiles_after_warmup"],
        "attention_impl": stats["attention_impl"],
        "kv_pages_spec": [str(axis) for axis in runner.kv_pages.keys[0].sharding.spec],
        "kv_pages_shape": list(runner.kv_pages.keys[0].shape),
        "kv_cache_bytes_per_token": stats["kv_cache_bytes_per_token"],
        "device0_expert_fraction": fraction_on_device0(flat_params, routed_expert),
        "device0_attention_fraction": fraction_on_device0(flat_params, lambda n: ".self_attn." in n),
        "expert_devices": stats.get("expert_devices"),
        "rebalanced": rebalanced,
    }


results = {"num_devices": len(jax.devices())}
for spec in sys.argv[1:]:
    results[spec] = run(spec)
report_and_exit(results)
