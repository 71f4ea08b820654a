"""Quantized projections for decode-sized rows as a Pallas (Triton) kernel: the weight read at its stored width.

The XLA reference (quantized.py) dots a decode step's rows with the integers group by group as 16-bit floats
([M, G, N] group sums), which leaves the widening and the per-group products to XLA's fusions. This kernel
loads each block of integers once, widens it in registers and folds its group's scale into float32 partial
sums, so a decode step reads one byte per int8 weight and half a byte per 4-bit one and writes nothing but
[S, rows, N] sums (issue 25: bytes per token against the roofline on a GPU).

Layout (quantized.py): q int8 [K, N], or 4-bit packed two rows a byte ([K / 2, N], byte i holds rows 2i
(low nibble) and 2i + 1 (high)); scales (and mins) [G, N]. The 4-bit rows are never interleaved back:
the rows' even and odd columns (x[:, 0::2], x[:, 1::2], cut outside the kernel: x is small) multiply
the low and high nibbles, two products that add up to the dot over the group.

Grid: (column block, K split). A decode step has few rows, so the columns alone give too few programs to
keep a GPU's cores reading (a 4096-wide weight in 128-column blocks is 32 programs for 132 cores): K is
cut into `num_splits` parts whose float32 partial sums [S, rows, N] are added outside, as flash-decoding
splits a context. Within a program, a loop over the split's groups (one group without mins, as per-channel
int8: blocks of up to 256 rows, the scale applied once at the end): a group's integers widened to the rows' dtype, one matmul
into float32, times the group's scale, plus the group's row sums times its mins where the source has
them. Rows are padded to 16 for the matmul units, one row too: a vector product for one row (no padding)
measured 1.5-1.7x slower.

Where it pays (an H200, against XLA's dots on the same weights, docs/notes/quantization.md "GPU"): 4-bit
weights at any decode rows (one row of a 4096 x 14336 Q4_0: 77.5 us against 150; 32 rows: 79 against 221)
and int8 from two rows (32 rows: 84 against 163 us); one row of int8 stays with XLA (77 against 82 us),
which fuses the widening into its own dot there (`preferred`). Neither path reads at the memory's
bandwidth yet: the kernel's best is about a quarter of a copy's bytes per second (a bfloat16 dot by XLA
reads at 0.6-0.9 of it), so a quantized model on a GPU saves memory, not decode time.

Not row-invariant: a row's sums depend on the call's rows (splits and column blocks change above 16 rows, and
one row of int8 goes to XLA), as XLA's GPU dots' do.

Lowered with Triton on a GPU (power-of-two tiles: column blocks of 128 / 64 / 32 / 16, groups of
32 to 256 along K); on the CPU it runs with interpret=True (the tests). `supported` says why a weight
cannot take it (the reference serves those calls).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.matmul.quantized import QuantizedWeight

MAX_ROWS = 64  # a decode or verify step's rows (the default largest decode bucket)
MAX_GROUP = 256  # K rows of a group a loop step holds in registers
MIN_DOT_ROWS = 16  # matmul tiles on GPUs want at least 16 rows
PER_CHANNEL_BLOCK = 256  # K rows a loop step reads of a per-channel int8 weight
# K splits aim for this many programs per GPU core (SM), and column blocks are the widest of COLUMN_BLOCKS that
# divides N; with up to 16 rows, narrower blocks (from 64) and 16 programs a core: measured on an H200
# (bench/quantized_gpu_matmul.py --sweep, docs/notes/quantization.md "GPU"): one row of a 4096 x 14336 Q4_0 weight
# 77.5 us at 64 columns and 16 programs a core against 105 at 128 and 4; 32 rows best at 128 and 2 (84 vs 101 us)
PROGRAMS_PER_CORE = 2
FEW_ROWS_PROGRAMS_PER_CORE = 16
COLUMN_BLOCKS = (128, 64, 32, 16)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(weight, num_rows: int) -> str | None:
    """Why the kernel cannot compute rows [num_rows, K] @ weight (None: it can)."""
    if not isinstance(weight, QuantizedWeight):
        return "the kernel reads QuantizedWeight (GGUF K-quants' two-level blocks take the reference)"
    if weight.values.ndim != 2:
        return f"a projection takes a 2-d weight, got {weight.shape}"
    if num_rows > MAX_ROWS:
        return f"{num_rows} rows: the kernel serves decode-sized steps (up to {MAX_ROWS})"
    depth, columns = weight.shape
    if not any(columns % block == 0 for block in COLUMN_BLOCKS):
        return f"N = {columns} is not a multiple of {COLUMN_BLOCKS[-1]}"
    group = depth // weight.num_groups
    if _grouped(weight) and not (_is_power_of_two(group) and 32 <= group <= MAX_GROUP):
        return f"groups of {group} along K: the kernel takes power-of-two groups of 32 to {MAX_GROUP}"
    if weight.num_groups == 1 and _per_channel_block(depth) is None:
        return f"K = {depth} is not a multiple of 32"
    return None


def preferred(weight, num_rows: int) -> bool:
    """Whether the kernel computes this call faster than XLA's dots (measured; the module's docstring): every
    supported 4-bit call, and int8 from two rows."""
    return supported(weight, num_rows) is None and (weight.bits == 4 or num_rows > 1)


def _grouped(weight: QuantizedWeight) -> bool:
    """Scales (and mins) applied group by group in the loop; one group without mins: once, at the end, as a
    per-channel int8 weight's (its K then walked in blocks of up to 256)."""
    return weight.num_groups > 1 or weight.mins is not None


def _per_channel_block(depth: int) -> int | None:
    return next((block for block in (256, 128, 64, 32) if depth % block == 0), None)


def _kernel(x_ref, *refs, block: int, steps: int, bits: int, grouped: bool, has_mins: bool, offset: float):
    """One (column block, K split): float32 partial sums [rows, columns] of the split's groups."""
    if has_mins:
        values_ref, scales_ref, mins_ref, sums_ref, out_ref = refs
    else:
        (values_ref, scales_ref, out_ref), mins_ref, sums_ref = refs, None, None
    dtype = x_ref.dtype
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None  # no TF32 for float32
    rows, columns = out_ref.shape
    packed = block // 2 if bits == 4 else block  # stored rows a step reads

    def product(start, size, q_block):  # x's columns [start, start + size) by the widened integers
        x_block = x_ref[:, pl.ds(start, size)]
        return jnp.dot(x_block, q_block.astype(dtype), preferred_element_type=jnp.float32, precision=precision)

    def step(index, accumulator):
        stored = values_ref[pl.ds(index * packed, packed), :]
        if bits == 8:
            part = product(index * block, block, stored)
        else:  # x_ref holds [even columns | odd columns], each K_split / 2 wide
            low = (stored & 0xF).astype(jnp.float32) - offset
            high = (stored >> 4).astype(jnp.float32) - offset
            part = product(index * packed, packed, low) + product(steps * packed + index * packed, packed, high)
        if grouped:
            part = part * scales_ref[pl.ds(index, 1), :].astype(jnp.float32)
            if mins_ref is not None:
                assert sums_ref is not None
                part = part + sums_ref[:, pl.ds(index, 1)] * mins_ref[pl.ds(index, 1), :].astype(jnp.float32)
        return accumulator + part

    accumulator = jax.lax.fori_loop(0, steps, step, jnp.zeros((rows, columns), jnp.float32))
    if not grouped:
        accumulator = accumulator * scales_ref[...].astype(jnp.float32)
    out_ref[...] = accumulator


def default_num_splits(
    column_blocks: int, steps: int, cores: int | None = None, programs_per_core: int = PROGRAMS_PER_CORE
) -> int:
    """K splits (a divisor of the loop's steps) so that column blocks x splits covers the GPU's cores about
    `programs_per_core` times; one on a CPU, where interpret mode runs programs one after another."""
    if cores is None:
        cores = getattr(jax.devices()[0], "core_count", 0) if jax.default_backend() == "gpu" else 0
    if not cores:
        return 1
    want = max(1, (programs_per_core * cores) // column_blocks)
    return max(d for d in range(1, steps + 1) if steps % d == 0 and d <= want)


@functools.partial(jax.jit, static_argnames=("num_splits", "block_columns", "interpret", "programs_per_core"))
def quantized_matmul(
    rows,
    weight: QuantizedWeight,
    *,
    num_splits: int | None = None,
    block_columns: int | None = None,
    interpret: bool | None = None,
    programs_per_core: int | None = None,
):
    """rows [M, K] @ weight [K, N] -> float32 [M, N], M <= MAX_ROWS; the reference's contract (quantized.matmul
    with float activations)."""
    reason = supported(weight, rows.shape[0])
    if reason:
        raise ValueError(reason)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    num_rows, depth = rows.shape
    if depth != weight.shape[0]:
        raise ValueError(f"rows {rows.shape} do not contract with a quantized weight {weight.shape}")
    columns = weight.shape[1]
    groups = weight.num_groups
    grouped = _grouped(weight)
    block = depth // groups if grouped else _per_channel_block(depth)
    assert block is not None
    total_steps = depth // block
    few_rows = num_rows <= MIN_DOT_ROWS
    block_columns = block_columns or next(
        b for b in (COLUMN_BLOCKS[1:] if few_rows else COLUMN_BLOCKS) if columns % b == 0
    )
    programs_per_core = programs_per_core or (FEW_ROWS_PROGRAMS_PER_CORE if few_rows else PROGRAMS_PER_CORE)
    if columns % block_columns:
        raise ValueError(f"block_columns {block_columns} does not divide N = {columns}")
    column_blocks = columns // block_columns
    num_splits = num_splits or default_num_splits(column_blocks, total_steps, programs_per_core=programs_per_core)
    if total_steps % num_splits:
        raise ValueError(f"{num_splits} K splits do not divide {total_steps} steps of {block} rows")
    steps = total_steps // num_splits
    split_depth = depth // num_splits
    padded_rows = max(MIN_DOT_ROWS, 1 << (num_rows - 1).bit_length())
    x = jnp.pad(rows, ((0, padded_rows - num_rows), (0, 0)))
    if weight.bits == 4:  # each split's even columns, then its odd ones: [rows, S, 2, K / 2S]
        x = x.reshape(padded_rows, num_splits, split_depth // 2, 2).transpose(0, 1, 3, 2).reshape(padded_rows, depth)
    stored_split = split_depth // 2 if weight.bits == 4 else split_depth
    x_spec = pl.BlockSpec((padded_rows, split_depth), lambda j, s: (0, s))
    scale_rows = steps if grouped else 1
    in_specs = [
        x_spec,
        pl.BlockSpec((stored_split, block_columns), lambda j, s: (s, j)),
        pl.BlockSpec((scale_rows, block_columns), lambda j, s: (s if grouped else 0, j)),
    ]
    operands = [x, weight.values, weight.scales]
    has_mins = weight.mins is not None
    if has_mins:  # the rows' sums per group times the mins: [rows, G]
        sums = jnp.sum(rows.astype(jnp.float32).reshape(num_rows, groups, block), axis=-1)
        sums = jnp.pad(sums, ((0, padded_rows - num_rows), (0, 0)))
        in_specs += [
            pl.BlockSpec((steps, block_columns), lambda j, s: (s, j)),
            pl.BlockSpec((padded_rows, steps), lambda j, s: (0, s)),
        ]
        operands += [weight.mins, sums]
    kernel = functools.partial(
        _kernel,
        block=block,
        steps=steps,
        bits=weight.bits,
        grouped=grouped,
        has_mins=has_mins,
        offset=0.0 if has_mins or weight.bits == 8 else 8.0,
    )
    partials = pl.pallas_call(
        kernel,
        grid=(column_blocks, num_splits),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, padded_rows, block_columns), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((num_splits, padded_rows, columns), jnp.float32),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),
    )(*operands)
    return partials.sum(axis=0)[:num_rows]
