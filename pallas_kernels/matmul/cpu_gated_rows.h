// The gated activation that the float CPU kernel takes into a down projection's call (cpu_matmul.cc's
// SmallMatmulGated): silu(gate) * up, rounded as models/layers.py's gated_activation rounds it, from the gate and up
// projections' float32 results, then those rows times the down weight.
//
// Why in the kernel (issue 29, session 51): in a step of several rows XLA:CPU runs that fusion split over its
// intra-op pool (its cost model calls an exp over [8, 1536] worth two threads), and the split fusion waits for a
// pool thread to wake beside the kernels' own spinning helpers: 35-110 us a layer at 8-32 bfloat16 rows, 3.4 ms of
// a 56 ms batch-32 step, against a few microseconds of vector code here.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_float_vectors.h"
#include "cpu_matmul_vectors.h"
#include "cpu_workers.h"

namespace {

// e^x in kLanes lanes: Cephes' expf (x = n ln 2 + r, |r| <= ln 2 / 2, a degree-7 polynomial in r, times 2^n), within
// 2 ulp of the exact value; +inf above 88.72, 0 below -87.34 (no subnormals), NaN kept. Not XLA's own exp bit for
// bit, which only a rounding edge of a 16-bit result can tell.
inline VecF ExpLanes(VecF x) {
  const VecF high = Broadcast(88.3762626647949f), low = Broadcast(-87.3365478515625f);
  const VecF clamped = x > high ? high : (x < low ? low : x);
  // n = x / ln 2 rounded to the nearest integer (ties to even) by the 1.5 * 2^23 shift: |x / ln 2| < 128
  const VecF shift = Broadcast(12582912.0f);
  const VecF n = (clamped * Broadcast(1.44269504088896341f) + shift) - shift;
  VecF r = clamped - n * Broadcast(0.693359375f);
  r = r - n * Broadcast(-2.12194440e-4f);
  VecF p = Broadcast(1.9875691500e-4f);
  p = p * r + Broadcast(1.3981999507e-3f);
  p = p * r + Broadcast(8.3334519073e-3f);
  p = p * r + Broadcast(4.1665795894e-2f);
  p = p * r + Broadcast(1.6666665459e-1f);
  p = p * r + Broadcast(5.0000001201e-1f);
  p = p * (r * r) + r + Broadcast(1.0f);
  typedef int32_t VecI __attribute__((vector_size(4 * kLanes)));
  const VecI exponent = (__builtin_convertvector(n, VecI) + 127) << 23;
  VecF scale;
  std::memcpy(&scale, &exponent, sizeof(scale));
  VecF result = p * scale;
  const VecF infinity = Broadcast(__builtin_inff());
  result = x > Broadcast(88.7228391116729996f) ? infinity : result;
  result = x < low ? Broadcast(0.0f) : result;
  return x != x ? x : result;  // NaN in, NaN out
}

// A float32 vector rounded to the stored type T and widened back (T::Round lane by lane: to nearest, ties to even).
template <typename T>
inline VecF RoundTrip(VecF v) {
  if constexpr (std::is_same_v<typename T::Stored, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, BF16>) {
    VecU bits;
    std::memcpy(&bits, &v, sizeof(bits));
    const VecU nan = (bits & 0x7fffffffu) > 0x7f800000u;
    VecU rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    rounded = nan ? ((bits | 0x00400000u) & 0xffff0000u) : rounded;
    VecF out;
    std::memcpy(&out, &rounded, sizeof(out));
    return out;
  } else {
    return __builtin_convertvector(__builtin_convertvector(v, VecHalf), VecF);
  }
}

// kLanes values already representable in T, stored as T.
template <typename T>
inline void StoreStored(typename T::Stored* out, VecF v) {
  if constexpr (std::is_same_v<typename T::Stored, float>) {
    StoreF(out, v);
  } else if constexpr (std::is_same_v<T, BF16>) {
    VecU bits;
    std::memcpy(&bits, &v, sizeof(bits));
    const VecH stored = __builtin_convertvector(bits >> 16, VecH);
    std::memcpy(out, &stored, sizeof(stored));
  } else {
    const VecHalf stored = __builtin_convertvector(v, VecHalf);
    std::memcpy(out, &stored, sizeof(stored));
  }
}

// kLanes of silu(gate) * up as gated_activation computes them in T: the gate and up rounded to T (the projections'
// results in the model's dtype), silu in float32 as x * (1 / (1 + e^-x)) (XLA's logistic expansion), rounded to T,
// times up, rounded to T.
template <typename T>
inline VecF SiluGateLanes(VecF gate, VecF up) {
  const VecF g = RoundTrip<T>(gate);
  const VecF one = Broadcast(1.0f);
  const VecF activated = RoundTrip<T>(g * (one / (one + ExpLanes(-g))));
  return RoundTrip<T>(activated * RoundTrip<T>(up));
}

// Rows a gated activation runs on the calling thread alone (as kNormSerialRows: a decode step's few)
constexpr int64_t kGatedSerialRows = 8;

// gate, up [M, F] float32 -> silu(gate) * up [M, F] in T's stored type. A row's tail of fewer than kLanes goes
// through the same lanes from a padded copy, so every element is computed alike wherever it sits: a row's values
// never depend on the call's rows (row invariance, as the kernel's products).
template <typename T>
std::vector<typename T::Stored> SiluGatedRows(const float* gate, const float* up, int64_t rows, int64_t width,
                                              int64_t num_workers) {
  std::vector<typename T::Stored> gated(rows * width);
  auto gate_row = [&](int64_t, int64_t r) {
    const float* g = gate + r * width;
    const float* u = up + r * width;
    typename T::Stored* out = gated.data() + r * width;
    int64_t c = 0;
    for (; c + kLanes <= width; c += kLanes) StoreStored<T>(out + c, SiluGateLanes<T>(LoadF(g + c), LoadF(u + c)));
    if (c < width) {
      float g_tail[kLanes] = {}, u_tail[kLanes] = {};
      typename T::Stored out_tail[kLanes];
      std::memcpy(g_tail, g + c, (width - c) * sizeof(float));
      std::memcpy(u_tail, u + c, (width - c) * sizeof(float));
      StoreStored<T>(out_tail, SiluGateLanes<T>(LoadF(g_tail), LoadF(u_tail)));
      std::memcpy(out + c, out_tail, (width - c) * sizeof(typename T::Stored));
    }
  };
  if (rows <= kGatedSerialRows) {
    for (int64_t r = 0; r < rows; ++r) gate_row(0, r);
  } else {
    jaxserve_cpu::RunItems(num_workers, rows, gate_row);
  }
  return gated;
}

}  // namespace
