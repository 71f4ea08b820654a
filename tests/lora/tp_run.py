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


def run(mesh: str) -> dict:
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
    llm.load_lora("mixed_again", adapter_dir("mixed_r3"))
    again = llm.generate(prompts[2], SamplingParams(max_tokens=max_tokens, temperature=0.0, lora="mixed_again"))
    return dict(
        num_devices=len(jax.devices()),
        greedy_equal=equal,
        reloaded_equal=again[0].outputs[0].token_ids == record["greedy_token_ids"]["mixed_r3"][2],
        specs=lora_specs(llm),
        compiles_after_warmup=llm.stats()["num_compiles_after_warmup"],
    )


results = {}
for mesh in sys.argv[1:]:
    try:
        results[mesh] = run(mesh)
    except Exception as error:  # reported per mesh, so one failure does not hide the others
        results[mesh] = {"error": f"{type(error).__name__}: {error}"}
print(json.dumps(results))
