// The float32 vectors every CPU matmul kernel computes in (cpu_matmul.cc, cpu_quantized_matmul.cc,
// cpu_kquant_matmul.cc, cpu_lora_matmul.cc), for the instruction path the compiler flags select (cpu_library.py):
//   avx512    16 float lanes (AVX-512F)
//   avx2      8 lanes, FMA
//   portable  4 lanes (SSE2 on x86-64, NEON on arm64), multiply then add, no FMA
// and the few operations on them that want an intrinsic. One copy, so that every kernel's lanes, rounding (FmaOne in
// cpu_weight_basics.h is one lane of Fma) and loads agree. Internal to each kernel's translation unit.

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif

typedef float VecF __attribute__((vector_size(4 * kLanes)));
typedef uint32_t VecU __attribute__((vector_size(4 * kLanes)));
typedef uint16_t VecH __attribute__((vector_size(2 * kLanes)));
typedef _Float16 VecHalf __attribute__((vector_size(2 * kLanes)));

inline VecF Fma(VecF a, VecF b, VecF acc) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, acc);
#elif defined(__AVX2__) && defined(__FMA__)
  return _mm256_fmadd_ps(a, b, acc);
#else
  return acc + a * b;
#endif
}

// An intrinsic where the vector types' generic code is slower: VecF{} + x adds a zero first, the sign of zero
// forbidding its removal.
inline VecF Broadcast(float x) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(x);
#elif defined(__AVX2__) && defined(__FMA__)
  return _mm256_set1_ps(x);
#else
  VecF v;
  for (int i = 0; i < kLanes; ++i) v[i] = x;
  return v;
#endif
}

inline VecF LoadF(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void StoreF(float* p, VecF v) { std::memcpy(p, &v, sizeof(v)); }

}  // namespace
