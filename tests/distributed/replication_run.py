"""Run as a subprocess by test_result_replication.py, with 4 fake CPU devices set up before JAX starts.

An engine on dp 2 x tp 2 whose steps run as every process runs a step plan (leader_runner.execute_everywhere:
global inputs, results replicated), on one process. For each step: whether its inputs scored prompt tokens,
whether its prompt-logprob arrays are the step's own (not moved) and whether they are replicated; and the
prompt logprobs and tokens served, with those of the same engine's plain steps. Prints one JSON object.
"""

import json

import jax
import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.distributed.leader_runner import execute_everywhere
from tests.support.fixtures import SMALL_ENGINE, expected, fixture_dir


class RunsAsEveryProcess:
    """The engine's runner, each step run through execute_everywhere; records what each step's prompt
    logprobs became."""

    def __init__(self, inner, mesh):
        self.inner, self.mesh, self.steps = inner, mesh, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, shape, inputs):
        own = {}
        execute = self.inner.execute

        def keeping_the_steps_own(shape, global_inputs):
            own["pending"] = execute(shape, global_inputs)
            return own["pending"]

        self.inner.execute = keeping_the_steps_own
        try:
            pending = execute_everywhere(self.inner, self.mesh, shape, inputs)
        finally:
            del self.inner.execute
        step_inputs = getattr(inputs, "step", inputs)
        mine, theirs = jax.tree.leaves(pending.prompt_logprobs), jax.tree.leaves(own["pending"].prompt_logprobs)
        self.steps.append(
            dict(
                scores=bool((np.asarray(step_inputs.prompt_logprob_targets) >= 0).any()),
                unmoved=all(a is b for a, b in zip(mine, theirs)),
                replicated=all(leaf.sharding.is_fully_replicated for leaf in mine),
            )
        )
        return pending


def served(llm):
    prompts = [p["token_ids"] for p in expected("llama_gqa")["prompts"]]
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=3 if i % 2 else None) for i in range(len(prompts))
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    scores = [
        None if o.prompt_logprobs is None else [None if e is None else sorted(e.items()) for e in o.prompt_logprobs]
        for o in outputs
    ]
    return tokens, scores


llm = LLM(fixture_dir("llama_gqa"), **SMALL_ENGINE, data_parallel_size=2, tensor_parallel_size=2)
plain_tokens, plain_scores = served(llm)
wrapper = RunsAsEveryProcess(llm.engine.runner, llm.engine.parts.mesh)
llm.engine.runner = wrapper
tokens, scores = served(llm)
print(
    json.dumps(
        dict(
            steps=wrapper.steps,
            tokens_equal=tokens == plain_tokens,
            prompt_logprobs_equal=repr(scores) == repr(plain_scores),
            scored_prompts=sum(s is not None for s in scores),
        )
    )
)
