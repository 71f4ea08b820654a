"""llama.cpp's GGUF block types re-expressed as QuantizedWeight's one layout, without a float copy.

A GGUF matrix is stored as rows of N outputs, each row K values in blocks along K (the contraction axis,
as QuantizedWeight's groups). Every type here maps onto `w = q * scale (+ min)` per group of K:

    Q8_0   blocks of 32: float16 d, 32 int8              -> int8, groups of 32, float16 scales (exact)
    Q4_0   blocks of 32: float16 d, 16 bytes of nibbles  -> 4-bit, offset 8, float16 scales (exact)
    Q4_1   blocks of 32: float16 d, m, 16 bytes          -> 4-bit with mins, float16 (exact)
    Q4_K   super-blocks of 256: d, dmin, 6-bit sub-block scales and mins, nibbles
                                                         -> 4-bit with mins per 32, float32 (exact:
                                                            d * sc needs more than float16's mantissa)
    Q5_K   as Q4_K plus a fifth bit                      -> int8 groups of 32 with mins, float32 (exact)
    Q6_K   super-blocks of 256: d, int8 scales per 16, 6-bit values
                                                         -> int8 groups of 16, float32 scales (exact)
    Q3_K   super-blocks of 256: d, 6-bit scales per 16, 3-bit values
                                                         -> 4-bit, offset 8, groups of 16, float32 (exact)
    Q2_K   super-blocks of 256: d, dmin, 4-bit scales and mins per 16, 2-bit values
                                                         -> 4-bit with mins, groups of 16, float32 (exact)
    IQ4_NL blocks of 32: float16 d, 4-bit indices into a 16-value table
                                                         -> int8 (the table's values), groups of 32, float16
    IQ4_XS as IQ4_NL in super-blocks of 256 with 6-bit scales per 32
                                                         -> int8 groups of 32, float32 scales (exact)

That is how stacked experts load them (the grouped expert matmul reads QuantizedWeight). A 2-d matrix of
a K-quant (and Q5_0 / Q5_1, which a Q4_K_M / Q5_K_M file holds where K is not a multiple of 256) loads as
kquant.py's KQuantWeight instead: the blocks' bits moved into planes along K with the two-level scales as
stored, at 1.00-1.03x the file's bytes (`from_gguf_kquant_blocks`). Q5_0 / Q5_1 experts dequantize.

The decoding follows the gguf package's own dequantizers (gguf.quants), which the tests compare against.
Other types have no quantized path: the reader dequantizes them as before (and says so in the log).

Which tensors stay quantized does not depend on the family: the GGUF reader hands a family's read_param
(jaxserve/models/*.py, the same mapping as for safetensors) `Blocks` in place of float arrays. A Blocks
behaves as the float [N, K] tensor for the few things name mappings do to tensors (`.T`, a slice of output
rows as Phi-3's fused qkv / gate_up split, np.stack of per-expert tensors as Mixtral / Qwen-MoE / DeepSeek
stack them), which keep the blocks (they run along K); anything else gets the dequantized values
(`__array__` / `__array_function__`), and the param then loads as float or re-quantized.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from jaxserve.loading.quantize import pack_nibbles, stack
from pallas_kernels.matmul.kquant import HIGH_BITS, KQuantWeight, pack_rows
from pallas_kernels.matmul.quantized import QuantizedWeight

Q = GGMLQuantizationType
QK_K = 256


def _halves(qs: np.ndarray) -> np.ndarray:
    """[B, 16] bytes -> [B, 32] nibbles: element j is byte j's low nibble, element j + 16 its high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _f16(columns: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(columns).view(np.float16)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of packed 6-bit scales and mins -> ([B, 8], [B, 8]) uint8."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q8_0(b):
    return b[:, 2:].view(np.int8), _f16(b[:, :2]), None, 32


def _q4_0(b):
    return _halves(b[:, 2:]), _f16(b[:, :2]), None, 32


def _q4_1(b):
    return _halves(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4]), 32


def _q4_k(b):
    d, dmin = _f16(b[:, 0:2]).astype(np.float32), _f16(b[:, 2:4]).astype(np.float32)
    sc, mn = _scale_min_k4(b[:, 4:16])
    qs = b[:, 16:].reshape(-1, 4, 32)  # four 32-byte chunks, each two sub-blocks (low, then high nibbles)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, QK_K)
    return q, d * sc, -(dmin * mn), 32


def _q5_k(b):
    d, dmin = _f16(b[:, 0:2]).astype(np.float32), _f16(b[:, 2:4]).astype(np.float32)
    sc, mn = _scale_min_k4(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:].reshape(-1, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [B, 8, 32]
    q = (low | (high << 4)).reshape(-1, QK_K).astype(np.int8)  # 0..31
    return q, d * sc, -(dmin * mn), 32


def _q6_k(b):
    ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
    scales = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210]).astype(np.float32)
    low = np.stack([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 2, 4, 32)
    high = np.stack([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=2)  # [B, 2, 4, 32]
    q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(-1, QK_K)
    return q, d * scales, None, 16


def _q2_k(b):
    """scales [16] (low nibble sc, high m), 2-bit q [64 bytes], d, dmin: w = d sc q - dmin m per 16."""
    d, dmin = _f16(b[:, 80:82]).astype(np.float32), _f16(b[:, 82:84]).astype(np.float32)
    scales = b[:, :16]
    q = (b[:, 16:80].reshape(-1, 2, 1, 32) >> SHIFTS_2BIT) & 3  # [B, 2, 4, 32]: natural order
    return q.reshape(-1, QK_K), d * (scales & 0x0F), -(dmin * (scales >> 4)), 16


def _q3_k(b):
    """hmask [32], 2-bit low q [64], 6-bit scales [12], d: w = d (sc - 32) (q - 4) per 16, as nibbles q + 4."""
    hmask, qs, packed, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110]).astype(np.float32)
    low = (packed[:, :8].reshape(-1, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)).reshape(-1, 16) & 0x0F
    high = (packed[:, 8:].reshape(-1, 1, 4) >> SHIFTS_2BIT.reshape(1, 4, 1)).reshape(-1, 16) & 0x03
    sc = (low | (high << 4)).astype(np.float32) - 32
    q_low = ((qs.reshape(-1, 2, 1, 32) >> SHIFTS_2BIT) & 3).reshape(-1, QK_K)
    q_high = ((hmask.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1).reshape(-1, QK_K)
    return q_low + (q_high << 2) + 4, d * sc, None, 16  # (q - 4 + 4 high) + 8: a set high bit means no -4


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def _iq4_nl(b):
    """d, 16 bytes of indices into IQ4_VALUES: w = d * value, kept as int8 values (exact, 8 bits)."""
    return IQ4_VALUES[_halves(b[:, 2:])], _f16(b[:, :2]), None, 32


def _iq4_xs(b):
    """d, 6-bit sub-block scales (2 high bits [2 bytes], 4 low [4 bytes]), 8 x 16 bytes of indices."""
    d = _f16(b[:, 0:2]).astype(np.float32)
    high = (b[:, 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [B, 8]
    low = (b[:, 4:8].reshape(-1, 4, 1) >> np.array([0, 4], np.uint8).reshape(1, 1, 2)).reshape(-1, 8) & 0x0F
    sc = (low | (high.astype(np.uint8) << 4)).astype(np.float32) - 32
    indices = _halves(b[:, 8:].reshape(-1, 16)).reshape(-1, QK_K)
    return IQ4_VALUES[indices], d * sc, None, 32


SHIFTS_2BIT = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)

# type -> (bytes per block, values per block, decoder, bits of the stored layout)
LAYOUTS = {
    Q.Q8_0: (34, 32, _q8_0, 8),
    Q.Q4_0: (18, 32, _q4_0, 4),
    Q.Q4_1: (20, 32, _q4_1, 4),
    Q.Q4_K: (144, QK_K, _q4_k, 4),
    Q.Q5_K: (176, QK_K, _q5_k, 8),
    Q.Q6_K: (210, QK_K, _q6_k, 8),
    # exact in a wider layout than the file's (bytes: Q3_K 1.75x, Q2_K 3x, IQ4 ~2x), not a float copy
    Q.Q2_K: (84, QK_K, _q2_k, 4),
    Q.Q3_K: (110, QK_K, _q3_k, 4),
    Q.IQ4_NL: (18, 32, _iq4_nl, 8),
    Q.IQ4_XS: (136, QK_K, _iq4_xs, 8),
    # only as KQuantWeight (two-level); as a QuantizedWeight (experts) they dequantize
    Q.Q5_0: (22, 32, None, 8),
    Q.Q5_1: (24, 32, None, 8),
}


def has_quantized_layout(qtype) -> bool:
    return qtype in LAYOUTS


def _q4_k_planes(b):
    sc, mn = _scale_min_k4(b[:, 4:16])
    qs = b[:, 16:].reshape(-1, 4, 32)  # four 32-byte chunks, each two sub-blocks (low, then high nibbles)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, QK_K)
    return q, sc, mn, _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q5_k_planes(b):
    sc, mn = _scale_min_k4(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:].reshape(-1, 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [B, 8, 32]
    return (low | (high << 4)).reshape(-1, QK_K), sc, mn, _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q6_k_planes(b):
    ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
    low = np.stack([ql & 0x0F, ql >> 4], axis=2).reshape(-1, 2, 4, 32)
    high = np.stack([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=2)  # [B, 2, 4, 32]
    q = (low | (high << 4)).reshape(-1, QK_K)  # 0..63: q + 32, as stored
    return q, b[:, 192:208].view(np.int8), None, _f16(b[:, 208:210]), None


def _q5_high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's 4 bytes of high bits [B, 4] -> [B, 32]: element j's bit is bit j of the little-endian word."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q5_0_planes(b):
    q = _halves(b[:, 6:]) | (_q5_high_bits(b[:, 2:6]) << 4)  # 0..31: q + 16, as stored
    return q, None, None, _f16(b[:, 0:2]), None


def _q5_1_planes(b):
    q = _halves(b[:, 8:]) | (_q5_high_bits(b[:, 4:8]) << 4)
    return q, None, None, _f16(b[:, 0:2]), _f16(b[:, 2:4])


# type -> (its KQuantWeight kind, values per block, the block's planes: q [B, values] uint8 as stored in
# natural order, sub-block scales [B, S] or None, mins [B, S] or None, d [B, 1] float16, dmin [B, 1] or None)
KQUANT_PLANES = {
    Q.Q4_K: ("q4_k", QK_K, _q4_k_planes),
    Q.Q5_K: ("q5_k", QK_K, _q5_k_planes),
    Q.Q6_K: ("q6_k", QK_K, _q6_k_planes),
    Q.Q5_0: ("q5_0", 32, _q5_0_planes),
    Q.Q5_1: ("q5_1", 32, _q5_1_planes),
}


def from_gguf_kquant_blocks(raw: np.ndarray, qtype, compute_dtype: str) -> KQuantWeight:
    """raw [N, bytes per row] uint8 (a GGUF K-quant matrix's rows) -> the [K, N] KQuantWeight: the blocks' bits
    moved into planes (no dequantization), a chunk of rows at a time into arrays allocated once."""
    kind, block_values, planes = KQUANT_PLANES[qtype]
    block_bytes = LAYOUTS[qtype][0]
    columns = raw.shape[0]
    depth = raw.shape[1] // block_bytes * block_values
    high_bits = HIGH_BITS[kind]
    arrays: dict[str, np.ndarray | None] = {}
    for start in range(0, columns, ROWS_PER_CHUNK):
        rows = raw[start : start + ROWS_PER_CHUNK]
        count = rows.shape[0]
        q, sc, mn, d, dmin = planes(np.ascontiguousarray(rows).reshape(-1, block_bytes))
        q = q.reshape(count, depth).T  # [K, count]
        parts = {
            "low": pack_rows(q, 4),
            "high": pack_rows(q >> 4, high_bits) if high_bits else None,
            "sub_scales": None if sc is None else sc.reshape(count, -1).T,
            "sub_mins": None if mn is None else mn.reshape(count, -1).T,
            "d": d.reshape(count, -1).T,
            "dmin": None if dmin is None else dmin.reshape(count, -1).T,
        }
        if not arrays:
            arrays = {
                name: None if part is None else np.empty((part.shape[0], columns), part.dtype)
                for name, part in parts.items()
            }
        for name, part in parts.items():
            array = arrays[name]
            if array is not None and part is not None:
                array[:, start : start + count] = part
    assert arrays, "a GGUF matrix has rows"
    return KQuantWeight(**arrays, kind=kind, compute_dtype=compute_dtype)  # type: ignore[arg-type]


ROWS_PER_CHUNK = 2048  # GGUF rows (outputs) decoded at a time: decoding's temporaries stay small


def from_gguf_blocks(raw: np.ndarray, qtype, compute_dtype: str) -> QuantizedWeight:
    """raw [N, bytes per row] uint8 (a GGUF matrix's rows) -> the [K, N] QuantizedWeight with its values,
    decoded a chunk of rows at a time into arrays allocated once."""
    block_bytes, block_values, decode, bits = LAYOUTS[qtype]
    columns = raw.shape[0]
    depth = raw.shape[1] // block_bytes * block_values
    values = scales = mins = None
    group = 0
    for start in range(0, columns, ROWS_PER_CHUNK):
        rows = raw[start : start + ROWS_PER_CHUNK]
        count = rows.shape[0]
        q, chunk_scales, chunk_mins, group = decode(np.ascontiguousarray(rows).reshape(-1, block_bytes))
        groups = depth // group
        if values is None:
            values = np.empty((depth // 2 if bits == 4 else depth, columns), np.uint8 if bits == 4 else np.int8)
            scales = np.empty((groups, columns), chunk_scales.dtype)
            mins = None if chunk_mins is None else np.empty((groups, columns), chunk_mins.dtype)
        assert values is not None and scales is not None
        q = q.reshape(count, depth).T  # [K, count]
        values[:, start : start + count] = pack_nibbles(q.astype(np.uint8)) if bits == 4 else q
        scales[:, start : start + count] = chunk_scales.reshape(count, groups).T
        if mins is not None and chunk_mins is not None:
            mins[:, start : start + count] = chunk_mins.reshape(count, groups).T
    assert values is not None and scales is not None, "a GGUF matrix has rows"
    return QuantizedWeight(values, scales, mins, bits=bits, group_size=group, compute_dtype=compute_dtype)


class NoBlocks(Exception):
    """A tensor a name mapping asked for has no quantized layout kept (a float or another type): the param is
    read as float instead."""


@dataclasses.dataclass(frozen=True, eq=False)
class Blocks:
    """A GGUF matrix's quantized blocks standing in for its float values: [N, K] as a checkpoint holds it
    (rows: outputs; the blocks run along K), or [K, N] once transposed; `start:stop` the rows kept.
    Nothing is read until `quantized` (the blocks) or `__array__` (the float values) is asked for."""

    raw: Callable[[], np.ndarray]  # -> uint8 [N, bytes per row], every row of the tensor
    dequantized: Callable[[], np.ndarray]  # -> float32 [N, K]: the reader's float values of the same tensor
    qtype: GGMLQuantizationType
    num_rows: int
    depth: int
    start: int = 0
    stop: int | None = None
    transposed: bool = False

    ndim = 2

    @property
    def shape(self) -> tuple[int, int]:
        rows = (self.num_rows if self.stop is None else self.stop) - self.start
        return (self.depth, rows) if self.transposed else (rows, self.depth)

    @property
    def T(self) -> Blocks:  # noqa: N802 (numpy's name)
        return dataclasses.replace(self, transposed=not self.transposed)

    def __getitem__(self, index):
        """A contiguous slice of output rows keeps the blocks; any other index reads the float values."""
        if not self.transposed and isinstance(index, slice) and index.step in (None, 1):
            start, stop, _ = index.indices(self.shape[0])
            return dataclasses.replace(self, start=self.start + start, stop=self.start + max(start, stop))
        return np.asarray(self)[index]

    def __array__(self, dtype=None, copy=None):
        values = self.dequantized()[self.start : self.stop]
        values = values.T if self.transposed else values
        return values if dtype is None else values.astype(dtype)

    def __array_function__(self, func, types, args, kwargs):
        return _array_function(func, args, kwargs)

    def quantized(self, compute_dtype: str, two_level: bool = True) -> QuantizedWeight | KQuantWeight:
        """The [K, N] weight of the rows kept (whichever way this stand-in is transposed): K-quant blocks as a
        KQuantWeight (two_level; the file's bytes), other types (and K-quants with two_level False) as a
        QuantizedWeight."""
        raw = self.raw()[self.start : self.stop]
        if two_level and self.qtype in KQUANT_PLANES:
            return from_gguf_kquant_blocks(raw, self.qtype, compute_dtype)
        return from_gguf_blocks(raw, self.qtype, compute_dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class StackedBlocks:
    """np.stack of per-expert Blocks: [X, ...] of its parts' shape."""

    parts: tuple[Blocks, ...]

    ndim = 3

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].shape)

    def __getitem__(self, index):
        return np.asarray(self)[index]

    def __array__(self, dtype=None, copy=None):
        return np.stack([np.asarray(part, dtype) for part in self.parts])

    def __array_function__(self, func, types, args, kwargs):
        return _array_function(func, args, kwargs)

    @property
    def transposed(self) -> bool:
        return all(part.transposed for part in self.parts)

    def quantized(self, compute_dtype: str) -> QuantizedWeight:
        """The [X, K, N] QuantizedWeight, its arrays allocated once and filled expert by expert."""
        # experts keep the one-level layout: the grouped expert matmul (quantized_experts.py) reads QuantizedWeight
        first = self.parts[0].quantized(compute_dtype, two_level=False)
        assert isinstance(first, QuantizedWeight)
        arrays = {
            leaf: None
            if getattr(first, leaf) is None
            else np.empty((len(self.parts), *getattr(first, leaf).shape), getattr(first, leaf).dtype)
            for leaf in ("values", "scales", "mins")
        }
        for expert, part in enumerate(self.parts):
            weight = first if expert == 0 else part.quantized(compute_dtype, two_level=False)
            for leaf, array in arrays.items():
                if array is not None:
                    array[expert] = getattr(weight, leaf)
        return dataclasses.replace(first, **arrays)


def _array_function(func, args, kwargs):
    """np.stack of Blocks of one type keeps them as blocks; any other numpy function gets float values."""
    if func is np.stack and kwargs.get("axis", 0) == 0 and len(args) == 1:
        parts = tuple(args[0])
        if parts and all(isinstance(part, Blocks) for part in parts) and LAYOUTS[parts[0].qtype][2] is not None:
            if len({(part.qtype, part.shape, part.transposed) for part in parts}) == 1:
                return StackedBlocks(parts)
    return func(*_float_values(args), **{key: _float_values(value) for key, value in kwargs.items()})


def _float_values(value):
    if isinstance(value, (Blocks, StackedBlocks)):
        return np.asarray(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_float_values(item) for item in value)
    if isinstance(value, dict):
        return {key: _float_values(item) for key, item in value.items()}
    return value


class BlocksReader:
    """A checkpoint reader (`name in reader`, `reader.read(name)`) that answers with a GGUF reader's Blocks:
    what a family's read_param is handed to find a param's quantized blocks. A tensor without a quantized
    layout raises NoBlocks (the param is then read as float, once)."""

    def __init__(self, reader):
        self.reader = reader

    def __contains__(self, name: str) -> bool:
        return name in self.reader

    def read(self, name: str) -> Blocks:
        blocks = self.reader.read_blocks(name)
        if blocks is None:
            raise NoBlocks(name)
        return blocks


def mapped_blocks(reader, read_param, path: tuple[str, ...], shape: tuple[int, ...], stored_transposed: bool):
    """The param at `path` as its checkpoint's quantized blocks, laid out by the family's own read_param:
    Blocks / StackedBlocks of `shape`, or None where the reader has no blocks or the mapping did not keep them
    (a float tensor, a type without a layout, or an operation other than a transpose, a row slice or a stack).
    stored_transposed: the param is [N, K] (the embedding, stored [E, V]); a kernel is [K, N]."""
    if not hasattr(reader, "read_blocks"):
        return None
    try:
        value = read_param(BlocksReader(reader), path, shape)
    except NoBlocks:
        return None
    if not isinstance(value, (Blocks, StackedBlocks)) or tuple(value.shape) != tuple(shape):
        return None
    if value.transposed == stored_transposed:  # blocks run along K: a kernel must be [K, N], the embedding [N, K]
        return None
    return value


def layout_bits(value: Blocks | StackedBlocks) -> int:
    """Bits of the layout the blocks load as (8 or 4)."""
    return LAYOUTS[value.qtype if isinstance(value, Blocks) else value.parts[0].qtype][3]


def requantized(value: Blocks | StackedBlocks, quantize_matrix: Callable[[np.ndarray], QuantizedWeight]):
    """The blocks re-quantized to another layout (int8 asked of Q4_0 blocks, int4 of Q8_0), a chunk of GGUF
    rows (our output columns, which quantize independently) at a time: each chunk dequantized by gguf.quants,
    transposed to [K, n] and quantized, so the tensor is never whole in float. Equal to quantizing the whole
    dequantized tensor."""
    if isinstance(value, StackedBlocks):
        return stack([requantized(part, quantize_matrix) for part in value.parts])
    raw = value.raw()[value.start : value.stop]
    columns = raw.shape[0]
    step = max(16, REQUANTIZE_CHUNK_BYTES // (4 * value.depth))
    first, arrays = None, {}
    for start in range(0, columns, step):
        part = quantize_matrix(np.ascontiguousarray(dequantize(raw[start : start + step], value.qtype).T))
        if first is None:
            if step >= columns:
                return part
            first = part
            for leaf in ("values", "scales", "mins"):
                array = getattr(part, leaf)
                arrays[leaf] = None if array is None else np.empty((*array.shape[:-1], columns), array.dtype)
        for leaf, array in arrays.items():
            if array is not None:
                array[..., start : start + step] = getattr(part, leaf)
    assert first is not None, "a GGUF matrix has rows"
    return dataclasses.replace(first, **arrays)


REQUANTIZE_CHUNK_BYTES = 4 << 20  # float32 rows dequantized at a time


__all__ = [
    "LAYOUTS",
    "Blocks",
    "BlocksReader",
    "NoBlocks",
    "StackedBlocks",
    "from_gguf_blocks",
    "from_gguf_kquant_blocks",
    "has_quantized_layout",
    "layout_bits",
    "mapped_blocks",
    "requantized",
]
