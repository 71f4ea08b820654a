"""Float experts on one CPU device go through the projections' CPU kernel (sharding/moe.py's LocalExperts with the
plan): each token's result is the same bits whether its step has 1 row or 70, as the dense projections' are, so a
mixture-of-experts model's logprobs do not move with the chunk size, prefix-cache hits or the batch (XLA:CPU's dot and
ragged_dot add a row's terms in another order as the row count changes: 2 rows already differ at K = 2880)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from pallas_kernels.matmul import choose_matmul
from sharding.moe import LocalExperts, expert_dispatch
from tests.support.fixtures import fixture_dir


def experts_call(local: LocalExperts, x, expert_ids, weights, gate, up, down):
    return np.asarray(local(x, weights, expert_ids, gate, up, down, (), activation=jax.nn.silu))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_each_row_is_alike_in_a_call_of_any_size(dtype):
    plan = choose_matmul("cpu", 1)
    local = expert_dispatch(None, plan)
    assert isinstance(local, LocalExperts) and local.matmul is plan
    rng = np.random.default_rng(0)
    num_experts, hidden, inner, rows, top_k = 5, 36, 20, 40, 2
    gate, up = (jnp.asarray(rng.standard_normal((num_experts, hidden, inner)), dtype) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((num_experts, inner, hidden)), dtype)
    x = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
    expert_ids = jnp.asarray(rng.integers(0, num_experts, (rows, top_k)), jnp.int32)
    weights = jnp.asarray(rng.random((rows, top_k)), jnp.float32)
    call = jax.jit(lambda *args: local(*args, (), activation=jax.nn.silu))
    whole = np.asarray(call(x, weights, expert_ids, gate, up, down))
    for row in (0, 7, rows - 1):
        alone = np.asarray(call(x[row : row + 1], weights[row : row + 1], expert_ids[row : row + 1], gate, up, down))
        assert np.array_equal(alone[0], whole[row]), row
    for count in (2, 3, 9, 17):
        part = np.asarray(call(x[:count], weights[:count], expert_ids[:count], gate, up, down))
        assert np.array_equal(part, whole[:count]), count
    reference = experts_call(LocalExperts(), x, expert_ids, weights, gate, up, down)  # ragged_dot
    np.testing.assert_allclose(whole.astype(np.float32), reference.astype(np.float32), rtol=2e-2, atol=2e-2)


def test_a_moe_models_logprobs_are_alike_in_chunks_of_any_size():
    """GPT-OSS (biases, clamped SwiGLU, sinks) scored in 16-token and 64-token prefill chunks: the same bits."""
    prompt = list(range(3, 60))
    scored = []
    for chunk in (16, 64):
        llm = LLM(
            fixture_dir("gpt_oss"),
            dtype="float32",
            max_model_len=128,
            max_num_seqs=2,
            max_num_batched_tokens=chunk,
            prefill_token_buckets=(chunk,),
            enable_prefix_caching=False,
            show_progress=False,
        )
        out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, prompt_logprobs=2))[0]
        scored.append((out.prompt_logprobs, out.outputs[0].token_ids, out.outputs[0].logprobs))
    assert scored[0] == scored[1]
