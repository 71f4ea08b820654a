// [K, N] weights stored in column panels (cpu_matmul.cc, issue 29): w[k, n] at panels[n / P][k][n % P], P =
// kPanelColumns (16) columns a panel, the last panel padded with zeros past N. The engine stores its float
// projections so on the CPU (pallas_kernels/matmul/cpu.py, ColumnPanels).
//
// Why: one row of x reads every weight byte once, and reading is all it does. A [K, N] weight read by register
// tiles goes in column strips (a tile's columns of each of a block's rows, N elements apart), and the layers'
// calls read at 0.83-0.90 of a two-thread stream where the tied head, read [N, K] as a few long runs side by
// side (NkStreams), reads at 1.0 (docs/notes/cpu-kernels.md, sessions 23-24). In panels a tile of G panels reads
// G long runs in address order, one per panel: SmolLM2-135M's 30 layers at one row, two workers, Intel Xeon (AMX):
// float32 0.89 -> 1.01 of the stream, bfloat16 0.83 -> 0.97 (a harness beside bench/cpu_matmul_stream.cc,
// session 32: one panel of 128 columns, a single run, read no faster than the strips: the runs side by side are
// what the prefetchers want). [N, K] itself would do as well at one row but sums each output as a dot product
// (lane partials, then a horizontal tree): the many-row tiles would have to keep that order.
//
// Each output's terms are added in K's order, whatever the rows, as in the [K, N] walks (Row invariance,
// cpu_matmul.cc): the call is cut as the quantized kernels cut theirs (cpu_call_plan.h: the call's one-row
// blocks in order as one sequence of bytes, cut along K only where a run ends), the same cut at every row count,
// a piece's K range walked from zero (up to kWalkRows rows: tiles straight from the panels; more: passes packed
// and widened once, KnRows; bfloat16 on AVX-512 BF16 CPUs in vdpbf16ps pairs at every row count, the cut between
// pairs of K rows: PanelPairPiece) and the pieces past a block's first K added in K's order after the runs.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_call_plan.h"

namespace {

constexpr int64_t kPanelColumns = 16;                           // P: pallas_kernels/matmul/cpu.py's PANEL_COLUMNS
constexpr int kPanelVectors = int(kPanelColumns / kLanes);       // vectors across a panel: 1, 2 or 4
constexpr int64_t kPanelBlockColumns = kWalkVectors[1] * kLanes;  // a one-row tile's panels: a block of the cut
constexpr int64_t kPanelAheadRows = 16;   // software prefetch this many panel rows ahead (bfloat16 0.85 -> 0.99)
constexpr int64_t kPanelBlockRows = 64;   // rows of a tile before the second group of rows of x reads them again

inline int64_t Panels(int64_t columns) { return (columns + kPanelColumns - 1) / kPanelColumns; }

// R rows of x by G whole panels (w: the first panel's row k0; panels `panel_stride` elements apart) over `count`
// rows, added into out [R, G * P] (rows ldo apart). Prefetches each panel `ahead` rows on.
// bfloat16 where kWalkEvenOdd (avx2, portable: cpu_matmul_few_rows.h's EvenOddWeights) widens a panel row's pairs
// of elements by a shift and an and, the accumulators in [evens, odds] order while the tile runs (the same FMAs per
// output in the same order: the same bits).
template <typename T, int R, int G>
inline void PanelTile(const float* x, int64_t ldx, const typename T::Stored* w, int64_t panel_stride, int64_t count,
                      int64_t ahead, float* out, int64_t ldo) {
  using S = typename T::Stored;
  constexpr int VP = kPanelVectors;
  constexpr bool kEvenOdd = kWalkEvenOdd && std::is_same_v<T, BF16> && VP % 2 == 0;
  // A tile of one panel and 3+ rows (avx2, portable) computes long enough per panel row that the hardware's
  // prefetch, restarting at each panel's block (4 KiB of float32 a panel, the next panel K x 64 bytes on), leaves
  // it waiting: it also fetches the next panel's row as it reads its own, a whole tile ahead. Session 43,
  // cpu_matmul_stream two workers from memory, in-process alternation (median of 15 rounds, off / on): float32 3
  // rows 1.06x, 4: 1.13x, 5-6: 1.03-1.04x, 7: 1.06x, 8: 1.08x; bfloat16 3 / 4 / 8 rows 1.08 / 1.14 / 1.11x; two
  // rows (two panels a tile) 0.97-0.99x, so not there.
  constexpr bool kPrefetchNextTile = G == 1 && R >= 3;
  if constexpr (kEvenOdd) {
    for (int r = 0; r < R; ++r) EvenOddColumns(out + r * ldo, G * kPanelColumns, false);
  }
  VecF acc[R][G][VP];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
      for (int v = 0; v < VP; ++v) acc[r][g][v] = LoadF(out + r * ldo + g * kPanelColumns + v * kLanes);
  for (int64_t k = 0; k < count; ++k) {
    VecF wv[G][VP];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const S* row = w + g * panel_stride + k * kPanelColumns;
      if (ahead != 0) __builtin_prefetch(row + ahead * kPanelColumns, 0, JAXSERVE_WALK_LOCALITY);
      if (kPrefetchNextTile && ahead != 0) __builtin_prefetch(row + panel_stride, 0, JAXSERVE_WALK_LOCALITY);
      if constexpr (kEvenOdd) {
#pragma GCC unroll 4
        for (int v = 0; v < VP; v += 2) EvenOddWeights(row + v * kLanes, wv[g][v], wv[g][v + 1]);
      } else {
#pragma GCC unroll 4
        for (int v = 0; v < VP; ++v) wv[g][v] = LoadedOnce<R>(T::Vector(row + v * kLanes));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const VecF xb = Broadcast(x[r * ldx + k]);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
        for (int v = 0; v < VP; ++v) acc[r][g][v] = Fma(xb, wv[g][v], acc[r][g][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
      for (int v = 0; v < VP; ++v) StoreF(out + r * ldo + g * kPanelColumns + v * kLanes, acc[r][g][v]);
  if constexpr (kEvenOdd) {
    for (int r = 0; r < R; ++r) EvenOddColumns(out + r * ldo, G * kPanelColumns, true);
  }
}

// One group of R rows by the panels of `width` columns (the last panel may be partial: its tile runs on a copy of
// its columns, zeros past them, whose padded lanes are dropped).
template <typename T, int R, int G>
inline void PanelGroup(const float* x, int64_t ldx, const typename T::Stored* w, int64_t panel_stride, int64_t count,
                       int64_t ahead, int64_t width, float* out, int64_t ldo) {
  const int64_t whole = width / kPanelColumns;
  int64_t panel = 0;
  for (; panel + G <= whole; panel += G) {
    PanelTile<T, R, G>(x, ldx, w + panel * panel_stride, panel_stride, count, ahead, out + panel * kPanelColumns, ldo);
  }
  for (; panel < whole; ++panel) {
    PanelTile<T, R, 1>(x, ldx, w + panel * panel_stride, panel_stride, count, ahead, out + panel * kPanelColumns, ldo);
  }
  const int64_t c0 = whole * kPanelColumns, rest = width - c0;
  if (rest == 0) return;
  float last[R][kPanelColumns] = {};
  for (int r = 0; r < R; ++r) std::memcpy(last[r], out + r * ldo + c0, rest * sizeof(float));
  PanelTile<T, R, 1>(x, ldx, w + whole * panel_stride, panel_stride, count, ahead, &last[0][0], kPanelColumns);
  for (int r = 0; r < R; ++r) std::memcpy(out + r * ldo + c0, last[r], rest * sizeof(float));
}

// R rows of x (up to kWalkRows) by panel rows [0, count) of `width` columns, added into out: R1 rows, then (more
// rows than a register tile holds) R2 over the same panel rows, in blocks of kPanelBlockRows so that they are in L1.
template <typename T, int R>
void PanelWalk(const float* x, int64_t ldx, const typename T::Stored* w, int64_t panel_stride, int64_t count,
               int64_t width, float* out, int64_t ldo) {
  // More rows than one tile holds (7-8 on avx2 / portable): float32 runs a first group of kWalkGroupRows (12
  // accumulators) and the rest, where two even groups (8 accumulators each at 8 rows) read the step's calls 8-12%
  // slower from memory on an AVX2-only AMD EPYC (session 38, cpu_matmul_stream 7 / 8 2 panels); bfloat16's
  // widened pairs ran ~3% slower that way, so they keep the even groups. Each output's FMAs are in K's order
  // either way: the same bits.
  constexpr int R1 = R <= kWalkGroupRows ? R : std::is_same_v<T, F32> ? kWalkGroupRows : (R + 1) / 2;
  constexpr int R2 = R - R1;
  constexpr int G = std::max(1, kWalkVectors[R1] / kPanelVectors);
  for (int64_t kb = 0; kb < count; kb += kPanelBlockRows) {
    const int64_t rows = std::min(kPanelBlockRows, count - kb);
    const int64_t ahead = kb + rows < count ? kPanelAheadRows : 0;
    const auto* wb = w + kb * kPanelColumns;
    PanelGroup<T, R1, G>(x + kb, ldx, wb, panel_stride, rows, ahead, width, out, ldo);
    if constexpr (R2 > 0) PanelGroup<T, R2, G>(x + R1 * ldx + kb, ldx, wb, panel_stride, rows, 0, width, out + R1 * ldo, ldo);
  }
}

template <typename T, int R>
void PanelWalkRows(int rows, const float* x, int64_t ldx, const typename T::Stored* w, int64_t panel_stride,
                   int64_t count, int64_t width, float* out, int64_t ldo) {
  if constexpr (R > 0) {
    if (rows == R) return PanelWalk<T, R>(x, ldx, w, panel_stride, count, width, out, ldo);
    PanelWalkRows<T, R - 1>(rows, x, ldx, w, panel_stride, count, width, out, ldo);
  }
}

// Panel rows [0, count) of `width` columns (w: the first panel's first row), widened into packed [count, width].
template <typename T>
void PackPanels(const typename T::Stored* w, int64_t panel_stride, int64_t count, int64_t width, float* packed) {
  for (int64_t c0 = 0; c0 < width; c0 += kPanelColumns) {
    const auto* panel = w + c0 / kPanelColumns * panel_stride;
    const int64_t columns = std::min(kPanelColumns, width - c0);
    for (int64_t k = 0; k < count; ++k) {
      const auto* row = panel + k * kPanelColumns;
      float* to = packed + k * width + c0;
      if (columns == kPanelColumns) {
#pragma GCC unroll 4
        for (int v = 0; v < kPanelVectors; ++v) StoreF(to + v * kLanes, T::Vector(row + v * kLanes));
      } else {
        for (int64_t c = 0; c < columns; ++c) to[c] = T::One(row[c]);
      }
    }
  }
}

#ifdef JAXSERVE_BF16_PAIRS
// bfloat16 panels where the library multiplies in vdpbf16ps pairs (cpu_matmul_bf16_pairs.h: AVX-512 BF16 without
// AMX). A panel's rows k and k + 1 are 64 contiguous bytes (16 columns each): one load, and one vpermw makes the 16
// pairs (w[k, c], w[k + 1, c]) that vdpbf16ps multiplies by x's pair (x[k], x[k + 1]). The many-row passes pack a
// pass's pairs from the panels (PackPanelPairs) for the pair tiles (PairRows). Each output adds its pairs in K's
// order from its piece's first row at every row count, one vdpbf16ps a pair, as the [K, N] pair walks and
// PairItem do: a row's sums are the same bits in a call of any rows (Row invariance).
//
// Why panels here too (issue 29): bfloat16 stayed [K, N] on these CPUs for the pair tiles, whose one-row walk reads
// two rows' column strips and interleaves them; one decode step's 120 layer calls from a huge-page arena in an XLA
// program (/tmp-style script, in-process alternation, AMD EPYC Zen 4) ran 1.33x as long as in widened panels (1 row;
// 1.05x at 4 rows, 0.96x at 8), while widened panels ran 16 rows 1.26x and 48 rows 1.39x as long as the pairs.

inline __m512i PanelPairOrder() {  // a0 b0 a1 b1 ... a15 b15 from a0..a15 b0..b15 (rows k and k + 1 of a panel)
  alignas(64) static constexpr uint16_t kOrder[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_load_si512(kOrder);
}

// Panel rows k and k + 1 (the second as zeros where `both` is false: an odd count's last row) as 16 pairs.
inline __m512bh PanelPair(const uint16_t* row, bool both, __m512i order) {
  const __m512i rows = both ? _mm512_loadu_si512(row) : _mm512_maskz_loadu_epi16(0xFFFF, row);
  return (__m512bh)_mm512_permutexvar_epi16(order, rows);
}

// R rows of x (bfloat16, ldx apart, from the piece's first K) by G whole panels over `count` panel rows, added
// into out [R, G * P]. Prefetches each panel `ahead` rows on.
template <int R, int G>
inline void PanelPairTile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t panel_stride, int64_t count,
                          int64_t ahead, float* out, int64_t ldo) {
  static_assert(kPanelColumns == kLanes, "a panel's pairs are one vector of float32 sums");
  const __m512i order = PanelPairOrder();
  __m512 acc[R][G];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_loadu_ps(out + r * ldo + g * kPanelColumns);
  for (int64_t k = 0; k < count; k += 2) {
    const bool both = k + 1 < count;
    __m512bh wv[G];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const uint16_t* row = w + g * panel_stride + k * kPanelColumns;
      if (ahead != 0) __builtin_prefetch(row + ahead * kPanelColumns, 0, JAXSERVE_WALK_LOCALITY);
      wv[g] = PanelPair(row, both, order);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = PairBroadcast(x + r * ldx + k);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], xb, wv[g]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(out + r * ldo + g * kPanelColumns, acc[r][g]);
}

// PanelGroup's pairs: R rows by the panels of `width` columns (a partial last panel through a copy of its columns).
template <int R, int G>
inline void PanelPairGroup(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t panel_stride, int64_t count,
                           int64_t ahead, int64_t width, float* out, int64_t ldo) {
  const int64_t whole = width / kPanelColumns;
  int64_t panel = 0;
  for (; panel + G <= whole; panel += G) {
    PanelPairTile<R, G>(x, ldx, w + panel * panel_stride, panel_stride, count, ahead, out + panel * kPanelColumns, ldo);
  }
  for (; panel < whole; ++panel) {
    PanelPairTile<R, 1>(x, ldx, w + panel * panel_stride, panel_stride, count, ahead, out + panel * kPanelColumns, ldo);
  }
  const int64_t c0 = whole * kPanelColumns, rest = width - c0;
  if (rest == 0) return;
  float last[R][kPanelColumns] = {};
  for (int r = 0; r < R; ++r) std::memcpy(last[r], out + r * ldo + c0, rest * sizeof(float));
  PanelPairTile<R, 1>(x, ldx, w + whole * panel_stride, panel_stride, count, ahead, &last[0][0], kPanelColumns);
  for (int r = 0; r < R; ++r) std::memcpy(out + r * ldo + c0, last[r], rest * sizeof(float));
}

// PanelWalk's pairs (up to kWalkRows rows, one group: AVX-512 has the registers), in blocks of kPanelBlockRows
// (even: the pairs stay aligned to the piece's first row).
template <int R>
void PanelPairWalk(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t panel_stride, int64_t count,
                   int64_t width, float* out, int64_t ldo) {
  static_assert(kPanelBlockRows % 2 == 0);
  constexpr int G = std::max(1, kWalkVectors[R]);
  for (int64_t kb = 0; kb < count; kb += kPanelBlockRows) {
    const int64_t rows = std::min(kPanelBlockRows, count - kb);
    const int64_t ahead = kb + rows < count ? kPanelAheadRows : 0;
    PanelPairGroup<R, G>(x + kb, ldx, w + kb * kPanelColumns, panel_stride, rows, ahead, width, out, ldo);
  }
}

template <int R>
void PanelPairWalkRows(int rows, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t panel_stride,
                       int64_t count, int64_t width, float* out, int64_t ldo) {
  if constexpr (R > 0) {
    if (rows == R) return PanelPairWalk<R>(x, ldx, w, panel_stride, count, width, out, ldo);
    PanelPairWalkRows<R - 1>(rows, x, ldx, w, panel_stride, count, width, out, ldo);
  }
}

// Panel rows [0, count) of `width` columns as PackPairs lays out a [K, N] pass: pair j's row holds, for each column
// c < padded, w[2j, c] then w[2j + 1, c] (the panels' zeros past the weight's columns, zeros for an odd count's
// missing row).
inline void PackPanelPairs(const uint16_t* w, int64_t panel_stride, int64_t count, int64_t padded, uint16_t* packed) {
  const __m512i order = PanelPairOrder();
  for (int64_t j = 0; 2 * j < count; ++j) {
    const bool both = 2 * j + 1 < count;
    uint16_t* to = packed + j * 2 * padded;
    for (int64_t c0 = 0; c0 < padded; c0 += kPanelColumns) {
      const uint16_t* row = w + c0 / kPanelColumns * panel_stride + 2 * j * kPanelColumns;
      _mm512_storeu_si512(to + 2 * c0, (__m512i)PanelPair(row, both, order));
    }
  }
}

// PanelPiece for bfloat16 pairs: the walks up to kWalkRows rows, else passes of packed pairs through the pair tiles;
// both add into out, cleared by the caller. The piece starts at an even K (RunPanels cuts between pairs of rows), so
// an odd count's last pair is K's last row and x16's zero pad.
inline void PanelPairPiece(const Problem& p, const jaxserve_cpu::CallPiece& piece, float* out, int64_t ldo) {
  const int64_t panel_stride = p.depth * kPanelColumns, count = piece.g1 - piece.g0;
  const auto* w = static_cast<const uint16_t*>(p.w) + piece.c0 / kPanelColumns * panel_stride + piece.g0 * kPanelColumns;
  const uint16_t* x = p.x16 + piece.g0;
  if (p.rows <= kWalkRows) {
    return PanelPairWalkRows<kWalkRows>(int(p.rows), x, p.x16_stride, w, panel_stride, count, piece.width, out, ldo);
  }
  const int64_t chunk = PassRows(piece.width), padded = Panels(piece.width) * kPanelColumns;  // (chunk: even)
  uint16_t* packed = PairBuffer(chunk / 2 * 2 * padded);
  for (int64_t k = 0; k < count; k += chunk) {
    const int64_t rows = std::min(chunk, count - k), pairs = (rows + 1) / 2;
    PackPanelPairs(w + k * kPanelColumns, panel_stride, rows, padded, packed);
    int64_t r0 = 0;
    for (; r0 + kKnRows <= p.rows; r0 += kKnRows) {
      PairRows<kKnRows>(x + r0 * p.x16_stride + k, p.x16_stride, packed, pairs, piece.width, padded, out + r0 * ldo,
                        ldo);
    }
    if (r0 < p.rows) {
      PairRemainder<kKnRows - 1>(int(p.rows - r0), x + r0 * p.x16_stride + k, p.x16_stride, packed, pairs,
                                 piece.width, padded, out + r0 * ldo, ldo);
    }
  }
}
#endif

// One piece of the cut (a weight's columns [c0, c0 + width), panel rows [g0, g1)) for all rows of x, into out
// (rows ldo apart): up to kWalkRows rows added into out as the caller cleared it; more, written from zero in
// passes of `chunk` packed rows, as KnItem's (bfloat16 pairs: added into out at every row count, PanelPairPiece).
template <typename T>
void PanelPiece(const Problem& p, const jaxserve_cpu::CallPiece& piece, float* out, int64_t ldo) {
#ifdef JAXSERVE_BF16_PAIRS
  if constexpr (std::is_same_v<T, BF16>) return PanelPairPiece(p, piece, out, ldo);
#endif
  const int64_t panel_stride = p.depth * kPanelColumns;
  const auto* w = static_cast<const typename T::Stored*>(p.w) + piece.c0 / kPanelColumns * panel_stride;
  if (p.rows <= kWalkRows) {
    return PanelWalkRows<T, kWalkRows>(int(p.rows), p.x + piece.g0, p.depth, w + piece.g0 * kPanelColumns,
                                       panel_stride, piece.g1 - piece.g0, piece.width, out, ldo);
  }
  const int64_t chunk = PassRows(piece.width);
  float* packed = PackBuffer(chunk * piece.width);
  for (int64_t k = piece.g0; k < piece.g1; k += chunk) {
    const int64_t count = std::min(chunk, piece.g1 - k);
    const bool from_zero = k == piece.g0;
    PackPanels<T>(w + k * kPanelColumns, panel_stride, count, piece.width, packed);
    int64_t r0 = 0;
    for (; r0 + kKnRows <= p.rows; r0 += kKnRows) {
      KnRows<kKnRows>(p.x + r0 * p.depth + k, p.depth, packed, count, piece.width, out + r0 * ldo, ldo, from_zero);
    }
    if (r0 < p.rows) {
      KnRemainder<kKnRows - 1>(int(p.rows - r0), p.x + r0 * p.depth + k, p.depth, packed, count, piece.width,
                               out + r0 * ldo, ldo, from_zero);
    }
  }
}

// A call of weights in panels: the one-row call's cut (blocks of a one-row tile's panels, in two runs a worker so
// that a late helper still gets its share). Up to kWalkRows rows each run walks its pieces in order; more, every
// piece is an item (each writes its own columns, or its own partial).
template <typename T>
void RunPanels(const std::vector<Problem>& problems, int64_t num_workers) {
  const int64_t rows = problems[0].rows;
  // bfloat16 pairs are cut between pairs of K rows (a group is two rows): every piece starts at an even row, so its
  // last pair never reads x past its row (x16's rows are padded to even K only)
  constexpr int64_t kGroupRows = std::is_same_v<T, BF16> && kBf16Pairs ? 2 : 1;
  std::vector<jaxserve_cpu::CallBlock> blocks;
  for (size_t i = 0; i < problems.size(); ++i) {
    const Problem& p = problems[i];
    for (int64_t c0 = 0; c0 < p.columns; c0 += kPanelBlockColumns) {
      const int64_t width = std::min(kPanelBlockColumns, p.columns - c0);
      const int64_t bytes = kGroupRows * Panels(width) * kPanelColumns * int64_t(sizeof(typename T::Stored));
      blocks.push_back({int64_t(i), c0, width, (p.depth + kGroupRows - 1) / kGroupRows, bytes});
    }
  }
  jaxserve_cpu::CallCut cut = jaxserve_cpu::CutCall(blocks, rows, 2 * num_workers);
  if constexpr (kGroupRows > 1) {
    for (jaxserve_cpu::CallPiece& c : cut.pieces) {
      c.g0 *= kGroupRows;
      c.g1 = std::min(c.g1 * kGroupRows, problems[c.weight].depth);
    }
  }
  float* partials = PartialsBuffer(cut.partial_floats);
  const bool walks = rows <= kWalkRows;
  const bool adds = walks || (std::is_same_v<T, BF16> && kBf16Pairs);  // into cleared outputs: the pairs' passes too
  for (const Problem& p : problems) {  // (K = 0: no piece writes the zeros)
    if ((adds || p.depth == 0) && rows * p.columns > 0) std::memset(p.out, 0, sizeof(float) * rows * p.columns);
  }
  if (adds && cut.partial_floats > 0) std::memset(partials, 0, sizeof(float) * cut.partial_floats);
  auto piece = [&](int64_t i) {
    const jaxserve_cpu::CallPiece& c = cut.pieces[i];
    const Problem& p = problems[c.weight];
    if (c.partial >= 0) return PanelPiece<T>(p, c, partials + c.partial, c.width);
    PanelPiece<T>(p, c, p.out + c.c0, p.columns);
  };
  if (walks) {
    jaxserve_cpu::RunItems(num_workers, int64_t(cut.run_starts.size()) - 1, [&](int64_t, int64_t run) {
      for (int64_t i = cut.run_starts[run]; i < cut.run_starts[run + 1]; ++i) piece(i);
    });
  } else {
    jaxserve_cpu::RunItems(num_workers, int64_t(cut.pieces.size()), [&](int64_t, int64_t i) { piece(i); });
  }
  // The pieces past a block's first K added into its columns in K's order (the plan's order); a block's pieces are
  // one item, so that a prefill chunk's sums (up to 2 x workers - 1 partials of [256, 128]) are shared by the threads.
  std::vector<std::vector<int64_t>> sums;  // per block with partials: its pieces, in K's order
  for (int64_t i = 0; i < int64_t(cut.pieces.size()); ++i) {
    const jaxserve_cpu::CallPiece& c = cut.pieces[i];
    if (c.partial < 0) continue;
    const jaxserve_cpu::CallPiece* last = sums.empty() ? nullptr : &cut.pieces[sums.back().back()];
    if (last == nullptr || last->weight != c.weight || last->c0 != c.c0) sums.emplace_back();
    sums.back().push_back(i);
  }
  auto add = [&](int64_t, int64_t block) {
    for (int64_t i : sums[block]) {
      const jaxserve_cpu::CallPiece& c = cut.pieces[i];
      const Problem& p = problems[c.weight];
      jaxserve_cpu::AddPartial(partials + c.partial, rows, c.width, p.out + c.c0, p.columns);
    }
  };
  if (cut.partial_floats <= kSumItemFloats) {
    for (int64_t block = 0; block < int64_t(sums.size()); ++block) add(0, block);
  } else {
    jaxserve_cpu::RunItems(num_workers, int64_t(sums.size()), add);
  }
}

}  // namespace
