"""Rotary tables once per step: a step computes the sin and cos of its positions once and every layer rotates
its queries and keys with them (layers.step_rope_cos_sin). XLA:CPU takes each sin and cos as a scalar libm call
and, left alone, fused a copy of them into every layer's q and k rotation, per head: 8% of a float32 prefill on
the default model."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.kv_pages import AttentionMetadata
from jaxserve.models.layers import apply_rope, rotate, step_rope_cos_sin


def test_every_compiled_step_computes_one_sine_and_one_cosine_table(llama_llm):
    executables = llama_llm.engine.runner.executables
    assert executables
    for shape, executable in executables.items():
        text = executable.as_text()
        sines = len(re.findall(r" sine\(", text))
        cosines = len(re.findall(r" cosine\(", text))
        assert (sines, cosines) == (1, 1), f"{shape}: {sines} sine and {cosines} cosine ops (want one table each)"


def test_the_step_tables_rotate_as_apply_rope_and_are_shared_by_equal_frequencies():
    rng = np.random.default_rng(0)
    positions = jnp.asarray([0, 3, 17, 4095, -1], jnp.int32)
    frequencies = tuple(float(f) for f in 1.0 / 10000.0 ** (np.arange(0, 6, 2) / 6))  # rotary 6 of head_dim 8
    x = jnp.asarray(rng.standard_normal((5, 3, 8)), jnp.float32)
    expected = apply_rope(x, positions, jnp.asarray(frequencies, jnp.float32))
    computed = []

    def step(positions, x):
        metadata = AttentionMetadata(positions, positions, positions, positions.reshape(1, -1))
        cos, sin = step_rope_cos_sin(metadata, frequencies, 1.0)
        computed.append(step_rope_cos_sin(metadata, frequencies, 1.0)[0] is cos)  # the next layer's: the same
        scaled_cos, _ = step_rope_cos_sin(metadata, frequencies, 0.5)  # another factor: a table of its own
        computed.append(scaled_cos is cos)
        return rotate(x, cos, sin), scaled_cos, cos

    rotated, scaled_cos, cos = jax.jit(step)(positions, x)
    np.testing.assert_allclose(np.asarray(rotated), np.asarray(expected), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(scaled_cos), 0.5 * np.asarray(cos), rtol=1e-6)
    assert computed == [True, False]
