"""The model a quantized engine stands for: a float engine of the same checkpoint whose params are the quantized
engine's, dequantized (tests compare the two: the quantized reads must compute what the dequantized weights do)."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve import LLM
from pallas_kernels.matmul.panels import is_panels, to_panels
from pallas_kernels.matmul.quantized import QuantizedWeight, dequantize, untiled


def params_by_path(llm: LLM) -> dict:
    """The engine's params by path, quantized weights in their [K, N] form (a one-device CPU engine keeps them in
    the int8-dot kernel's tiles: pallas_kernels/matmul/quantized_tiles.py)."""
    return {path: untiled(variable.get_value()) for path, variable in nnx.to_flat_state(llm.engine.runner.params())}


def dequantized_twin(quantized: LLM, twin: LLM) -> LLM:
    """`twin` (a float engine of the same checkpoint) with the quantized engine's params, dequantized."""
    stored = params_by_path(quantized)
    replaced = []
    for path, variable in nnx.to_flat_state(twin.engine.runner.params()):
        value = stored[path]
        if isinstance(value, QuantizedWeight):
            float_value = dequantize(value, jnp.float32)
            if tuple(map(str, path[-2:])) == ("embed_tokens", "embedding"):
                float_value = float_value.T  # stored [E, V]
            twin_value = variable.get_value()
            if is_panels(twin_value):  # the twin's float projection in the CPU kernel's layout
                value = to_panels(float_value)
            else:
                value = jax.device_put(float_value, twin_value.sharding)
        replaced.append((path, variable.replace(value)))
    twin.engine.runner.replace_params(nnx.from_flat_state(replaced))
    return twin
