"""Projections: a step's rows times a layer's weights, behind one dispatch chosen once at build time.

A projection takes rows [M, K] (the step's M tokens, already in the weight's dtype) and a weight [K, N],
or [N, K] when `transposed` (a tied embedding serving as the head, contracted on the axis where it lies),
and returns float32 [M, N]; the model adds the bias and casts back. Implementations:

  reference  XLA's own dots (reference.py): the specification, any backend, any dtype
  cpu        the C++ small matmul (cpu.py, cpu_matmul.cc), for decode-sized M on a process with one CPU
             device: each weight element read once at its stored width (XLA:CPU widens a whole 16-bit
             weight to float32 before a dot with few rows, issue #16), and several weights by the same
             rows (a layer's q, k and v) in one call whose threads share the work

Data flow: the engine's builder calls `choose_matmul` once (platform, device count, whether the kernel
builds here) and hands the `MatmulPlan` to `build_model` beside the attention dispatch; every Linear
keeps it and calls it while the step is traced. The plan is an ordered tuple of entries, the reference
last: the first entry that `serves` a call (by its number of rows and its weights, both known at trace
time) computes it, so a compiled step holds one fixed kernel per projection.

A new variant is a new entry, never a new flag on the calls: a module with the reference's contract for
the weights it serves, and an entry (`MatmulEntry`: `serves`, `__call__`, `joins_weights`) that
`choose_matmul` puts ahead of those it should win over. Quantized weights (int8 / int4 with their
scales, issue 25) are a weight type of their own, which their entry's `serves` recognizes; LoRA (issue
28) is an entry whose weight type carries the adapters beside the base weight, computing the base
product through the entry that serves the base weight and adding the adapters' low-rank products.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import jax.numpy as jnp

from pallas_kernels.matmul import cpu, kquant, kquant_cpu, quantized, quantized_cpu, quantized_gpu, reference
from pallas_kernels.matmul.row_blocks import ROW_INVARIANT_ROWS, in_row_blocks, tracing_verify_rows


def _bfloat16_max_rows() -> int:
    """bfloat16 rows the kernel serves of weights stored [K, N] or [N, K]: all of a decode step's (64, the kernel's
    limit and the default largest decode bucket) unless XLA's own bfloat16 dots run on AMX tiles here (YNNPACK on
    AMX: twice the kernel's float32 FMAs from 16 rows on, measured before the kernel had vdpbf16ps; issue #29);
    the kernel's own AMX tiles take more where the library has them (small_matmul_entry). With
    AVX-512 BF16 the kernel's passes run on vdpbf16ps as XLA's do (cpu_matmul_bf16_pairs.h: as fast as
    XLA's dots at 16-64 rows, its tied head faster); on AVX2-only CPUs XLA widens or runs bfloat16 slowly,
    and the kernel's widen-in-registers tiles keep bfloat16 batches at least as fast per row as float32.
    The kernel's path follows JAXSERVE_CPU_KERNEL_PATH, so an avx2 run on an AVX-512 machine routes as an
    AVX2 machine would."""
    from pallas_kernels import cpu_library

    try:
        path = cpu_library.chosen_path()
    except ValueError:  # a bad JAXSERVE_CPU_KERNEL_PATH: loading the kernel reports it
        return 8
    return 8 if path == "avx512" and "amx_bf16" in cpu_library.cpu_flags() else cpu.MATMUL_MAX_ROWS


# Rows up to which the CPU kernel serves a dot in one call. Every decode and verify step's rows (up to 64, the default
# largest decode bucket) and prefill chunks 256 rows a call (cpu.MATMUL_MAX_ROWS) in float32 and float16, so that a
# row's projections are the same bits in a 1-row decode step, a batched one, a speculative verify step and a prefill
# chunk (issue 26: greedy outputs identical with speculation on and off; the kernel's rows do not depend on the
# call's row count, cpu_matmul.cc "Row invariance", where XLA's dots sum in their own order). Until session 16
# float32 stopped at eight rows (XLA's GEMMs were faster above; docs/notes/cpu-kernels.md has the cost now); until
# session 20 prefill chunks went 64 rows a call (each 64 rows read every weight again: a 192-token prefill's
# projections took 1.1-1.35x as long). bfloat16: see _bfloat16_max_rows.
SMALL_MATMUL_MAX_ROWS = {
    jnp.dtype(jnp.bfloat16): _bfloat16_max_rows(),
    jnp.dtype(jnp.float16): cpu.MATMUL_MAX_ROWS,
    jnp.dtype(jnp.float32): cpu.MATMUL_MAX_ROWS,
}


class MatmulEntry(Protocol):
    """One implementation in a plan: which calls it serves, and the calls."""

    joins_weights: ClassVar[bool]  # several weights by the same rows in one call pays (threads share the work)

    def serves(self, num_rows: int, weights: tuple) -> bool:
        """Whether this entry computes rows [num_rows, K] by these weights; decided at trace time."""
        ...

    def __call__(self, rows, weights: tuple, *, transposed: bool) -> tuple:
        """rows [M, K] by each weight [K, N_i] ([N_i, K] transposed) -> float32 [M, N_i] each."""
        ...


@dataclass(frozen=True)
class ReferenceMatmul:
    """XLA's dots, one weight at a time: serves every call."""

    joins_weights: ClassVar[bool] = False

    def serves(self, num_rows: int, weights: tuple) -> bool:
        return True

    def __call__(self, rows, weights: tuple, *, transposed: bool) -> tuple:
        return tuple(reference.matmul(rows, weight, transposed=transposed) for weight in weights)


@dataclass(frozen=True)
class SmallMatmul:
    """The C++ kernel, for up to `max_rows` rows of weights in one of the dtypes it serves; a dtype it serves
    for every decode-sized call (ROW_INVARIANT_ROWS) it serves for any rows, as many a call as it takes
    (row_blocks.py). `invariant_rows`: dtypes whose rows above a count are not the bits of their one-row calls
    (bfloat16 on AMX tiles above a walk's 8 rows, cpu_matmul_amx.h): a verify step's rows go in blocks of that
    many, as a decode step of that many sequences computes them."""

    max_rows: tuple[tuple[str, int], ...]  # (weight dtype, rows up to which the kernel serves it)
    invariant_rows: tuple[tuple[str, int], ...] = ()  # (weight dtype, rows up to which a row is its one-row call's)
    joins_weights: ClassVar[bool] = True

    def serves(self, num_rows: int, weights: tuple) -> bool:
        dtype = str(jnp.dtype(weights[0].dtype))
        if any(str(jnp.dtype(weight.dtype)) != dtype for weight in weights):
            return False
        limit = self._limit(weights)
        return num_rows <= limit or limit >= ROW_INVARIANT_ROWS or (limit > 0 and tracing_verify_rows())

    def __call__(self, rows, weights: tuple, *, transposed: bool) -> tuple:
        compute = lambda block: cpu.small_matmuls(block, weights, transposed=transposed)  # noqa: E731
        return in_row_blocks(compute, rows, block=self._block(weights))

    def normed(self, rows, scale, eps: float, weights: tuple) -> tuple:
        """RMSNorm(rows; scale, eps) by each weight [K, N_i], the norm inside the kernel's call."""
        compute = lambda block: cpu.small_matmuls_normed(block, scale, eps, weights)  # noqa: E731
        return in_row_blocks(compute, rows, block=self._block(weights))

    def gated(self, activation: str, gate, up, weights: tuple) -> tuple | None:
        """activation(gate) * up (gate and up: float32 projections) by each weight [F, N_i], the activation inside
        the kernel's call; None for an activation it does not compute."""
        if activation not in cpu.GATED_ACTIVATIONS:
            return None
        compute = lambda gate, up: cpu.small_matmuls_gated(gate, up, weights)  # noqa: E731
        return in_row_blocks(compute, gate, up, block=self._block(weights))

    def _limit(self, weights: tuple) -> int:
        return dict(self.max_rows).get(str(jnp.dtype(weights[0].dtype)), 0)

    def _block(self, weights: tuple) -> int:
        limit = self._limit(weights)
        if tracing_verify_rows():
            limit = dict(self.invariant_rows).get(str(jnp.dtype(weights[0].dtype)), limit)
        return min(limit, cpu.MATMUL_MAX_ROWS)

    def panel_dtypes(self) -> tuple:
        """The weight dtypes to store in column panels (panels.py): those the kernel reads so and serves at every
        row count (a bfloat16 prefill that XLA's AMX dots served would contract the panels at a third of the
        speed, session 32: bfloat16 on AMX CPUs only with the kernel's own AMX tiles, session 33)."""
        served = {jnp.dtype(dtype) for dtype, rows in self.max_rows if rows >= cpu.MATMUL_MAX_ROWS}
        return tuple(dtype for dtype in cpu.panel_dtypes() if dtype in served)


@dataclass(frozen=True)
class QuantizedReferenceMatmul:
    """Quantized weights (quantized.py) with XLA's dots, any backend: serves every call with a quantized weight
    among its weights (a float one beside it, as a GGUF file may mix them, is projected by the reference).
    `activations` (QuantizedWeight) and `kquant_activations` (K-quants): int8 where the plan's CPU kernel for
    that weight type rounds x to int8, so rows past the kernel's limit (prefill chunks) are computed as the
    kernel computes decode rows (int8_activations.py); float: the dequantized product."""

    activations: str = "float"
    kquant_activations: str = "float"
    joins_weights: ClassVar[bool] = False

    def serves(self, num_rows: int, weights: tuple) -> bool:
        return any(quantized.is_quantized(weight) for weight in weights)

    def __call__(self, rows, weights: tuple, *, transposed: bool) -> tuple:
        return tuple(self._one(rows, weight, transposed) for weight in weights)

    def _one(self, rows, weight, transposed: bool):
        if not quantized.is_quantized(weight):
            return reference.matmul(rows, weight, transposed=transposed)
        activations = self.kquant_activations if kquant.is_kquant(weight) else self.activations
        return quantized.matmul(rows, weight, transposed=transposed, activations=activations)


@dataclass(frozen=True)
class QuantizedPallasMatmul:
    """Quantized weights by the Pallas (Triton) kernel on one GPU (quantized_gpu.py), for decode-sized rows: each
    weight read once at its stored width. Calls where XLA's dots measured faster (one row of int8) or the kernel
    cannot take the weight (K-quants, odd sizes), and float weights beside them, go to XLA's dots."""

    joins_weights: ClassVar[bool] = False

    def serves(self, num_rows: int, weights: tuple) -> bool:
        return num_rows <= quantized_gpu.MAX_ROWS and any(quantized.is_quantized(weight) for weight in weights)

    def __call__(self, rows, weights: tuple, *, transposed: bool) -> tuple:
        return tuple(self._one(rows, weight, transposed) for weight in weights)

    def _one(self, rows, weight, transposed: bool):
        if not transposed and quantized_gpu.preferred(weight, rows.shape[0]):
            return quantized_gpu.quantized_matmul(rows, weight)
        return QuantizedReferenceMatmul()._one(rows, weight, transposed)


@dataclass(frozen=True)
class MatmulPlan:
    """The projections' kernels for this engine, as the model calls them (models/layers.py's `Matmul`)."""

    entries: tuple[MatmulEntry, ...]  # tried in order; the last, the reference, serves every call

    def __call__(self, rows, weight, *, transposed: bool = False):
        """rows [M, K] @ weight [K, N] (weight [N, K] when transposed) -> float32 [M, N]."""
        weights = (weight,)
        return self._entry(rows.shape[0], weights)(rows, weights, transposed=transposed)[0]

    def together(self, rows, weights) -> tuple | None:
        """rows [M, K] by several weights [K, N_i] in one call where the serving entry joins them -> float32
        [M, N_i] each; None where each weight is better projected on its own."""
        weights = tuple(weights)
        entry = self._entry(rows.shape[0], weights)
        return entry(rows, weights, transposed=False) if entry.joins_weights else None

    def together_normed(self, rows, scale, eps: float, weights) -> tuple | None:
        """RMSNorm(rows) (in float32, rounded to rows' dtype, times `scale`: models/layers.py's RMSNorm) by several
        weights [K, N_i] in one call where the serving entry takes the norm into it (the CPU float and int8-dot kernels:
        a decode step's norm is four XLA thunks between two calls) -> float32 [M, N_i] each; None where the caller normalizes."""
        weights = tuple(weights)
        entry = self._entry(rows.shape[0], weights)
        normed = getattr(entry, "normed", None) if getattr(entry, "takes_norm", True) else None
        return None if normed is None else normed(rows, scale, eps, weights)

    def gated(self, activation: str, gate, up, weight):
        """activation(gate) * up (float32 [M, F] each: the gate and up projections' results, rounded to the
        weight's dtype as models/layers.py's gated_activation rounds them) by the down weight [F, N] in one call
        where the serving entry takes the activation into it (the CPU float kernel, silu) -> float32 [M, N]; None
        where the caller computes the activation."""
        entry = self._entry(gate.shape[0], (weight,))
        gated = getattr(entry, "gated", None)
        ys = None if gated is None else gated(activation, gate, up, (weight,))
        return None if ys is None else ys[0]

    def _entry(self, num_rows: int, weights: tuple) -> MatmulEntry:
        return next(entry for entry in self.entries if entry.serves(num_rows, weights))

    @property
    def panel_dtypes(self) -> tuple:
        """The float weight dtypes this plan's kernel wants in column panels (device/panel_weights.py); none
        without the CPU kernel."""
        return next((entry.panel_dtypes() for entry in self.entries if isinstance(entry, SmallMatmul)), ())

    @property
    def tiles_quantized(self) -> bool:
        """Whether this plan's quantized weights go to the CPU int8-dot kernel, which reads them fastest in tiles
        (quantized_tiles.py; device/panel_weights.py moves them at load)."""
        return any(
            isinstance(entry, quantized_cpu.QuantizedSmallMatmul) and entry.activations == "int8"
            for entry in self.entries
        )

    @property
    def has_cpu_kernel(self) -> bool:
        """Float weights go to the CPU kernel, whose rows come out alike in a call of any size (XLA's dots and
        ragged_dot add a row's terms in another order as the row count changes)."""
        return any(isinstance(entry, SmallMatmul) for entry in self.entries)


def small_matmul_entry() -> SmallMatmul:
    """The CPU kernel's entry: SMALL_MATMUL_MAX_ROWS, and bfloat16 at every row count where the library runs it on
    AMX tiles above a walk's rows (cpu.amx_tiles; known once the library is built, which importing this module
    does not do), those rows then not their one-row calls' bits."""
    max_rows = {str(dtype): rows for dtype, rows in SMALL_MATMUL_MAX_ROWS.items()}
    invariant_rows = {}
    if cpu.amx_tiles():
        invariant_rows["bfloat16"] = max_rows["bfloat16"]
        max_rows["bfloat16"] = cpu.MATMUL_MAX_ROWS
    return SmallMatmul(tuple(max_rows.items()), tuple(invariant_rows.items()))


def choose_matmul(platform: str, num_devices: int, quantized_activations: str = "int8") -> MatmulPlan:
    """The plan for an engine on `platform` in a process with `num_devices` devices: the CPU kernel for
    decode-sized rows (SMALL_MATMUL_MAX_ROWS by dtype) where there is one CPU device and the kernel
    builds, the reference for everything else. With several devices a weight may be sharded over them,
    and the kernel is a custom call XLA's partitioner cannot split. `quantized_activations` (the engine
    option: int8 | float) picks the CPU quantized kernel's treatment of x (quantized_cpu.py)."""
    entries: tuple[MatmulEntry, ...] = (ReferenceMatmul(),)
    if platform == "cpu" and num_devices == 1 and cpu.available():
        entries = (small_matmul_entry(), *entries)
    # ahead: the others take float weights
    entries = (*quantized_entries(platform, num_devices, quantized_activations), *entries)
    return MatmulPlan(entries)


def quantized_entries(platform: str, num_devices: int, activations: str = "int8") -> tuple[MatmulEntry, ...]:
    """The entries for quantized weights, ahead of the float ones: the CPU kernel where it serves (quantized_cpu.py,
    x kept as `activations` says: decode-sized rows; with int8 prefill chunks too, PLAN_MAX_ROWS), on one GPU the
    Pallas kernel for decode rows (quantized_gpu.py), XLA's dots for the rest."""
    quantized_cpu.check_activations(activations)  # refused on every platform, not only where the kernel runs
    kernels: tuple[MatmulEntry, ...] = ()
    # x as the kernels treat it, in the reference too (rows past their limit), where the kernels run
    reference_activations = kquant_reference_activations = "float"
    if platform == "cpu" and num_devices == 1 and kquant_cpu.available():  # GGUF K-quants (kquant.py)
        kernels += (kquant_cpu.KQuantSmallMatmul(kquant_cpu.KERNEL_MAX_ROWS, activations),)
        kquant_reference_activations = activations if kquant_cpu.computes_int8() else "float"
    if platform == "cpu" and num_devices == 1 and quantized_cpu.available(activations):
        kernels += (quantized_cpu.QuantizedSmallMatmul(quantized_cpu.PLAN_MAX_ROWS[activations], activations),)
        reference_activations = activations
    if platform == "gpu" and num_devices == 1:
        kernels += (QuantizedPallasMatmul(),)
    return (*kernels, QuantizedReferenceMatmul(reference_activations, kquant_reference_activations))


# XLA's dots only: any backend, any placement of the weights
REFERENCE_PLAN = MatmulPlan((QuantizedReferenceMatmul(), ReferenceMatmul()))

__all__ = [
    "REFERENCE_PLAN",
    "SMALL_MATMUL_MAX_ROWS",
    "MatmulEntry",
    "MatmulPlan",
    "QuantizedPallasMatmul",
    "QuantizedReferenceMatmul",
    "ReferenceMatmul",
    "SmallMatmul",
    "choose_matmul",
    "small_matmul_entry",
]
