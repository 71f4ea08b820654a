// Scalar basics of the CPU attention kernels: 16-bit floats as stored, their widening and rounding, and
// the online softmax's exp. Used by cpu_kernel.cc and cpu_latent_kernel.cc (cpu_kernel.cc adds the
// quantized page types: int8 and float8 rows with their scales).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jaxserve_cpu_attention {

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// 16-bit floats as stored in a buffer: their bits.
struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};

inline float ToFloat(float x) { return x; }

inline float ToFloat(BFloat16 x) {
  const uint32_t bits = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float ToFloat(Float16 x) {
  _Float16 h;
  std::memcpy(&h, &x.bits, sizeof(h));
  return float(h);
}

template <typename T>
T FromFloat(float x);

template <>
inline float FromFloat<float>(float x) {
  return x;
}

// Rounded to nearest even, as XLA's convert does.
template <>
inline BFloat16 FromFloat<BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if (std::isnan(x)) return {uint16_t((bits >> 16) | 0x40)};  // stays a (quiet) NaN
  bits += 0x7fff + ((bits >> 16) & 1);
  return {uint16_t(bits >> 16)};
}

template <>
inline Float16 FromFloat<Float16>(float x) {
  const _Float16 h = _Float16(x);
  Float16 out;
  std::memcpy(&out.bits, &h, sizeof(h));
  return out;
}

// n float16 values widened to float32. GCC leaves ToFloat's loop scalar (one vcvtph2ps of one value each): a
// float32 model's float16 cache (cache.kv_dtype) read 1.4x slower than its bfloat16 one at 1800 keys.
inline void WidenFloat16(const Float16* source, int64_t n, float* target) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(target + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(source + i))));
  }
#endif
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(target + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(source + i))));
  }
#endif
  for (; i < n; ++i) target[i] = ToFloat(source[i]);
}

// n values widened to float32 into `target`.
template <typename T>
inline void Widen(const T* source, int64_t n, float* target) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(target, source, n * sizeof(float));
  } else if constexpr (std::is_same_v<T, Float16>) {
    WidenFloat16(source, n, target);
  } else {
    for (int64_t i = 0; i < n; ++i) target[i] = ToFloat(source[i]);
  }
}

// exp(x) for the x <= 0 of an online softmax, in a form the compiler vectorizes (std::exp is a scalar
// libm call): Cody-Waite range reduction and Cephes' expf polynomial, within a few ulp of expf.
// Anything below expf's underflow, -inf included, is exactly 0, so masked keys get no weight.
// exp(f) for |f| <= ln(2) / 2 (Cephes' expf polynomial), for a float or any GCC vector of floats: the scalar
// ExpNonpositive and the kernels' vector forms share it, so every path's weights come from one arithmetic.
template <typename T>
inline T ExpOfReduced(T f) {
  T p = T{} + 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  return p * f * f + f + 1.0f;
}

// x - n ln(2) in two parts (ln(2)'s high bits exact in a float), the argument ExpOfReduced takes.
template <typename T>
inline T ReduceByLn2(T x, T n) {
  return x - n * 0.693359375f + n * 2.12194440e-4f;
}

inline constexpr float kLog2E = 1.44269504088896341f;
inline constexpr float kExpLowest = -87.0f;  // below: 0 (2^n would leave float's exponent range)

inline float ExpNonpositive(float x) {
  const float clamped = std::max(x, kExpLowest);
  const float n = std::floor(clamped * kLog2E + 0.5f);
  const float r = ExpOfReduced(ReduceByLn2(clamped, n));
  int32_t exponent_bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &exponent_bits, sizeof(scale));
  return x < kExpLowest ? 0.0f : r * scale;
}

inline float Dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace jaxserve_cpu_attention
