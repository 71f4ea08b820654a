"""Quantized weights: a weight type of their own, and the XLA projection that reads them (the reference).

One layout covers int8 per output channel, int4 in groups along K, and llama.cpp's GGUF block types:

    w[k, n] = q[k, n] * scales[k // G, n]  (+ mins[k // G, n] where the source has them)

with q int8, or 4-bit packed two to a byte along K (byte i holds rows 2i, low nibble, and 2i + 1, high
nibble). A 4-bit weight without mins stores q + 8 (llama.cpp's Q4_0: values -8..7); with mins the nibble
is q itself (0..15, Q4_1 and the K-quants' sub-blocks). Scales and mins keep the source's width (float16
for GGUF blocks), so the bytes stay near the file's.

The model never names the type: a Linear's kernel param simply holds a QuantizedWeight instead of an
array (nnx keeps any pytree as a param's value), `project` casts rows to its `dtype` (the compute dtype),
and the matmul plan's quantized entries (pallas_kernels/matmul/__init__.py) recognize it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pallas_kernels.matmul import int8_activations, kquant, quantized_tiles
from pallas_kernels.matmul.kquant import KQuantWeight
from pallas_kernels.matmul.quantized_tiles import TiledQuantizedWeight
from pallas_kernels.matmul.reference import dot_operand_dtype

# Rows from which the reference dequantizes the weight and runs one dot (compute-bound prefill: the copy
# is paid once for many rows); below, it dots the integers group by group and scales the group sums, so
# no float copy of the weight is made (a decode step reads the weight at its stored width).
DEQUANTIZE_FROM_ROWS = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A [..., K, N] weight (leading axes: stacked experts) stored as integers with per-group scales."""

    # numpy while the loader builds it on the host, jax arrays once placed
    values: jax.Array | np.ndarray  # int8 [..., K, N] (bits 8), or uint8 [..., K / 2, N] (bits 4, two rows per byte)
    scales: jax.Array | np.ndarray  # [..., K / G, N] float16 / bfloat16 / float32
    mins: (
        jax.Array | np.ndarray | None
    )  # [..., K / G, N] like scales, or None (symmetric; 4-bit nibbles carry offset 8)
    bits: int = dataclasses.field(metadata=dict(static=True), default=8)
    group_size: int = dataclasses.field(metadata=dict(static=True), default=0)  # G, along K
    compute_dtype: str = dataclasses.field(metadata=dict(static=True), default="float32")  # the rows' dtype

    def __getitem__(self, index):
        """`param[...]` (how modules read a param's value) is the weight itself."""
        if index is not Ellipsis:
            raise TypeError("a QuantizedWeight is read whole (param[...]), not indexed")
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., K, N] shape, as the float weight it stands for."""
        *lead, rows, columns = self.values.shape
        return (*lead, rows * (8 // self.bits), columns)

    @property
    def dtype(self):
        return jnp.dtype(self.compute_dtype)

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def nbytes(self) -> int:
        return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(self))

    @property
    def num_groups(self) -> int:
        return self.scales.shape[-2]

    def embedding_rows(self, token_ids):
        """A quantized embedding (stored [E, V], as the tied head it also is) looked up: [T, E] in the compute
        dtype. The model asks for this method rather than naming the type (models import no kernel)."""
        return take_columns(self, token_ids)


# What the XLA functions below take: a QuantizedWeight, its tiles, or a GGUF K-quant's planes
AnyQuantized = QuantizedWeight | TiledQuantizedWeight | KQuantWeight


def untiled(weight):
    """A TiledQuantizedWeight (quantized_tiles.py: the CPU kernel's layout) as the [K, N] QuantizedWeight it came
    from (a GGUF K-quant's: the KQuantWeight), bit for bit; any other weight as it is."""
    if not quantized_tiles.is_tiled(weight):
        return weight
    if quantized_tiles.holds_kquant(weight):
        return quantized_tiles.untiled_kquant(weight)
    values, scales, mins = quantized_tiles.untiled_arrays(weight)
    return QuantizedWeight(
        values, scales, mins, bits=weight.bits, group_size=weight.group_size, compute_dtype=weight.compute_dtype
    )


def integers(weight: AnyQuantized):
    """q [..., K, N] int8: the stored integers, unpacked, the 4-bit offset taken out where there are no mins."""
    weight = untiled(weight)
    if isinstance(weight, KQuantWeight):
        return kquant.integers(weight)
    if weight.bits == 8:
        return weight.values
    low = (weight.values & 0xF).astype(jnp.int8)
    high = (weight.values >> 4).astype(jnp.int8)
    *lead, half, columns = weight.values.shape
    q = jnp.stack([low, high], axis=-2).reshape(*lead, 2 * half, columns)  # rows 2i, 2i + 1
    return q if weight.mins is not None else q - jnp.int8(8)


def dequantize(weight: AnyQuantized, dtype=None):
    """The float weight [..., K, N] it stands for, in `dtype` (default: its compute dtype); scales applied in
    float32."""
    weight = untiled(weight)
    if isinstance(weight, KQuantWeight):  # GGUF K-quants' two-level layout (kquant.py)
        return kquant.dequantize(weight, dtype)
    q = integers(weight)
    *lead, depth, columns = q.shape
    groups = weight.num_groups
    grouped = q.reshape(*lead, groups, depth // groups, columns).astype(jnp.float32)
    w = grouped * weight.scales.astype(jnp.float32)[..., :, None, :]
    if weight.mins is not None:
        w = w + weight.mins.astype(jnp.float32)[..., :, None, :]
    return w.reshape(*lead, depth, columns).astype(dtype or weight.dtype)


def matmul(rows, weight: AnyQuantized, *, transposed: bool = False, activations: str = "float"):
    """rows [M, K] (the compute dtype) @ weight [K, N] -> float32 [M, N], with XLA's dots. `activations` int8:
    x rounded per 32 k first as the CPU int8 kernel rounds it (int8_activations.py), the products in float32."""
    weight = untiled(weight)  # (XLA's dots read the [K, N] layout)
    if isinstance(weight, KQuantWeight):  # GGUF K-quants' two-level layout (kquant.py)
        return kquant.matmul(rows, weight, transposed=transposed, activations=activations)
    if transposed:
        raise ValueError("quantized weights are stored [K, N]; a transposed projection takes a float weight")
    if weight.values.ndim != 2:
        raise ValueError(f"a projection takes a 2-d weight, got a quantized {weight.shape}")
    num_rows, depth = rows.shape
    if depth != weight.shape[0]:
        raise ValueError(f"rows {rows.shape} do not contract with a quantized weight {weight.shape}")
    groups = weight.num_groups
    group = depth // groups
    group_sums = None  # [M, G]: what the mins multiply (the rows' sums per group)
    if activations == "int8":
        # float32 throughout: q * d needs more bits than a 16-bit compute dtype holds
        rows, group_sums = int8_activations.fake_quantize(rows, group)
    elif activations != "float":
        raise ValueError(f"unknown activations {activations!r}; expected int8 or float")
    operand_dtype = dot_operand_dtype(rows.dtype)
    if num_rows >= DEQUANTIZE_FROM_ROWS:
        y = jax.lax.dot_general(
            rows.astype(operand_dtype),
            dequantize(weight, operand_dtype),
            (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
        )
        if group_sums is not None and weight.mins is not None:  # as the int8 kernel: mins times q8_1's s
            mins = weight.mins.astype(jnp.float32)
            sums = jnp.sum(rows.reshape(num_rows, groups, group), axis=-1)
            y = y + (group_sums - sums) @ mins  # the float16-rounded s in place of the sums of q * d
        return y
    q = integers(weight).reshape(groups, group, -1).astype(operand_dtype)  # small integers: exact in 16 bits
    grouped_rows = rows.reshape(num_rows, groups, group).astype(operand_dtype)
    # [M, G, N]: each group's integer sum, then its scale; G is 1 for per-channel int8
    sums = jnp.einsum("mgk,gkn->mgn", grouped_rows, q, preferred_element_type=jnp.float32)
    y = jnp.einsum("mgn,gn->mn", sums, weight.scales.astype(jnp.float32))
    if weight.mins is not None:
        if group_sums is None:
            group_sums = jnp.sum(grouped_rows.astype(jnp.float32), axis=-1)
        y = y + group_sums @ weight.mins.astype(jnp.float32)
    return y


def take_columns(weight: AnyQuantized, column_ids, dtype=None):
    """Columns of a [K, N] weight, dequantized -> [len(column_ids), K]: a quantized embedding (stored as the head
    it also is, [E, V]) looked up by token ids. Reads only those columns' bytes."""
    if isinstance(weight, KQuantWeight):
        return kquant.take_columns(weight, column_ids, dtype)
    if quantized_tiles.is_tiled(weight):
        return quantized_tiles.columns_dequantized(weight, column_ids, dtype)
    picked = QuantizedWeight(
        jnp.take(weight.values, column_ids, axis=-1),
        jnp.take(weight.scales, column_ids, axis=-1),
        None if weight.mins is None else jnp.take(weight.mins, column_ids, axis=-1),
        bits=weight.bits,
        group_size=weight.group_size,
        compute_dtype=weight.compute_dtype,
    )
    return dequantize(picked, dtype).T


def place_shardings(weight: QuantizedWeight | KQuantWeight, sharding, stored_transposed: bool = False):
    """A sharding for each of the weight's arrays, given the float param's (None: the default device). With a
    NamedSharding, values, scales and mins split as it splits K and N wherever their own sizes divide
    (packed rows and groups stay whole on a shard), else stay whole along that axis; stored_transposed: the
    param's axes are [N, K] (the embedding [V, E], stored [E, V])."""
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if not isinstance(sharding, NamedSharding):
        return jax.tree.map(lambda leaf: sharding, weight)
    if stored_transposed:
        first, second = (tuple(sharding.spec) + (None, None))[:2]
        sharding = NamedSharding(sharding.mesh, PartitionSpec(second, first))
    return jax.tree.map(lambda leaf: _leaf_sharding(leaf.shape, sharding), weight)


def _leaf_sharding(shape: tuple[int, ...], sharding: NamedSharding) -> NamedSharding:
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    for axis, mesh_axis in enumerate(spec):
        if mesh_axis is None:
            continue
        names = mesh_axis if isinstance(mesh_axis, tuple) else (mesh_axis,)
        split = int(np.prod([sharding.mesh.shape[name] for name in names]))
        if shape[axis] % split:
            spec[axis] = None
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def is_quantized(weight) -> bool:
    """A QuantizedWeight (or its tiles, quantized_tiles.py) or a GGUF K-quant's KQuantWeight (kquant.py): what the
    quantized entries serve."""
    return isinstance(weight, (QuantizedWeight, TiledQuantizedWeight, KQuantWeight))


__all__ = [
    "DEQUANTIZE_FROM_ROWS",
    "QuantizedWeight",
    "dequantize",
    "integers",
    "is_quantized",
    "matmul",
    "place_shardings",
    "take_columns",
    "untiled",
]
