"""Requests the two-process worker (worker.py) serves whose results test_multihost.py also computes on one
process (worker.py itself starts jax.distributed when imported)."""

from jaxserve import SamplingParams
from tests.support.fixtures import expected


def scored_prompts(llm, name):
    """The first four fixture prompts' top-3 prompt logprobs ([token id, logprob] pairs per position; the odd
    prompts ask, the even ones not: rows that ask none share their steps)."""
    prompts = [p["token_ids"] for p in expected(name)["prompts"]]
    params = [SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3 if i % 2 else None) for i in range(4)]
    outputs = llm.generate(prompts[:4], params, use_tqdm=False)
    return [
        None
        if o.prompt_logprobs is None
        else [None if e is None else sorted([t, v.logprob] for t, v in e.items()) for e in o.prompt_logprobs]
        for o in outputs
    ]
