"""A QuantizedWeight (quantized.py) stored in tiles for the CPU int8-dot kernel: per 64 columns and 32 k one
contiguous block in which the four k of a column that an integer dot product takes in a 32-bit lane lie side by
side (cpu_int8_dot_tiles.h has the byte order and says why: on a [K, N] weight each four rows are interleaved in
registers first, which bound a one-row decode step's walk on AVX2 CPUs without VNNI; tiled, the walk is a
sequential read with no shuffles, issue 25).

    values  [N / 64, K / 32, 2048] int8   (bits 8: byte 256 q + 4 c + b is k 32 i + 4 q + b of column 64 t + c)
            [N / 64, K / 32, 1024] uint8  (bits 4: byte 256 p + 4 c + b holds k 32 i + 8 p + b in its low nibble,
                                           32 i + 8 p + 4 + b in its high one; offset 8 where there are no mins)
            [N / 64, K / 32, 1280] uint8  (bits 5: the 4-bit block of q's low 4 bits, then 256 bytes of bit 4:
                                           byte 1024 + 4 c + b's bit 2 p + h is k 32 i + 8 p + 4 h + b's;
                                           offset 16 where there are no mins)
            [N / 64, K / 32, 1536] uint8  (bits 6, Q6_K: the 4-bit block, then two 256-byte blocks of bits 4-5:
                                           byte 1024 + 256 (s / 4) + 4 c + b holds at bits 2 (s % 4) .. + 1
                                           those of k 32 i + 8 p + 4 h + b, s = 2 p + h; offset 32)
    scales  [N / 64, G, 64], mins the same or None

5-bit tiles hold GGUF Q5_0 / Q5_1 (kquant.py's KQuantWeight of those kinds: d per 32 k, Q5_1's m added as mins), at
the file's bytes: a small model's Q4_K_M / Q5_K_M file is mostly these where K is not a multiple of 256 (SmolLM2's
576), and the K-quant kernel's walk over their [K, N] planes read ~0.25 of a stream at one row (issue 25).
GGUF Q4_K and Q5_K take 4- and 5-bit tiles with TWO-LEVEL scales: scales and mins the uint8 sub-block sc and m
[N / 64, G, 64], super_scales and super_mins the float16 d and dmin per super-block of 8 chunks [N / 64, G / 8, 64]
(w = d * sc * q - dmin * m). GGUF Q6_K takes 6-bit tiles with int8 sc per 16 k as scales [N / 64, K / 16, 64]
(two rows a chunk) and its d as super_scales, no mins (w = d * sc * (q - 32)).

A weight type of its own, as ColumnPanels is for float weights (panels.py): a one-device CPU engine's projections
(and a quantized tied embedding, the head it also is) are moved into tiles at load (device/panel_weights.py), the
int8-dot kernel reads them (quantized_cpu.py), XLA's reference and checkpoints take `untiled(weight)`, the
[K, N] QuantizedWeight (a 5-bit one's KQuantWeight) back, bit for bit. Tiles need N a multiple of 64 and groups of whole 32-k chunks
(`can_tile`); other weights stay [K, N].
"""

from __future__ import annotations

import dataclasses
from typing import TypeGuard

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.matmul import kquant

TILE_COLUMNS = 64  # cpu_int8_dot_tiles.h's kTiledColumns
CHUNK = 32  # k per block (the kernel's activation chunk, ggml's QK8_0)
NIBBLE_BYTES = TILE_COLUMNS * CHUNK // 2  # a 4- or 5-bit chunk's low nibbles; a 5-bit one's bit 4 after them
FIVE_BIT_KINDS = ("q5_0", "q5_1")  # the KQuantWeight kinds with a 5-bit tiled form
TWO_LEVEL_KINDS = ("q4_k", "q5_k", "q6_k")  # the KQuantWeight kinds with a tiled form of two-level scales
KQUANT_KINDS = FIVE_BIT_KINDS + TWO_LEVEL_KINDS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TiledQuantizedWeight:
    """A [K, N] QuantizedWeight's arrays in tiles (the module docstring has the layout)."""

    values: jax.Array | np.ndarray  # [N / 64, K / 32, chunk bytes]
    scales: jax.Array | np.ndarray  # [N / 64, G, 64]
    mins: jax.Array | np.ndarray | None  # like scales, or None
    # two-level (Q4_K / Q5_K): float16 d and dmin [N / 64, K / 256, 64], scales and mins then uint8 sc and m;
    # Q6_K: d, scales int8 sc [N / 64, K / 16, 64], no mins
    super_scales: jax.Array | np.ndarray | None = None
    super_mins: jax.Array | np.ndarray | None = None
    bits: int = dataclasses.field(metadata=dict(static=True), default=8)
    group_size: int = dataclasses.field(metadata=dict(static=True), default=0)
    compute_dtype: str = dataclasses.field(metadata=dict(static=True), default="float32")

    def __getitem__(self, index):
        """`param[...]` (how modules read a param's value) is the weight itself."""
        if index is not Ellipsis:
            raise TypeError("a TiledQuantizedWeight is read whole (param[...]), not indexed")
        return self

    @property
    def shape(self) -> tuple[int, int]:
        """The logical [K, N] shape, as the float weight it stands for."""
        return (self.values.shape[1] * CHUNK, self.values.shape[0] * TILE_COLUMNS)

    @property
    def dtype(self):
        return jnp.dtype(self.compute_dtype)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(self))

    @property
    def num_groups(self) -> int:
        return self.scales.shape[1]

    def embedding_rows(self, token_ids):
        """A quantized tied embedding (the head [E, V]) looked up: [T, E] in the compute dtype, reading only those
        columns' bytes (quantized.QuantizedWeight.embedding_rows)."""
        return columns_dequantized(self, token_ids)


def chunk_bytes(bits: int) -> int:
    return TILE_COLUMNS * CHUNK * bits // 8


def can_tile(weight) -> bool:
    """Whether a QuantizedWeight (quantized.py) has a tiled form: 2-d, N a multiple of 64, groups of whole chunks;
    or a 2-d Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K KQuantWeight with N a multiple of 64."""
    if isinstance(weight, kquant.KQuantWeight):
        return weight.kind in KQUANT_KINDS and weight.low.ndim == 2 and weight.shape[1] % TILE_COLUMNS == 0
    if weight.values.ndim != 2 or weight.bits not in (4, 8):
        return False
    depth, columns = weight.shape
    groups = weight.scales.shape[0]
    return columns % TILE_COLUMNS == 0 and depth % groups == 0 and (depth // groups) % CHUNK == 0


# Tiles are made on the host a slab of columns at a time (the reshapes' temporaries stay this small), into one
# array of the result's size: a large 4-bit embedding's unpacked nibbles would otherwise take 2-4x its bytes.
SLAB_BYTES = 16 << 20


def to_tiles(weight) -> TiledQuantizedWeight:
    """A [K, N] QuantizedWeight, or a Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K KQuantWeight (can_tile), in tiles: numpy for
    numpy, else placed as the weight's arrays are."""
    if not can_tile(weight):
        if isinstance(weight, kquant.KQuantWeight):
            raise ValueError(f"a {weight.kind} weight {weight.shape} has no tiled form")
        raise ValueError(f"a quantized weight {weight.shape} in groups of {weight.group_size} has no tiled form")
    kquants = isinstance(weight, kquant.KQuantWeight)
    supers = (None, None)
    if kquants:
        first, group_size = weight.low, kquant.SUB_BLOCK[weight.kind]
        planes = (np.asarray(weight.low),) if weight.high is None else (np.asarray(weight.low), np.asarray(weight.high))
        bits = 4 + kquant.HIGH_BITS[weight.kind]
        if weight.kind in TWO_LEVEL_KINDS:  # sc and m per chunk, d and dmin per super-block
            scale_array, min_array, supers = weight.sub_scales, weight.sub_mins, (weight.d, weight.dmin)
        else:  # Q5_0 / Q5_1: d per 32 k as the scales, Q5_1's m (added) as the mins
            scale_array, min_array = weight.d, weight.dmin
    else:
        first, bits, group_size = weight.values, weight.bits, weight.group_size
        planes = (np.asarray(weight.values),)  # (a CPU array's own memory, not a copy)
        scale_array, min_array = weight.scales, weight.mins
    depth, columns = weight.shape
    tiles, chunks, block = columns // TILE_COLUMNS, depth // CHUNK, chunk_bytes(bits)
    tiled = np.empty((tiles, chunks, block), planes[0].dtype)
    slab = max(1, SLAB_BYTES // (chunks * block))  # tiles at a time
    for t0 in range(0, tiles, slab):
        t1 = min(tiles, t0 + slab)
        parts = [plane[:, t0 * TILE_COLUMNS : t1 * TILE_COLUMNS] for plane in planes]
        if len(parts) == 2:  # a K-quant's low and high planes
            tiled[t0:t1] = _tile_with_high_bits(parts[0], parts[1], bits - 4, chunks)
        else:
            tiled[t0:t1] = _tile_values(parts[0], bits, chunks)
    small = [min_array, *supers]  # [G, N] or [G / 8, N] each, or None
    mins, super_scales, super_mins = (None if a is None else _tile_columns(a) for a in small)
    scales = _tile_columns(scale_array)
    if not isinstance(first, np.ndarray):  # placed as the weight's arrays are
        place = lambda array: jax.device_put(array, first.sharding)  # noqa: E731
        maybe = lambda array: None if array is None else place(array)  # noqa: E731
        tiled, scales = place(tiled), place(scales)
        mins, super_scales, super_mins = maybe(mins), maybe(super_scales), maybe(super_mins)
    return TiledQuantizedWeight(
        tiled,
        scales,
        mins,
        super_scales,
        super_mins,
        bits=bits,
        group_size=group_size,
        compute_dtype=weight.compute_dtype,
    )


def _tile_values(values: np.ndarray, bits: int, chunks: int) -> np.ndarray:
    """[K, 64 t] int8 (or [K / 2, 64 t] packed 4-bit) -> their t tiles' blocks [t, K / 32, chunk bytes]."""
    tiles = values.shape[1] // TILE_COLUMNS
    if bits == 8:
        grid = values.reshape(chunks, 8, 4, tiles, TILE_COLUMNS)  # [i, q, b, t, c]
        return grid.transpose(3, 0, 1, 4, 2).reshape(tiles, chunks, -1)  # [t, i, q, c, b]
    nibbles = _unpack_rows(np, values)  # [K, 64 t]
    grid = nibbles.reshape(chunks, 4, 2, 4, tiles, TILE_COLUMNS)  # [i, p, half, b, t, c]
    packed = grid[:, :, 0] | (grid[:, :, 1] << 4)  # [i, p, b, t, c]
    return packed.transpose(3, 0, 1, 4, 2).reshape(tiles, chunks, -1)  # [t, i, p, c, b]


def _tile_with_high_bits(low: np.ndarray, high: np.ndarray, high_bits: int, chunks: int) -> np.ndarray:
    """A K-quant's planes of 64 t columns (low [K / 2, 64 t], high [K * high_bits / 8, 64 t]: kquant.py) -> their t
    tiles' 5- or 6-bit blocks [t, K / 32, 1280 or 1536]: the nibbles' 4-bit tile, then `high_bits` blocks of 256
    bytes, byte 4 c + b of block s / n holding at bits high_bits * (s % n) those of k 4 s + b (n = 8 / high_bits)."""
    tiles = low.shape[1] // TILE_COLUMNS
    per_byte = 8 // high_bits
    tops = _unpack_planes(np, high, high_bits)  # [K, 64 t]
    grid = tops.reshape(chunks, high_bits, per_byte, 4, tiles, TILE_COLUMNS)  # [i, s / n, s % n, b, t, c]
    packed = np.zeros((chunks, high_bits, 4, tiles, TILE_COLUMNS), np.uint8)  # [i, s / n, b, t, c]
    for j in range(per_byte):
        packed |= grid[:, :, j] << (high_bits * j)
    high_blocks = packed.transpose(3, 0, 1, 4, 2).reshape(tiles, chunks, -1)  # [t, i, s / n, c, b]
    return np.concatenate([_tile_values(low, 4, chunks), high_blocks], axis=-1)


def holds_kquant(weight: TiledQuantizedWeight) -> bool:
    """Whether tiles came from a KQuantWeight (5- or 6-bit, or two-level scales): untiled_kquant gives it back."""
    return weight.bits in (5, 6) or weight.super_scales is not None


def untiled_kquant(weight: TiledQuantizedWeight) -> kquant.KQuantWeight:
    """The Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K KQuantWeight tiles came from (holds_kquant), bit for bit (traceable)."""
    xp = np if isinstance(weight.values, np.ndarray) else jnp
    depth, columns = weight.shape
    nibbles = _tiled_nibbles(xp, weight.values[..., :NIBBLE_BYTES]).transpose(1, 2, 0, 3).reshape(depth, columns)
    pairs = nibbles.reshape(depth // 2, 2, columns)
    low = pairs[:, 0] | (pairs[:, 1] << 4)
    high = None
    if weight.bits in (5, 6):
        high_bits = weight.bits - 4
        per_byte = 8 // high_bits
        tops = _tiled_high_bits(xp, weight.values, high_bits).transpose(1, 2, 0, 3)  # [i, k, t, c]
        tops = tops.reshape(depth // per_byte, per_byte, columns)  # [K / n, j, N]
        high = tops[:, 0]
        for j in range(1, per_byte):
            high = high | (tops[:, j] << (high_bits * j))
    untile = lambda a: a.transpose(1, 0, 2).reshape(a.shape[1], columns)  # noqa: E731
    maybe = lambda a: None if a is None else untile(a)  # noqa: E731
    if weight.super_scales is not None:  # Q4_K / Q5_K / Q6_K
        return kquant.KQuantWeight(
            low=low,
            high=high,
            sub_scales=untile(weight.scales),
            sub_mins=maybe(weight.mins),
            d=untile(weight.super_scales),
            dmin=maybe(weight.super_mins),
            kind={4: "q4_k", 5: "q5_k", 6: "q6_k"}[weight.bits],
            compute_dtype=weight.compute_dtype,
        )
    return kquant.KQuantWeight(
        low=low,
        high=high,
        sub_scales=None,
        sub_mins=None,
        d=untile(weight.scales),
        dmin=maybe(weight.mins),
        kind="q5_0" if weight.mins is None else "q5_1",
        compute_dtype=weight.compute_dtype,
    )


def untiled_arrays(weight: TiledQuantizedWeight) -> tuple:
    """(values, scales, mins) of the [K, N] QuantizedWeight a 4- or 8-bit tiled weight came from, bit for bit
    (traceable)."""
    xp = np if isinstance(weight.values, np.ndarray) else jnp
    depth, columns = weight.shape
    tiles, chunks = columns // TILE_COLUMNS, depth // CHUNK
    if weight.bits == 8:
        grid = weight.values.reshape(tiles, chunks, 8, TILE_COLUMNS, 4)  # [t, i, q, c, b]
        values = grid.transpose(1, 2, 4, 0, 3).reshape(depth, columns)
    else:
        nibbles = _tiled_nibbles(xp, weight.values).transpose(1, 2, 0, 3).reshape(depth, columns)  # [K, N]
        pairs = nibbles.reshape(depth // 2, 2, columns)
        values = pairs[:, 0] | (pairs[:, 1] << 4)
    untile = lambda a: None if a is None else a.transpose(1, 0, 2).reshape(a.shape[1], columns)  # noqa: E731
    return values, untile(weight.scales), untile(weight.mins)


def columns_dequantized(weight: TiledQuantizedWeight, column_ids, dtype=None):
    """Columns of the [K, N] weight, dequantized -> [len(column_ids), K] (the compute dtype by default)."""
    depth = weight.shape[0]
    tile, within = column_ids // TILE_COLUMNS, column_ids % TILE_COLUMNS
    groups = weight.num_groups
    if weight.bits == 8:
        grid = weight.values.reshape(weight.values.shape[0], depth // CHUNK, 8, TILE_COLUMNS, 4)
        q = grid[tile, :, :, within, :].reshape(-1, depth).astype(jnp.float32)  # [T, K]
    else:
        nibble_bytes = weight.values[..., :NIBBLE_BYTES]
        grid = nibble_bytes.reshape(weight.values.shape[0], depth // CHUNK, 4, TILE_COLUMNS, 4)
        picked = grid[tile, :, :, within, :]  # [T, i, p, b] bytes
        q = jnp.stack([picked & 0xF, picked >> 4], axis=-2).reshape(-1, depth)  # [T, K]: k 32 i + 8 p + 4 h + b
        if weight.bits in (5, 6):  # (_tile_with_high_bits's blocks)
            high_bits = weight.bits - 4
            shape = (weight.values.shape[0], depth // CHUNK, high_bits, TILE_COLUMNS, 4)
            picked_high = weight.values[..., NIBBLE_BYTES:].reshape(shape)[tile, :, :, within, :]  # [T, i, s / n, b]
            mask = (1 << high_bits) - 1
            parts = [(picked_high >> (high_bits * j)) & mask for j in range(8 // high_bits)]
            q = q | (jnp.stack(parts, axis=-2).reshape(-1, depth) << 4)  # [T, i, s / n, s % n, b]: k 32 i + 4 s + b
        q = q.astype(jnp.float32)
        if weight.mins is None:
            q = q - {4: 8.0, 5: 16.0, 6: 32.0}[weight.bits]
    scales = weight.scales[tile, :, within].astype(jnp.float32)  # [T, G]
    mins = None if weight.mins is None else weight.mins[tile, :, within].astype(jnp.float32)
    if weight.super_scales is not None:  # d * sc, -(dmin * m)
        per_super = groups // weight.super_scales.shape[1]
        per_group = lambda a: jnp.repeat(a[tile, :, within].astype(jnp.float32), per_super, axis=1)  # noqa: E731
        scales = per_group(weight.super_scales) * scales
        if weight.super_mins is not None and mins is not None:
            mins = -(per_group(weight.super_mins) * mins)
    w = q.reshape(-1, groups, depth // groups) * scales[:, :, None]
    if mins is not None:
        w = w + mins[:, :, None]
    # an id past the weight's columns: NaN, as jnp.take gives the [K, N] form's lookup (indexing would clamp)
    w = jnp.where((column_ids < weight.shape[1])[:, None, None], w, jnp.nan)
    return w.reshape(-1, depth).astype(dtype or weight.dtype)


def is_tiled(weight) -> TypeGuard[TiledQuantizedWeight]:
    return isinstance(weight, TiledQuantizedWeight)


def _tile_columns(array) -> np.ndarray:
    """[G, N] -> [N / 64, G, 64], on the host."""
    groups, columns = array.shape
    return np.ascontiguousarray(
        np.asarray(array).reshape(groups, columns // TILE_COLUMNS, TILE_COLUMNS).transpose(1, 0, 2)
    )


def _unpack_rows(xp, values):
    """uint8 [K / 2, N] (row 2i low nibble, 2i + 1 high) -> the nibbles [K, N] uint8."""
    half, columns = values.shape
    return xp.stack([values & 0xF, values >> 4], axis=1).reshape(2 * half, columns)


def _unpack_planes(xp, high, bits: int):
    """uint8 [K * bits / 8, N] (row n i + j at bits j * bits, n = 8 / bits) -> [K, N] of `bits`-bit values."""
    per_byte = 8 // bits
    rows, columns = high.shape
    parts = [(high >> (bits * j)) & ((1 << bits) - 1) for j in range(per_byte)]
    return xp.stack(parts, axis=1).reshape(per_byte * rows, columns)


def _tiled_high_bits(xp, values, high_bits: int):
    """Tiled 5- or 6-bit values [t, i, chunk bytes] -> each value's bits above the nibble [t, i, 32, 64] ([tile,
    chunk, k, column])."""
    tiles, chunks, _ = values.shape
    per_byte = 8 // high_bits
    grid = values[..., NIBBLE_BYTES:].reshape(tiles, chunks, high_bits, TILE_COLUMNS, 4)  # [t, i, s / n, c, b]
    mask = (1 << high_bits) - 1
    tops = xp.stack([(grid >> (high_bits * j)) & mask for j in range(per_byte)], axis=3)  # [t, i, s / n, s % n, c, b]
    return tops.transpose(0, 1, 2, 3, 5, 4).reshape(tiles, chunks, CHUNK, TILE_COLUMNS)


def _tiled_nibbles(xp, values):
    """Tiled 4-bit values [t, i, 1024] -> nibbles [t, i, 32, 64] ([tile, chunk, k within the chunk, column])."""
    tiles, chunks, _ = values.shape
    grid = values.reshape(tiles, chunks, 4, TILE_COLUMNS, 4)  # [t, i, p, c, b]
    halves = xp.stack([grid & 0xF, grid >> 4], axis=3)  # [t, i, p, half, c, b]
    return halves.transpose(0, 1, 2, 3, 5, 4).reshape(tiles, chunks, CHUNK, TILE_COLUMNS)
