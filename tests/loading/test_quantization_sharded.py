"""Quantized weights under tensor parallelism (4 fake CPU devices, in a subprocess so that XLA_FLAGS comes
before JAX starts): the rules table's placement carries the scales with their weights (split along N with
the columns, along K with the rows where whole groups fall on each shard, else kept whole), and the
sharded engine computes what the one-device engine computes."""

import json
import os
import subprocess
import sys

from tests.support.fake_devices import fake_device_xla_flags
from tests.support.fixtures import fixture_dir

SCRIPT = r"""
import json, sys
import numpy as np
from flax import nnx
from jaxserve import LLM, SamplingParams
from tests.support.fixtures import SMALL_ENGINE

fixture = sys.argv[1]
prompts = [[1] + np.random.default_rng(seed).integers(3, 384, size=20).tolist() for seed in range(2)]
params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
result = {}
for tp in (1, 2):
    # x in float on both: the one-device engine's CPU kernel would round it to int8 where meshes' dots cannot
    llm = LLM(fixture, quantization="int4", quantized_activations="float", tensor_parallel_size=tp, **SMALL_ENGINE)
    outputs = llm.generate(prompts, params)
    result[tp] = dict(
        tokens=[o.outputs[0].token_ids for o in outputs],
        logprobs=[[{str(k): v for k, v in step.items()} for step in o.outputs[0].logprobs] for o in outputs],
        compiles_after_warmup=llm.stats()["num_compiles_after_warmup"],
    )
    if tp == 2:
        specs = {}
        for path, variable in nnx.to_flat_state(llm.engine.runner.params()):
            name = ".".join(map(str, path))
            if name in ("layers.0.self_attn.q_proj.kernel", "layers.0.self_attn.o_proj.kernel", "lm_head.kernel"):
                weight = variable.get_value()
                specs[name] = {leaf: [str(a) for a in getattr(weight, leaf).sharding.spec] for leaf in ("values", "scales")}
        result["specs"] = specs
print("RESULT" + json.dumps(result))
"""


def test_int4_weights_shard_with_their_scales_and_compute_the_same():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, XLA_FLAGS=fake_device_xla_flags(4), PYTHONPATH=root)
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, fixture_dir("llama_gqa")],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT") :])
    one, two = result["1"], result["2"]
    assert two["tokens"] == one["tokens"]
    for steps_one, steps_two in zip(one["logprobs"], two["logprobs"]):
        for a, b in zip(steps_one, steps_two):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-4 for k in a)
    assert two["compiles_after_warmup"] == 0
    specs = result["specs"]
    # q_proj [64, 64] split by heads (N): values [32 packed rows, 64] and scales [2 groups, 64] split alike
    assert specs["layers.0.self_attn.q_proj.kernel"] == {"values": ["None", "tensor"], "scales": ["None", "tensor"]}
    # o_proj split by heads on its K side: 2 groups of 32 rows, one whole group per shard
    assert specs["layers.0.self_attn.o_proj.kernel"] == {"values": ["tensor", "None"], "scales": ["tensor", "None"]}
    assert specs["lm_head.kernel"]["values"] == ["None", "tensor"]  # vocab columns
