"""One process of a two-process engine serving penalised requests (run by test_penalties.py as processes 0
and 1).

    python -m tests.distributed.penalties_worker PROCESS_ID PORT OUT_DIR

A data-parallel rank on each process (dp2 x tp4), so that rows sampled on process 1's devices read its
own copy of the SequenceBuffers: only if each reset of an entry reached it too do they match process 0's.
Process 0 writes its greedy tokens to OUT_DIR/results.json; both leave the program with exit code 0.
"""

import json
import os
import sys

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

from jaxserve import LLM  # noqa: E402
from tests.distributed.penalised_requests import ENGINE, generate_rounds  # noqa: E402
from tests.support.fixtures import fixture_dir  # noqa: E402

# A fresh persistent cache, as worker.py's (which says why): on the default one process 0 loads the engine's
# executables while process 1 (which JAX never lets write entries) compiles them cold, and process 0 waits at the
# first collective; past gloo's 30 s on a loaded machine (session 15: exit codes [3, -6] at load 10).
cache = os.path.join(out_dir, "xla_cache")
llm = LLM(
    fixture_dir("llama_gqa"),
    process_group=group,
    data_parallel_size=2,
    tensor_parallel_size=4,
    compilation_cache_dir=cache,
    **ENGINE,
)
if process_id == 0:
    results = {"rounds": generate_rounds(llm), "stats": llm.stats()}
    llm.engine.runner.shutdown()
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, default=str)
else:
    run_follower(llm.engine.parts, group)
jax.distributed.shutdown()
# Out without the interpreter's teardown: a native thread torn down mid-exception aborted process 0 once, no Python
# traceback, at the end as far as its log shows (glibc's "FATAL: exception not rethrown", exit -6; test-suite.md).
# What the test checks (the tokens, both processes through the program) is done by now.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
