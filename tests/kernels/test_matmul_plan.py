"""The projections' dispatch (pallas_kernels/matmul): which entry the builder's plan holds where, which entry
serves a call, the reference's exact lowering (the HLO a step had before the dispatch existed), and that the
models name no kernel."""

import ast
import pathlib
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.layers import project
from pallas_kernels import cpu_library
from pallas_kernels.matmul import (
    REFERENCE_PLAN,
    SMALL_MATMUL_MAX_ROWS,
    MatmulPlan,
    QuantizedPallasMatmul,
    QuantizedReferenceMatmul,
    ReferenceMatmul,
    SmallMatmul,
    choose_matmul,
    cpu,
    kquant_cpu,
    quantized_cpu,
    reference,
    small_matmul_entry,
)
from pallas_kernels.matmul.row_blocks import ROW_INVARIANT_ROWS

MODELS = pathlib.Path(__file__).resolve().parents[2] / "jaxserve" / "models"


def test_the_plan_takes_the_kernel_only_on_a_one_device_cpu_process():
    cpu_plan = choose_matmul("cpu", 1)
    # first: they take only quantized weights (K-quant planes, then the int8 / 4-bit groups)
    quantized_entries = [kquant_cpu.KQuantSmallMatmul, quantized_cpu.QuantizedSmallMatmul, QuantizedReferenceMatmul]
    assert [type(entry) for entry in cpu_plan.entries] == [*quantized_entries, SmallMatmul, ReferenceMatmul]
    assert cpu_plan.entries[3] == small_matmul_entry()
    # several devices (a mesh, or fake CPU devices): weights may be sharded, which the custom call cannot split
    for platform, num_devices in [("cpu", 8), ("gpu", 2), ("tpu", 4)]:
        assert choose_matmul(platform, num_devices) == REFERENCE_PLAN
    # one GPU: the Pallas quantized kernel ahead of XLA's dots (test_quantized_gpu_matmul.py)
    assert choose_matmul("gpu", 1) == MatmulPlan((QuantizedPallasMatmul(), *REFERENCE_PLAN.entries))


def test_the_plan_falls_back_to_the_reference_without_a_compiler(monkeypatch, tmp_path):
    cpu_library.load.cache_clear()
    cpu_library.register.cache_clear()
    try:
        with monkeypatch.context() as patch:
            patch.setattr(cpu_library, "CACHE_DIR", str(tmp_path))
            patch.setattr(cpu_library.shutil, "which", lambda name: None)
            assert choose_matmul("cpu", 1) == REFERENCE_PLAN
    finally:
        cpu_library.load.cache_clear()
        cpu_library.register.cache_clear()
    assert choose_matmul("cpu", 1) != REFERENCE_PLAN  # built again once a compiler is back


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_the_kernel_serves_up_to_its_rows_and_joins_weights_only_there(dtype):
    plan = choose_matmul("cpu", 1)
    max_rows = dict(small_matmul_entry().max_rows)[str(jnp.dtype(dtype))]
    weights = [jnp.ones((16, 8), dtype), jnp.ones((16, 4), dtype)]
    for num_rows in (1, max_rows, max_rows + 1, 150, 2 * cpu.MATMUL_MAX_ROWS + 1):
        rows = jnp.ones((num_rows, 16), dtype)
        hlo = jax.jit(lambda rows, *ws: plan.together(rows, ws) or ()).lower(rows, *weights).as_text()
        # a dtype served for every decode-sized call is served for any rows, as many a call as the kernel takes
        # (row_blocks.py): a prefill chunk of up to MATMUL_MAX_ROWS rows in one call
        calls = 1 if num_rows <= max_rows else (-(-num_rows // max_rows) if max_rows >= ROW_INVARIANT_ROWS else 0)
        assert hlo.count(f"@{cpu.MATMUL_TARGET}(") == calls
        assert REFERENCE_PLAN.together(rows, weights) is None  # XLA's dots: one weight at a time
    # weights of different dtypes never share a kernel call
    mixed = [jnp.ones((16, 8), dtype), jnp.ones((16, 4), jnp.float32 if dtype != jnp.float32 else jnp.bfloat16)]
    assert plan.together(jnp.ones((1, 16), dtype), mixed) is None


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("num_rows", [1, 3, 20])
def test_both_plans_compute_the_product(dtype, transposed, num_rows):
    rng = np.random.default_rng(0)
    rows = jnp.asarray(rng.standard_normal((num_rows, 40)), dtype)
    weight = jnp.asarray(rng.standard_normal((24, 40) if transposed else (40, 24)), dtype)
    wide = np.asarray(weight, np.float64)
    expected = np.asarray(rows, np.float64) @ (wide.T if transposed else wide)
    for plan in (REFERENCE_PLAN, choose_matmul("cpu", 1)):
        got = jax.jit(lambda r, w, plan=plan: plan(r, w, transposed=transposed))(rows, weight)
        assert got.dtype == jnp.float32 and got.shape == (num_rows, 24)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-4 * np.sqrt(40))


def test_rows_past_the_invariant_ones_go_in_one_call_but_verify_rows_in_blocks():
    """SmallMatmul.invariant_rows (bfloat16 on AMX tiles, cpu_matmul_amx.h): calls of up to 256 rows, but a verify
    step's rows in blocks of the invariant rows, which each row computes as its one-row call does."""
    from pallas_kernels.matmul.row_blocks import verify_rows

    entry = SmallMatmul(max_rows=(("bfloat16", cpu.MATMUL_MAX_ROWS),), invariant_rows=(("bfloat16", 8),))
    weight = jnp.ones((16, 40), jnp.bfloat16)
    # panels wherever the library builds (AVX-512 BF16 CPUs' vdpbf16ps pairs read panels too)
    assert (jnp.dtype(jnp.bfloat16) in cpu.panel_dtypes()) == cpu.available()
    assert entry.serves(200, (weight,)) and (jnp.dtype(jnp.bfloat16) in entry.panel_dtypes()) == cpu.available()
    assert jnp.dtype(jnp.bfloat16) not in SmallMatmul(max_rows=(("bfloat16", 8),)).panel_dtypes()

    def calls(num_rows: int, verify: bool) -> int:
        def step(rows, weight):
            if not verify:
                return entry(rows, (weight,), transposed=False)
            with verify_rows():
                return entry(rows, (weight,), transposed=False)

        rows = jnp.ones((num_rows, 16), jnp.bfloat16)
        return jax.jit(step).lower(rows, weight).as_text().count(f"@{cpu.MATMUL_TARGET}(")

    assert [calls(n, verify=False) for n in (8, 9, 64, 256, 300)] == [1, 1, 1, 1, 2]
    assert [calls(n, verify=True) for n in (8, 9, 40)] == [1, 2, 5]


def test_the_cpu_entry_takes_bfloat16_on_amx_tiles_where_the_library_has_them():
    entry = small_matmul_entry()
    rows = dict(entry.max_rows)
    if cpu.amx_tiles():
        assert rows["bfloat16"] == cpu.MATMUL_MAX_ROWS and dict(entry.invariant_rows) == {"bfloat16": 8}
    else:
        assert rows == {str(dtype): rows for dtype, rows in SMALL_MATMUL_MAX_ROWS.items()} and not entry.invariant_rows


def _lowered(fn, *args) -> str:
    """The lowered module without its first line, which names the Python function."""
    return jax.jit(fn).lower(*args).as_text().split("\n", 1)[1]


def test_the_reference_lowers_as_the_model_did_before_the_dispatch():
    """The forms XLA:CPU computes best (issue #16), kept op for op: a float32 tied head is jnp.dot(x, E.T)
    (as nnx's Embed.attend); a 16-bit weight is contracted where it lies, asking for float32, with one row
    padded to two."""
    x32, embedding32 = jnp.ones((3, 8), jnp.float32), jnp.ones((50, 8), jnp.float32)
    assert _lowered(lambda x, e: reference.matmul(x, e, transposed=True), x32, embedding32) == _lowered(
        lambda x, e: jnp.dot(x, e.T), x32, embedding32
    )
    x16, embedding16 = jnp.ones((1, 8), jnp.bfloat16), jnp.ones((50, 8), jnp.bfloat16)

    def as_before(x, e):
        padded = jnp.pad(x, ((0, 1), (0, 0)))
        y = jax.lax.dot_general(padded, e, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return y[:1]

    assert _lowered(lambda x, e: reference.matmul(x, e, transposed=True), x16, embedding16) == _lowered(
        as_before, x16, embedding16
    )
    assert "transpose" not in _lowered(lambda x, e: reference.matmul(x, e, transposed=True), x16, embedding16)


@dataclass(frozen=True)
class DoubledSmallMatmul:
    """A stand-in for a new variant (a quantized kernel, say): it serves float32 weights for up to two rows."""

    joins_weights: ClassVar[bool] = False

    def serves(self, num_rows: int, weights: tuple) -> bool:
        return num_rows <= 2 and all(w.dtype == jnp.float32 for w in weights)

    def __call__(self, rows, weights: tuple, *, transposed: bool) -> tuple:
        return tuple(2 * reference.matmul(rows, w, transposed=transposed) for w in weights)


def test_a_new_entry_plugs_in_ahead_of_the_reference_with_no_change_to_the_model():
    plan = MatmulPlan((DoubledSmallMatmul(), ReferenceMatmul()))
    weight = jnp.asarray(np.random.default_rng(1).standard_normal((8, 4)), jnp.float32)
    for num_rows, factor in [(2, 2.0), (3, 1.0)]:
        x = jnp.ones((num_rows, 8), jnp.float32)
        got = project(x, weight, matmul=plan)
        np.testing.assert_allclose(np.asarray(got), factor * np.asarray(x @ weight), rtol=1e-6)


def test_models_import_no_kernel():
    """models/ holds math only: kernels reach it as the functions and plans it is built with."""
    imported = []
    for path in MODELS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                imported.append((path.name, node.module or ""))
            elif isinstance(node, ast.Import):
                imported += [(path.name, alias.name) for alias in node.names]
    assert any(module == "jaxserve.models.layers" for _, module in imported)  # the walk sees the imports
    # The one exception is the quantized KV pages' layout (a pytree of values and scales): a data type
    # defined beside the kernels that read it, which the cache allocates; no kernel comes with it.
    layout = "pallas_kernels.paged_attention.kv_quantization"
    kernels = [(name, module) for name, module in imported if module.startswith("pallas_kernels") and module != layout]
    assert kernels == []
