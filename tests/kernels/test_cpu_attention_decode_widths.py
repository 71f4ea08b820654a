"""The CPU attention kernel's decode rows (fewer than four query rows per kv head: a score is one dot product
per key, and the values are added with the accumulator held in registers across a tile's keys) at head
sizes that leave every tail of those loops: 40 (less than a 64-column block: single vectors, then single
columns on AVX-512) and 80 (a block, then a vector or two); against the reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import cpu, reference
from tests.kernels.steps import TOLERANCE, assert_matches_on_real_tokens, ragged_step


@pytest.mark.parametrize(
    "head_dim,groups,dtype",
    [(40, 3, jnp.float32), (80, 1, jnp.float32), (80, 3, jnp.bfloat16), (40, 1, jnp.float16)],
)
def test_decode_rows_match_reference_at_odd_head_sizes(head_dim, groups, dtype):
    args = ragged_step(np.random.default_rng(head_dim + groups), 16, head_dim, groups, dtype, 1)
    expected = reference.ragged_paged_attention(*args, query_block=1)
    got = cpu.ragged_paged_attention(*args, query_block=1)
    assert got.shape == expected.shape
    assert_matches_on_real_tokens(got, expected, args[5], TOLERANCE[jnp.dtype(dtype)])
