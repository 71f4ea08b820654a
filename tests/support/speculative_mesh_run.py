"""Run by tests/engine/test_speculative_meshes.py with 8 fake CPU devices: for each case (a fixture and its
mesh), greedy and seeded sampled outputs with speculation (n-gram or a draft model) on and off, and what the engines held and
compiled afterwards. Prints one JSON object."""

import sys

from jaxserve import LLM, SamplingParams
from jaxserve.host.request import GuidedDecodingParams
from tests.engine.test_speculative import ENGINE, NGRAM, summary, workload
from tests.support.fake_devices import report_and_exit
from tests.support.fixtures import fixture_dir

SELF_INT8 = {"method": "draft", "draft_quantization": "int8", "speculative_adaptive": False}
CASES = {  # fixture, mesh, speculation
    "llama_tp2": ("llama_gqa", dict(tensor_parallel_size=2), NGRAM),
    "mixtral_dp2_ep": ("mixtral", dict(data_parallel_size=2, enable_expert_parallel=True), NGRAM),
    "llama_tp2_draft": ("llama_gqa", dict(tensor_parallel_size=2), SELF_INT8),
    "llama_dp2_draft": ("llama_gqa", dict(data_parallel_size=2), SELF_INT8),
    "llama_dp2_tp2": ("llama_gqa", dict(data_parallel_size=2, tensor_parallel_size=2), NGRAM),
    "llama_dp2_tp2_draft": ("llama_gqa", dict(data_parallel_size=2, tensor_parallel_size=2), SELF_INT8),
    "mixtral_dp2_ep_draft": ("mixtral", dict(data_parallel_size=2, enable_expert_parallel=True), SELF_INT8),
}

results, plain_runs = {}, {}  # cases on the same fixture and mesh share the plain engine's run
prompts, params = workload(3, 16)
# guided rows: each data-parallel rank's verify rows carry their own masks per position (engine/speculation.py)
GUIDED = [
    SamplingParams(
        temperature=0.0, max_tokens=20, guided_decoding=GuidedDecodingParams(regex="[a-z]{2,5}( [a-z]{2,5})*")
    ),
    SamplingParams(
        temperature=0.9,
        seed=3,
        max_tokens=20,
        guided_decoding=GuidedDecodingParams(choice=["alpha beta", "gamma delta"]),
    ),
]
prompts += [[40, 41, 42, 43] * 4, [50, 51, 52] * 5]
params += GUIDED
for case in sys.argv[1:]:
    fixture, parallel, speculation = CASES[case]
    outputs, stats = {}, {}
    for name, speculative in (("plain", None), ("speculative", speculation)):
        key = (fixture, tuple(sorted(parallel.items())))
        if speculative is None and key in plain_runs:
            outputs[name], stats[name] = plain_runs[key]
            continue
        options = {**ENGINE, **parallel, **({"speculative": speculative} if speculative else {})}
        llm = LLM(fixture_dir(fixture), **options)
        generated = llm.generate(prompts, params)
        outputs[name] = summary(generated)
        stats[name] = llm.stats()
        guided_drafted = sum(o.num_draft_tokens for r in generated[-len(GUIDED) :] for o in r.outputs)
        if speculative is None:
            plain_runs[key] = outputs[name], stats[name]
    speculative_stats = stats["speculative"]
    results[case] = dict(
        equal=outputs["speculative"] == outputs["plain"],
        guided_drafted=guided_drafted,
        accepted=speculative_stats["speculative_num_accepted_tokens"],
        compiles_after_warmup=[s["num_compiles_after_warmup"] for s in stats.values()],
        pages_held=[s["kv_pages_total"] - s["kv_pages_free"] for s in stats.values()],
        draft_pages_held=speculative_stats.get("speculative_draft_kv_pages_total", 0)
        - speculative_stats.get("speculative_draft_kv_pages_free", 0),
        # a draft's proposals after each round's first, in chained executables (device/step.py chained_steps)
        chained_steps=speculative_stats.get("speculative_draft_chained_steps", 0),
    )
report_and_exit(results)
