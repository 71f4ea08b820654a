// A few rows times quantized weights, for decode steps on the CPU, as an XLA FFI custom call:
// out_i [M, N_i] float32 = x [M, K] @ w_i, where w [K, N] = q * scales[k / G] (+ mins[k / G]) per group of G
// rows of K (pallas_kernels/matmul/quantized.py's layout): q int8 [K, N], or 4-bit packed two rows to a
// byte [K / 2, N] (low nibble row 2i, high 2i + 1; offset 8 where there are no mins). Several weights by
// the same rows (a layer's q, k and v; gate and up) go in one call, their work items shared by the threads.
//
// Why: a decode step is bound by reading weights; XLA's dots widen the integers to a float copy first.
// Here each weight byte is read once, in address order, and widened in registers: four weight rows per
// pass over a group's sums (kept in L1 for up to 8 rows of x), each widened vector serving every row; the
// sums are scaled once per (group, column), the min (or the 4-bit offset 8) applied through the group's
// sum of x. (The first version added one weight row per pass, a load and a store of the sums per
// multiply-add, and ran int8 no faster than float32.)
//
// Work is split as cpu_matmul.cc splits a [K, N] weight: column blocks times (where there are too few
// blocks for the threads) a fixed split of K into parts along group boundaries, each part into its own
// partial, summed in part order, so results do not depend on which thread took which item. The parts are a
// one-row call's whatever the rows: each row's result is the bits a one-row call gives it (session 16). Built by
// pallas_kernels/cpu_library.py into the kernels' one library (the helpers in ../cpu_workers.h); the
// compiler flags pick the path (AVX-512, AVX2, or the portable vector types).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_workers.h"
#include "matmul/cpu_float_vectors.h"
#include "matmul/cpu_weight_basics.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {


typedef int32_t VecI __attribute__((vector_size(4 * kLanes)));
typedef int8_t VecB __attribute__((vector_size(kLanes)));
typedef uint8_t VecUB __attribute__((vector_size(kLanes)));

constexpr int64_t kBlockColumns = 4096;  // an item's columns at most (one row of x: a page of int8 per row)
constexpr int64_t kSumsBytes = 16 * 1024; // an item's group sums [rows, width] float32, in L1
constexpr int64_t kMinBlockColumns = 64; // narrower blocks where a weight has too few columns for the threads
constexpr int64_t kMaxRows = 64;         // the wrapper sends no more
constexpr int kRowGroup = 8;             // rows of x per walk over a group's weights
constexpr int64_t kPrefetchBytes = 4096; // software prefetch this far ahead along the walk (as cpu_matmul.cc)

using jaxserve_cpu::BFloat16ToFloat;  // cpu_weight_basics.h
using jaxserve_cpu::FmaOne;
using jaxserve_cpu::HalfToFloat;




// kLanes int8 weights widened to float32 (vpmovsxbd + vcvtdq2ps on the x86 paths).
inline VecF WidenInt8(const int8_t* p) {
#if defined(__AVX512F__)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  VecB b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, VecF);
#endif
}

// kLanes bytes of packed nibbles: the low nibbles (row 2i) and the high ones (row 2i + 1) as float32.
inline void WidenNibbles(const uint8_t* p, VecF& low, VecF& high) {
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  low = _mm512_cvtepi32_ps(_mm512_and_si512(wide, _mm512_set1_epi32(0x0F)));
  high = _mm512_cvtepi32_ps(_mm512_srli_epi32(wide, 4));
#elif defined(__AVX2__)
  const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  low = _mm256_cvtepi32_ps(_mm256_and_si256(wide, _mm256_set1_epi32(0x0F)));
  high = _mm256_cvtepi32_ps(_mm256_srli_epi32(wide, 4));
#else
  VecUB b;
  std::memcpy(&b, p, sizeof(b));
  const VecI wide = __builtin_convertvector(b, VecI);
  low = __builtin_convertvector(wide & 0x0F, VecF);
  high = __builtin_convertvector(wide >> 4, VecF);
#endif
}

using jaxserve_cpu::FloatArray;  // x, scales, mins: cpu_weight_basics.h

struct Problem {
  const void* values;   // int8 [K, N] or uint8 [K / 2, N]
  FloatArray scales;    // [G, N]
  FloatArray mins;      // [G, N]; data null: none
  float* out;           // [M, N]
  const float* x_sums;  // [M, K / G]: each group's sum of x (for the mins and the 4-bit offset)
  int64_t columns, group, num_groups;
  int bits;
  int64_t block_columns, blocks, parts;  // the split into work items (Plan)
};

struct Rows {
  const float* x;  // [M, K], widened
  int64_t rows, depth;
};

// One stored weight, as its integer (4-bit: the nibble as stored), in float32.
template <int Bits>
inline float Weight(const Problem& p, int64_t k, int64_t col) {
  if (Bits == 8) return float(static_cast<const int8_t*>(p.values)[k * p.columns + col]);
  const uint8_t byte = static_cast<const uint8_t*>(p.values)[(k / 2) * p.columns + col];
  return float(k % 2 ? byte >> 4 : byte & 0x0F);
}

// Up to 8 rows r0.. r0 + R of x times group g's weight rows at columns [c0, c0 + width), added into
// partial [M, N]. The weight rows are read in address order, four at a time (two byte rows of 4-bit), each
// widened vector serving all R rows; the group's sums [R, width] stay in L1 (`sums`), then are scaled once.
// Software prefetch kPrefetchBytes ahead along the walk. (A register tile over a group's rows, a GEMM
// micro-kernel's order, hopped between weight rows N bytes apart: with N a multiple of 4 KiB, as a
// vocabulary-wide head's is, every row fell into one L1 set and the prefetches were evicted before use.)
template <int R, int Bits>
void GroupRows(const Problem& p, const Rows& x, int64_t r0, int64_t g, int64_t c0, int64_t width, const float* scale,
               const float* minimum, float* sums, float* partial) {
  // weight rows (of K) per pass over the sums: eight int8 rows for one row of x on AVX-512 (its 32
  // registers hold the eight broadcasts and widened rows), halving the sums' loads and stores (int8 ran
  // 8-17% faster, 4-bit no faster); four otherwise
  constexpr int S = (Bits == 8 && R == 1 && kLanes == 16) ? 8 : 4;
  constexpr int64_t kBytesPerStep = Bits == 8 ? S : S / 2;  // byte rows they take
  const int64_t k0 = g * p.group, k1 = k0 + p.group;
  const int64_t vectors = width / kLanes * kLanes;
  const int64_t row_bytes = p.columns;  // a byte row's stride
  const int64_t ahead_steps = std::max<int64_t>(1, (kPrefetchBytes + width * kBytesPerStep - 1) / (width * kBytesPerStep));
  const int64_t ahead = ahead_steps * kBytesPerStep * row_bytes;
  const float* xr = x.x + r0 * x.depth;
  for (int r = 0; r < R; ++r) std::fill(sums + r * width, sums + (r + 1) * width, 0.0f);
  const auto* base = static_cast<const uint8_t*>(p.values);
  int64_t k = k0;
  for (; k + S <= k1; k += S) {
    const uint8_t* s0 = base + (Bits == 8 ? k : k / 2) * row_bytes + c0;
    VecF xv[R][S];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < S; ++j) xv[r][j] = Broadcast(xr[r * x.depth + k + j]);
    for (int64_t c = 0; c < vectors; c += kLanes) {
      if (c % 64 == 0) {
        for (int64_t j = 0; j < kBytesPerStep; ++j) __builtin_prefetch(s0 + ahead + j * row_bytes + c);
      }
      VecF w[S];
      if constexpr (Bits == 8) {
        const auto* q = reinterpret_cast<const int8_t*>(s0 + c);
        for (int j = 0; j < S; ++j) w[j] = WidenInt8(q + j * row_bytes);
      } else {
        for (int j = 0; j < S / 2; ++j) WidenNibbles(s0 + j * row_bytes + c, w[2 * j], w[2 * j + 1]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        float* out = sums + r * width + c;
        VecF a = LoadF(out);
        for (int j = 0; j < S; ++j) a = Fma(xv[r][j], w[j], a);
        StoreF(out, a);
      }
    }
  }
  // the group's last rows (fewer than a step's: odd groups, per-channel int8 at odd K) and the last columns
  // (N not a multiple of the vector), one at a time
  for (int64_t c = vectors; c < width; ++c) {
    for (int64_t kk = k0; kk < k; ++kk) {
      for (int r = 0; r < R; ++r) {
        sums[r * width + c] = FmaOne(xr[r * x.depth + kk], Weight<Bits>(p, kk, c0 + c), sums[r * width + c]);
      }
    }
  }
  for (; k < k1; ++k) {
    for (int64_t c = 0; c < width; ++c) {
      const float w = Weight<Bits>(p, k, c0 + c);
      for (int r = 0; r < R; ++r) sums[r * width + c] = FmaOne(xr[r * x.depth + k], w, sums[r * width + c]);
    }
  }
  const bool has_mins = p.mins.data != nullptr;
  for (int r = 0; r < R; ++r) {
    float* __restrict out = partial + (r0 + r) * p.columns + c0;
    const float* __restrict sum = sums + r * width;
    const float x_sum = p.x_sums[(r0 + r) * p.num_groups + g];
    // nibbles without mins hold q + 8: sum(x * (n - 8)) = sum(x * n) - 8 * sum(x)
    const float offset = (Bits == 4 && !has_mins) ? 8.0f * x_sum : 0.0f;
    const float min_weight = has_mins ? x_sum : 0.0f;
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) out[c] += (sum[c] - offset) * scale[c] + min_weight * minimum[c];
  }
}

// Block columns for `rows` rows of x: the group sums of up to 8 rows, [8, width] float32, stay in L1.
inline int64_t BlockColumns(int64_t rows) {
  const int64_t fits = kSumsBytes / int64_t(sizeof(float) * std::min<int64_t>(rows, kRowGroup));
  return std::min<int64_t>(kBlockColumns, fits / kMinBlockColumns * kMinBlockColumns);  // whole vectors
}

// Groups [g0, g1) of every row of x times columns [c0, c0 + width), added into partial [M, N]: group by
// group, so the group's weight rows (G x width bytes) stay in cache while each 8 rows of x pass over them.
template <int Bits>
void Item(const Problem& p, const Rows& x, int64_t g0, int64_t g1, int64_t c0, int64_t width, float* partial) {
  alignas(64) float scale[kBlockColumns];
  alignas(64) float minimum[kBlockColumns];
  alignas(64) float sums[kSumsBytes / sizeof(float)];
  if (p.mins.data == nullptr) std::fill(minimum, minimum + width, 0.0f);
  for (int64_t g = g0; g < g1; ++g) {
    p.scales.Widen(g * p.columns + c0, width, scale);
    if (p.mins.data != nullptr) p.mins.Widen(g * p.columns + c0, width, minimum);
    int64_t r0 = 0;
    for (; r0 + kRowGroup <= x.rows; r0 += kRowGroup) {
      GroupRows<kRowGroup, Bits>(p, x, r0, g, c0, width, scale, minimum, sums, partial);
    }
    switch (x.rows - r0) {
      case 7: GroupRows<7, Bits>(p, x, r0, g, c0, width, scale, minimum, sums, partial); break;
      case 6: GroupRows<6, Bits>(p, x, r0, g, c0, width, scale, minimum, sums, partial); break;
      case 5: GroupRows<5, Bits>(p, x, r0, g, c0, width, scale, minimum, sums, partial); break;
      case 4: GroupRows<4, Bits>(p, x, r0, g, c0, width, scale, minimum, sums, partial); break;
      case 3: GroupRows<3, Bits>(p, x, r0, g, c0, width, scale, minimum, sums, partial); break;
      case 2: GroupRows<2, Bits>(p, x, r0, g, c0, width, scale, minimum, sums, partial); break;
      case 1: GroupRows<1, Bits>(p, x, r0, g, c0, width, scale, minimum, sums, partial); break;
      default: break;
    }
  }
}

// Column blocks of a weight for `rows` rows: at most BlockColumns(rows) wide, narrower (whole vectors, as even
// as they allow) where there are fewer than `wanted` blocks.
inline int64_t PlanWidth(const Problem& p, int64_t rows, int64_t wanted) {
  const int64_t widest = BlockColumns(rows);
  if ((p.columns + widest - 1) / widest >= wanted) return widest;
  const int64_t even = (p.columns + wanted - 1) / wanted;
  return std::min(widest, std::max(kMinBlockColumns, (even + kMinBlockColumns - 1) / kMinBlockColumns * kMinBlockColumns));
}

// A weight's split: column blocks (narrower where there are too few for the threads), then parts of K. The
// parts are a one-row call's whatever the rows (session 16): a row's groups are summed in the same parts, added
// in the same order, in a call of 1 row as of 8 or 64, so a verify step's row gets a decode step's bits (a
// column's sums do not depend on which block holds it). More rows only make more, narrower column blocks.
void Plan(Problem& p, int64_t rows, int64_t num_workers) {
  const int64_t wanted = 2 * num_workers;  // two items per thread at least, so that a late helper gets its share
  p.block_columns = PlanWidth(p, rows, wanted);
  p.blocks = (p.columns + p.block_columns - 1) / p.block_columns;
  const int64_t one_row_width = PlanWidth(p, 1, wanted);
  const int64_t one_row_blocks = (p.columns + one_row_width - 1) / one_row_width;
  p.parts = 1;
  if (one_row_blocks < wanted) p.parts = std::min((wanted + one_row_blocks - 1) / one_row_blocks, p.num_groups);
}

void Run(int64_t num_workers, std::vector<Problem>& problems, const Rows& x) {
  std::vector<int64_t> first_item;  // each problem's first work item
  std::vector<std::vector<float>> partials(problems.size());  // parts beyond the first, where K is split
  int64_t num_items = 0;
  for (size_t i = 0; i < problems.size(); ++i) {
    Problem& p = problems[i];
    Plan(p, x.rows, num_workers);
    first_item.push_back(num_items);
    num_items += p.blocks * p.parts;
    std::fill(p.out, p.out + x.rows * p.columns, 0.0f);
    if (p.parts > 1) partials[i].assign((p.parts - 1) * x.rows * p.columns, 0.0f);
  }
  jaxserve_cpu::RunItems(num_workers, num_items, [&](int64_t, int64_t item) {
    const size_t i = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
    const Problem& p = problems[i];
    const int64_t local = item - first_item[i];
    const int64_t block = local % p.blocks, part = local / p.blocks;
    const int64_t c0 = block * p.block_columns, width = std::min(p.block_columns, p.columns - c0);
    const int64_t g0 = p.num_groups * part / p.parts, g1 = p.num_groups * (part + 1) / p.parts;
    float* partial = part == 0 ? p.out : partials[i].data() + (part - 1) * x.rows * p.columns;
    if (p.bits == 8) {
      Item<8>(p, x, g0, g1, c0, width, partial);
    } else {
      Item<4>(p, x, g0, g1, c0, width, partial);
    }
  });
  for (size_t i = 0; i < problems.size(); ++i) {
    const Problem& p = problems[i];
    const int64_t size = x.rows * p.columns;
    for (int64_t part = 1; part < p.parts; ++part) {
      const float* from = partials[i].data() + (part - 1) * size;
#pragma omp simd
      for (int64_t j = 0; j < size; ++j) p.out[j] += from[j];
    }
  }
}

ffi::Error QuantizedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs arrays, ffi::RemainingRets outs,
                           ffi::Span<const int64_t> bits, ffi::Span<const int64_t> has_mins) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return ffi::Error::InvalidArgument("quantized_matmul: x must be 2-d");
  const int64_t rows = x_dims[0], depth = x_dims[1];
  if (rows > kMaxRows) return ffi::Error::InvalidArgument("quantized_matmul: too many rows");
  const size_t count = outs.size();
  if (count == 0 || arrays.size() != 3 * count || bits.size() != count || has_mins.size() != count) {
    return ffi::Error::InvalidArgument("quantized_matmul: values, scales and mins, bits and has_mins per result");
  }
  std::vector<Problem> problems;
  for (size_t i = 0; i < count; ++i) {
    auto values = arrays.get<ffi::AnyBuffer>(3 * i);
    auto scales = arrays.get<ffi::AnyBuffer>(3 * i + 1);
    auto mins = arrays.get<ffi::AnyBuffer>(3 * i + 2);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!values.has_value() || !scales.has_value() || !mins.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument("quantized_matmul: bad weight or result");
    }
    const auto v_dims = values->dimensions(), s_dims = scales->dimensions(), m_dims = mins->dimensions();
    if (v_dims.size() != 2 || s_dims.size() != 2) {
      return ffi::Error::InvalidArgument("quantized_matmul: values and scales must be 2-d");
    }
    if (bits[i] != 8 && bits[i] != 4) return ffi::Error::InvalidArgument("quantized_matmul: bits must be 8 or 4");
    const int64_t columns = v_dims[1], num_groups = s_dims[0];
    const ffi::DataType value_type = bits[i] == 8 ? ffi::DataType::S8 : ffi::DataType::U8;
    if (values->element_type() != value_type || v_dims[0] * (8 / bits[i]) != depth || s_dims[1] != columns ||
        num_groups < 1 || depth % num_groups || (bits[i] == 4 && (depth / num_groups) % 2) ||
        (*out)->element_count() != size_t(rows * columns)) {
      return ffi::Error::InvalidArgument("quantized_matmul: inconsistent shapes or types");
    }
    if (has_mins[i] && (m_dims.size() != 2 || m_dims[0] != num_groups || m_dims[1] != columns ||
                        mins->element_type() != scales->element_type())) {
      return ffi::Error::InvalidArgument("quantized_matmul: mins must be shaped and typed as scales");
    }
    problems.push_back(Problem{values->untyped_data(),
                               FloatArray{scales->untyped_data(), scales->element_type()},
                               FloatArray{has_mins[i] ? mins->untyped_data() : nullptr, mins->element_type()},
                               (*out)->typed_data(),
                               nullptr,
                               columns,
                               depth / num_groups,
                               num_groups,
                               int(bits[i]),
                               0,
                               0,
                               0});
  }
  std::vector<float> x_wide(rows * depth);
  FloatArray{x.untyped_data(), x.element_type()}.Widen(0, rows * depth, x_wide.data());
  std::vector<std::vector<float>> x_sums(count);  // each weight's group sums of x, [M, its groups]
  for (size_t i = 0; i < count; ++i) {
    Problem& p = problems[i];
    x_sums[i].assign(rows * p.num_groups, 0.0f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < depth; ++k) x_sums[i][r * p.num_groups + k / p.group] += x_wide[r * depth + k];
    p.x_sums = x_sums[i].data();
  }
  Run(std::max<int64_t>(1, pool.num_threads()), problems, Rows{x_wide.data(), rows, depth});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantizedMatmul, QuantizedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("bits")
                                  .Attr<ffi::Span<const int64_t>>("has_mins"));
