// What the quantized CPU kernels (cpu_quantized_matmul.cc, cpu_quantized_int8_dot.cc, cpu_kquant_matmul.cc)
// and the float kernel (cpu_matmul.cc) share: a scalar multiply-add rounded as the vectors' (FmaOne), 16-bit floats
// read one at a time, float arrays of three widths widened to float32 (FloatArray),
// and the address-order prefetch of the next part of a weight (AheadLines). One copy here, so a fix to any
// reaches every kernel.

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxserve_cpu {

// One lane of a vector fused multiply-add, rounded as the vectors' (a fused multiply-add where the path has FMA,
// else a product then a sum), so that the columns and K terms past whole vectors add up as explicitly as the
// vectors do. Left to the compiler, `sum += x * w` is contracted in some instantiations and not in others (GCC on
// an AMD EPYC with AVX-512: a quantized weight's 83rd column differed between 1-row and 2-row calls), and a row of
// a call must not depend on the call's rows (cpu_matmul.cc, "Row invariance").
inline float FmaOne(float a, float b, float acc) {
#if defined(__FMA__)
  return __builtin_fmaf(a, b, acc);
#else
  return acc + a * b;
#endif
}

inline float HalfToFloat(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof(h));
  return float(h);
}

inline float BFloat16ToFloat(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

// A float array of one of three widths (an FFI buffer's data and element type: x, scales, mins), read as
// float32.
struct FloatArray {
  const void* data = nullptr;
  xla::ffi::DataType type = xla::ffi::DataType::F32;

  void Widen(int64_t offset, int64_t count, float* out) const {
    switch (type) {
      case xla::ffi::DataType::F16: {
        const auto* in = static_cast<const uint16_t*>(data) + offset;
        int64_t i = 0;
        // (one at a time, the conversion took a fifth of a one-row item's time over 576 columns)
#if defined(__AVX512F__)
        for (; i + 16 <= count; i += 16) {
          _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i))));
        }
#elif defined(__F16C__)
        for (; i + 8 <= count; i += 8) {
          _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
        }
#endif
        for (; i < count; ++i) out[i] = HalfToFloat(in[i]);
        break;
      }
      case xla::ffi::DataType::BF16: {
        const auto* in = static_cast<const uint16_t*>(data) + offset;
        for (int64_t i = 0; i < count; ++i) out[i] = BFloat16ToFloat(in[i]);
        break;
      }
      case xla::ffi::DataType::U8: {  // small integers (a K-quant's sub-block scales and mins)
        const auto* in = static_cast<const uint8_t*>(data) + offset;
        for (int64_t i = 0; i < count; ++i) out[i] = float(in[i]);
        break;
      }
      case xla::ffi::DataType::S8: {  // (Q6_K's sub-block scales)
        const auto* in = static_cast<const int8_t*>(data) + offset;
        for (int64_t i = 0; i < count; ++i) out[i] = float(in[i]);
        break;
      }
      default:
        std::memcpy(out, static_cast<const float*>(data) + offset, count * sizeof(float));
    }
  }
};

// A weight region [runs, run_bytes] (runs `stride` bytes apart; whole rows, run_bytes == stride, are one
// run) as cache lines to prefetch in ADDRESS order, a few at a time while the current part is read.
// Why address order: the kernels' tiles read one line of each of a chunk's 16-32 weight rows, N bytes
// apart; lines prefetched in that order let one core keep few misses in flight (one row read ~0.25-0.5 of
// a read stream), lines in address order 0.6-0.8 (issue 25, session 11). Every line needs its own
// prefetch: the hardware streamer does not train on software prefetches (every 2nd-16th line: 0.2-0.3).
// kLocality 2 = prefetcht1 (L2): a prefetcht0 from memory holds one of L1's few miss buffers for the whole
// memory latency (0.24-0.37 of a stream).
template <int kLocality = 2>
struct AheadLines {
  const uint8_t* run = nullptr;
  int64_t run_bytes = 0, stride = 0, runs = 0, offset = 0;
  int64_t lines_per_tile = 0;  // Issue(lines_per_tile) per tile spreads the region over `tiles` tiles

  AheadLines() = default;
  AheadLines(const uint8_t* start, int64_t run_bytes_, int64_t stride_, int64_t runs_, int64_t tiles = 1)
      : run(start), run_bytes(run_bytes_), stride(stride_), runs(runs_) {
    if (run_bytes == stride) {  // whole rows: one run
      run_bytes *= runs;
      runs = 1;
    }
    lines_per_tile = tiles > 0 ? (Lines() + tiles - 1) / tiles : Lines();
  }
  int64_t Lines() const { return runs * ((run_bytes + 63) / 64); }
  inline void Issue(int64_t lines) {
    for (; lines > 0 && runs > 0; --lines) {
      __builtin_prefetch(run + offset, 0, kLocality);
      offset += 64;
      if (offset >= run_bytes) {
        offset = 0;
        run += stride;
        --runs;
      }
    }
  }
  inline void IssueTile() { Issue(lines_per_tile); }
  inline void IssueAll() { Issue(INT64_MAX); }
};

}  // namespace jaxserve_cpu
