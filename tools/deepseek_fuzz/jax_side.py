"""jaxserve on a hf_side.py checkpoint: greedy tokens against the recorded ones, with random engine settings
(page size, chunk budget, query block, attention kernel); TP / DP / EP from the environment, e.g.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu TP=2 DP=2 EP=1 \
        .venv/bin/python tools/deepseek_fuzz/jax_side.py SEED DIR
"""

import json
import os
import sys

import numpy as np

from jaxserve import LLM, SamplingParams

seed = int(sys.argv[1])
d = sys.argv[2]
f = json.load(open(os.path.join(d, "fuzz.json")))
rng = np.random.default_rng(seed + 1000)
qb = int(rng.choice([4, 8, 16]))
engine = dict(
    tensor_parallel_size=int(os.environ.get("TP", 1)),
    data_parallel_size=int(os.environ.get("DP", 1)),
    enable_expert_parallel=bool(os.environ.get("EP")),
    dtype="float32",
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=max(qb, int(rng.choice([16, 32, 64]))),
    page_size=int(rng.choice([4, 8, 16])),
    prefill_query_block=qb,
    attention_impl=str(rng.choice(["auto", "reference", "pallas"])),
    show_progress=False,
)
outs = LLM(d, **engine).generate(
    f["prompts"], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False
)
eq = [o.outputs[0].token_ids == e for o, e in zip(outs, f["expected"])]
print(
    json.dumps(
        dict(seed=seed, equal=sum(eq), of=len(eq), **({} if all(eq) else dict(config=f["config"], engine=engine)))
    )
)
