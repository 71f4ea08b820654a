// A few rows times a quantized weight, for decode steps on the CPU, as an XLA FFI custom call:
// out [M, N] float32 = x [M, K] @ w, where w [K, N] = q * scales[k / G] (+ mins[k / G]) per group of G
// rows of K (pallas_kernels/matmul/quantized.py's layout): q int8 [K, N], or 4-bit packed two rows to a
// byte [K / 2, N] (low nibble row 2i, high 2i + 1; offset 8 where there are no mins).
//
// Why: a decode step is bound by reading weights; XLA's dots widen the integers to a float copy first.
// Here each weight byte is read once and widened in registers; each group's integer products are summed
// in float32, then scaled once per group and column (and the min times the group's sum of x added), so
// the scales cost a row of reads per group, not a multiply per weight.
//
// Work is split as cpu_matmul.cc splits a [K, N] weight: column blocks times (where there are too few
// blocks for the threads) a fixed split of K into parts along group boundaries, each part into its own
// partial, summed in part order, so results do not depend on which thread took which item. Built by
// pallas_kernels/cpu_library.py into the kernels' one library (the helpers in ../cpu_workers.h).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlockColumns = 512;  // an item's columns: 8 rows of float32 sums over them stay in L1
constexpr int64_t kMaxRows = 64;        // the wrapper sends no more
constexpr int64_t kRowGroup = 8;        // rows of x per pass over the weights

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

// A float array of one of the three widths, read as float32.
struct FloatArray {
  const void* data = nullptr;
  ffi::DataType type = ffi::DataType::F32;

  void Widen(int64_t offset, int64_t count, float* out) const {
    switch (type) {
      case ffi::DataType::F16: {
        const auto* in = static_cast<const uint16_t*>(data) + offset;
        for (int64_t i = 0; i < count; ++i) out[i] = HalfToFloat(in[i]);
        break;
      }
      case ffi::DataType::BF16: {
        const auto* in = static_cast<const uint16_t*>(data) + offset;
        for (int64_t i = 0; i < count; ++i) out[i] = BFloat16ToFloat(in[i]);
        break;
      }
      default:
        std::memcpy(out, static_cast<const float*>(data) + offset, count * sizeof(float));
    }
  }
};

struct Problem {
  const void* values;   // int8 [K, N] or uint8 [K / 2, N]
  FloatArray scales;    // [G, N]
  FloatArray mins;      // [G, N]; data null: none
  const float* x;       // [M, K], widened
  const float* x_sums;  // [M, G]: each group's sum of x (for the mins)
  int64_t rows, depth, columns, group, num_groups;
  int bits;
};

// Groups [g0, g1) of rows r0.. r0 + R of x times columns [c0, c0 + width), added into partial [M, N].
template <int R, int Bits>
void Item(const Problem& p, int64_t r0, int64_t g0, int64_t g1, int64_t c0, int64_t width, float* partial) {
  alignas(64) float sums[R][kBlockColumns];
  alignas(64) float scale[kBlockColumns];
  alignas(64) float minimum[kBlockColumns];
  alignas(64) float low[kBlockColumns];   // 4-bit: a byte row's two weight rows, widened
  alignas(64) float high[kBlockColumns];
  const float offset = (Bits == 4 && p.mins.data == nullptr) ? 8.0f : 0.0f;
  for (int64_t g = g0; g < g1; ++g) {
    for (int r = 0; r < R; ++r) std::fill(sums[r], sums[r] + width, 0.0f);
    const int64_t k0 = g * p.group, k1 = k0 + p.group;
    if (Bits == 8) {
      const auto* q = static_cast<const int8_t*>(p.values);
      for (int64_t k = k0; k < k1; ++k) {
        const int8_t* __restrict row = q + k * p.columns + c0;
        float xv[R];
        for (int r = 0; r < R; ++r) xv[r] = p.x[(r0 + r) * p.depth + k];
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) {
          const float w = float(row[c]);
          for (int r = 0; r < R; ++r) sums[r][c] += xv[r] * w;
        }
      }
    } else {
      const auto* q = static_cast<const uint8_t*>(p.values);
      for (int64_t k = k0; k < k1; k += 2) {
        const uint8_t* __restrict row = q + (k / 2) * p.columns + c0;
        float low_x[R], high_x[R];
        for (int r = 0; r < R; ++r) {
          low_x[r] = p.x[(r0 + r) * p.depth + k];
          high_x[r] = p.x[(r0 + r) * p.depth + k + 1];
        }
        // Unpacked first into two float rows (one simple loop the compiler vectorizes), then used as the
        // int8 path uses its row: unpacking inside the accumulation loop was left scalar (40x slower).
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) {
          low[c] = float(int(row[c] & 0x0F)) - offset;
          high[c] = float(int(row[c] >> 4)) - offset;
        }
        for (int r = 0; r < R; ++r) {
          float* __restrict out = sums[r];
          const float lx = low_x[r], hx = high_x[r];
#pragma omp simd
          for (int64_t c = 0; c < width; ++c) out[c] += lx * low[c] + hx * high[c];
        }
      }
    }
    p.scales.Widen(g * p.columns + c0, width, scale);
    if (p.mins.data != nullptr) p.mins.Widen(g * p.columns + c0, width, minimum);
    for (int r = 0; r < R; ++r) {
      float* __restrict out = partial + (r0 + r) * p.columns + c0;
      if (p.mins.data != nullptr) {
        const float x_sum = p.x_sums[(r0 + r) * p.num_groups + g];
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) out[c] += sums[r][c] * scale[c] + x_sum * minimum[c];
      } else {
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) out[c] += sums[r][c] * scale[c];
      }
    }
  }
}

template <int Bits>
void RowBlocks(const Problem& p, int64_t g0, int64_t g1, int64_t c0, int64_t width, float* partial) {
  int64_t r0 = 0;
  for (; r0 + kRowGroup <= p.rows; r0 += kRowGroup) Item<8, Bits>(p, r0, g0, g1, c0, width, partial);
  switch (p.rows - r0) {
    case 7: Item<7, Bits>(p, r0, g0, g1, c0, width, partial); break;
    case 6: Item<6, Bits>(p, r0, g0, g1, c0, width, partial); break;
    case 5: Item<5, Bits>(p, r0, g0, g1, c0, width, partial); break;
    case 4: Item<4, Bits>(p, r0, g0, g1, c0, width, partial); break;
    case 3: Item<3, Bits>(p, r0, g0, g1, c0, width, partial); break;
    case 2: Item<2, Bits>(p, r0, g0, g1, c0, width, partial); break;
    case 1: Item<1, Bits>(p, r0, g0, g1, c0, width, partial); break;
    default: break;
  }
}

void Run(ffi::ThreadPool& pool, const Problem& p, float* out) {
  const int64_t num_workers = std::max<int64_t>(1, pool.num_threads());
  const int64_t blocks = (p.columns + kBlockColumns - 1) / kBlockColumns;
  // Two items per thread at least, so that a late helper still gets its share.
  int64_t parts = 1;
  if (blocks < 2 * num_workers) parts = std::min((2 * num_workers + blocks - 1) / blocks, p.num_groups);
  const int64_t size = p.rows * p.columns;
  std::vector<float> partials(parts * size, 0.0f);
  float* partial_data = partials.data();
  jaxserve_cpu::RunItems(num_workers, blocks * parts, [&p, blocks, parts, size, partial_data](int64_t, int64_t i) {
    const int64_t block = i % blocks, part = i / blocks;
    const int64_t c0 = block * kBlockColumns, width = std::min(kBlockColumns, p.columns - c0);
    const int64_t g0 = p.num_groups * part / parts, g1 = p.num_groups * (part + 1) / parts;
    float* partial = partial_data + part * size;
    if (p.bits == 8) {
      RowBlocks<8>(p, g0, g1, c0, width, partial);
    } else {
      RowBlocks<4>(p, g0, g1, c0, width, partial);
    }
  });
  std::memcpy(out, partial_data, size * sizeof(float));
  for (int64_t part = 1; part < parts; ++part) {
#pragma omp simd
    for (int64_t i = 0; i < size; ++i) out[i] += partial_data[part * size + i];
  }
}

ffi::Error QuantizedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer values, ffi::AnyBuffer scales,
                           ffi::AnyBuffer mins, ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t bits, bool has_mins) {
  const auto x_dims = x.dimensions(), v_dims = values.dimensions(), s_dims = scales.dimensions();
  if (x_dims.size() != 2 || v_dims.size() != 2 || s_dims.size() != 2) {
    return ffi::Error::InvalidArgument("quantized_matmul: x, values and scales must be 2-d");
  }
  const int64_t rows = x_dims[0], depth = x_dims[1], columns = v_dims[1], num_groups = s_dims[0];
  if (rows > kMaxRows) return ffi::Error::InvalidArgument("quantized_matmul: too many rows");
  if (bits != 8 && bits != 4) return ffi::Error::InvalidArgument("quantized_matmul: bits must be 8 or 4");
  const ffi::DataType value_type = bits == 8 ? ffi::DataType::S8 : ffi::DataType::U8;
  if (values.element_type() != value_type || v_dims[0] * (8 / bits) != depth || s_dims[1] != columns ||
      num_groups < 1 || depth % num_groups || (bits == 4 && (depth / num_groups) % 2) ||
      out->element_count() != size_t(rows * columns)) {
    return ffi::Error::InvalidArgument("quantized_matmul: inconsistent shapes or types");
  }
  const auto m_dims = mins.dimensions();
  if (has_mins && (m_dims.size() != 2 || m_dims[0] != num_groups || m_dims[1] != columns ||
                   mins.element_type() != scales.element_type())) {
    return ffi::Error::InvalidArgument("quantized_matmul: mins must be shaped and typed as scales");
  }
  std::vector<float> x_wide(rows * depth);
  FloatArray{x.untyped_data(), x.element_type()}.Widen(0, rows * depth, x_wide.data());
  const int64_t group = depth / num_groups;
  std::vector<float> x_sums(rows * num_groups, 0.0f);
  if (has_mins) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < depth; ++k) x_sums[r * num_groups + k / group] += x_wide[r * depth + k];
  }
  Problem problem{values.untyped_data(),
                  FloatArray{scales.untyped_data(), scales.element_type()},
                  FloatArray{has_mins ? mins.untyped_data() : nullptr, mins.element_type()},
                  x_wide.data(),
                  x_sums.data(),
                  rows,
                  depth,
                  columns,
                  group,
                  num_groups,
                  int(bits)};
  Run(pool, problem, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantizedMatmul, QuantizedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<bool>("has_mins"));
