"""Prefill chunks of more than 64 tokens through the int8 CPU quantized kernel (64 rows a call, row_blocks.py)
against the same engine whose plan sends them to XLA's reference with int8_activations' rounding (a kernel limit
under 64 rows): the two round x alike, so greedy tokens agree and log-probabilities differ by float summation
order only."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.loading.default_model import random_llama_weights
from pallas_kernels.matmul import quantized_cpu
from tests.loading.test_int8_activations import CONFIG, TOKENIZER_MODEL, TYPES
from tests.support.fixtures import SMALL_ENGINE
from tests.support.gguf_files import write_gguf

# 70-150 tokens each: chunks of the 256-token prefill bucket, past the kernel's old 64 rows
PROMPTS = [[1] + np.random.default_rng(seed).integers(3, 384, size=n).tolist() for seed, n in enumerate((150, 70, 110))]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    """Q8_0 and Q4_0 blocks, K of 96 and 160 (test_int8_activations.py's model)."""
    path = str(tmp_path_factory.mktemp("gguf") / "model.gguf")
    write_gguf(path, CONFIG, random_llama_weights(CONFIG), TYPES, tokenizer=("llama", TOKENIZER_MODEL))
    return path


def _prefill_uses_kernel(llm) -> bool:
    """Whether the 256-token prefill step calls the int8 kernel on its rows, 64 a call (it does on the few rows
    whose logits it samples either way: the head)."""
    runner = llm.engine.runner
    (text,) = [runner.executables[shape].as_text() for shape in runner.executables if shape.num_tokens == 256]
    target = f'custom_call_target="{quantized_cpu.target(None, "int8")}"'
    return any(target in line and "f32[64," in line for line in text.splitlines())


def test_prefill_past_64_rows_takes_the_kernel_and_keeps_the_references_tokens(gguf_path, monkeypatch):
    options = {**SMALL_ENGINE, "max_model_len": 256, "max_num_batched_tokens": 256}
    options |= {"prefill_token_buckets": (64, 256)}
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
    outputs = {}
    for max_rows in (quantized_cpu.PLAN_MAX_ROWS["int8"], 63):  # 63: the kernel serves decode rows only
        monkeypatch.setitem(quantized_cpu.PLAN_MAX_ROWS, "int8", max_rows)
        llm = LLM(gguf_path, **options, quantization="auto")
        assert _prefill_uses_kernel(llm) == (max_rows >= 64)
        outputs[max_rows] = [output.outputs[0] for output in llm.generate(PROMPTS, params)]
        del llm
    kernel, reference = outputs[quantized_cpu.PLAN_MAX_ROWS["int8"]], outputs[63]
    compared = 0
    for ours, theirs in zip(kernel, reference, strict=True):
        for position, (our_step, their_step) in enumerate(zip(ours.logprobs, theirs.logprobs, strict=True)):
            for token in set(our_step) & set(their_step):
                assert abs(our_step[token] - their_step[token]) < 2e-3, (position, our_step, their_step)
                compared += 1
            if ours.token_ids[position] != theirs.token_ids[position]:
                # only a near tie may flip on summation order
                top_two = sorted(their_step.values(), reverse=True)[:2]
                assert top_two[0] - top_two[1] < 1e-3, (position, our_step, their_step)
                break
    assert compared >= 2 * len(PROMPTS)
