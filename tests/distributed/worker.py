"""One process of a two-process jaxserve program (run by test_multihost.py, twice, as processes 0 and 1).

    python -m tests.distributed.worker PROCESS_ID PORT OUT_DIR

Both processes build the same engines in the same order; process 0 generates and writes what it saw
to OUT_DIR/results.json, process 1 runs its plans (jaxserve.distributed.run_follower).
"""

import json
import os
import sys
import time

from jaxserve.distributed.config import DistributedConfig
from jaxserve.distributed.follower import run_follower
from jaxserve.distributed.runtime import initialize

process_id, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
group = initialize(
    DistributedConfig(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        num_cpu_devices=4,
        peer_timeout=30.0,
        hash_check_interval=4,
        initialization_timeout=60,
    )
)
assert group is not None

import jax  # noqa: E402  (after initialize: the devices are the program's)

from jaxserve import LLM, SamplingParams  # noqa: E402
from tests.distributed.worker_prompts import scored_prompts  # noqa: E402
from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir  # noqa: E402

# A fresh persistent cache per run, not the default one: on CPU the two processes key the same jit apart (a
# two-process psum: different keys in process 0 and 1) and only process 0 writes entries (JAX), so on a warm
# default cache process 0 loads every executable while process 1 compiles them all cold, and process 0 waits
# at the first collective past peer_timeout and gloo's 30 s (exit codes [3, -6], in this session and the
# last). Cold in both, the two stay in step. The last engine (tp8 again) finds process 0's executables here.
ENGINE = {**SMALL_ENGINE, "compilation_cache_dir": os.path.join(out_dir, "xla_cache")}
# (fixture, engine options): tensor parallelism across the processes (8 devices), data across them
# (a rank per process) with tensor within, experts over all 8 devices (6 experts: uneven, two hold none)
ENGINES = {
    "tp8": ("llama_gqa", {"tensor_parallel_size": 8}),
    "dp2tp4": ("llama_gqa", {"data_parallel_size": 2, "tensor_parallel_size": 4}),
    "ep8": ("mixtral_6x", {"data_parallel_size": 2, "tensor_parallel_size": 4, "enable_expert_parallel": True}),
}
# The last engine: process 1 changes step 1's token ids (a test hook), a divergence that ends both processes.
ENGINES["diverge"] = ENGINES["tp8"]


def compare_with_hf(llm, name):
    prompts = expected(name)["prompts"]
    outputs = llm.generate(
        [p["token_ids"] for p in prompts], SamplingParams(max_tokens=24, temperature=0.0, logprobs=8), use_tqdm=False
    )
    return {
        "greedy_equal": [o.outputs[0].token_ids == p["greedy_token_ids"] for o, p in zip(outputs, prompts)],
        "max_logprob_error": max(
            abs(o.outputs[0].logprobs[0][t] - v)
            for o, p in zip(outputs, prompts)
            for t, v in zip(p["first_top_token_ids"], p["first_top_logprobs"])
        ),
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }


def lead(key, llm, name):
    result = compare_with_hf(llm, name)
    kv_devices = llm.engine.runner.kv_pages.keys[0].sharding.device_set
    result["devices_holding_kv"] = sorted({device.process_index for device in kv_devices})
    if key == "tp8":
        llm.save_checkpoint(os.path.join(out_dir, "checkpoint"))
    if key == "dp2tp4":  # prompt logprobs of rows on both processes' ranks, beside rows that ask none
        result["prompt_logprobs"] = scored_prompts(llm, name)
    if key == "ep8":
        before = llm.stats()
        llm.rebalance_experts()
        moved = llm.stats()
        result.update(
            expert_devices_before=before["expert_devices"],
            expert_devices_moved=moved["expert_devices"],
            after_rebalance=compare_with_hf(llm, name),
            compiles_after_warmup=moved["num_compiles_after_warmup"],
        )
        llm.save_checkpoint(os.path.join(out_dir, "ep_checkpoint"))  # experts moved across processes
    llm.engine.runner.shutdown()
    return result


results = {"process_count": jax.process_count(), "device_count": jax.device_count()}
for key in ["tp8", "dp2tp4", "ep8", "diverge"]:
    if key == "diverge" and process_id == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f)
    name, options = ENGINES[key]
    started = time.monotonic()
    llm = LLM(fixture_dir(name), process_group=group, **ENGINE, **options)
    built = time.monotonic()
    if process_id == 0:
        results[key] = lead(key, llm, name)
        results[key]["seconds"] = {"build": built - started, "serve": time.monotonic() - built}
    else:
        run_follower(llm.engine.parts, group, perturb_step=1 if key == "diverge" else None)
jax.distributed.shutdown()  # not reached: the divergence ends both processes (exit code 3)
