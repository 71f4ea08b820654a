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

The decoding follows the gguf package's own dequantizers (gguf.quants), which the tests compare against.
Other types have no quantized path: the reader dequantizes them as before (and says so in the log).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from jaxserve.loading.quantize import pack_nibbles
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


# type -> (bytes per block, values per block, decoder, bits of the stored layout)
LAYOUTS = {
    Q.Q8_0: (34, 32, _q8_0, 8),
    Q.Q4_0: (18, 32, _q4_0, 4),
    Q.Q4_1: (20, 32, _q4_1, 4),
    Q.Q4_K: (144, QK_K, _q4_k, 4),
    Q.Q5_K: (176, QK_K, _q5_k, 8),
    Q.Q6_K: (210, QK_K, _q6_k, 8),
}


def has_quantized_layout(qtype) -> bool:
    return qtype in LAYOUTS


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


__all__ = ["LAYOUTS", "from_gguf_blocks", "has_quantized_layout"]
