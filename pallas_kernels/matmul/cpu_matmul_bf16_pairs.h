// bfloat16 weights on CPUs with AVX-512 BF16 (cpu_matmul.cc's many-row regime, issue #29): `vdpbf16ps`
// multiplies pairs of bfloat16 along K and adds both products into one float32 lane, 32 multiply-adds an
// instruction where an FMA on widened weights does 16. It wants the pair (w[k, c], w[k + 1, c]) side by
// side, which a [K, N] weight stores N apart: each pass of rows is packed once with its pairs of rows
// interleaved (`vpermt2w`, two rows in, two vectors of interleaved columns out), still bfloat16 (half the
// bytes of the widened pack: the pass stays in L1/L2), and x's rows are kept in bfloat16 with K padded to
// even, so that the pair (x[r, k], x[r, k + 1]) is one 32-bit broadcast.
//
// Rounding differs from the FMA path: each lane adds the two products to the accumulator with float32
// rounding, and denormal inputs and results are flushed to zero (bfloat16 denormals are below 1e-38).
// Determinism holds as before: the order of the sums depends only on the plan.
//
// Elsewhere (no AVX-512 BF16 at build time) kBf16Pairs is false and cpu_matmul.cc widens as before. Also
// off on CPUs with AMX (Intel Sapphire Rapids and later; `-march=native` defines __AMX_BF16__ there): their
// `vdpbf16ps` issues on one port where FMAs issue on two, and the widened FMA paths ran faster at every row
// count (one thread, SmolLM2-135M, fraction of a read stream, bench/cpu_matmul_stream.cc with and without
// -DJAXSERVE_NO_BF16_PAIRS, session 12): 5 rows layers 0.71-0.73 -> 0.75-0.78, head 0.70-0.74 -> 0.81-0.83;
// 8 rows 0.50-0.54 -> 0.62-0.64, head 0.35-0.37 -> 0.66-0.73; 16 rows 0.24 -> 0.29; 64 rows layers 0.09 ->
// 0.12-0.13; 4 rows equal. (The pairs were tuned on an AMD Zen 4, where both retire about 3.5 G/s.)

#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_matmul_vectors.h"

namespace {

// JAXSERVE_NO_BF16_PAIRS: widen instead (bench/cpu_matmul_stream.cc's A/B); JAXSERVE_BF16_PAIRS_WITH_AMX: pairs
// on an AMX CPU too (the same A/B the other way).
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__) && !defined(JAXSERVE_NO_BF16_PAIRS) && \
    (!defined(__AMX_BF16__) || defined(JAXSERVE_BF16_PAIRS_WITH_AMX))
constexpr bool kBf16Pairs = true;
#define JAXSERVE_BF16_PAIRS 1  // cpu_matmul_few_rows.h's tiles too

// A worker's packed pairs of weight rows, reused across passes and calls.
inline uint16_t* PairBuffer(int64_t elements) {
  thread_local std::vector<uint16_t> buffer;
  if (int64_t(buffer.size()) < elements) buffer.resize(elements);
  return buffer.data();
}

// Rows [0, count) of w (`stride` apart) by columns [0, width) into packed pairs: pair j's row holds, for
// each column c < padded (width rounded up to whole vectors), w[2j, c] then w[2j + 1, c]. Zeros past
// `width` and for the missing row of an odd count (masked loads: nothing past the weight is read).
inline void PackPairs(const uint16_t* w, int64_t stride, int64_t count, int64_t width, int64_t padded,
                      uint16_t* packed) {
  alignas(64) static constexpr uint16_t kLow[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  for (int64_t j = 0; 2 * j < count; ++j) {
    const uint16_t* a = w + 2 * j * stride;
    const uint16_t* b = a + stride;
    const bool has_b = 2 * j + 1 < count;
    uint16_t* to = packed + j * 2 * padded;
    for (int64_t c = 0; c < padded; c += 32) {
      const int64_t left = width - c;
      const __mmask32 mask = left >= 32 ? ~__mmask32(0) : left <= 0 ? 0 : (__mmask32(1) << left) - 1;
      const __m512i va = _mm512_maskz_loadu_epi16(mask, a + c);
      const __m512i vb = has_b ? _mm512_maskz_loadu_epi16(mask, b + c) : _mm512_setzero_si512();
      _mm512_storeu_si512(to + 2 * c, _mm512_permutex2var_epi16(va, low, vb));
      if (c + kLanes < padded) _mm512_storeu_si512(to + 2 * c + 32, _mm512_permutex2var_epi16(va, high, vb));
    }
  }
}

// x's pair (x[k], x[k + 1]) in every 32-bit lane (x: bfloat16 at k), kept in a register: one broadcast a row of a
// tile, not one memory operand per instruction that uses it (the few-row walks' tiles).
inline __m512bh PairBroadcast(const uint16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  __m512i xb = _mm512_set1_epi32(pair);
  asm("" : "+v"(xb));
  return (__m512bh)xb;
}

// R rows of x (bfloat16, rows ldx apart, from the pass's first K) by V vectors of packed columns over
// `pairs` pairs of rows: R * V float32 accumulators in registers, one 32-bit broadcast of x a row and
// pair; the last vector's columns masked by `last` (a block's width that is not whole vectors).
template <int R, int V>
inline void PairTile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t pairs, float* out,
                     int64_t ldo, __mmask16 last) {
  __m512 acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_maskz_loadu_ps(v == V - 1 ? last : 0xFFFF, out + r * ldo + v * kLanes);
  for (int64_t j = 0; j < pairs; ++j) {
    const uint16_t* row = w + j * ldw;
    __m512bh wv[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(row + v * 2 * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * j, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xb, wv[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) _mm512_mask_storeu_ps(out + r * ldo + v * kLanes, v == V - 1 ? last : 0xFFFF, acc[r][v]);
}

// R rows of x by a pass's packed columns: tiles of kKnVectors[R] vectors, then single vectors, the last
// one masked.
template <int R>
void PairRows(const uint16_t* x, int64_t ldx, const uint16_t* packed, int64_t pairs, int64_t width, int64_t padded,
              float* out, int64_t ldo) {
  constexpr int V = kKnVectors[R];
  const int64_t full = width / kLanes, ldw = 2 * padded;
  int64_t v = 0;
  for (; v + V <= full; v += V) PairTile<R, V>(x, ldx, packed + v * 2 * kLanes, ldw, pairs, out + v * kLanes, ldo, 0xFFFF);
  for (; v < full; ++v) PairTile<R, 1>(x, ldx, packed + v * 2 * kLanes, ldw, pairs, out + v * kLanes, ldo, 0xFFFF);
  if (const int64_t tail = width % kLanes; tail > 0) {
    const __mmask16 mask = __mmask16((1u << tail) - 1);
    PairTile<R, 1>(x, ldx, packed + full * 2 * kLanes, ldw, pairs, out + full * kLanes, ldo, mask);
  }
}

template <int R>
void PairRemainder(int rows, const uint16_t* x, int64_t ldx, const uint16_t* packed, int64_t pairs, int64_t width,
                   int64_t padded, float* out, int64_t ldo) {
  if constexpr (R > 0) {
    if (rows == R) return PairRows<R>(x, ldx, packed, pairs, width, padded, out, ldo);
    PairRemainder<R - 1>(rows, x, ldx, packed, pairs, width, padded, out, ldo);
  }
}

// One item of the many-row regime: weight rows [k0, k1) (k0 even) by columns [c0, c0 + width), added
// into partial [M, N], in passes of `chunk` (even) rows, each packed in pairs once for every group of rows.
inline void PairItem(const Problem& p, int64_t k0, int64_t k1, int64_t c0, int64_t width, int64_t chunk,
                     float* partial) {
  const int64_t padded = (width + kLanes - 1) / kLanes * kLanes;
  uint16_t* packed = PairBuffer((chunk + 1) / 2 * 2 * padded);
  const auto* w = static_cast<const uint16_t*>(p.w);
  for (int64_t k = k0; k < k1; k += chunk) {
    const int64_t count = std::min(chunk, k1 - k), pairs = (count + 1) / 2;
    PackPairs(w + k * p.columns + c0, p.columns, count, width, padded, packed);
    const uint16_t* x = p.x16 + k;
    int64_t r0 = 0;
    for (; r0 + kKnRows <= p.rows; r0 += kKnRows) {
      PairRows<kKnRows>(x + r0 * p.x16_stride, p.x16_stride, packed, pairs, width, padded,
                        partial + r0 * p.columns + c0, p.columns);
    }
    if (r0 < p.rows) {
      PairRemainder<kKnRows - 1>(int(p.rows - r0), x + r0 * p.x16_stride, p.x16_stride, packed, pairs, width, padded,
                                 partial + r0 * p.columns + c0, p.columns);
    }
  }
}


#else
constexpr bool kBf16Pairs = false;
inline void PairItem(const Problem&, int64_t, int64_t, int64_t, int64_t, int64_t, float*) {}
#endif

}  // namespace
