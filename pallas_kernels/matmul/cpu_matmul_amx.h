// bfloat16 weights (in column panels, cpu_matmul_panels.h, as a [K, N] matrix, or [N, K]: the tied head) times more
// rows than a walk takes (batched decode steps of 9-64 sequences, prefill chunks up to 256 rows), on Intel's AMX
// tiles (Sapphire Rapids and later; issue 29).
//
// Why: on an AMX CPU bfloat16 above a walk's rows went to XLA's dots (YNNPACK on AMX tiles ran batches twice as
// fast as the kernel's widened FMAs; vdpbf16ps issues on one port there, cpu_matmul_bf16_pairs.h), so bfloat16
// weights stayed [K, N] (XLA's dot over panels ran a prefill at 0.46-0.65x), and single-stream bfloat16 read them at
// 0.73-0.75 of the memory roofline where panels read at 0.80-0.88. Here the tiles read the panels: SmolLM2-135M's 30
// layers' projections (two workers, best of 7, session 33), XLA's dots over [K, N] / these tiles over panels: 16 rows
// 24.0 / 13.3-14.1 ms, 64 rows 31.7 / 26.3 ms, 256 rows 65.1 / 55.5 ms.
//
// A tile product (TDPBF16PS) wants its B operand as pairs along K, (w[k, c], w[k + 1, c]) side by side: a panel's
// rows k and k + 1 are 64 contiguous bytes (16 columns each), interleaved by one vpermw into a B tile's row (a
// matrix's two rows: two masked loads). An item is 32 columns of one weight over all of K, for all rows of x (x
// packed once a call as whole A tiles, AmxTiles): its first group of 32 rows streams the
// panels in blocks of 32 rows of K (interleaving each block as it goes, prefetching on), the later groups reuse the
// interleaved item from cache; C tiles hold the sums over all of K, so every output is written once.
//
// Rounding: TDPBF16PS adds pairs of products into float32 in its own order (not the walks' FMAs in K's order: on
// this CPU 2 in 3 outputs differ in the last bits from a one-row call), and flushes denormals. So rows above a walk's
// are not the bits of a one-row call (as XLA's dots were not): the Python side sends a verify step's rows in blocks
// a walk takes (pallas_kernels/matmul/__init__.py, SmallMatmul), so greedy outputs with speculation on stay those of
// decode steps of that many rows.
//
// Linux grants the tiles' state to a process that asks (arch_prctl, kernel 5.16 and later); where it does not, or
// where the compiler's target lacks AMX, kAmxTiles is false or AmxTilesGranted() says no: cpu.py's amx_tiles() then
// tells the Python side, whose plan keeps bfloat16 [K, N] and sends its calls above 8 rows to XLA's dots as before.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_matmul_bf16_pairs.h"
#include "cpu_matmul_vectors.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BW__) && !defined(JAXSERVE_NO_AMX)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define JAXSERVE_AMX_TILES 1
#endif

namespace {

#ifdef JAXSERVE_AMX_TILES
constexpr bool kAmxTiles = !kBf16Pairs;  // JAXSERVE_BF16_PAIRS_WITH_AMX: the pairs serve bfloat16 (their A/B)

inline bool AmxTilesGranted() {
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtileData = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtileData) == 0;
  }();
  return granted;
}

constexpr int64_t kAmxRows = 16;      // rows of an A or C tile
constexpr int64_t kAmxDepth = 32;     // bfloat16 of K in an A tile's row (64 bytes)
constexpr int64_t kAmxItemColumns = 2 * kPanelColumns;  // two panels: two C tiles side by side
constexpr int64_t kAmxAheadBlocks = 2;  // the item's first group prefetches this many blocks of K on (2, 8, 16 alike)

// Tiles 0-3: C (row groups 0 / 1 by panels 0 / 1); 4, 5: A (row groups); 6, 7: B (panels). Every tile 16 rows of 64
// bytes. Loaded by each item, released after it: another library's tiles (XLA's) may run on the same thread between.
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

inline void LoadAmxConfig() {
  AmxConfig config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = uint8_t(kAmxRows);
  _tile_loadconfig(&config);
}

// x [M, K] (bfloat16, rows `stride` apart) with its rows padded to whole A tiles and K to whole A rows with zeros,
// so that every tile load stays inside and the padding multiplies to nothing.
// Kept by the calling thread across calls (a fresh vector each call faulted its pages in again).
inline const uint16_t* AmxRows(const uint16_t* x, int64_t stride, int64_t rows, int64_t depth, int64_t padded_rows,
                               int64_t padded_depth) {
  thread_local std::vector<uint16_t> out;
  if (int64_t(out.size()) < padded_rows * padded_depth) out.resize(padded_rows * padded_depth);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(&out[r * padded_depth], x + r * stride, depth * sizeof(uint16_t));
    std::fill(&out[r * padded_depth + depth], &out[r * padded_depth] + padded_depth, uint16_t(0));
  }
  std::fill(&out[rows * padded_depth], &out[padded_rows * padded_depth], uint16_t(0));
  return out.data();
}

// x [M, K] as A tiles, each 1 KiB contiguous ([M / 16][K / 32][16][32], zeros past M and K): a tile loads as 16
// consecutive lines (from rows `padded_depth` apart it loaded 16 lines a row apart from L2, and the calls above 8
// rows ran at a fifth of the tiles' rate). Kept by the calling thread across calls.
inline const uint16_t* AmxTiles(const uint16_t* x, int64_t stride, int64_t rows, int64_t depth, int64_t padded_rows,
                                int64_t padded_depth) {
  constexpr int64_t kTile = kAmxRows * kAmxDepth;
  const int64_t blocks = padded_depth / kAmxDepth;
  thread_local std::vector<uint16_t> out;
  if (int64_t(out.size()) < padded_rows * padded_depth) out.resize(padded_rows * padded_depth);
  for (int64_t r = 0; r < padded_rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      uint16_t* to = &out[((r / kAmxRows * blocks + b) * kAmxRows + r % kAmxRows) * kAmxDepth];
      const int64_t count = r < rows ? std::clamp<int64_t>(depth - b * kAmxDepth, 0, kAmxDepth) : 0;
      if (count > 0) std::memcpy(to, x + r * stride + b * kAmxDepth, count * sizeof(uint16_t));
      std::fill(to + count, to + kAmxDepth, uint16_t(0));
    }
  }
  static_assert(kTile == 512);
  return out.data();
}

// A worker's interleaved item, [padded_depth / 2][2 panels][32], reused across items and calls.
inline uint16_t* AmxItemBuffer(int64_t elements) {
  thread_local std::vector<uint16_t> buffer;
  if (int64_t(buffer.size()) < elements) buffer.resize(elements);
  return buffer.data();
}

// An item's columns of a [K, N] weight: two panels (w[k, c] at w + (c / 16) * panel_stride + k * 16 + c % 16; a
// panel's rows k and k + 1 are 64 contiguous bytes, and its columns past N zeros) or, stored as a matrix, 32 columns
// of its rows (row_stride N, panel_stride 16).
struct AmxColumns {
  const uint16_t* w;
  int64_t row_stride, panel_stride, depth, columns;  // columns: those of the item's 32 that the weight has
  bool panels;
};

// K rows [k0, k0 + 32) of the item interleaved in pairs into the B tiles' rows at `to` ([16][2][32]); zeros past K
// and past the weight's columns (masked loads: nothing past the weight is read).
inline void InterleaveBlock(const AmxColumns& item, int64_t k0, uint16_t* to) {
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                         5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int q = 0; q < 2; ++q) {
    const int64_t columns = std::clamp<int64_t>(item.columns - q * kPanelColumns, 0, kPanelColumns);
    const uint16_t* panel = item.w + q * item.panel_stride;
    if (columns > 0 && k0 + (kAmxAheadBlocks + 1) * kAmxDepth <= item.depth) {  // a line a pair of rows
      for (int64_t j = 0; j < kAmxRows; ++j) {
        __builtin_prefetch(panel + (k0 + kAmxAheadBlocks * kAmxDepth + 2 * j) * item.row_stride);
        if (!item.panels) __builtin_prefetch(panel + (k0 + kAmxAheadBlocks * kAmxDepth + 2 * j + 1) * item.row_stride);
      }
    }
    const __mmask16 column_mask = __mmask16((1u << columns) - 1);
    for (int64_t j = 0; j < kAmxRows; ++j) {
      const int64_t k = k0 + 2 * j;
      const int64_t rows = columns > 0 ? std::clamp<int64_t>(item.depth - k, 0, 2) : 0;
      __m512i v;
      if (item.panels) {
        const __mmask32 mask = rows == 2 ? ~__mmask32(0) : rows == 1 ? __mmask32(0xFFFF) : 0;
        v = _mm512_maskz_loadu_epi16(mask, panel + k * kPanelColumns);
      } else {
        const __m256i first = _mm256_maskz_loadu_epi16(rows >= 1 ? column_mask : 0, panel + k * item.row_stride);
        const __m256i second = _mm256_maskz_loadu_epi16(rows == 2 ? column_mask : 0, panel + (k + 1) * item.row_stride);
        v = _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
      }
      _mm512_storeu_si512(to + (j * 2 + q) * kAmxItemColumns, _mm512_permutexvar_epi16(pairs, v));
    }
  }
}

// The C tiles of a group of up to 32 rows into out (rows ldo apart): `rows` rows by `columns` columns.
inline void StoreAmxGroup(int64_t rows, int64_t columns, float* out, int64_t ldo) {
  if (rows >= 2 * kAmxRows && columns == kAmxItemColumns) {
    _tile_stored(0, out, ldo * 4);
    _tile_stored(1, out + kPanelColumns, ldo * 4);
    _tile_stored(2, out + kAmxRows * ldo, ldo * 4);
    _tile_stored(3, out + kAmxRows * ldo + kPanelColumns, ldo * 4);
    return;
  }
  alignas(64) float sums[2 * kAmxRows][kAmxItemColumns];
  _tile_stored(0, &sums[0][0], sizeof(sums[0]));
  _tile_stored(1, &sums[0][kPanelColumns], sizeof(sums[0]));
  if (rows > kAmxRows) {
    _tile_stored(2, &sums[kAmxRows][0], sizeof(sums[0]));
    _tile_stored(3, &sums[kAmxRows][kPanelColumns], sizeof(sums[0]));
  }
  for (int64_t r = 0; r < rows; ++r) std::memcpy(out + r * ldo, sums[r], columns * sizeof(float));
}

// One group of up to 32 rows of x (its A tiles, AmxTiles: the second 16 rows' `group_stride` elements on) by the
// interleaved item over all of K; when `from` is given, each block of K is interleaved from the weight first (the
// item's first group).
inline void AmxGroup(const uint16_t* x, int64_t group_stride, int64_t padded_depth, int64_t rows,
                     const AmxColumns* from, uint16_t* item, float* out, int64_t ldo, int64_t columns) {
  const bool two = rows > kAmxRows;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k0 = 0; k0 < padded_depth; k0 += kAmxDepth) {
    uint16_t* block = item + k0 * kAmxItemColumns;
    if (from != nullptr) InterleaveBlock(*from, k0, block);
    const uint16_t* a = x + k0 * kAmxRows;  // block k0 / 32's tile, 512 elements a block
    _tile_loadd(4, a, kAmxDepth * 2);
    _tile_loadd(6, block, kAmxItemColumns * 4);
    _tile_loadd(7, block + kAmxItemColumns, kAmxItemColumns * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a + group_stride, kAmxDepth * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  StoreAmxGroup(rows, columns, out, ldo);
}

// A call of bfloat16 [K, N] weights (in panels or not) with more rows than a walk takes: items of 32 columns over
// all of K, shared by the threads; every output written once.
inline void RunAmxColumns(const std::vector<Problem>& problems, int64_t num_workers) {
  const int64_t rows = problems[0].rows, depth = problems[0].depth;
  const int64_t padded_rows = (rows + kAmxRows - 1) / kAmxRows * kAmxRows;
  const int64_t padded_depth = (depth + kAmxDepth - 1) / kAmxDepth * kAmxDepth;
  const uint16_t* x = AmxTiles(problems[0].x16, problems[0].x16_stride, rows, depth, padded_rows, padded_depth);
  std::vector<std::pair<int64_t, int64_t>> items;  // (weight, first column)
  for (size_t i = 0; i < problems.size(); ++i) {
    for (int64_t c0 = 0; c0 < problems[i].columns; c0 += kAmxItemColumns) items.emplace_back(int64_t(i), c0);
  }
  jaxserve_cpu::RunItems(num_workers, int64_t(items.size()), [&](int64_t, int64_t index) {
    const auto [i, c0] = items[index];
    const Problem& p = problems[i];
    const auto* w = static_cast<const uint16_t*>(p.w);
    const int64_t columns = std::min(kAmxItemColumns, p.columns - c0);
    const AmxColumns from = p.panels ? AmxColumns{w + c0 * depth, kPanelColumns, depth * kPanelColumns, depth, columns, true}
                                     : AmxColumns{w + c0, p.columns, kPanelColumns, depth, columns, false};
    uint16_t* item = AmxItemBuffer(std::max<int64_t>(1, padded_depth * kAmxItemColumns));
    LoadAmxConfig();
    for (int64_t r0 = 0; r0 < rows; r0 += 2 * kAmxRows) {
      AmxGroup(x + r0 * padded_depth, kAmxRows * padded_depth, padded_depth, std::min(2 * kAmxRows, rows - r0),
               r0 == 0 ? &from : nullptr,
               item, p.out + r0 * p.columns + c0, p.columns, columns);
    }
    _tile_release();
  });
}

// [N, K] weights (a tied embedding as the head): the tiles compute out^T = w x^T, A tiles straight from w's rows
// (16 outputs by 32 of K, K apart) and B tiles from x's rows in pairs, x^T packed once a call: for each group of 16
// rows and block of 32 of K, [16 pairs][16 rows] of 32-bit pairs (x[r, k], x[r, k + 1]).
constexpr int64_t kAmxNkItemRows = 128;  // outputs (weight rows) per item: 4 blocks of two A tiles

inline const uint32_t* AmxPairsByRow(const uint16_t* x, int64_t padded_rows, int64_t padded_depth) {
  const int64_t blocks = padded_depth / kAmxDepth;
  thread_local std::vector<uint32_t> pairs;  // kept by the calling thread, as AmxRows's
  if (int64_t(pairs.size()) < padded_rows * padded_depth / 2) pairs.resize(padded_rows * padded_depth / 2);
  for (int64_t g = 0; g < padded_rows / kAmxRows; ++g) {
    for (int64_t b = 0; b < blocks; ++b) {
      uint32_t* tile = pairs.data() + (g * blocks + b) * kAmxRows * kAmxRows;
      for (int64_t j = 0; j < kAmxRows; ++j) {
        for (int64_t r = 0; r < kAmxRows; ++r) {
          std::memcpy(tile + j * kAmxRows + r, &x[(g * kAmxRows + r) * padded_depth + b * kAmxDepth + 2 * j], 4);
        }
      }
    }
  }
  return pairs.data();
}

// Where an A tile of 16 weight rows from n0 by K [k0, k0 + 32) loads from (its rows `stride` bytes apart): w itself,
// or for rows past N or K past its end a zero-padded copy in `padded`, so that nothing past the weight is read.
// (GCC's tile intrinsics take the tile's number as a literal: the callers load.)
inline const uint16_t* WeightRows(const uint16_t* w, int64_t outputs, int64_t depth, int64_t n0, int64_t k0,
                                  uint16_t (&padded)[kAmxRows][kAmxDepth], int64_t& stride) {
  if (n0 + kAmxRows <= outputs && k0 + kAmxDepth <= depth) {
    stride = depth * 2;
    return w + n0 * depth + k0;
  }
  std::memset(padded, 0, sizeof(padded));
  const int64_t count = std::clamp<int64_t>(depth - k0, 0, kAmxDepth);
  for (int64_t n = n0; n < std::min(outputs, n0 + kAmxRows); ++n) {
    std::memcpy(padded[n - n0], w + n * depth + k0, count * sizeof(uint16_t));
  }
  stride = kAmxDepth * 2;
  return &padded[0][0];
}

// A C tile's sums ([16 outputs][16 rows]) into out [rows, outputs] at (r0, n0), transposed; rows and outputs past
// the call's dropped.
inline void StoreTransposed(const float (&sums)[kAmxRows][kAmxRows], float* out, int64_t ldo, int64_t r0, int64_t rows,
                            int64_t n0, int64_t outputs) {
  const int64_t nr = std::min(kAmxRows, rows - r0), nn = std::min(kAmxRows, outputs - n0);
  if (nn == kAmxRows) {  // a row of out is a column of the tile: one gather from L1 (scalar moves: 256 a tile)
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(int(kAmxRows)));
    for (int64_t r = 0; r < nr; ++r) {
      _mm512_storeu_ps(out + (r0 + r) * ldo + n0, _mm512_i32gather_ps(column, &sums[0][r], sizeof(float)));
    }
    return;
  }
  for (int64_t r = 0; r < nr; ++r) {
    for (int64_t n = 0; n < nn; ++n) out[(r0 + r) * ldo + n0 + n] = sums[n][r];
  }
}

inline void RunAmxTransposed(const std::vector<Problem>& problems, int64_t num_workers) {
  const int64_t rows = problems[0].rows, depth = problems[0].depth;
  const int64_t padded_rows = (rows + kAmxRows - 1) / kAmxRows * kAmxRows;
  const int64_t padded_depth = (depth + kAmxDepth - 1) / kAmxDepth * kAmxDepth;
  const int64_t groups = padded_rows / kAmxRows, blocks = padded_depth / kAmxDepth;
  const uint32_t* x = AmxPairsByRow(AmxRows(problems[0].x16, problems[0].x16_stride, rows, depth, padded_rows, padded_depth),
                                                padded_rows, padded_depth);
  std::vector<std::pair<int64_t, int64_t>> items;  // (weight, first output)
  for (size_t i = 0; i < problems.size(); ++i) {
    for (int64_t n0 = 0; n0 < problems[i].columns; n0 += kAmxNkItemRows) items.emplace_back(int64_t(i), n0);
  }
  jaxserve_cpu::RunItems(num_workers, int64_t(items.size()), [&](int64_t, int64_t index) {
    const auto [i, first] = items[index];
    const Problem& p = problems[i];
    const auto* w = static_cast<const uint16_t*>(p.w);
    const int64_t outputs = p.columns;
    alignas(64) uint16_t padded[kAmxRows][kAmxDepth];
    alignas(64) float sums[kAmxRows][kAmxRows];
    LoadAmxConfig();
    for (int64_t n0 = first; n0 < std::min(outputs, first + kAmxNkItemRows); n0 += 2 * kAmxRows) {
      const bool second_outputs = n0 + kAmxRows < outputs;
      for (int64_t g = 0; g < groups; g += 2) {
        const bool second_rows = g + 1 < groups;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t b = 0; b < blocks; ++b) {
          int64_t stride;
          _tile_loadd(4, WeightRows(w, outputs, depth, n0, b * kAmxDepth, padded, stride), stride);
          _tile_loadd(6, x + (g * blocks + b) * kAmxRows * kAmxRows, kAmxRows * 4);
          _tile_dpbf16ps(0, 4, 6);
          if (second_rows) {
            _tile_loadd(7, x + ((g + 1) * blocks + b) * kAmxRows * kAmxRows, kAmxRows * 4);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (second_outputs) {
            _tile_loadd(5, WeightRows(w, outputs, depth, n0 + kAmxRows, b * kAmxDepth, padded, stride), stride);
            _tile_dpbf16ps(2, 5, 6);
            if (second_rows) _tile_dpbf16ps(3, 5, 7);
          }
        }
        const int64_t r0 = g * kAmxRows, bytes = sizeof(sums[0]);
        _tile_stored(0, sums, bytes);
        StoreTransposed(sums, p.out, outputs, r0, rows, n0, outputs);
        if (second_rows) {
          _tile_stored(1, sums, bytes);
          StoreTransposed(sums, p.out, outputs, r0 + kAmxRows, rows, n0, outputs);
        }
        if (second_outputs) {
          _tile_stored(2, sums, bytes);
          StoreTransposed(sums, p.out, outputs, r0, rows, n0 + kAmxRows, outputs);
        }
        if (second_outputs && second_rows) {
          _tile_stored(3, sums, bytes);
          StoreTransposed(sums, p.out, outputs, r0 + kAmxRows, rows, n0 + kAmxRows, outputs);
        }
      }
    }
    _tile_release();
  });
}
#else
constexpr bool kAmxTiles = false;
inline bool AmxTilesGranted() { return false; }
inline void RunAmxColumns(const std::vector<Problem>&, int64_t) {}
inline void RunAmxTransposed(const std::vector<Problem>&, int64_t) {}
#endif

// Whether a call of `rows` rows of T goes to the tiles (cpu_matmul.cc's WidenAndRun and Run).
template <typename T>
inline bool OnAmxTiles(int64_t rows) {
  return std::is_same_v<T, BF16> && kAmxTiles && rows > kWalkRows && AmxTilesGranted();
}

}  // namespace
