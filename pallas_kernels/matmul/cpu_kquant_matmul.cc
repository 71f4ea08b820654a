// A few rows times GGUF K-quant weights (Q4_K, Q5_K, Q6_K, and the Q5_0 / Q5_1 of Q4_K_M / Q5_K_M files) at
// the file's bytes, for decode steps on the CPU, as an XLA FFI custom call: out_i [M, N_i] float32 =
// x [M, K] @ w_i, with w_i in kquant.py's planes:
//
//   low [K / 2, N] uint8        q's low 4 bits, rows 2i (low nibble) and 2i + 1 (high nibble)
//   high [K / 8 or K / 4, N]    Q5_K / Q5_0 / Q5_1: bit 4 of rows 8i + j at bit j; Q6_K: bits 4-5 of rows
//                               4i + j at 2j
//   sub_scales [K / G, N]       uint8 6-bit sc (Q4_K / Q5_K, G 32) or int8 (Q6_K, G 16)
//   sub_mins [K / 32, N] uint8  6-bit m (Q4_K / Q5_K)
//   d, dmin [K / 256, N] f16    per super-block (Q5_0 / Q5_1: d and m [K / 32, N])
//
//   w = d * sc * q - dmin * m   (Q4_K: q 0..15, Q5_K: q 0..31);   w = d * sc * (q - 32)   (Q6_K: q 0..63)
//   w = d * (q - 16)            (Q5_0);                            w = d * q + m          (Q5_1)
//
// Why: the K-quants are what llama.cpp users hold (Q4_K_M: Q4_K with some Q6_K), and reading them at their
// stored 4.5-6.6 bits per weight is what a decode step, bound by reading weights, gains from. Each work
// item is a block of columns and a range of super-blocks; within a sub-block, eight weight rows at a time
// are widened from their planes into floats (in L1) and used by every row of x (up to 8 per pass; more
// rows pass over the sub-block again), their products summed per (row, column); at the sub-block's end
// the sums are scaled by d * sc (formed in float32 as ggml does) once per column, and the min applied
// through the sub-block's sum of x (sum x w = d sc sum x q - dmin m sum x).
//
// Threads: column blocks, and where there are too few for the threads a fixed split of the sub-blocks
// into parts, each into its own partial, summed in part order (results do not depend on which thread took
// which item; as cpu_quantized_matmul.cc). Built by pallas_kernels/cpu_library.py into the kernels' one
// library; the loops are plain C++ that the compiler vectorizes for the path's flags.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "cpu_workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 64;          // the wrapper sends no more
constexpr int kRowGroup = 8;              // rows of x per pass over a sub-block's weights
constexpr int kStep = 8;                  // weight rows widened at a time (one Q5_K high byte, two Q6_K ones)
constexpr int64_t kSuperBlock = 256;      // values per super-block
constexpr int64_t kBlockColumns = 256;    // an item's columns at most: [8, 256] floats of weights and of sums
constexpr int64_t kMinBlockColumns = 32;  // narrower blocks where a weight has too few columns for the threads

float HalfToFloat(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof(h));
  return float(h);
}
float BFloat16ToFloat(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

constexpr int kQ5_0 = 50, kQ5_1 = 51;

// count float16 values -> float32, eight or sixteen at a time where the CPU converts them (F16C).
void WidenHalves(const uint16_t* in, int64_t count, float* out) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= count; j += 16) {
    _mm512_storeu_ps(out + j, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + j))));
  }
#endif
#if defined(__F16C__)
  for (; j + 8 <= count; j += 8) {
    _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + j))));
  }
#endif
  for (; j < count; ++j) out[j] = HalfToFloat(in[j]);
}

struct Weight {
  int kind = 4;                       // 4, 5 or 6: Q4_K, Q5_K, Q6_K; kQ5_0, kQ5_1
  const uint8_t* low = nullptr;       // [K / 2, N]
  const uint8_t* high = nullptr;      // [K / 8, N] (Q5_K), [K / 4, N] (Q6_K)
  const void* sub_scales = nullptr;   // [K / G, N] uint8 (Q4_K, Q5_K) or int8 (Q6_K)
  const uint8_t* sub_mins = nullptr;  // [K / 32, N] (Q4_K, Q5_K)
  const uint16_t* d = nullptr;        // [K / 256, N] float16
  const uint16_t* dmin = nullptr;     // [K / 256, N] float16 (Q4_K, Q5_K)
  float* out = nullptr;               // [M, N]
  const float* x_sums = nullptr;      // [M, K / 32]: each sub-block's sum of x (the mins)
  int64_t columns = 0, group = 32;
  int64_t groups_per_d = 8;  // sub-blocks per row of d: 8 (Q4_K, Q5_K), 16 (Q6_K), 1 (Q5_0, Q5_1)
  int64_t block_columns = 0, blocks = 0, parts = 1;  // the split into work items (Plan)
};

struct Rows {
  const float* data;  // [rows, depth] float32
  int64_t rows, depth;
};

// Weight rows k0 .. k0 + 7, columns c0 .. c0 + width, as float q (Q6_K: less 32) into wq[8][kBlockColumns].
void Widen(const Weight& w, int64_t k0, int64_t c0, int64_t width, float* wq) {
  const int64_t n = w.columns;
  for (int i = 0; i < kStep / 2; ++i) {
    const uint8_t* low = w.low + (k0 / 2 + i) * n + c0;
    float* even = wq + (2 * i) * kBlockColumns;
    float* odd = wq + (2 * i + 1) * kBlockColumns;
    if (w.kind == 4) {
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) {
        even[j] = float(low[j] & 0x0F);
        odd[j] = float(low[j] >> 4);
      }
    } else if (w.kind != 6) {  // a fifth bit: Q5_K, Q5_1 (q 0..31), Q5_0 (q + 16 stored)
      const uint8_t* high = w.high + (k0 / 8) * n + c0;
      const int shift = 2 * i, offset = w.kind == kQ5_0 ? 16 : 0;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) {
        even[j] = float(int((low[j] & 0x0F) | (((high[j] >> shift) & 1) << 4)) - offset);
        odd[j] = float(int((low[j] >> 4) | (((high[j] >> (shift + 1)) & 1) << 4)) - offset);
      }
    } else {
      const uint8_t* high = w.high + (k0 / 4 + i / 2) * n + c0;
      const int shift = 4 * (i % 2);
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) {
        even[j] = float(int((low[j] & 0x0F) | (((high[j] >> shift) & 3) << 4)) - 32);
        odd[j] = float(int((low[j] >> 4) | (((high[j] >> (shift + 2)) & 3) << 4)) - 32);
      }
    }
  }
}

// One item: columns c0 .. c0 + width over sub-blocks g0 .. g1, added into partial [M, N].
void Item(const Weight& w, const Rows& x, int64_t g0, int64_t g1, int64_t c0, int64_t width, float* partial) {
  alignas(64) float wq[kStep * kBlockColumns];
  alignas(64) float sums[kRowGroup * kBlockColumns];
  alignas(64) float scale[kBlockColumns];
  alignas(64) float minimum[kBlockColumns];
  const int64_t n = w.columns, group = w.group;
  const int64_t num_x_groups = x.depth / 32;
  for (int64_t r0 = 0; r0 < x.rows; r0 += kRowGroup) {
    const int rows = int(std::min<int64_t>(kRowGroup, x.rows - r0));
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t s = g / w.groups_per_d;  // the row of d (and dmin)
      std::fill(sums, sums + rows * kBlockColumns, 0.0f);
      for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += kStep) {
        Widen(w, k0, c0, width, wq);
        for (int r = 0; r < rows; ++r) {
          const float* xr = x.data + (r0 + r) * x.depth + k0;
          const float x0 = xr[0], x1 = xr[1], x2 = xr[2], x3 = xr[3];
          const float x4 = xr[4], x5 = xr[5], x6 = xr[6], x7 = xr[7];
          float* sum = sums + r * kBlockColumns;
#pragma omp simd
          for (int64_t j = 0; j < width; ++j) {
            float a = sum[j];
            a += x0 * wq[j] + x1 * wq[kBlockColumns + j];
            a += x2 * wq[2 * kBlockColumns + j] + x3 * wq[3 * kBlockColumns + j];
            a += x4 * wq[4 * kBlockColumns + j] + x5 * wq[5 * kBlockColumns + j];
            a += x6 * wq[6 * kBlockColumns + j] + x7 * wq[7 * kBlockColumns + j];
            sum[j] = a;
          }
        }
      }
      // float16 rows widened in vectors first (as many conversions per sub-block as columns), then the products
      WidenHalves(w.d + s * n + c0, width, scale);
      if (w.kind == kQ5_1) {
        WidenHalves(w.dmin + s * n + c0, width, minimum);
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) minimum[j] = -minimum[j];  // m is added: a negative min
      } else if (w.kind == 6) {
        const int8_t* sc = static_cast<const int8_t*>(w.sub_scales) + g * n + c0;
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) scale[j] *= float(sc[j]);
      } else if (w.kind != kQ5_0) {
        const uint8_t* sc = static_cast<const uint8_t*>(w.sub_scales) + g * n + c0;
        const uint8_t* m = w.sub_mins + g * n + c0;
        WidenHalves(w.dmin + s * n + c0, width, minimum);
#pragma omp simd
        for (int64_t j = 0; j < width; ++j) {
          scale[j] *= float(sc[j]);
          minimum[j] *= float(m[j]);
        }
      }
      for (int r = 0; r < rows; ++r) {
        float* out = partial + (r0 + r) * n + c0;
        const float* sum = sums + r * kBlockColumns;
        if (w.kind == 6 || w.kind == kQ5_0) {
#pragma omp simd
          for (int64_t j = 0; j < width; ++j) out[j] += sum[j] * scale[j];
        } else {
          const float x_sum = w.x_sums[(r0 + r) * num_x_groups + g];
#pragma omp simd
          for (int64_t j = 0; j < width; ++j) out[j] += sum[j] * scale[j] - x_sum * minimum[j];
        }
      }
    }
  }
}

// A weight's split: column blocks (narrower where there are too few for the threads), then parts of K
// along sub-blocks.
void Plan(Weight& w, int64_t depth, int64_t num_workers) {
  const int64_t wanted = 2 * num_workers;
  int64_t width = kBlockColumns;
  if ((w.columns + width - 1) / width < wanted) {
    const int64_t even = (w.columns + wanted - 1) / wanted;
    width = std::min(kBlockColumns, std::max(kMinBlockColumns, (even + 15) / 16 * 16));
  }
  w.block_columns = width;
  w.blocks = (w.columns + width - 1) / width;
  w.parts = 1;
  if (w.blocks < wanted) w.parts = std::min((wanted + w.blocks - 1) / w.blocks, depth / w.group);
}

void Run(int64_t num_workers, std::vector<Weight>& weights, const Rows& x) {
  std::vector<int64_t> first_item;
  std::vector<std::vector<float>> partials(weights.size());  // parts beyond the first, where K is split
  int64_t num_items = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    Weight& w = weights[i];
    Plan(w, x.depth, num_workers);
    first_item.push_back(num_items);
    num_items += w.blocks * w.parts;
    std::fill(w.out, w.out + x.rows * w.columns, 0.0f);
    if (w.parts > 1) partials[i].assign((w.parts - 1) * x.rows * w.columns, 0.0f);
  }
  jaxserve_cpu::RunItems(num_workers, num_items, [&](int64_t, int64_t item) {
    const size_t i = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
    const Weight& w = weights[i];
    const int64_t local = item - first_item[i];
    const int64_t block = local % w.blocks, part = local / w.blocks;
    const int64_t c0 = block * w.block_columns, width = std::min(w.block_columns, w.columns - c0);
    const int64_t groups = x.depth / w.group;
    const int64_t g0 = groups * part / w.parts, g1 = groups * (part + 1) / w.parts;
    float* partial = part == 0 ? w.out : partials[i].data() + (part - 1) * x.rows * w.columns;
    Item(w, x, g0, g1, c0, width, partial);
  });
  for (size_t i = 0; i < weights.size(); ++i) {
    const Weight& w = weights[i];
    const int64_t size = x.rows * w.columns;
    for (int64_t part = 1; part < w.parts; ++part) {
      const float* from = partials[i].data() + (part - 1) * size;
#pragma omp simd
      for (int64_t j = 0; j < size; ++j) w.out[j] += from[j];
    }
  }
}

// Whether `buffer` is 2-d [rows, columns] of `type`.
bool Is(const ffi::AnyBuffer& buffer, ffi::DataType type, int64_t rows, int64_t columns) {
  const auto dims = buffer.dimensions();
  return buffer.element_type() == type && dims.size() == 2 && dims[0] == rows && dims[1] == columns;
}

constexpr int kArraysPerWeight = 6;  // low, high, sub_scales, sub_mins, d, dmin (dummies where a kind has none)

ffi::Error KQuantMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs arrays, ffi::RemainingRets outs,
                        ffi::Span<const int64_t> kinds) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return ffi::Error::InvalidArgument("kquant_matmul: x must be 2-d");
  const int64_t rows = x_dims[0], depth = x_dims[1];
  if (rows > kMaxRows) return ffi::Error::InvalidArgument("kquant_matmul: too many rows");
  if (depth % 32) return ffi::Error::InvalidArgument("kquant_matmul: K must be a multiple of 32");
  const size_t count = outs.size();
  if (count == 0 || arrays.size() != kArraysPerWeight * count || kinds.size() != count) {
    return ffi::Error::InvalidArgument("kquant_matmul: six arrays and a kind per result");
  }
  std::vector<Weight> weights;
  for (size_t i = 0; i < count; ++i) {
    std::vector<ffi::AnyBuffer> a;
    for (int j = 0; j < kArraysPerWeight; ++j) {
      auto buffer = arrays.get<ffi::AnyBuffer>(kArraysPerWeight * i + j);
      if (!buffer.has_value()) return ffi::Error::InvalidArgument("kquant_matmul: bad weight array");
      a.push_back(*buffer);
    }
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!out.has_value()) return ffi::Error::InvalidArgument("kquant_matmul: bad result");
    Weight w;
    w.kind = int(kinds[i]);
    const bool legacy = w.kind == kQ5_0 || w.kind == kQ5_1;  // 32-value blocks, no super-blocks
    if (w.kind != 4 && w.kind != 5 && w.kind != 6 && !legacy) {
      return ffi::Error::InvalidArgument("kquant_matmul: kind must be 4, 5, 6, 50 or 51");
    }
    if (!legacy && depth % kSuperBlock) return ffi::Error::InvalidArgument("kquant_matmul: K-quants want K % 256 == 0");
    const auto low_dims = a[0].dimensions();
    if (low_dims.size() != 2) return ffi::Error::InvalidArgument("kquant_matmul: low must be 2-d");
    w.columns = low_dims[1];
    w.group = w.kind == 6 ? 16 : 32;
    w.groups_per_d = legacy ? 1 : kSuperBlock / w.group;
    const int64_t n = w.columns, d_rows = depth / w.group / w.groups_per_d;
    bool ok = Is(a[0], ffi::DataType::U8, depth / 2, n) && Is(a[4], ffi::DataType::F16, d_rows, n) &&
              (*out)->element_count() == size_t(rows * n);
    if (legacy) {
      ok = ok && Is(a[1], ffi::DataType::U8, depth / 8, n);
      if (w.kind == kQ5_1) ok = ok && Is(a[5], ffi::DataType::F16, d_rows, n);
    } else if (w.kind == 4) {
      ok = ok && Is(a[2], ffi::DataType::U8, depth / 32, n);
    } else if (w.kind == 5) {
      ok = ok && Is(a[1], ffi::DataType::U8, depth / 8, n) && Is(a[2], ffi::DataType::U8, depth / 32, n);
    } else {
      ok = ok && Is(a[1], ffi::DataType::U8, depth / 4, n) && Is(a[2], ffi::DataType::S8, depth / 16, n);
    }
    if (w.kind == 4 || w.kind == 5) {
      ok = ok && Is(a[3], ffi::DataType::U8, depth / 32, n) && Is(a[5], ffi::DataType::F16, d_rows, n);
    }
    if (!ok) return ffi::Error::InvalidArgument("kquant_matmul: inconsistent shapes or types");
    w.low = static_cast<const uint8_t*>(a[0].untyped_data());
    w.high = w.kind == 4 ? nullptr : static_cast<const uint8_t*>(a[1].untyped_data());
    w.sub_scales = legacy ? nullptr : a[2].untyped_data();
    w.sub_mins = w.kind == 4 || w.kind == 5 ? static_cast<const uint8_t*>(a[3].untyped_data()) : nullptr;
    w.d = static_cast<const uint16_t*>(a[4].untyped_data());
    w.dmin = w.kind == 6 || w.kind == kQ5_0 ? nullptr : static_cast<const uint16_t*>(a[5].untyped_data());
    w.out = (*out)->typed_data();
    weights.push_back(w);
  }
  std::vector<float> x_wide(rows * depth);
  const void* x_data = x.untyped_data();
  switch (x.element_type()) {
    case ffi::DataType::F32:
      std::memcpy(x_wide.data(), x_data, x_wide.size() * sizeof(float));
      break;
    case ffi::DataType::F16:
      for (size_t i = 0; i < x_wide.size(); ++i) x_wide[i] = HalfToFloat(static_cast<const uint16_t*>(x_data)[i]);
      break;
    case ffi::DataType::BF16:
      for (size_t i = 0; i < x_wide.size(); ++i) x_wide[i] = BFloat16ToFloat(static_cast<const uint16_t*>(x_data)[i]);
      break;
    default:
      return ffi::Error::InvalidArgument("kquant_matmul: x must be float32, bfloat16 or float16");
  }
  std::vector<float> x_sums(rows * (depth / 32), 0.0f);  // each 32 values' sum of x: the mins' sub-blocks
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < depth; ++k) x_sums[r * (depth / 32) + k / 32] += x_wide[r * depth + k];
  for (Weight& w : weights) w.x_sums = x_sums.data();
  Run(std::max<int64_t>(1, pool.num_threads()), weights, Rows{x_wide.data(), rows, depth});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveKQuantMatmul, KQuantMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("kinds"));
