"""No XLA compile at all while serving, counted by JAX itself (not only the engine's own count): the host tier's page
copies, warmed up on the pools as the runner got them, met the step's committed pools on first use and compiled
again (session 49: a jit call's cache key counts whether its arguments are committed)."""

import numpy as np

from jaxserve import LLM, SamplingParams
from tests.support.xla_compiles import xla_compiles


def test_host_tier_copies_compile_nothing_while_serving():
    llm = LLM(
        "tiny-random",
        max_model_len=64,
        max_num_seqs=4,
        page_size=4,
        num_pages=30,
        enable_prefix_caching=True,
        swap_space=0.01,
        show_progress=False,
    )
    rng = np.random.default_rng(0)
    with xla_compiles() as compiles:
        for _ in range(2):
            prompts = [[1] + rng.integers(3, 384, size=int(rng.integers(10, 30))).tolist() for _ in range(6)]
            prompts += [prompt[:12] + [7, 8] for prompt in prompts[:3]]  # prefixes back from the host tier
            llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False)
    stats = llm.stats()
    assert stats["host_tier_pages"] > 0 and stats["host_tier_hit_tokens"] > 0  # the copies both ways ran
    assert compiles == []
    assert stats["num_compiles_after_warmup"] == 0
