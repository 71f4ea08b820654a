// The small matmul's walks for 1 to 8 rows of x (cpu_matmul.cc): a decode step of a few sequences, or one
// sequence's speculative verify step (k + 1 = 5 rows, issue #26), over weights read once from memory.
//
// [K, N] weights (TiledWalk): register tiles of R rows by V vectors of columns ("columns in registers,
// rows of x broadcast"), each widened weight vector serving all R rows straight from registers. The walk
// before (four weight rows a step, accumulators [R, width] in L1) loaded and stored every accumulator
// once per four weight rows: at 5 rows that work, not the memory, bound it (0.4-0.5 of a read stream).
// A tile reads a column strip of the weights (rows `columns` apart), which the hardware prefetchers follow
// badly (notes: cpu-kernels.md), so the item's rows are walked in blocks of kWalkBlockRows: every tile
// of a block runs over the block's rows, and prefetches the same strip kWalkAheadRows rows further on,
// so the lines of a block arrive in about address order, a block's distance ahead. 16 / 16 since session 23
// (32 / 32 before, and still on AMD CPUs: cpu_library.compile_flags): on an idle Intel Xeon (AMX) single stream
// +5% (bfloat16) / +6% (float32) end to end, batch-8 steps 2-4% faster; blocks and rows alike (a block only
// splits the loop over k: every output's terms in the same order, the same bits).
//
// [N, K] weights (NkStreams, the tied head): each weight row is a dot product along K; S weight rows at
// once, taken from S equal parts of the item (S long runs in address order),
// each weight vector serving all R rows of x from registers.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_matmul_bf16_pairs.h"
#include "cpu_matmul_vectors.h"

namespace {

#ifndef JAXSERVE_WALK_BLOCK_ROWS
#define JAXSERVE_WALK_BLOCK_ROWS 16
#endif
#ifndef JAXSERVE_WALK_AHEAD_ROWS
#define JAXSERVE_WALK_AHEAD_ROWS 16
#endif
#ifndef JAXSERVE_WALK_LOCALITY
#define JAXSERVE_WALK_LOCALITY 1
#endif
constexpr int64_t kWalkBlockRows = JAXSERVE_WALK_BLOCK_ROWS;  // weight rows every tile walks before the next block
constexpr int64_t kWalkAheadRows = JAXSERVE_WALK_AHEAD_ROWS;  // software prefetch this many rows ahead in a strip
constexpr int64_t kWalkLineBytes = 64;

#if defined(__AVX512F__)
// Vectors of columns per tile by rows of x: R * V accumulators + V weights + a broadcast within 32 registers.
constexpr int kWalkVectors[] = {0, 8, 8, 6, 5, 4, 4, 3, 3};
// Weight rows read side by side by rows of x ([N, K]): R * S accumulators + S weights + an x vector.
constexpr int kStreams[] = {0, 4, 4, 4, 4, 4, 4, 3, 3};
constexpr int kWalkGroupRows = 8;  // rows of x in one register tile; more run as two groups over the same strip
#else
// Within 16 registers. One row: 8 vectors (128 bytes of bfloat16 a weight row, two lines; 6 read 3-12% slower
// from memory on avx2 by the medians of four alternating runs, session 17, within the ranges' noise); two rows
// stay at 4 (6: 12 accumulators, or two groups of one row at 8, were no faster).
constexpr int kWalkVectors[] = {0, 8, 4, 3, 2, 2, 2, 1, 1};
constexpr int kStreams[] = {0, 4, 4, 3, 2, 2, 2, 1, 1};
// 16 registers: one tile of 7-8 rows has a single vector of columns (8 FMAs per weight vector, 9 loads with
// the broadcasts) or a single stream of the head; two groups of 4 (and 3) rows over the same weights (the
// second group's reads hit L1) keep two vectors, resp. two streams, in registers (session 14).
constexpr int kWalkGroupRows = 6;
#endif

// The lines of a strip of `Bytes` from p, into L2 (JAXSERVE_WALK_LOCALITY 1: prefetcht2; into L1 (3) a
// block's distance ahead evicted the block being read: 32 rows of a 576-wide float32 weight are 72 KiB).
template <int64_t Bytes>
inline void PrefetchStrip(const void* p) {
  const char* next = static_cast<const char*>(p);
#pragma GCC unroll 8
  for (int64_t b = 0; b < Bytes; b += kWalkLineBytes) __builtin_prefetch(next + b, 0, JAXSERVE_WALK_LOCALITY);
  if (Bytes % kWalkLineBytes != 0) __builtin_prefetch(next + Bytes - 1, 0, JAXSERVE_WALK_LOCALITY);
}

// bfloat16 weights 2 * kLanes at a time: one 32-bit lane holds elements 2j and 2j + 1, widened by a shift (the
// even elements) and an and (the odd ones), two plain ALU operations where two widening loads (vpmovzxwd, a
// shuffle each) and two shifts did (session 14's SplitWalk at one row). The accumulators of such columns are kept in
// [evens, odds] order per 2 * kLanes columns (EvenOddColumns at each end of TiledWalk): every output still sees
// the same FMAs in the same order (the same bits). On avx2 and portable (session 17, avx2 one row with the caches
// hot: 18-23 -> 24-32 GB/s; from memory, and at 2 and 8 rows, no change beyond the noise); avx512 keeps vpmovzxwd
// (not measured there).
#if defined(__AVX512F__)
constexpr bool kWalkEvenOdd = false;
#else
constexpr bool kWalkEvenOdd = true;
#endif
inline void EvenOddWeights(const uint16_t* p, VecF& even, VecF& odd) {
  VecU pairs;
  std::memcpy(&pairs, p, sizeof(pairs));
  even = (VecF)(pairs << 16);
  odd = (VecF)(pairs & 0xffff0000u);
}

// Columns [0, n) of one row of accumulators (n a multiple of 2 * kLanes) into [evens, odds] order per 2 * kLanes
// columns, or back.
inline void EvenOddColumns(float* acc, int64_t n, bool back) {
  for (int64_t c = 0; c < n; c += 2 * kLanes) {
    const VecF a = LoadF(acc + c), b = LoadF(acc + c + kLanes);
#if defined(__AVX512F__)
    const VecF lo = back ? __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23)
                         : __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const VecF hi = back ? __builtin_shufflevector(a, b, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31)
                         : __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#elif defined(__AVX2__) && defined(__FMA__)
    const VecF lo = back ? __builtin_shufflevector(a, b, 0, 8, 1, 9, 2, 10, 3, 11)
                         : __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14);
    const VecF hi = back ? __builtin_shufflevector(a, b, 4, 12, 5, 13, 6, 14, 7, 15)
                         : __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
#else
    const VecF lo = back ? __builtin_shufflevector(a, b, 0, 4, 1, 5) : __builtin_shufflevector(a, b, 0, 2, 4, 6);
    const VecF hi = back ? __builtin_shufflevector(a, b, 2, 6, 3, 7) : __builtin_shufflevector(a, b, 1, 3, 5, 7);
#endif
    StoreF(acc + c, lo);
    StoreF(acc + c + kLanes, hi);
  }
}

// Keeps the compiler from folding a load into each instruction that uses it: x's vector, loaded once and
// used by S FMAs, was otherwise read S times from memory (memory operands), and the loads bound the loop.
inline void KeepInRegister(VecF& v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+v"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
}

// A weight vector that `Uses` FMAs read (one per row of x in a register tile), in a register once loaded. GCC folds
// a float32 weight's load into each FMA that uses it (a memory operand per row), and then the loads, not the FMAs,
// bound the tile: on an AVX2-only AMD EPYC (Zen 3) the float32 tiles of 2-4 rows ran at half the rate of 5-6 rows
// (session 43: PanelTile cache-hot, one thread, 4 rows 48 -> 98 GFLOP/s, 3 rows 48 -> 78, 2 rows by two panels
// 54 -> 95; the 5-6 row tiles, whose weights GCC already kept in registers, unchanged). One use: left to the
// compiler (a one-row tile's 8 weight vectors and 8 accumulators do not fit 16 registers). bfloat16's widened
// vectors are computed in registers anyway. Returns the value (an asm operand on an array element made GCC store
// the array back to the stack every iteration). AVX-512 builds change little (870 of 894 folded FMAs stay; not
// measured on such a CPU): see docs/notes/cpu-kernels.md, session 43.
template <int Uses>
inline VecF LoadedOnce(VecF v) {
  if constexpr (Uses > 1) KeepInRegister(v);
  return v;
}

// R rows of x by V vectors of columns over `count` weight rows (w: the strip's first row, rows `ldw`
// apart), adding into out [R, ...] (rows ldo apart). Prefetches each row's strip `ahead` elements on.
// EvenOdd (bfloat16, V even): the weights widened by EvenOddWeights, out's columns in [evens, odds] order.
template <typename T, int R, int V, bool EvenOdd = false>
inline void WalkTile(const float* x, int64_t ldx, const typename T::Stored* w, int64_t ldw, int64_t count,
                     int64_t ahead, float* out, int64_t ldo) {
  using S = typename T::Stored;
  constexpr int64_t kStripBytes = int64_t(V) * kLanes * int64_t(sizeof(S));
  VecF acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = LoadF(out + r * ldo + v * kLanes);
  for (int64_t k = 0; k < count; ++k) {
    const S* row = w + k * ldw;
    if (ahead != 0) PrefetchStrip<kStripBytes>(row + ahead);
    VecF wv[V];
    if constexpr (EvenOdd) {
      static_assert(std::is_same_v<T, BF16> && V % 2 == 0);
#pragma GCC unroll 8
      for (int v = 0; v < V; v += 2) EvenOddWeights(row + v * kLanes, wv[v], wv[v + 1]);
    } else {
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) wv[v] = LoadedOnce<R>(T::Vector(row + v * kLanes));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const VecF xb = Broadcast(x[r * ldx + k]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] = Fma(xb, wv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) StoreF(out + r * ldo + v * kLanes, acc[r][v]);
}

#if defined(JAXSERVE_BF16_PAIRS)
// bfloat16 on AVX-512 BF16: rows k and k + 1 of a strip interleaved in registers (vpunpcklwd/hwd: one
// instruction each, no pack) give the pairs vdpbf16ps multiplies by the broadcast pair (x[r, k], x[r, k + 1]):
// half the multiply instructions of widened FMAs and no widening, which bound bfloat16 at 3-8 rows. The
// unpacks interleave within 128-bit lanes, so of a group of 32 columns the low accumulator holds columns
// 0-3, 8-11, 16-19, 24-27 and the high one the rest: permuted from and back to column order once a tile.
template <int R, int G>
inline void PairWalkTile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t count, int64_t ahead,
                         float* out, int64_t ldo, __mmask32 last) {
  constexpr int64_t kStripBytes = int64_t(G) * 64;
  const __m512i to_low = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i to_high = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512i from_low = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i from_high = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  __m512 acc[R][G][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __mmask32 mask = g == G - 1 ? last : ~__mmask32(0);
      const __m512 a = _mm512_maskz_loadu_ps(__mmask16(mask), out + r * ldo + g * 32);
      const __m512 b = _mm512_maskz_loadu_ps(__mmask16(mask >> 16), out + r * ldo + g * 32 + 16);
      acc[r][g][0] = _mm512_permutex2var_ps(a, to_low, b);
      acc[r][g][1] = _mm512_permutex2var_ps(a, to_high, b);
    }
  }
  for (int64_t k = 0; k < count; k += 2) {
    const uint16_t* row = w + k * ldw;
    const bool has_next = k + 1 < count;  // an odd count's last row pairs with zeros
    if (ahead != 0) {
      PrefetchStrip<kStripBytes>(row + ahead);
      PrefetchStrip<kStripBytes>(row + ldw + ahead);
    }
    __m512bh low[G], high[G];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __mmask32 mask = g == G - 1 ? last : ~__mmask32(0);
      const __m512i a = _mm512_maskz_loadu_epi16(mask, row + g * 32);
      const __m512i b = has_next ? _mm512_maskz_loadu_epi16(mask, row + ldw + g * 32) : _mm512_setzero_si512();
      low[g] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      high[g] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = PairBroadcast(x + r * ldx + k);
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        acc[r][g][0] = _mm512_dpbf16_ps(acc[r][g][0], xb, low[g]);
        acc[r][g][1] = _mm512_dpbf16_ps(acc[r][g][1], xb, high[g]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const __mmask32 mask = g == G - 1 ? last : ~__mmask32(0);
      _mm512_mask_storeu_ps(out + r * ldo + g * 32, __mmask16(mask),
                            _mm512_permutex2var_ps(acc[r][g][0], from_low, acc[r][g][1]));
      _mm512_mask_storeu_ps(out + r * ldo + g * 32 + 16, __mmask16(mask >> 16),
                            _mm512_permutex2var_ps(acc[r][g][0], from_high, acc[r][g][1]));
    }
  }
}

// Groups of 32 columns per pair tile by rows of x: R * 2G accumulators + 2G pairs + a broadcast.
constexpr int kPairWalkGroups[] = {0, 4, 4, 3, 3, 2, 2, 1, 1};

// TiledWalk's blocks for bfloat16 in pairs (x in bfloat16: Problem::x16, K padded to even; k0 even).
template <int R>
void PairTiledWalk(const Problem& p, int64_t k0, int64_t k1, int64_t c0, int64_t width, float* partial) {
  constexpr int G = kPairWalkGroups[R];
  const auto* w = static_cast<const uint16_t*>(p.w);
  const int64_t tiles = width / (G * 32) * (G * 32), groups = width / 32 * 32;
  for (int64_t kb = k0; kb < k1; kb += kWalkBlockRows) {
    const int64_t count = std::min(kWalkBlockRows, k1 - kb);
    const int64_t ahead = kb + count < k1 ? kWalkAheadRows * p.columns : 0;
    const uint16_t* x = p.x16 + kb;
    const uint16_t* wb = w + kb * p.columns + c0;
    float* out = partial + c0;
    int64_t c = 0;
    for (; c < tiles; c += G * 32) PairWalkTile<R, G>(x, p.x16_stride, wb + c, p.columns, count, ahead, out + c, p.columns, ~__mmask32(0));
    for (; c < groups; c += 32) PairWalkTile<R, 1>(x, p.x16_stride, wb + c, p.columns, count, ahead, out + c, p.columns, ~__mmask32(0));
    if (c < width) {
      const __mmask32 mask = (__mmask32(1) << (width - c)) - 1;
      PairWalkTile<R, 1>(x, p.x16_stride, wb + c, p.columns, count, ahead, out + c, p.columns, mask);
    }
  }
}
#endif

// One row of x by float32 weights on AMD CPUs (cpu_library.py defines JAXSERVE_ONE_ROW_SWEEP there): the item's
// weight rows read whole, in address order, each adding into the item's accumulators in L1 (partial; at most 16 KiB,
// BlockColumns). On an AMD EPYC (Zen 4, session 21) the tiles' column strips read at 0.55-0.62 of a one-thread
// stream, where the Intel Xeons of sessions 12-16 read them at 0.96-1.1; this sweep ran SmolLM2's 30 layers 11-17%
// faster there (avx512; 23% on the avx2 path), two workers, in process. Each output's FMAs are the tiles' in the same
// order (K's, continued through partial): the same bits. Not for bfloat16: a sweep of a pair of rows (vdpbf16ps)
// or of two rows at once read 26-39% slower than the tiles (two streams a row apart), so it keeps them.
#ifndef JAXSERVE_ONE_ROW_SWEEP
#define JAXSERVE_ONE_ROW_SWEEP 0
#endif
inline void RowSweep(const Problem& p, int64_t k0, int64_t k1, int64_t c0, int64_t width, float* partial) {
  const float* w = static_cast<const float*>(p.w);
  float* out = partial + c0;
  const int64_t vectors = width / kLanes * kLanes;
  for (int64_t k = k0; k < k1; ++k) {
    const float* row = w + k * p.columns + c0;
    const VecF xb = Broadcast(p.x[k]);
    for (int64_t c = 0; c < vectors; c += kLanes) StoreF(out + c, Fma(xb, LoadF(row + c), LoadF(out + c)));
    for (int64_t c = vectors; c < width; ++c) out[c] = FmaOne(p.x[k], row[c], out[c]);
  }
}

// Rows [k0, k1) of the weights by columns [c0, c0 + width), R rows of x, added into partial [R, N].
template <typename T, int R>
void TiledWalk(const Problem& p, int64_t k0, int64_t k1, int64_t c0, int64_t width, float* partial) {
#if defined(JAXSERVE_BF16_PAIRS)
  if constexpr (std::is_same_v<T, BF16>) return PairTiledWalk<R>(p, k0, k1, c0, width, partial);
#endif
  if constexpr (R == 1 && JAXSERVE_ONE_ROW_SWEEP && std::is_same_v<T, F32>) {
    return RowSweep(p, k0, k1, c0, width, partial);
  }
  // More rows than a register tile holds: two groups (R1 + R2) over each strip, the first prefetching.
  constexpr int R1 = R > kWalkGroupRows ? (R + 1) / 2 : R, R2 = R - R1;
  constexpr int V = kWalkVectors[R1];
  // bfloat16 in tiles of an even number of vectors: the even/odd widening (EvenOddWeights) over the tiles and then
  // strips of two vectors, up to `strips` columns, whose accumulators are in [evens, odds] order while the item runs.
  constexpr bool kEvenOdd = kWalkEvenOdd && std::is_same_v<T, BF16> && V % 2 == 0;
  constexpr int V1 = kEvenOdd ? 2 : 1;  // vectors of a strip past the whole tiles
  const auto* w = static_cast<const typename T::Stored*>(p.w);
  const int64_t tiles = width / (V * kLanes) * (V * kLanes), strips = width / (V1 * kLanes) * (V1 * kLanes);
  const int64_t vectors = width / kLanes * kLanes;
  const int64_t ldo = p.columns;
  if constexpr (kEvenOdd) {
    for (int r = 0; r < R; ++r) EvenOddColumns(partial + r * ldo + c0, strips, false);
  }
  for (int64_t kb = k0; kb < k1; kb += kWalkBlockRows) {
    const int64_t count = std::min(kWalkBlockRows, k1 - kb);
    // The strip kWalkAheadRows rows on; the last block's rows were prefetched by the blocks before it.
    const int64_t ahead = kb + count < k1 ? kWalkAheadRows * p.columns : 0;
    const float* x = p.x + kb;
    const auto* wb = w + kb * p.columns + c0;
    float* out = partial + c0;
    int64_t c = 0;
    for (; c < tiles; c += V * kLanes) {
      WalkTile<T, R1, V, kEvenOdd>(x, p.depth, wb + c, p.columns, count, ahead, out + c, ldo);
      if constexpr (R2 > 0) {
        WalkTile<T, R2, V, kEvenOdd>(x + R1 * p.depth, p.depth, wb + c, p.columns, count, 0, out + R1 * ldo + c, ldo);
      }
    }
    for (; c < strips; c += V1 * kLanes) {
      WalkTile<T, R1, V1, kEvenOdd>(x, p.depth, wb + c, p.columns, count, ahead, out + c, ldo);
      if constexpr (R2 > 0) {
        WalkTile<T, R2, V1, kEvenOdd>(x + R1 * p.depth, p.depth, wb + c, p.columns, count, 0, out + R1 * ldo + c, ldo);
      }
    }
    for (; c < vectors; c += kLanes) {
      WalkTile<T, R1, 1>(x, p.depth, wb + c, p.columns, count, ahead, out + c, ldo);
      if constexpr (R2 > 0) WalkTile<T, R2, 1>(x + R1 * p.depth, p.depth, wb + c, p.columns, count, 0, out + R1 * ldo + c, ldo);
    }
    for (; c < width; ++c) {
      for (int r = 0; r < R; ++r) {
        float sum = out[r * p.columns + c];
        for (int64_t k = 0; k < count; ++k) sum = FmaOne(x[r * p.depth + k], T::One(wb[k * p.columns + c]), sum);
        out[r * p.columns + c] = sum;
      }
    }
  }
  if constexpr (kEvenOdd) {
    for (int r = 0; r < R; ++r) EvenOddColumns(partial + r * ldo + c0, strips, true);
  }
}

// R rows of x by weight rows n, n + part, ..., n + (S - 1) part (for n in [n0, n1)): out[r, n] = x[r] . w[n].
template <typename T, int R, int S>
void NkStreamRows(const float* x, int64_t depth, const typename T::Stored* w, int64_t part, float* out, int64_t ldo,
                  int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const typename T::Stored* rows[S];
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) rows[s] = w + (n + s * part) * depth;
    VecF acc[R][S];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int s = 0; s < S; ++s) acc[r][s] = VecF{};
    int64_t k = 0;
    for (; k + kLanes <= depth; k += kLanes) {
      VecF wv[S];
#pragma GCC unroll 8
      for (int s = 0; s < S; ++s) wv[s] = LoadedOnce<R>(T::Vector(rows[s] + k));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        VecF xv = LoadF(x + r * depth + k);
        KeepInRegister(xv);
#pragma GCC unroll 8
        for (int s = 0; s < S; ++s) acc[r][s] = Fma(xv, wv[s], acc[r][s]);
      }
    }
    // Unrolled whole, as every loop over acc's indices must be: where GCC leaves one a loop (at R x S = 24 it
    // did), acc lives in memory and each step of the K loop above stored all R x S accumulators: 6 and 8 rows of
    // the head ran at 0.65-0.9 of 5 rows' FLOP/s (float32) and 0.48 (bfloat16 pairs), session 49.
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int s = 0; s < S; ++s) {
        float sum = HorizontalSum(acc[r][s]);
        for (int64_t j = k; j < depth; ++j) sum = FmaOne(x[r * depth + j], T::One(rows[s][j]), sum);
        out[r * ldo + n + s * part] = sum;
      }
    }
  }
}

#if defined(JAXSERVE_BF16_PAIRS)
// NkStreamRows for bfloat16 on AVX-512 BF16: along K, 32 elements of a weight row are 16 pairs already, so
// vdpbf16ps multiplies them by x's bfloat16 row as they are (x16, rows ldx apart): half the instructions
// of widened FMAs, no widening. The tail of K is a masked load of both (zeros past the row).
template <int R, int S>
void NkPairStreamRows(const uint16_t* x, int64_t ldx, int64_t depth, const uint16_t* w, int64_t part, float* out,
                      int64_t ldo) {
  for (int64_t n = 0; n < part; ++n) {
    const uint16_t* rows[S];
#pragma GCC unroll 8
    for (int s = 0; s < S; ++s) rows[s] = w + (n + s * part) * depth;
    __m512 acc[R][S];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int s = 0; s < S; ++s) acc[r][s] = _mm512_setzero_ps();
    for (int64_t k = 0; k < depth; k += 32) {
      const __mmask32 mask = depth - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (depth - k)) - 1;
      __m512bh wv[S];
#pragma GCC unroll 8
      for (int s = 0; s < S; ++s) wv[s] = (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[s] + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m512i xv = _mm512_maskz_loadu_epi16(mask, x + r * ldx + k);
        asm("" : "+v"(xv));  // loaded once, not once per instruction
#pragma GCC unroll 8
        for (int s = 0; s < S; ++s) acc[r][s] = _mm512_dpbf16_ps(acc[r][s], (__m512bh)xv, wv[s]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)  // unrolled whole, or acc lives in memory (NkStreamRows)
#pragma GCC unroll 8
      for (int s = 0; s < S; ++s) out[r * ldo + n + s * part] = _mm512_reduce_add_ps(acc[r][s]);
  }
}
#endif

// R rows of x by `count` weight rows (w [count, depth]) into out [R, ...] (rows ldo apart).
template <typename T, int R>
void NkStreams(const Problem& p, const typename T::Stored* w, int64_t count, float* out) {
  constexpr int S = kStreams[R];
  const int64_t part = count / S, done = part * S;
#if defined(JAXSERVE_BF16_PAIRS)
  if constexpr (std::is_same_v<T, BF16>) {
    NkPairStreamRows<R, S>(p.x16, p.x16_stride, p.depth, w, part, out, p.columns);
    return NkPairStreamRows<R, 1>(p.x16, p.x16_stride, p.depth, w + done * p.depth, count - done, out + done, p.columns);
  }
#endif
  const float* x = p.x;
  const int64_t depth = p.depth, ldo = p.columns;
  if constexpr (R > kWalkGroupRows) {
    // Two groups of rows of x (R1 + R2) with kStreams[R1] streams each, over blocks of kGroupBlock weight
    // rows a stream: the second group reads the block the first has just brought into L1. Every output's
    // dot product is the same chain of FMAs as in one group (the same bits).
    constexpr int R1 = (R + 1) / 2, R2 = R - R1, S1 = kStreams[R1];
    constexpr int64_t kGroupBlock = 4;
    const int64_t part1 = count / S1, done1 = part1 * S1;
    for (int64_t n = 0; n < part1; n += kGroupBlock) {
      const int64_t end = std::min(part1, n + kGroupBlock);
      NkStreamRows<T, R1, S1>(x, depth, w, part1, out, ldo, n, end);
      NkStreamRows<T, R2, S1>(x + R1 * depth, depth, w, part1, out + R1 * ldo, ldo, n, end);
    }
    NkStreamRows<T, R1, 1>(x, depth, w + done1 * depth, count - done1, out + done1, ldo, 0, count - done1);
    NkStreamRows<T, R2, 1>(x + R1 * depth, depth, w + done1 * depth, count - done1, out + R1 * ldo + done1, ldo, 0,
                           count - done1);
    return;
  }
  NkStreamRows<T, R, S>(x, depth, w, part, out, ldo, 0, part);
  NkStreamRows<T, R, 1>(x, depth, w + done * depth, count - done, out + done, ldo, 0, count - done);
}

}  // namespace
