// The int8-activation quantized kernel's (cpu_quantized_int8_dot.cc) inputs as it reads them: float arrays of
// one of three widths (x, scales, mins), and x quantized to int8 per chunk of up to 32 k within a weight group
// (ggml's quantize_row_q8_0 rounding), once per call for all its rows, the rows split among the threads.
// Included once, by that file (after cpu_int8_dot_vectors.h): its names live in the file's anonymous namespace.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_workers.h"
#include "matmul/cpu_weight_basics.h"
#include "xla/ffi/api/ffi.h"

namespace {

namespace ffi = xla::ffi;

// FloatArray, HalfToFloat, BFloat16ToFloat: cpu_weight_basics.h.
using jaxserve_cpu::BFloat16ToFloat;
using jaxserve_cpu::HalfToFloat;

constexpr int64_t kChunk = 32;  // k per activation scale (ggml's QK8_0)

using jaxserve_cpu::FloatArray;  // x, scales, mins

// `count` values of `array` from `offset` in the sums' order: whole tiles (the first `vectors`) in tile order
inline void WidenInTileOrder(const FloatArray& array, int64_t offset, int64_t count, int64_t vectors, float* natural,
                             float* out) {
  array.Widen(offset, count, natural);
#if defined(QDOT_X86)
  for (int64_t t = 0; t < vectors; t += kTile) TileOrder(natural + t, out + t);
#else
  vectors = 0;  // portable tiles are in column order
#endif
  std::memcpy(out + vectors, natural + vectors, (count - vectors) * sizeof(float));
}

// x quantized for one chunking (chunks of up to 32 k within groups of `group`).
struct Activations {
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> scale;   // [M, chunks]: d, as float16 holds it
  std::vector<float> sum;     // [M, chunks]: d * sum of q over the chunk, as float16 holds it
  std::vector<int32_t> qsum;  // [M, chunks]: sum of q over the chunk (a tiled walk's start, cpu_int8_dot_tiles.h)
  // [M, chunks]: d, and d * sum of q, in float32: as ggml's q8_K holds them (a float d, per 256 there), the
  // activations of its Q4_K / Q5_K dots (the two-level tiles', cpu_int8_dot_tiles.h)
  std::vector<float> scale32, sum32;
  std::vector<int32_t> qsum16;  // [M, chunks]: sum of q over the chunk's first 16 k (Q6_K's sub-blocks of 16)
  int64_t chunks_per_group = 0, chunks = 0;
};

// ggml keeps a q8_0 / q8_1 block's d (and q8_1's s = d * sum q) in float16, and its dot products use those
// rounded values: doing the same makes the products equal llama.cpp's up to the order of additions (x is
// quantized with the float32 d, as there). Beyond float16's range the float32 value stays.
inline float AsHalf(float v) { return std::fabs(v) <= 65504.0f ? static_cast<float>(static_cast<_Float16>(v)) : v; }

// What a chunk's quantization sums: of q as rounded (the vectors' lanes before their int8 store; the values past
// whole vectors as stored), of q as stored, and of the stored q of its first 16 k (Q6_K's sub-blocks). The first
// two differ only where x is not finite (the store truncates; a lane then holds INT_MIN, so the sums wrap as
// unsigned: defined, and what the code before them computed).
struct ChunkSums {
  int32_t rounded = 0, stored = 0, first16 = 0;
};

// One chunk of one row, ggml's quantize_row_q8_0_ref: d = max|x| / 127, q = roundf(x * (1 / d)), and its sums.
// Vectors of 16 (AVX-512) or 8 (AVX2) values at a time, the rest one by one; roundf exactly either way: the
// truncation, plus sign(v) where the (exact) remainder is at least a half. Why vectors on every x86 path: a
// one-row call quantizes its 576-1536 values before any weight is read, 121 calls a decode step (issue 25: one
// by one, with the sums in scalar loops after, ~1.7 us a call on AVX-512, ~4% of a Q4_0 step).
inline ChunkSums QuantizeChunk(const float* x, int64_t count, int8_t* q, float* d_out) {
  int64_t k = 0;
  float amax = 0.0f;
#if defined(__AVX512F__)
  // (512 x 576 floats, one thread: 0.39 ms scalar, 0.19 ms so; about 10% vs 5% of a 512-row chunk's int8 dots)
  const __m512 sign_bit = _mm512_set1_ps(-0.0f);
  __m512 vmax = _mm512_setzero_ps();
  for (; k + 16 <= count; k += 16) vmax = _mm512_max_ps(vmax, _mm512_andnot_ps(sign_bit, _mm512_loadu_ps(x + k)));
  amax = _mm512_reduce_max_ps(vmax);
#elif defined(__AVX2__)
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  for (; k + 8 <= count; k += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(x + k)));
  __m128 half_max = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  half_max = _mm_max_ps(half_max, _mm_movehl_ps(half_max, half_max));
  amax = _mm_cvtss_f32(_mm_max_ss(half_max, _mm_movehdup_ps(half_max)));
#endif
  for (; k < count; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  *d_out = d;
  ChunkSums sums;
  k = 0;
#if defined(__AVX512F__)
  const __m512 inverse = _mm512_set1_ps(id), half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
  __m512i rounded = _mm512_setzero_si512(), stored = _mm512_setzero_si512();
  for (; k + 16 <= count; k += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + k), inverse);
    __m512 whole = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_andnot_ps(sign_bit, _mm512_sub_ps(v, whole)), half, _CMP_GE_OQ);
    whole = _mm512_mask_add_ps(whole, up, whole, _mm512_or_ps(one, _mm512_and_ps(sign_bit, v)));
    const __m512i ints = _mm512_cvttps_epi32(whole);
    rounded = _mm512_add_epi32(rounded, ints);
    const __m128i bytes = _mm512_cvtepi32_epi8(ints);  // (truncating, as the scalar store)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), bytes);
    stored = _mm512_add_epi32(stored, _mm512_cvtepi8_epi32(bytes));
    if (k == 0) sums.first16 = _mm512_reduce_add_epi32(stored);
  }
  sums.rounded = _mm512_reduce_add_epi32(rounded);
  sums.stored = _mm512_reduce_add_epi32(stored);
#elif defined(__AVX2__)
  const __m256 inverse = _mm256_set1_ps(id), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
  // each 32-bit lane's low byte, then the two 128-bit halves' four bytes side by side (a truncating store)
  const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                             0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i halves_together = _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1);
  __m256i rounded = _mm256_setzero_si256(), stored = _mm256_setzero_si256();
  auto add_lanes = [](__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
  };
  for (; k + 8 <= count; k += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + k), inverse);
    __m256 whole = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign_bit, _mm256_sub_ps(v, whole)), half, _CMP_GE_OQ);
    whole = _mm256_add_ps(whole, _mm256_and_ps(up, _mm256_or_ps(one, _mm256_and_ps(sign_bit, v))));
    const __m256i ints = _mm256_cvttps_epi32(whole);
    rounded = _mm256_add_epi32(rounded, ints);
    const __m256i packed = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(ints, low_bytes), halves_together);
    const __m128i bytes = _mm256_castsi256_si128(packed);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + k), bytes);
    stored = _mm256_add_epi32(stored, _mm256_cvtepi8_epi32(bytes));
    if (k == 8) sums.first16 = add_lanes(stored);
  }
  sums.rounded = add_lanes(rounded);
  sums.stored = add_lanes(stored);
#endif
  const int64_t vectored = k;
  for (; k < count; ++k) {
    q[k] = int8_t(std::round(x[k] * id));
    sums.rounded = int32_t(uint32_t(sums.rounded) + uint32_t(int32_t(q[k])));
    sums.stored += q[k];
  }
  if (vectored < 16) {  // (the first 16 were not all vectors: summed from the stored q)
    sums.first16 = 0;
    for (int64_t i = 0; i < std::min<int64_t>(count, 16); ++i) sums.first16 += q[i];
  }
  return sums;
}

// Rows [r0, r1) of x (float [M, K], any of the three widths) quantized into `a` (already sized).
inline void QuantizeRows(const FloatArray& x, int64_t r0, int64_t r1, int64_t depth, int64_t group, Activations& a) {
  std::vector<float> widened(x.type == ffi::DataType::F32 ? 0 : depth);
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = static_cast<const float*>(x.data) + r * depth;  // (float32 x read where it is)
    if (!widened.empty()) {
      x.Widen(r * depth, depth, widened.data());
      row = widened.data();
    }
    for (int64_t c = 0; c < a.chunks; ++c) {
      const int64_t g0 = c / a.chunks_per_group * group;
      const int64_t k0 = g0 + c % a.chunks_per_group * kChunk, k1 = std::min(k0 + kChunk, g0 + group);
      float d;
      const ChunkSums sums = QuantizeChunk(row + k0, k1 - k0, a.q.data() + r * depth + k0, &d);
      a.scale[r * a.chunks + c] = AsHalf(d);
      a.sum[r * a.chunks + c] = AsHalf(d * float(sums.rounded));
      a.qsum[r * a.chunks + c] = sums.stored;  // the start of a tiled walk: the stored q's own sum
      a.qsum16[r * a.chunks + c] = sums.first16;
      a.scale32[r * a.chunks + c] = d;
      a.sum32[r * a.chunks + c] = d * float(sums.stored);
    }
  }
}

// x [rows, depth] quantized per chunk of groups of `group`, rows split among up to `num_workers` threads.
inline Activations Quantize(const FloatArray& x, int64_t rows, int64_t depth, int64_t group, int64_t num_workers) {
  Activations a;
  a.chunks_per_group = (group + kChunk - 1) / kChunk;
  a.chunks = depth / group * a.chunks_per_group;
  a.q.resize(rows * depth);
  a.scale.resize(rows * a.chunks);
  a.sum.resize(rows * a.chunks);
  a.qsum.resize(rows * a.chunks);
  a.scale32.resize(rows * a.chunks);
  a.qsum16.resize(rows * a.chunks);
  a.sum32.resize(rows * a.chunks);
  constexpr int64_t kRowsPerItem = 16;  // (a decode step's few rows: one item, no helper woken)
  const int64_t items = (rows + kRowsPerItem - 1) / kRowsPerItem;
  jaxserve_cpu::RunItems(num_workers, items, [&](int64_t, int64_t item) {
    QuantizeRows(x, item * kRowsPerItem, std::min(rows, (item + 1) * kRowsPerItem), depth, group, a);
  });
  return a;
}

}  // namespace
