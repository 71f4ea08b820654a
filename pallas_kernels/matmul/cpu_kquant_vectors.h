// The K-quant kernel's vector basics (cpu_kquant_matmul.cc), for the instruction path the compiler flags
// select: lanes, register-tile widths, FMA, broadcast, and the widenings of the planes' bytes (zero- or
// sign-extended to 32-bit lanes) and float16 scales. GCC's vector types for the arithmetic (masks, shifts,
// conversions compile to the path's instructions); intrinsics where a generic form is slower or absent.
// Included once, by cpu_kquant_matmul.cc; cpu_library.py keys its build on this file too.

#pragma once

#include <cstdint>
#include <cstring>

#include "matmul/cpu_float_vectors.h"
#include "matmul/cpu_weight_basics.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace kquant_vectors {

#if defined(__AVX512F__)
// Vectors of columns per register tile, by rows of x in the tile: R * T accumulators, 2 * T widened weights
// (a pair of k) and T high-plane vectors within 32 registers.
constexpr int kTileVectors[] = {0, 4, 4, 3, 3, 2, 2, 2, 2};
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kTileVectors[] = {0, 3, 2, 2, 2, 1, 1, 1, 1};  // within 16 registers
#else
constexpr int kTileVectors[] = {0, 2, 2, 2, 2, 1, 1, 1, 1};
#endif
constexpr int kTileRows = int(sizeof(kTileVectors) / sizeof(int)) - 1;  // rows of x per register tile

typedef int32_t VecI __attribute__((vector_size(4 * kLanes)));
typedef uint8_t VecB __attribute__((vector_size(kLanes)));
typedef int8_t VecSB __attribute__((vector_size(kLanes)));



inline VecF ToFloat(VecI v) { return __builtin_convertvector(v, VecF); }

// kLanes bytes, zero-extended to 32-bit lanes (one vpmovzxbd from memory on the x86 paths).
inline VecI Bytes(const uint8_t* p) {
#if defined(__AVX512F__)
  return VecI(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__) && defined(__FMA__)
  return VecI(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  VecB b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, VecI);
#endif
}

// kLanes int8, sign-extended to 32-bit lanes.
inline VecI SignedBytes(const int8_t* p) {
#if defined(__AVX512F__)
  return VecI(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__) && defined(__FMA__)
  return VecI(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  VecSB b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, VecI);
#endif
}

using jaxserve_cpu::HalfToFloat;  // cpu_weight_basics.h

// kLanes float16 -> float32 (F16C's vcvtph2ps where there is one: GCC 12 left _Float16 loops scalar).
inline VecF Halves(const uint16_t* p) {
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  VecF v;
  for (int i = 0; i < kLanes; ++i) v[i] = HalfToFloat(p[i]);
  return v;
#endif
}

}  // namespace kquant_vectors
