"""Run by tests/loading/test_quantized_experts_meshes.py with 4 fake CPU devices: Mixtral with 6 experts, int4
(every K is 32: one group), on one device, beside the same model dequantized, and with its experts spread
over the 4 devices (uneven: 2, 2, 1, 1, padded rows), before and after moving them by a load profile; and
under tensor parallelism 2 (every expert on both devices, split along its F axis with its scales).

Prints one JSON object: greedy tokens and first logprobs per run, the expert values' partition spec, whether
canonical_params gives back one device's quantized arrays exactly, and compiles after warm-up."""

import jax
import numpy as np
from flax import nnx

from jaxserve import LLM, SamplingParams
from pallas_kernels.matmul.quantized import QuantizedWeight
from sharding.expert_placement import canonical_params
from tests.support.fake_devices import report_and_exit
from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir
from tests.support.quantized_twin import dequantized_twin, params_by_path

NAME = "mixtral_6x"
PROMPTS = [p["token_ids"] for p in expected(NAME)["prompts"]][:4]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)
# one decode bucket; x in float everywhere: the one-device engine's CPU kernel would round it to int8, which the
# meshes' dots (and the dequantized twin) do not
OPTIONS = {
    **SMALL_ENGINE,
    "max_num_seqs": 4,
    "decode_seq_buckets": (4,),
    "quantization": "int4",
    "quantized_activations": "float",
}


def outputs(llm: LLM) -> dict:
    results = llm.generate(PROMPTS, GREEDY)
    return {
        "tokens": [r.outputs[0].token_ids for r in results],
        "logprobs": [[{str(k): v for k, v in step.items()} for step in r.outputs[0].logprobs] for r in results],
    }


def expert_arrays(params: dict) -> dict:
    return {
        ".".join(map(str, path)): [np.asarray(leaf).tolist() for leaf in jax.tree.leaves(value)]
        for path, value in params.items()
        if isinstance(value, QuantizedWeight) and len(value.shape) == 3
    }


report = {}
one = LLM(fixture_dir(NAME), **OPTIONS)
report["one"] = outputs(one)
report["one"]["compiles_after_warmup"] = one.stats()["num_compiles_after_warmup"]
report["one"]["weights_device_bytes"] = one.stats()["weights_device_bytes"]
twin = dequantized_twin(one, LLM(fixture_dir(NAME), **{**OPTIONS, "quantization": "none"}))
report["dequantized"] = outputs(twin)
report["dequantized"]["weights_device_bytes"] = twin.stats()["weights_device_bytes"]
canonical_one = expert_arrays(params_by_path(one))
del twin

tp = LLM(fixture_dir(NAME), **OPTIONS, tensor_parallel_size=2)  # every expert on both, split along F
report["tp"] = outputs(tp)
tp_params = params_by_path(tp)
report["tp"]["specs"] = {
    name: {
        leaf: [str(axis) for axis in getattr(tp_params[("layers", 0, "mlp", name)], leaf).sharding.spec]
        for leaf in ("values", "scales")
    }
    for name in ("gate_proj", "down_proj")
}
report["tp"]["compiles_after_warmup"] = tp.stats()["num_compiles_after_warmup"]
del tp

ep = LLM(fixture_dir(NAME), **OPTIONS, data_parallel_size=4, enable_expert_parallel=True)
report["ep"] = outputs(ep)
gate = params_by_path(ep)[("layers", 0, "mlp", "gate_proj")]
report["ep"]["values_spec"] = [str(axis) for axis in gate.values.sharding.spec]
report["ep"]["scales_spec"] = [str(axis) for axis in gate.scales.sharding.spec]
report["ep"]["stored_rows"] = gate.values.shape[0]
report["ep"]["canonical_equal"] = (
    expert_arrays({path: v.get_value() for path, v in nnx.to_flat_state(canonical_params(ep.engine.runner.params()))})
    == canonical_one
)
before = [np.bincount(d, minlength=4).tolist() for d in ep.stats()["expert_devices"]]
ep.rebalance_experts(load=[[100, 1, 1, 1, 1, 50]] * 2)
report["ep"]["experts_per_device"] = [
    before,
    [np.bincount(d, minlength=4).tolist() for d in ep.stats()["expert_devices"]],
]
report["rebalanced"] = outputs(ep)
report["rebalanced"]["canonical_equal"] = (
    expert_arrays({path: v.get_value() for path, v in nnx.to_flat_state(canonical_params(ep.engine.runner.params()))})
    == canonical_one
)
report["rebalanced"]["compiles_after_warmup"] = ep.stats()["num_compiles_after_warmup"]
report_and_exit(report)
