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


def assert_speculation_keeps_outputs(path: str, engine: dict, speculative: dict, max_tokens: int, count: int) -> LLM:
    """Greedy outputs of `count` prompts equal with and without `speculative`; returns the speculating engine."""
    plain = LLM(path, **engine)
    speculating = LLM(path, **engine, speculative=speculative)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    batch = prompts(1, count)
    want = [r.outputs[0].token_ids for r in plain.generate(batch, params)]
    got = [r.outputs[0].token_ids for r in speculating.generate(batch, params)]
    diverged = [i for i, (a, b) in enumerate(zip(want, got)) if a != b]
    assert not diverged, f"{len(diverged)} of {len(batch)} outputs changed with speculation"
    one_at_a_time = [speculating.generate([p], params)[0].outputs[0].token_ids for p in batch[:4]]
    assert one_at_a_time == want[:4]
    assert speculating.stats()["num_compiles_after_warmup"] == 0
    return speculating


@pytest.mark.parametrize(
    "options",
    [{"dtype": "bfloat16"}, {"dtype": "float32", "quantization": "int8"}],
    ids=["bfloat16", "int8-weights-and-activations"],
)
def test_greedy_outputs_are_identical_with_speculation_where_activations_round(options):
    ngram = assert_speculation_keeps_outputs(fixture_dir("llama_gqa"), {**ENGINE, **options}, NGRAM, 96, 24)
    assert ngram.stats()["speculative_num_accepted_tokens"] > 20


def test_a_gguf_file_drafting_for_itself_keeps_every_output(tmp_path):
    """A GGUF file of Q4_0 / Q4_1 / Q8_0 / Q6_K tensors (int8 activations: the default) as its own draft: every
    proposal is accepted, so every token after the first of a round comes from a verify row of k + 1 tokens
    in a call of S x (k + 1) rows, through the int8-dot and K-quant kernels. Before every kernel computed a
    row alike in calls of any size (1fccce1), 10 of these 16 outputs changed."""
    from gguf import GGMLQuantizationType as T

    from jaxserve.loading.default_model import random_llama_weights
    from tests.loading.test_kquant_gguf import CONFIG, TOKENIZER_MODEL
    from tests.support.gguf_files import write_gguf

    path = str(tmp_path / "mixed.gguf")
    types = {"output.weight": T.Q6_K, "ffn_down": T.Q4_1, "attn_v": T.Q8_0, "": T.Q4_0}  # first match wins
    write_gguf(path, CONFIG, random_llama_weights(CONFIG), types, tokenizer=("llama", TOKENIZER_MODEL))
    itself = {"method": "draft", "draft_model": path, "draft_quantization": "auto", "num_speculative_tokens": 4}
    engine = {**ENGINE, "quantization": "auto"}
    drafted = assert_speculation_keeps_outputs(path, engine, {**itself, "speculative_adaptive": False}, 48, 16)
    stats = drafted.stats()
    assert stats["speculative_acceptance_rate"] == 1.0 and stats["speculative_num_verify_rows"] >= 16 * 9


def test_a_bfloat16_model_drafting_for_itself_has_every_proposal_accepted():
    """The target's own directory as its draft, in bfloat16: the draft's steps (one-token decode, two-token
    catch-up, prefill) must compute each row as the target's decode and verify steps do, or its greedy proposals
    part from the target's samples. On an AMX CPU the catch-up step's 2 x S rows went to XLA's AMX dots above 8
    rows (the kernel serves decode rows there) and 1.5% of llama_gqa's proposals were rejected."""
    path = fixture_dir("llama_gqa")
    itself = {"method": "draft", "draft_model": path, "num_speculative_tokens": 4, "speculative_adaptive": False}
    drafted = assert_speculation_keeps_outputs(path, {**ENGINE, "dtype": "bfloat16"}, itself, 48, 16)
    stats = drafted.stats()
    assert stats["speculative_acceptance_rate"] == 1.0 and stats["speculative_num_verify_rows"] >= 16 * 9
