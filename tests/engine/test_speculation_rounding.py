"""Greedy outputs are identical with speculation on and off where the model rounds between layers: bfloat16
activations, and int8 activations of quantized weights (the default for int4 and GGUF Q4/Q8 files). There a
verify row (a sequence's k + 1 tokens in one query block, S of them in a call of up to 64 rows) that summed
anything in another order than a decode row rounds a 1e-7 difference into another bfloat16 or int8 value and
flips greedy near-ties (session 15: 3 of 4 outputs of the default model's Q4_1 file changed). Every CPU kernel
computes a row alike in calls of any size (tests/kernels/test_*rows_alike*.py); this checks the whole step."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from tests.support.fixtures import SMALL_ENGINE, fixture_dir

ENGINE = {**SMALL_ENGINE, "decode_seq_buckets": (8,), "prefill_token_buckets": (64,)}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "speculative_adaptive": False}


def prompts(seed: int, count: int) -> list[list[int]]:
    """Repetitive prompts (the tiny model's loops accept proposals) and random ones."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        if i % 2:
            out.append(rng.integers(3, 60, size=int(rng.integers(3, 9))).tolist() * int(rng.integers(2, 5)))
        else:
            out.append(rng.integers(3, 380, size=int(rng.integers(2, 30))).tolist())
    return out


@pytest.mark.parametrize(
    "options",
    [{"dtype": "bfloat16"}, {"dtype": "float32", "quantization": "int8"}],
    ids=["bfloat16", "int8-weights-and-activations"],
)
def test_greedy_outputs_are_identical_with_speculation_where_activations_round(options):
    engine = {**ENGINE, **options}
    plain = LLM(fixture_dir("llama_gqa"), **engine)
    ngram = LLM(fixture_dir("llama_gqa"), **engine, speculative=NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    batch = prompts(1, 24)
    want = [r.outputs[0].token_ids for r in plain.generate(batch, params)]
    got = [r.outputs[0].token_ids for r in ngram.generate(batch, params)]
    diverged = [i for i, (a, b) in enumerate(zip(want, got)) if a != b]
    assert not diverged, f"{len(diverged)} of {len(batch)} outputs changed with speculation"
    one_at_a_time = [ngram.generate([p], params)[0].outputs[0].token_ids for p in batch[:6]]
    assert one_at_a_time == want[:6]
    stats = ngram.stats()
    assert stats["speculative_num_accepted_tokens"] > 20 and stats["num_compiles_after_warmup"] == 0
