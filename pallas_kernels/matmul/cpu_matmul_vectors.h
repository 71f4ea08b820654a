// The small matmul's vector basics (cpu_matmul.cc), for the instruction path the compiler flags select:
// lanes and register-tile tables, FMA, broadcast, horizontal sum, the stored element types' widenings, and
// a problem's operands. Included once, by cpu_matmul.cc; cpu_library.py keys its build on this file too.

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "matmul/cpu_float_vectors.h"
#include "matmul/cpu_rms_norm.h"
#include "matmul/cpu_weight_basics.h"

namespace {

#if defined(__AVX512F__)
constexpr const char* kPath = "avx512";
// Vectors of output columns per register tile, by rows in the tile ([K, N] weights): R * V accumulators
// plus V widened weights plus a broadcast x within 32 registers; widths that divide kBlockColumns.
constexpr int kKnVectors[] = {0, 8, 8, 6, 4, 4, 4, 3, 3};
// Weight rows (outputs) per register tile, by rows of x ([N, K] weights): R * NT accumulators plus R x
// vectors plus a weight vector within 32 registers.
constexpr int kNkOutputs[] = {0, 8, 8, 6, 6};
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* kPath = "avx2";
constexpr int kKnVectors[] = {0, 6, 4, 3, 2, 2, 2};  // within 16 registers
constexpr int kNkOutputs[] = {0, 6, 4, 3};
#else
constexpr const char* kPath = "portable";
constexpr int kKnVectors[] = {0, 6, 4, 3, 2, 2, 2};
constexpr int kNkOutputs[] = {0, 6, 4, 3};
#endif
constexpr int kKnRows = int(sizeof(kKnVectors) / sizeof(int)) - 1;  // rows of x per packed [K, N] tile (KnTile)
// Rows of x up to which [K, N] weights are walked straight from memory (RowWalk, cpu_matmul_few_rows.h) on every
// path: bound by reading the weights there. On avx2 up to session 14, 7-8 rows were packed (kKnRows 6): an extra
// store and load of every widened element, at half avx512's rate per byte with the caches hot.
constexpr int kWalkRows = 8;
constexpr int kNkRows = int(sizeof(kNkOutputs) / sizeof(int)) - 1;  // rows of x per [N, K] tile



using jaxserve_cpu::FmaOne;  // cpu_weight_basics.h: one lane of Fma, rounded as the vectors'


// A tree of shuffles and adds (a lane-by-lane loop is kLanes dependent scalar adds: with a dot product
// per weight row of the head at one row of x, that loop cost as much as the multiplies).
inline float HorizontalSum(VecF v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#elif defined(__AVX2__) && defined(__FMA__)
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
  float sum = 0.0f;
  for (int i = 0; i < kLanes; ++i) sum += v[i];
  return sum;
#endif
}

// The stored element types: how one element, and kLanes elements at once, widen to float32.
struct F32 : jaxserve_cpu::Float32Scalar {
  static VecF Vector(const float* p) {
    VecF v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
};
struct BF16 : jaxserve_cpu::BFloat16Scalar {
  static VecF Vector(const uint16_t* p) {
#if defined(__AVX512F__)
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#else
    VecH h;
    std::memcpy(&h, p, sizeof(h));
    return (VecF)(__builtin_convertvector(h, VecU) << 16);
#endif
  }
};
struct F16 : jaxserve_cpu::Float16Scalar {
  static VecF Vector(const uint16_t* p) {
#if defined(__AVX512F__)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    VecHalf h;
    std::memcpy(&h, p, sizeof(h));
    return __builtin_convertvector(h, VecF);
#endif
  }
};


struct Problem {
  const void* w;
  const float* x;  // [M, K], widened
  float* out;      // [M, N]
  int64_t rows, depth, columns;  // M, K, N
  const uint16_t* x16 = nullptr;  // bfloat16 x as given, K padded to even with a zero (cpu_matmul_bf16_pairs.h)
  int64_t x16_stride = 0;
  bool panels = false;  // w [ceil(N / P), K, P] (cpu_matmul_panels.h)
};

}  // namespace
