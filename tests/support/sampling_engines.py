"""The tiny-random engines that the sampling-control and guided-decoding tests share (one build each per
test process: every build compiles the step's buckets)."""

import functools

from jaxserve import LLM, SamplingParams

# Room for a JSON reply of ~150 tokens after a short prompt; eight rows for mixed batches and n > 1.
ENGINE_OPTIONS = dict(
    dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, show_progress=False
)


def tiny_random_llm(overlap_steps: bool = True) -> LLM:
    return _build(overlap_steps)


@functools.cache  # keyed by its one argument, however tiny_random_llm was called
def _build(overlap_steps: bool) -> LLM:
    return LLM("tiny-random", **ENGINE_OPTIONS, overlap_steps=overlap_steps)


def token_ids(llm: LLM, prompts, params) -> list[list[int]]:
    """The first sequence's tokens of each prompt's output."""
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params)]


def greedy(max_tokens: int, **controls) -> SamplingParams:
    return SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **controls})


def assert_idle(llm: LLM) -> None:
    """Nothing queued or running, no page held, nothing compiled since warm-up."""
    stats = llm.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    assert stats["num_compiles_after_warmup"] == 0
