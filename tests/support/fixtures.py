"""The committed tiny checkpoints (tests/fixtures, written by support/make_fixtures.py) and small engine limits."""

import json
import os

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
MODEL_NAMES = sorted(d for d in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, d)))

# Small limits keep the number of compiled buckets (and so the suite's time) low.
SMALL_ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, show_progress=False)
# One decode bucket (every decode step pads to 8 rows): half the step executables to trace, lower and compile
# at warm-up, for the many engines a multi-device run builds; outputs do not depend on the bucket.
ONE_DECODE_BUCKET = {**SMALL_ENGINE, "decode_seq_buckets": (8,)}


def fixture_dir(name: str) -> str:
    return os.path.join(FIXTURES, name)


def expected(name: str) -> dict:
    with open(os.path.join(FIXTURES, name, "expected.json")) as f:
        return json.load(f)
