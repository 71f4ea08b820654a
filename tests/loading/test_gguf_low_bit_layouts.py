"""GGUF types with no layout of their own bits (Q2_K, Q3_K, IQ4_NL, IQ4_XS) load exactly into a wider
QuantizedWeight layout (4-bit or int8 in groups, float32 scales where d * sc needs them) instead of a float
copy: the values equal the gguf package's dequantizer's, the bytes stay within a stated factor of the file's,
and the CPU kernel computes them (both activation kernels). The engine-level check is
tests/loading/test_quantization.py's GGUF file, which holds these types."""

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from jaxserve.loading.quantize_gguf import from_gguf_blocks
from pallas_kernels.matmul import quantized_cpu
from tests.kernels.test_quantized_matmul import numpy_dequantize
from tests.support.gguf_files import random_blocks

# type -> (bits, group, most stored bytes per file byte)
WIDER = {T.Q2_K: (4, 16, 3.1), T.Q3_K: (4, 16, 1.8), T.IQ4_NL: (8, 32, 1.9), T.IQ4_XS: (8, 32, 2.15)}


@pytest.mark.parametrize("qtype", list(WIDER))
def test_blocks_load_exactly_into_a_wider_layout(qtype):
    rng = np.random.default_rng(11)
    columns, depth = 9, 512
    raw = random_blocks((columns, depth), qtype, rng)
    assert raw.shape[1] == depth // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]
    weight = from_gguf_blocks(raw, qtype, "float32")
    bits, group, most_bytes = WIDER[qtype]
    assert (weight.shape, weight.bits, weight.group_size) == ((depth, columns), bits, group)
    np.testing.assert_array_equal(numpy_dequantize(weight), gguf_dequantize(raw, qtype).T.astype(np.float64))
    assert raw.nbytes < weight.nbytes <= most_bytes * raw.nbytes


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_the_cpu_kernel_computes_them(activations):
    rng = np.random.default_rng(12)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    weights = [from_gguf_blocks(random_blocks((40, 256), qtype, rng), qtype, "float32") for qtype in WIDER]
    outputs = quantized_cpu.quantized_matmuls(jnp.asarray(x), weights, activations=activations)
    for weight, out in zip(weights, outputs):
        w = numpy_dequantize(weight)
        expected = x.astype(np.float64) @ w
        # float x: float32 rounding; int8 x: each 32 values of x off by max|x| / 254 at most (ggml's q8_0), and
        # by 127 * 2^-11 d more as d is used in float16
        step = np.repeat(np.abs(x).reshape(3, -1, 32).max(axis=2) / 254 * (1 + 2 * 254 * 2.0**-11), 32, axis=1)
        bound = 1e-5 * (np.abs(x) @ np.abs(w)) + (0 if activations == "float" else step @ np.abs(w))
        assert np.all(np.abs(np.asarray(out) - expected) <= bound + 1e-6)
