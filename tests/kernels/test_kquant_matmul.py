"""GGUF K-quants (and Q5_0 / Q5_1) at the file's bytes (pallas_kernels/matmul/kquant.py): the blocks moved into
planes hold exactly the gguf package's values, at <= 1.03x the blocks' bytes; the XLA reference and the C++ kernel
(cpu_kquant_matmul.cc, every instruction path this CPU runs) against numpy at odd N, one to several
super-blocks of K, 1 to 20 rows, mixed kinds in one call; the plan joins a Q4_K_M layer's weights in one
call; tensor-parallel placements split every plane with its scales (4 fake devices, in a subprocess)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from jaxserve.loading.quantize_gguf import from_gguf_kquant_blocks
from pallas_kernels import cpu_library
from pallas_kernels.matmul import choose_matmul, kquant, kquant_cpu
from pallas_kernels.matmul.kquant import KQuantWeight, numpy_dequantize
from tests.kernels.row_invariance import assert_rows_as_alone
from tests.kernels.test_quantized_int8_dot import FLOAT32_EPS, quantize_rows
from tests.support.fake_devices import fake_device_xla_flags
from tests.support.gguf_files import random_blocks

KQUANTS = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0, T.Q5_1)


def _blocks(qtype, columns: int, depth: int, seed: int) -> np.ndarray:
    """[columns, bytes per row]: random K-quant blocks, or gguf's Q5_0 / Q5_1 of random values."""
    rng = np.random.default_rng(seed)
    if qtype in (T.Q5_0, T.Q5_1):
        return gguf_quantize(rng.standard_normal((columns, depth)).astype(np.float32), qtype)
    return random_blocks((columns, depth), qtype, rng)


def _weight(qtype, columns: int, depth: int, seed: int) -> tuple[KQuantWeight, np.ndarray]:
    """A placed KQuantWeight [depth, columns] from random blocks, and its float64 values by gguf."""
    raw = _blocks(qtype, columns, depth, seed)
    weight = jax.tree.map(jnp.asarray, from_gguf_kquant_blocks(raw, qtype, "float32"))
    return weight, gguf_dequantize(raw, qtype).T.astype(np.float64)


def _weights(*specs) -> tuple[tuple[KQuantWeight, ...], tuple[np.ndarray, ...]]:
    """(_weight(*spec) for each spec) as the weights and their float64 values."""
    pairs = [_weight(*spec) for spec in specs]
    return tuple(weight for weight, _ in pairs), tuple(dense for _, dense in pairs)


@pytest.mark.parametrize("qtype", KQUANTS)
def test_blocks_become_planes_with_the_files_values_and_bytes(qtype):
    raw = _blocks(qtype, 7, 512, 1)
    weight = from_gguf_kquant_blocks(raw, qtype, "float32")
    assert weight.shape == (512, 7) and weight.kind == qtype.name.lower()
    expected = gguf_dequantize(raw, qtype).T
    assert np.array_equal(numpy_dequantize(weight), expected)  # bit for bit: the same float32 products
    assert np.array_equal(np.asarray(kquant.dequantize(jax.tree.map(jnp.asarray, weight))), expected)
    assert weight.nbytes <= 1.03 * raw.nbytes  # Q4_K 148 / 144, Q5_K 180 / 176
    if qtype in (T.Q6_K, T.Q5_0, T.Q5_1):
        assert weight.nbytes == raw.nbytes


@pytest.mark.parametrize("num_rows", [3, 40])  # group sums below 32 rows, one dequantized dot from there
def test_the_xla_reference_computes_the_dequantized_product(num_rows):
    rng = np.random.default_rng(2)
    for index, qtype in enumerate(KQUANTS):
        weight, dense = _weight(qtype, 37, 512, index)
        x = rng.standard_normal((num_rows, 512)).astype(np.float32)
        got = jax.jit(kquant.matmul)(jnp.asarray(x), weight)
        np.testing.assert_allclose(np.asarray(got), x @ dense, rtol=1e-5, atol=2e-3)
        rows = np.asarray(kquant.take_columns(weight, jnp.asarray([0, 36, 5])))  # an embedding's lookup
        assert np.array_equal(rows, dense[:, [0, 36, 5]].T.astype(np.float32))


def test_the_cpu_kernel_computes_mixed_kinds_in_one_call_on_every_path():
    weights, dense = _weights(
        (T.Q4_K, 37, 768, 3),  # N not a multiple of a vector
        (T.Q6_K, 300, 768, 4),  # more than one column block
        (T.Q5_K, 531, 768, 5),
        (T.Q4_K, 3, 768, 6),  # fewer columns than threads: K split into parts
        (T.Q5_0, 40, 768, 8),  # blocks of 32, d per block
        (T.Q5_1, 5, 768, 9),
    )
    rng = np.random.default_rng(7)
    for path in cpu_library.runnable_paths():
        call = jax.jit(lambda x, ws, path=path: kquant_cpu.kquant_matmuls(x, ws, path=path, activations="float"))
        for num_rows, dtype in ((1, jnp.float32), (9, jnp.bfloat16), (20, jnp.float32)):
            x = jnp.asarray(rng.standard_normal((num_rows, 768)), dtype)
            wide = np.asarray(x.astype(jnp.float32), np.float64)
            for got, expected in zip(call(x, weights), dense, strict=True):
                np.testing.assert_allclose(np.asarray(got), wide @ expected, rtol=1e-5, atol=2e-3)


def int8_activation_model(x: np.ndarray, weight: KQuantWeight):
    """The int8 tiles' arithmetic (cpu_kquant_int8.h) in float64 from exact integer sums: x quantized per 32 k
    as ggml's quantize_row_q8_0, per sub-block sum(q_x * q) * d_x * (d * sc) - d_x * sum(q_x) * (dmin * m).
    Returns (result [M, N], the sum of its terms' sizes [M, N], the number of sub-blocks)."""
    q = np.asarray(kquant.integers(weight), np.int64)
    depth = q.shape[0]
    group = weight.group_size
    scales = np.asarray(kquant.group_scales(weight), np.float64)
    mins = kquant.group_mins(weight)
    mins = None if mins is None else np.asarray(mins, np.float64)
    xq, d = zip(*(quantize_rows(x, k0, k0 + 32) for k0 in range(0, depth, 32)), strict=True)
    result = np.zeros((x.shape[0], q.shape[1]))
    size = np.zeros_like(result)
    for g in range(depth // group):
        k0 = g * group
        chunk, offset = k0 // 32, k0 % 32
        part = xq[chunk][:, offset : offset + group]
        dx = d[chunk].astype(np.float64)[:, None]
        term = (part @ q[k0 : k0 + group]) * dx * scales[g]
        result += term
        size += np.abs(term)
        if mins is not None:
            min_term = dx * part.sum(axis=1)[:, None] * mins[g]
            result -= min_term
            size += np.abs(min_term)
    return result, size, depth // group


def test_int8_activations_compute_llama_cpps_integer_arithmetic_on_every_path():
    """Where the path has the int8 tiles (avx512: vpdpbusd with VNNI, else vpmaddubsw; avx2: vpmaddubsw): exact
    integer sums per sub-block, within float32 rounding of the model above, and within the activations' rounding of
    the dequantized product; the int8 paths give the same bits (the same integers, the same float operations per
    lane); elsewhere an int8 request keeps x in float (the dequantized product). Every kind, odd N (column tails),
    1 / 5 / 9 / 70 rows (70: the many-rows widened tiles)."""
    weights, dense = _weights(
        (T.Q4_K, 37, 512, 11),
        (T.Q5_K, 531, 512, 12),
        (T.Q6_K, 45, 512, 13),
        (T.Q5_0, 83, 512, 14),
        (T.Q5_1, 19, 512, 15),
    )
    rng = np.random.default_rng(16)
    inputs = {num_rows: rng.standard_normal((num_rows, 512)).astype(np.float32) for num_rows in (1, 5, 9, 70)}
    for x in inputs.values():
        x[0, 32:64] = 0.0  # a chunk of zeros: d = 0
    by_path = {}
    for path in cpu_library.runnable_paths():
        call = jax.jit(lambda x, ws, path=path: kquant_cpu.kquant_matmuls(x, ws, path=path, activations="int8"))
        for num_rows, x in inputs.items():
            results = [np.asarray(got) for got in call(jnp.asarray(x), weights)]
            if kquant_cpu.computes_int8(path):
                by_path.setdefault(num_rows, {})[path] = results
            for got, weight, expected in zip(results, weights, dense, strict=True):
                got = np.asarray(got, np.float64)
                if not kquant_cpu.computes_int8(path):
                    np.testing.assert_allclose(got, x @ expected, rtol=1e-5, atol=2e-3)
                    continue
                model, size, count = int8_activation_model(x, weight)
                error = np.abs(got - model)
                bound = (count + 6) * FLOAT32_EPS * size + 1e-30
                assert np.all(error <= bound), (path, weight.kind, num_rows, float(np.max(error / bound)))
                # each x is off by at most max|x of its chunk| / 254, times |w| over the chunk
                amax = np.abs(x).reshape(num_rows, -1, 32).max(axis=2) / 254
                rounding = amax @ np.abs(expected).reshape(-1, 32, expected.shape[1]).sum(axis=1)
                assert np.all(np.abs(got - x @ expected) <= rounding * (1 + 1e-5) + 1e-4), (path, weight.kind)
    for num_rows, results in by_path.items():  # on x86-64: avx2, and avx512 where the CPU has it
        first, *others = results.values()
        for other in others:
            for a, b in zip(first, other, strict=True):
                np.testing.assert_array_equal(a, b, err_msg=f"{list(results)} at {num_rows} rows")


def test_decode_calls_are_cut_per_call_and_repeat_bit_for_bit():
    """A call of up to 64 rows is planned as a whole (cpu_call_plan.h, as the int8-dot kernel's): its weights'
    whole-row column blocks in order as one sequence of bytes, cut at sub-block boundaries into one contiguous run
    per worker, so that a weight is split along K only where a run ends inside it (with two workers: inside the
    first Q6_K weight of the small call, mid super-block; inside a column block of the head-wide Q6_K weight, one
    of 3 blocks at 1-2 rows, each piece split in 12 at 8), and each piece prefetches the start of the next. Every
    path, x in int8 (the integer model where the path has the tiles) and in float (the dequantized product),
    1 / 2 / 8 rows; the same call again gives the same bits (the cut depends on shapes and workers, never on
    timing or the rows)."""
    small_specs = ((T.Q6_K, 260, 512, 31), (T.Q4_K, 37, 512, 32), (T.Q5_0, 64, 512, 33))
    small, small_dense = _weights(*small_specs)
    head, head_dense = _weight(T.Q6_K, 9000, 512, 34)
    rng = np.random.default_rng(35)
    for path in cpu_library.runnable_paths():
        for activations in ("int8", "float") if kquant_cpu.computes_int8(path) else ("float",):
            call = jax.jit(
                lambda x, ws, path=path, a=activations: kquant_cpu.kquant_matmuls(x, ws, path=path, activations=a)
            )
            for num_rows in (1, 2, 8):
                x = rng.standard_normal((num_rows, 512)).astype(np.float32)
                for weights, dense in ((small, small_dense), ((*small, head), (*small_dense, head_dense))):
                    first = [np.asarray(got) for got in call(jnp.asarray(x), weights)]
                    for got, weight, expected in zip(first, weights, dense, strict=True):
                        _assert_kernel_result(got, x, weight, expected, path, activations)
                    for _ in range(3):
                        for again, got in zip(call(jnp.asarray(x), weights), first, strict=True):
                            np.testing.assert_array_equal(np.asarray(again), got)


def test_a_row_computes_alike_in_calls_of_any_decode_or_verify_size():
    """tests/kernels/row_invariance.py's rule for the K-quant kernel: a call of up to 64 rows is cut along K where
    a one-row call is (its whole-row blocks up to 4096 columns), more rows only splitting each piece along its
    columns (3 rows and more: 256 wide), the same sub-blocks; so rows 0 and M // 2 of an M-row call are the bits
    of the one-row call, x in int8 and in float, on every path, every kind at odd widths in one call (the cut
    inside one of them) and with a head-wide Q4_K weight (the cut inside it). Main before session 16 cut the
    1-2 row, 3-8 row and 9+ row calls differently."""
    small, _ = _weights(
        (T.Q6_K, 260, 512, 51),
        (T.Q4_K, 37, 512, 52),
        (T.Q5_0, 64, 512, 53),
        (T.Q5_K, 83, 512, 54),
        (T.Q5_1, 19, 512, 55),
    )
    head, _ = _weight(T.Q4_K, 9000, 512, 56)
    x = np.random.default_rng(57).standard_normal((64, 512)).astype(np.float32)
    for path in cpu_library.runnable_paths():
        for activations in ("int8", "float") if kquant_cpu.computes_int8(path) else ("float",):
            call = jax.jit(
                lambda x, ws, path=path, a=activations: kquant_cpu.kquant_matmuls(x, ws, path=path, activations=a)
            )
            for weights in (small, (*small, head)):
                label = f"{path}, {activations}, {len(weights)}"
                assert_rows_as_alone(lambda rows, ws=weights, call=call: call(jnp.asarray(x[rows]), ws), label)


def _assert_kernel_result(got, x: np.ndarray, weight: KQuantWeight, expected: np.ndarray, path: str, activations: str):
    """The kernel's result against the integer model (x in int8 on a path with the int8 tiles: within float32
    rounding of it) or the dequantized product (x in float)."""
    got = np.asarray(got, np.float64)
    if activations == "float" or not kquant_cpu.computes_int8(path):
        np.testing.assert_allclose(got, x @ expected, rtol=1e-5, atol=2e-3)
        return
    model, size, count = int8_activation_model(x, weight)
    bound = (count + 6) * FLOAT32_EPS * size + 1e-30
    error = np.abs(got - model)
    assert np.all(error <= bound), (path, weight.kind, x.shape[0], float(np.max(error / bound)))


def test_prefill_sized_rows_compute_as_the_few_row_tiles_bit_for_bit():
    """65 and 200 rows (past the decode and verify buckets; odd): with int8 x the many-rows items (each weight
    widened once per call, cpu_kquant_int8.h's WidenedItem) are within float32 rounding of the integer model
    (odd N, column tails), and give each row exactly what the one-pass tiles give it in a call of 8 rows where
    neither call splits K: eight weights of a kind at 2048 columns (a one-row call's 8 whole-row blocks, which
    the call plan cuts at block boundaries for 1, 2, 4 or 8 threads; at 65+ rows 8 blocks of 256 a weight, K
    whole up to 4 threads). Where a call of 8 rows cuts K (odd shapes, joined weights) only the order of the
    parts' sums differs. Paths without the int8 tiles keep x in float (the dequantized product)."""
    weights, dense = _weights(
        (T.Q4_K, 531, 512, 21),  # two 256-column blocks and a tail of 19 columns
        (T.Q5_K, 64, 512, 22),
        (T.Q6_K, 45, 512, 23),
        (T.Q5_0, 192, 512, 24),
        (T.Q5_1, 19, 512, 25),
    )
    wide, _ = _weights(*((qtype, 2048, 512, 40 + i) for i, qtype in enumerate(KQUANTS)))
    rng = np.random.default_rng(26)
    for path in cpu_library.runnable_paths():
        call = jax.jit(lambda x, ws, path=path: kquant_cpu.kquant_matmuls(x, ws, path=path, activations="int8"))
        for num_rows in (65, 200):
            x = rng.standard_normal((num_rows, 512)).astype(np.float32)
            x[3, 64:96] = 0.0  # a chunk of zeros: d = 0
            for many, weight, expected in zip(call(jnp.asarray(x), weights), weights, dense, strict=True):
                many = np.asarray(many, np.float64)
                if not kquant_cpu.computes_int8(path):
                    np.testing.assert_allclose(many, x @ expected, rtol=1e-5, atol=2e-3)
                    continue
                model, size, count = int8_activation_model(x, weight)
                bound = (count + 6) * FLOAT32_EPS * size + 1e-30
                assert np.all(np.abs(many - model) <= bound), (path, weight.kind, num_rows)
            if not kquant_cpu.computes_int8(path):
                continue
            for weight in wide:
                for many, eight in zip(call(jnp.asarray(x), (weight,) * 8), call(jnp.asarray(x[:8]), (weight,) * 8)):
                    assert np.array_equal(np.asarray(many)[:8], np.asarray(eight)), (path, weight.kind, num_rows)


def test_the_plan_joins_a_q4_k_m_layers_weights_in_one_kernel_call():
    weights = [_weight(qtype, n, 256, i)[0] for i, (qtype, n) in enumerate(((T.Q4_K, 64), (T.Q4_K, 32), (T.Q6_K, 32)))]
    plan = choose_matmul("cpu", 1)
    text = jax.jit(lambda x, ws: plan.together(x, ws)).lower(jnp.ones((2, 256)), weights).as_text()
    assert text.count(kquant_cpu.KQUANT_TARGET) == 1
    # a prefill chunk: the kernel, 64 rows a call (row_blocks.py: a prefill row is the bits a decode row is)
    text = jax.jit(lambda x, ws: plan.together(x, ws)).lower(jnp.ones((200, 256)), weights).as_text()
    assert text.count(f"@{kquant_cpu.KQUANT_TARGET}(") == 4
    float_plan = choose_matmul("cpu", 1, quantized_activations="float")
    text = jax.jit(lambda x, ws: float_plan(x, ws[0])).lower(jnp.ones((200, 256)), weights).as_text()
    assert text.count(f"@{kquant_cpu.KQUANT_TARGET}(") == 4
    with pytest.raises(ValueError, match="does not serve"):
        kquant_cpu.kquant_matmuls(jnp.ones((1, 256)), [jnp.ones((256, 8))])


SHARDED = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from gguf import GGMLQuantizationType as T
from jaxserve.loading.quantize import place
from jaxserve.loading.quantize_gguf import from_gguf_kquant_blocks
from pallas_kernels.matmul import kquant
from tests.kernels.test_quantized_int8_dot import FLOAT32_EPS, quantize_rows
from tests.support.gguf_files import random_blocks

mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
result = {}
for qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
    weight = from_gguf_kquant_blocks(random_blocks((64, 512), qtype, np.random.default_rng(0)), qtype, "float32")
    dense = kquant.numpy_dequantize(weight)
    x = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)
    for name, spec in (("columns", P(None, "model")), ("rows", P("model", None))):
        placed = place(weight, NamedSharding(mesh, spec))
        got = np.asarray(jax.jit(kquant.matmul)(jnp.asarray(x), placed))
        specs = {f: [str(a) for a in getattr(placed, f).sharding.spec] for f in ("low", "sub_scales", "d")}
        result[f"{qtype.name} {name}"] = dict(specs=specs, error=float(np.max(np.abs(got - x @ dense))))
print("RESULT" + json.dumps(result))
"""


def test_tensor_parallel_placements_split_the_planes_with_their_scales():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, XLA_FLAGS=fake_device_xla_flags(4), PYTHONPATH=root)
    run = subprocess.run(
        [sys.executable, "-c", SHARDED], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    for name, entry in json.loads(lines[-1][len("RESULT") :]).items():
        assert entry["error"] < 2e-3, name
        axis = ["None", "model"] if name.endswith("columns") else ["model", "None"]
        # K 512: two super-blocks, so d splits along K with the planes and the sub-block scales
        assert entry["specs"] == {"low": axis, "sub_scales": axis, "d": axis}, name
