"""llama.cpp's K-quant weights (GGUF Q4_K, Q5_K, Q6_K, and the Q5_0 / Q5_1 that a Q4_K_M / Q5_K_M file holds
where K is not a multiple of 256) at the file's bytes, and the XLA projection that reads them (the
reference; what TPU and GPU run).

A K-quant tensor is super-blocks of 256 values along K, each with a float16 `d` (and `dmin`) and small
integer scales per sub-block (32 values for Q4_K / Q5_K, 16 for Q6_K):

    Q4_K  w = d * sc * q - dmin * m      q 0..15, sc and m 6-bit per 32      (4.5 bits per weight)
    Q5_K  as Q4_K with q 0..31                                               (5.5 bits)
    Q6_K  w = d * sc * (q - 32)          q 0..63, sc int8 per 16             (6.5625 bits)
    Q5_0  w = d * (q - 16)               q 0..31, d per 32 (no sub-scales)   (5.5 bits)
    Q5_1  w = d * q + m                  q 0..31, d and m per 32             (6 bits)

KQuantWeight keeps them as planes along K, columns (the outputs) last as QuantizedWeight's layout
(quantized.py), so the same sharding and kernels' walk apply:

    low         uint8 [..., K / 2, N]    q's low 4 bits, rows 2i (low nibble) and 2i + 1 (high nibble)
    high        uint8 [..., K / 4, N]    Q6_K: q's bits 4-5, rows 4i + j at bits 2j..2j+1
                uint8 [..., K / 8, N]    Q5_K / Q5_0 / Q5_1: q's bit 4, rows 8i + j at bit j;  None for Q4_K
    sub_scales  uint8 [..., K / 32, N]   Q4_K / Q5_K's 6-bit sc;  int8 [..., K / 16, N] for Q6_K;  None
    sub_mins    uint8 [..., K / 32, N]   Q4_K / Q5_K's 6-bit m;  None for the others
    d           float16 [..., K / 256, N]  (Q5_0 / Q5_1: [..., K / 32, N])
    dmin        float16 [..., K / 256, N]  Q4_K / Q5_K;  Q5_1's m [..., K / 32, N] (added);  else None

Bytes per 256 values: Q4_K 148 (file 144), Q5_K 180 (176), Q6_K 210 (210), Q5_0 176 (176), Q5_1 192
(192). The products d * sc and
dmin * m are formed in float32 as ggml does (exact: 11 by 6 or 8 bits), one small [K / G, N] array per
projection, never a float copy of the weight.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.matmul import int8_activations
from pallas_kernels.matmul.reference import dot_operand_dtype

SUPER_BLOCK = 256  # values per super-block (ggml's QK_K)
KINDS = ("q4_k", "q5_k", "q6_k", "q5_0", "q5_1")
SUB_BLOCK = {"q4_k": 32, "q5_k": 32, "q6_k": 16, "q5_0": 32, "q5_1": 32}  # values per scale
HIGH_BITS = {"q4_k": 0, "q5_k": 1, "q6_k": 2, "q5_0": 1, "q5_1": 1}  # bits above the low nibble
OFFSET = {"q4_k": 0, "q5_k": 0, "q6_k": 32, "q5_0": 16, "q5_1": 0}  # Q6_K stores q + 32, Q5_0 q + 16
# Rows from which the reference dequantizes the weight and runs one dot (as quantized.py)
DEQUANTIZE_FROM_ROWS = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KQuantWeight:
    """A [..., K, N] weight held as a GGUF K-quant's planes (leading axes: stacked experts)."""

    low: jax.Array | np.ndarray  # uint8 [..., K / 2, N]
    high: jax.Array | np.ndarray | None  # uint8 [..., K * HIGH_BITS / 8, N], or None (Q4_K)
    # uint8 [..., K / 32, N] (Q4_K, Q5_K), int8 [..., K / 16, N] (Q6_K), or None (Q5_0, Q5_1: d per 32)
    sub_scales: jax.Array | np.ndarray | None
    sub_mins: jax.Array | np.ndarray | None  # uint8 [..., K / 32, N] (Q4_K, Q5_K), or None
    d: jax.Array | np.ndarray  # float16 [..., K / 256, N] (Q5_0, Q5_1: [..., K / 32, N])
    dmin: jax.Array | np.ndarray | None  # float16 [..., K / 256, N] (Q4_K, Q5_K), Q5_1's m [..., K / 32, N], or None
    kind: str = dataclasses.field(metadata=dict(static=True), default="q4_k")  # one of KINDS
    compute_dtype: str = dataclasses.field(metadata=dict(static=True), default="float32")  # the rows' dtype

    def __getitem__(self, index):
        """`param[...]` (how modules read a param's value) is the weight itself."""
        if index is not Ellipsis:
            raise TypeError("a KQuantWeight is read whole (param[...]), not indexed")
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical [..., K, N] shape, as the float weight it stands for."""
        *lead, rows, columns = self.low.shape
        return (*lead, 2 * rows, columns)

    @property
    def dtype(self):
        return jnp.dtype(self.compute_dtype)

    @property
    def ndim(self) -> int:
        return self.low.ndim

    @property
    def nbytes(self) -> int:
        return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(self))

    @property
    def group_size(self) -> int:
        """Values per sub-block scale."""
        return SUB_BLOCK[self.kind]

    @property
    def num_groups(self) -> int:
        return self.shape[-2] // self.group_size

    def embedding_rows(self, token_ids):
        """A quantized embedding (stored [E, V]) looked up: [T, E] in the compute dtype (see quantized.py)."""
        return take_columns(self, token_ids)


def _unpack(plane, bits: int):
    """uint8 [..., R, N] holding 8 / bits rows per byte (row i * (8 / bits) + j at bits j * bits) -> uint8
    [..., R * 8 / bits, N]."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    parts = [(plane >> (bits * j)) & mask for j in range(per_byte)]
    *lead, rows, columns = plane.shape
    return jnp.stack(parts, axis=-2).reshape(*lead, rows * per_byte, columns)


def integers(weight: KQuantWeight):
    """q [..., K, N] int8 with the storage offset taken out (Q6_K: -32..31; Q4_K 0..15; Q5_K 0..31)."""
    q = _unpack(weight.low, 4)
    if weight.high is not None:
        q = q | (_unpack(weight.high, HIGH_BITS[weight.kind]) << 4)
    q = q.astype(jnp.int8)
    return q - jnp.int8(OFFSET[weight.kind]) if OFFSET[weight.kind] else q


def group_scales(weight: KQuantWeight):
    """float32 [..., K / G, N]: each sub-block's d * sc, formed as ggml forms it (Q5_0 / Q5_1: d)."""
    d = jnp.repeat(weight.d.astype(jnp.float32), weight.num_groups // weight.d.shape[-2], axis=-2)
    return d if weight.sub_scales is None else d * weight.sub_scales.astype(jnp.float32)


def group_mins(weight: KQuantWeight):
    """float32 [..., K / G, N]: each sub-block's dmin * m (subtracted; Q5_1: -m), or None (Q6_K, Q5_0)."""
    if weight.dmin is None:
        return None
    if weight.sub_mins is None:
        return -weight.dmin.astype(jnp.float32)  # Q5_1's m, added
    dmin = jnp.repeat(weight.dmin.astype(jnp.float32), weight.num_groups // weight.dmin.shape[-2], axis=-2)
    return dmin * weight.sub_mins.astype(jnp.float32)


def dequantize(weight: KQuantWeight, dtype=None):
    """The float weight [..., K, N] it stands for, in `dtype` (default: its compute dtype), computed in float32
    as ggml's dequantizers compute it."""
    q = integers(weight)
    *lead, depth, columns = q.shape
    groups = weight.num_groups
    grouped = q.reshape(*lead, groups, depth // groups, columns).astype(jnp.float32)
    w = grouped * group_scales(weight)[..., :, None, :]
    mins = group_mins(weight)
    if mins is not None:
        w = w - mins[..., :, None, :]
    return w.reshape(*lead, depth, columns).astype(dtype or weight.dtype)


def matmul(rows, weight: KQuantWeight, *, transposed: bool = False, activations: str = "float"):
    """rows [M, K] (the compute dtype) @ weight [K, N] -> float32 [M, N], with XLA's dots: below
    DEQUANTIZE_FROM_ROWS rows the integers are dotted sub-block by sub-block and the sums scaled after (no
    float copy of the weight); from there the weight is dequantized once for the many rows. `activations`
    int8: x rounded per 32 k first as the CPU kernel's int8 tiles round it (d in float32; int8_activations.py)."""
    if transposed:
        raise ValueError("quantized weights are stored [K, N]; a transposed projection takes a float weight")
    if weight.low.ndim != 2:
        raise ValueError(f"a projection takes a 2-d weight, got a K-quant {weight.shape}")
    num_rows, depth = rows.shape
    if depth != weight.shape[0]:
        raise ValueError(f"rows {rows.shape} do not contract with a K-quant weight {weight.shape}")
    if activations == "int8":  # in float32: q * d needs more bits than a 16-bit compute dtype holds
        rows, _ = int8_activations.fake_quantize(rows, int8_activations.CHUNK, half_d=False)
    elif activations != "float":
        raise ValueError(f"unknown activations {activations!r}; expected int8 or float")
    operand_dtype = dot_operand_dtype(rows.dtype)  # float32 on the CPU (quantized.py)
    if num_rows >= DEQUANTIZE_FROM_ROWS:
        return jax.lax.dot_general(
            rows.astype(operand_dtype),
            dequantize(weight, operand_dtype),
            (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
        )
    groups = weight.num_groups
    q = integers(weight).reshape(groups, depth // groups, -1).astype(operand_dtype)  # exact in 16 bits
    grouped_rows = rows.reshape(num_rows, groups, depth // groups).astype(operand_dtype)
    sums = jnp.einsum("mgk,gkn->mgn", grouped_rows, q, preferred_element_type=jnp.float32)  # [M, G, N]
    y = jnp.einsum("mgn,gn->mn", sums, group_scales(weight))
    mins = group_mins(weight)
    if mins is not None:
        y = y - jnp.sum(grouped_rows.astype(jnp.float32), axis=-1) @ mins
    return y


def take_columns(weight: KQuantWeight, column_ids, dtype=None):
    """Columns of a [K, N] weight, dequantized -> [len(column_ids), K] (an embedding lookup)."""
    picked = jax.tree.map(lambda leaf: jnp.take(leaf, column_ids, axis=-1), weight)
    return dequantize(picked, dtype).T


def is_kquant(weight) -> bool:
    return isinstance(weight, KQuantWeight)


# numpy, at load: the planes from values in natural K order


def pack_rows(q: np.ndarray, bits: int) -> np.ndarray:
    """q [..., K, N] uint8 of `bits` bits -> [..., K * bits / 8, N]: rows i * (8 / bits) + j at bits j * bits
    of byte row i (bits 4: QuantizedWeight's nibble packing)."""
    per_byte = 8 // bits
    packed = np.zeros((*q.shape[:-2], q.shape[-2] // per_byte, q.shape[-1]), np.uint8)
    for j in range(per_byte):
        packed |= (q[..., j::per_byte, :] & ((1 << bits) - 1)) << (bits * j)
    return packed


def numpy_dequantize(weight: KQuantWeight) -> np.ndarray:
    """The float32 [..., K, N] values, in numpy (tests and kernels' references)."""
    low = np.asarray(weight.low)
    q = np.stack([low & 15, low >> 4], axis=-2).reshape(*low.shape[:-2], -1, low.shape[-1]).astype(np.int16)
    if weight.high is not None:
        bits = HIGH_BITS[weight.kind]
        high = np.asarray(weight.high)
        parts = [(high >> (bits * j)) & ((1 << bits) - 1) for j in range(8 // bits)]
        q = q | (np.stack(parts, axis=-2).reshape(q.shape).astype(np.int16) << 4)
    q = q - OFFSET[weight.kind]
    group = weight.group_size
    scales = np.repeat(np.asarray(weight.d, np.float32), weight.num_groups // weight.d.shape[-2], axis=-2)
    if weight.sub_scales is not None:
        scales = scales * np.asarray(weight.sub_scales, np.float32)
    w = q.reshape(*q.shape[:-2], -1, group, q.shape[-1]).astype(np.float32) * scales[..., :, None, :]
    if weight.dmin is not None and weight.sub_mins is not None:
        dmin = np.repeat(np.asarray(weight.dmin, np.float32), weight.num_groups // weight.dmin.shape[-2], axis=-2)
        w = w - (dmin * np.asarray(weight.sub_mins, np.float32))[..., :, None, :]
    elif weight.dmin is not None:  # Q5_1: + m
        w = w + np.asarray(weight.dmin, np.float32)[..., :, None, :]
    return w.reshape(q.shape)


__all__ = [
    "DEQUANTIZE_FROM_ROWS",
    "KINDS",
    "SUPER_BLOCK",
    "KQuantWeight",
    "dequantize",
    "group_mins",
    "group_scales",
    "integers",
    "is_kquant",
    "matmul",
    "numpy_dequantize",
    "pack_rows",
    "take_columns",
]
