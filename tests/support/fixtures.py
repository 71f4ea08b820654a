"""The committed tiny checkpoints (tests/fixtures, written by support/make_fixtures.py) and small engine limits."""

import json
import os

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
MODEL_NAMES = sorted(d for d in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, d)))

# Small limits keep the number of compiled buckets (and so the suite's time) low. DERIVED_BUCKETS: the buckets
# the engine derives from them (decode 1, 4, 8; prefill 64), for tests of what changes between buckets (batch
# invariance, overlapped steps whose shape changes from one step to the next, lowering every bucket's kernels).
# num_scheduler_steps 1: decode chains (engine/decode_chain.py, auto 4 on a CPU) compile one more executable per
# decode bucket at warm-up, +40% of a clean suite's time; tests/engine/test_decode_chains.py, the batch invariance
# test and the servers' tests (their own configs) run them.
DERIVED_BUCKETS = dict(
    dtype="float32",
    max_model_len=128,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    show_progress=False,
    num_scheduler_steps=1,
)
# Every other test engine: one decode bucket (every decode step pads to 8 rows, also where a test lowers
# max_num_seqs), 2 step executables to trace, lower and compile at warm-up instead of 4; outputs do not depend
# on the bucket (tests/engine/test_engine.py's batch invariance test checks that on DERIVED_BUCKETS).
SMALL_ENGINE = {**DERIVED_BUCKETS, "decode_seq_buckets": (8,)}


def fixture_dir(name: str) -> str:
    return os.path.join(FIXTURES, name)


def expected(name: str) -> dict:
    with open(os.path.join(FIXTURES, name, "expected.json")) as f:
        return json.load(f)
