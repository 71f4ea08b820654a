"""Run by tests/engine/test_kv_quantization_meshes.py in a subprocess with 4 fake CPU devices: llama_gqa with an
int8 KV cache on one device, tensor parallel 2 and 4 (4: each KV head stored twice), data parallel 2, and tensor
parallel 2 in bfloat16 with int8 weights; prints
one JSON line: per mesh, greedy tokens, the scale pools' partition spec and compiles after warm-up."""

from jaxserve import LLM, SamplingParams
from tests.support.fake_devices import report_and_exit
from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir

MESHES = {"one": {}, "tp2": {"tensor_parallel_size": 2}, "tp4": {"tensor_parallel_size": 4}}
MESHES["dp2"] = {"data_parallel_size": 2}
# bfloat16 int8 weights on a mesh: the quantized reference's prefill dot (40+ rows) had bfloat16 operands into
# float32, which XLA:CPU's DotThunk does not run (reference.dot_operand_dtype)
MESHES["tp2_bf16_int8_weights"] = {"tensor_parallel_size": 2, "dtype": "bfloat16", "quantization": "int8"}


def main() -> None:
    prompts = [p["token_ids"] for p in expected("llama_gqa")["prompts"]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = {}
    for name, options in MESHES.items():
        llm = LLM(fixture_dir("llama_gqa"), **{**SMALL_ENGINE, "kv_dtype": "int8", **options})
        assert max(map(len, prompts)) >= 40  # a prefill chunk of 40+ rows: the quantized reference's dot
        scales = llm.engine.runner.kv_pages.keys[0].scales
        results[name] = dict(
            tokens=[output.outputs[0].token_ids for output in llm.generate(prompts, params)],
            scales_spec=[str(axis) for axis in getattr(scales.sharding, "spec", ())],
            compiles_after_warmup=llm.stats()["num_compiles_after_warmup"],
        )
    report_and_exit(results)


if __name__ == "__main__":
    main()
