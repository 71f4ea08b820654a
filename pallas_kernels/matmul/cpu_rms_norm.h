// The RMS norm that the CPU projection kernels take into their calls (cpu_matmul.cc's float weights,
// cpu_quantized_int8_dot.cc's quantized ones): the stored float types' scalar widen and round, and the rows of x
// through the model's RMSNorm. One copy, so that a float and a quantized layer normalize a row to the same bits.
//
// Why in the kernels (issues #29, #25): in a decode step a norm is four XLA thunks of a few microseconds each,
// cache-cold after the projection's stream of weights, twice a layer, plus the executor's gaps between them.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_workers.h"
#include "xla/ffi/api/ffi.h"

namespace jaxserve_cpu {

// A stored float type: one element widened to float32 (One) and a float32 rounded to it (Round), as XLA's
// convert rounds (to nearest, ties to even).
struct Float32Scalar {
  using Stored = float;
  static float One(float x) { return x; }
  static float Round(float x) { return x; }
};
struct BFloat16Scalar {
  using Stored = uint16_t;
  static float One(uint16_t bits) {
    const uint32_t wide = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &wide, sizeof(f));
    return f;
  }
  static uint16_t Round(float x) {  // (NaN stays a quiet NaN)
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);
    return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
};
struct Float16Scalar {
  using Stored = uint16_t;
  static float One(uint16_t bits) {
    _Float16 h;
    std::memcpy(&h, &bits, sizeof(h));
    return float(h);
  }
  static uint16_t Round(float x) {
    const _Float16 h = _Float16(x);
    uint16_t bits;
    std::memcpy(&bits, &h, sizeof(bits));
    return bits;
  }
};

// Whether a norm's scale fits rows of x: [K] in x's dtype (the kernels' FFI handlers refuse it otherwise)
inline bool NormScaleFits(const xla::ffi::AnyBuffer& x, const xla::ffi::AnyBuffer& scale) {
  const auto dims = x.dimensions();
  return dims.size() == 2 && scale.element_type() == x.element_type() && scale.element_count() == size_t(dims[1]);
}

// Rows a norm runs on the calling thread alone: a decode step's few are done sooner than the helpers would wake
constexpr int64_t kNormSerialRows = 8;

// The rows of x [M, K] through an RMS norm as the model's RMSNorm (models/layers.py, HF's Llama) computes it: in
// float32 x * rsqrt(mean(x^2) + eps), rounded to x's type, times `scale` [K] in x's type. The squares are summed
// over windows of 32 and then the windows, near XLA's order (its tree-reduction rewrite of the mean) but not
// always to its last bit. Each row on its own: a row's result does not depend on the call's rows.
template <typename T>
std::vector<typename T::Stored> NormedRows(const typename T::Stored* x, const typename T::Stored* scale, int64_t rows,
                                           int64_t depth, float eps, int64_t num_workers) {
  constexpr int64_t kWindow = 32;
  std::vector<typename T::Stored> normed(rows * depth);
  auto norm_row = [&](int64_t, int64_t r) {  // rows are independent: a prefill chunk's are shared by the threads
    const auto* row = x + r * depth;
    float sum = 0.0f;
    for (int64_t k0 = 0; k0 < depth; k0 += kWindow) {
      float window = 0.0f;
      for (int64_t k = k0; k < std::min(depth, k0 + kWindow); ++k) window += T::One(row[k]) * T::One(row[k]);
      sum += window;
    }
    const float inverse = 1.0f / std::sqrt(sum / float(depth) + eps);
    for (int64_t k = 0; k < depth; ++k) {
      const float rounded = T::One(T::Round(T::One(row[k]) * inverse));
      normed[r * depth + k] = T::Round(T::One(scale[k]) * rounded);
    }
  };
  if (rows <= kNormSerialRows) {
    for (int64_t r = 0; r < rows; ++r) norm_row(0, r);
  } else {
    RunItems(num_workers, rows, norm_row);
  }
  return normed;
}

}  // namespace jaxserve_cpu
