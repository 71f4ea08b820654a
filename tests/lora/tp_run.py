"""Run as a subprocess by test_lora_sharded.py, with fake CPU devices set up before JAX starts.

For each mesh given as dp:tp, an engine over llama_gqa with the three PEFT fixture adapters: greedy tokens of
every prompt under the base model and each adapter, mixed in one batch, compared with PEFT's; the partition
specs the LoRA slot arrays were given; and the compiles after loading and unloading. Prints one JSON object.
"""

import json
import sys

import jax

from jaxserve import LLM, SamplingParams
from tests.lora.support import ADAPTER_NAMES, BASE_MODEL, LORA_ENGINE, adapter_dir, expected
from tests.support.fake_devices import results_per_case

SPEC_LEAVES = ("layers.0.self_attn.q_proj", "layers.0.self_attn.o_proj", "layers.1.mlp.down_proj")


def lora_specs(llm) -> dict:
    specs = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(llm.engine.runner.params())[0]:
        names = [str(getattr(key, "key", getattr(key, "name", ""))) for key in path]
        if "lora" in names:
            at = names.index("lora")
            module = ".".join(names[:at])
            if module in SPEC_LEAVES:
                specs[f"{module}.{names[at + 1]}"] = [axis for axis in leaf.sharding.spec]
    return specs


def received_by_loads(llm, name: str, path: str) -> dict:
    """What the compiled slot write receives when `name` loads: for each new slot value, its dtype, the bytes
    the device with the most of it holds, and one slot's share of its slot array on a device. A host array
    is sent whole to every device."""
    registry = llm.engine.parts.lora
    write, seen = registry._write, []

    def recording(slot_arrays, slot, values):
        for array, value in zip(slot_arrays, values):
            if isinstance(value, jax.Array):
                most = max(shard.data.nbytes for shard in value.addressable_shards)
            else:
                most = value.nbytes
            # every device holds every slot (the slot axis is replicated): one slot is 1 / num_slots of its bytes
            share = max(shard.data.nbytes for shard in array.addressable_shards) // registry.num_slots
            seen.append(dict(dtype=str(value.dtype), slot_dtype=str(array.dtype), most=int(most), share=int(share)))
        return write(slot_arrays, slot, values)

    registry._write = recording
    try:
        llm.load_lora(name, path)
    finally:
        registry._write = write
    return dict(values=seen)


def placement_only(mesh: str) -> dict:
    """A bfloat16 engine (the fixture's weights cast): only what an adapter load hands the devices."""
    data, tensor, dtype = mesh.split(":")
    engine = {**LORA_ENGINE, "dtype": dtype, "lora": {**LORA_ENGINE["lora"], "adapters": {}}}
    llm = LLM(BASE_MODEL, **engine, data_parallel_size=int(data), tensor_parallel_size=int(tensor))
    return dict(load=received_by_loads(llm, "mixed", adapter_dir(ADAPTER_NAMES[-1])))


def run(mesh: str) -> dict:
    if mesh.count(":") == 2:
        return placement_only(mesh)
    data, tensor = (int(size) for size in mesh.split(":"))
    llm = LLM(BASE_MODEL, **LORA_ENGINE, data_parallel_size=data, tensor_parallel_size=tensor)
    prompts, record = expected()["prompts"], expected()
    cases = [(adapter, index) for index in range(len(prompts)) for adapter in (None, *ADAPTER_NAMES)]
    max_tokens = len(record["base_greedy_token_ids"][0])
    outputs = llm.generate(
        [prompts[index] for _, index in cases],
        [SamplingParams(max_tokens=max_tokens, temperature=0.0, lora=adapter) for adapter, _ in cases],
    )
    want = [
        record["base_greedy_token_ids"][index] if adapter is None else record["greedy_token_ids"][adapter][index]
        for adapter, index in cases
    ]
    equal = [output.outputs[0].token_ids == tokens for output, tokens in zip(outputs, want)]
    llm.unload_lora("mixed_r3")
    load = received_by_loads(llm, "mixed_again", adapter_dir("mixed_r3"))
    again = llm.generate(prompts[2], SamplingParams(max_tokens=max_tokens, temperature=0.0, lora="mixed_again"))
    return dict(
        num_devices=len(jax.devices()),
        greedy_equal=equal,
        reloaded_equal=again[0].outputs[0].token_ids == record["greedy_token_ids"]["mixed_r3"][2],
        specs=lora_specs(llm),
        load=load,
        compiles_after_warmup=llm.stats()["num_compiles_after_warmup"],
    )


print(json.dumps(results_per_case(run, sys.argv[1:])))
