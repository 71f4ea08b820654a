"""Run by tests/engine/test_kv_quantization_meshes.py in a subprocess with 4 fake CPU devices: llama_gqa with an
int8 KV cache on one device, tensor parallel 2 and 4 (4: each KV head stored twice) and data parallel 2; prints
one JSON line: per mesh, greedy tokens, the scale pools' partition spec and compiles after warm-up."""

import json

from jaxserve import LLM, SamplingParams
from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir

MESHES = {"one": {}, "tp2": {"tensor_parallel_size": 2}, "tp4": {"tensor_parallel_size": 4}}
MESHES["dp2"] = {"data_parallel_size": 2}


def main() -> None:
    prompts = [p["token_ids"] for p in expected("llama_gqa")["prompts"]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = {}
    for name, options in MESHES.items():
        llm = LLM(fixture_dir("llama_gqa"), **{**SMALL_ENGINE, "kv_dtype": "int8", **options})
        scales = llm.engine.runner.kv_pages.keys[0].scales
        results[name] = dict(
            tokens=[output.outputs[0].token_ids for output in llm.generate(prompts, params)],
            scales_spec=[str(axis) for axis in getattr(scales.sharding, "spec", ())],
            compiles_after_warmup=llm.stats()["num_compiles_after_warmup"],
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
