// A few rows times 16-bit (or float32) weight matrices, for decode steps on the CPU, as an XLA FFI
// custom call: out_i [M, N_i] float32 = x [M, K] @ w_i, with each w_i [K, N_i] or (transposed)
// [N_i, K], all in one of float32, bfloat16, float16, accumulated in float32.
//
// Why: XLA:CPU widens a 16-bit weight to float32 as a whole before a dot with few rows (issue #16),
// so a bfloat16 decode step moved five times its weights' bytes. Here each weight element is read
// once and widened in registers: the step costs the weights' bytes, which is the memory roofline.
//
// Work is split into small items shared by the caller and helper threads (../cpu_workers.h). Built by
// pallas_kernels/cpu_library.py into one library with the attention kernel (they share the helpers).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "cpu_workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kColumns = 4096;          // most output columns per item ([K, N] weights): 8 KiB of a 16-bit row
constexpr int64_t kAccumulatorBytes = 16 * 1024;  // an item's float32 accumulators ([rows, columns]) stay in L1
constexpr int64_t kItemBytes = 32 * 1024;    // weight bytes per work item ([N, K] weights)
constexpr int64_t kMaxRows = 64;             // the wrapper sends no more

// Software prefetch, this many bytes ahead of the rows being read: without it the out-of-order window,
// full of widening and multiplying, issues too few cache misses at a time (figures in bench/results/).
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kLineBytes = 64;

// Weight rows to prefetch ahead, rows of `row_bytes` apart: at least kPrefetchBytes, a multiple of 4.
inline int64_t PrefetchRows(int64_t row_bytes) {
  const int64_t rows = (kPrefetchBytes + row_bytes - 1) / std::max<int64_t>(1, row_bytes);
  return std::max<int64_t>(4, (rows + 3) / 4 * 4);
}

inline float Widen(uint16_t bits, std::true_type /*bfloat16*/) {
  const uint32_t wide = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}
inline float Widen(uint16_t bits, std::false_type /*float16*/) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof(h));
  return float(h);
}

struct BF16Tag {};
struct F16Tag {};

template <typename Tag>
struct Element;
template <>
struct Element<float> {
  using Stored = float;
  static float ToFloat(float x) { return x; }
};
template <>
struct Element<BF16Tag> {
  using Stored = uint16_t;
  static float ToFloat(uint16_t x) { return Widen(x, std::true_type()); }
};
template <>
struct Element<F16Tag> {
  using Stored = uint16_t;
  static float ToFloat(uint16_t x) { return Widen(x, std::false_type()); }
};

struct Problem {
  const void* w;
  const float* x;  // [M, K], widened
  float* out;      // [M, N]
  int64_t rows, depth, columns;  // M, K, N
};

// Rows [k0, k1) of w [K, N] times x's columns [k0, k1), result columns [c0, c0 + width), added into
// partial [M, N], for x rows [r0, r0 + R). Four weight rows at a time: each accumulator is loaded and
// stored once per four weight rows, and each weight element, widened in a register, serves all R rows.
// The item's weight rows are walked in address order (a stream the hardware prefetcher follows).
template <typename Tag, int R>
void RowGroup(const Problem& p, int64_t r0, int64_t k0, int64_t k1, int64_t c0, int64_t width, float* partial) {
  using E = Element<Tag>;
  const auto* w = static_cast<const typename E::Stored*>(p.w);
  float* acc[R];
  for (int r = 0; r < R; ++r) acc[r] = partial + (r0 + r) * p.columns + c0;
  constexpr int64_t kPerLine = kLineBytes / int64_t(sizeof(typename E::Stored));
  const int64_t ahead = PrefetchRows(width * int64_t(sizeof(typename E::Stored))) * p.columns;
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    const auto* __restrict s0 = w + k * p.columns + c0;
    const auto* __restrict s1 = s0 + p.columns;
    const auto* __restrict s2 = s1 + p.columns;
    const auto* __restrict s3 = s2 + p.columns;
    float xv[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) xv[r][j] = p.x[(r0 + r) * p.depth + k + j];
    for (int64_t line = 0; line < width; line += kPerLine) {
      for (int64_t j = 0; j < 4; ++j) __builtin_prefetch(s0 + ahead + j * p.columns + line);
      const int64_t end = std::min(width, line + kPerLine);
#pragma omp simd
      for (int64_t c = line; c < end; ++c) {
        const float w0 = E::ToFloat(s0[c]), w1 = E::ToFloat(s1[c]), w2 = E::ToFloat(s2[c]), w3 = E::ToFloat(s3[c]);
        for (int r = 0; r < R; ++r) {
        float a = acc[r][c];
        a += xv[r][0] * w0;
        a += xv[r][1] * w1;
        a += xv[r][2] * w2;
        a += xv[r][3] * w3;
        acc[r][c] = a;
      }
      }
    }
  }
  for (; k < k1; ++k) {
    const auto* __restrict segment = w + k * p.columns + c0;
    float xv[R];
    for (int r = 0; r < R; ++r) xv[r] = p.x[(r0 + r) * p.depth + k];
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) {
      const float wv = E::ToFloat(segment[c]);
      for (int r = 0; r < R; ++r) acc[r][c] += xv[r] * wv;
    }
  }
}

// x's rows in groups of up to eight, each group one pass over the item's weights: a decode step of up
// to eight sequences reads its weights once.
template <typename Tag>
void RowBlock(const Problem& p, int64_t k0, int64_t k1, int64_t c0, int64_t width, float* partial) {
  int64_t r0 = 0;
  for (; r0 + 8 <= p.rows; r0 += 8) RowGroup<Tag, 8>(p, r0, k0, k1, c0, width, partial);
  switch (p.rows - r0) {
    case 7: RowGroup<Tag, 7>(p, r0, k0, k1, c0, width, partial); break;
    case 6: RowGroup<Tag, 6>(p, r0, k0, k1, c0, width, partial); break;
    case 5: RowGroup<Tag, 5>(p, r0, k0, k1, c0, width, partial); break;
    case 4: RowGroup<Tag, 4>(p, r0, k0, k1, c0, width, partial); break;
    case 3: RowGroup<Tag, 3>(p, r0, k0, k1, c0, width, partial); break;
    case 2: RowGroup<Tag, 2>(p, r0, k0, k1, c0, width, partial); break;
    case 1: RowGroup<Tag, 1>(p, r0, k0, k1, c0, width, partial); break;
    default: break;
  }
}

// Outputs [n0, n0 + count) of every row, w [N, K]: each is a dot product of two contiguous rows. One
// row of x: four weight rows at a time, widened and multiplied in one pass; more: each weight row is
// widened once into `wide` (in L1) and reused for every row of x.
template <typename Tag>
void TransposedItem(const Problem& p, int64_t n0, int64_t count, float* wide) {
  using E = Element<Tag>;
  const auto* w = static_cast<const typename E::Stored*>(p.w);
  constexpr int64_t kPerLine = kLineBytes / int64_t(sizeof(typename E::Stored));
  const int64_t ahead = PrefetchRows(p.depth * int64_t(sizeof(typename E::Stored))) * p.depth;
  for (int64_t n = n0; n < n0 + count; ++n) {
    const auto* __restrict row = w + n * p.depth;
    for (int64_t line = 0; line < p.depth; line += kPerLine) __builtin_prefetch(row + ahead + line);
    if (p.rows == 1 && n + 4 <= n0 + count) {  // four outputs at once: four independent sums
      for (int64_t j = 1; j < 4; ++j) {
        for (int64_t line = 0; line < p.depth; line += kPerLine) __builtin_prefetch(row + ahead + j * p.depth + line);
      }
      const auto* __restrict row1 = row + p.depth;
      const auto* __restrict row2 = row1 + p.depth;
      const auto* __restrict row3 = row2 + p.depth;
      float sum0 = 0.0f, sum1 = 0.0f, sum2 = 0.0f, sum3 = 0.0f;
#pragma omp simd reduction(+ : sum0, sum1, sum2, sum3)
      for (int64_t k = 0; k < p.depth; ++k) {
        const float xk = p.x[k];
        sum0 += xk * E::ToFloat(row[k]);
        sum1 += xk * E::ToFloat(row1[k]);
        sum2 += xk * E::ToFloat(row2[k]);
        sum3 += xk * E::ToFloat(row3[k]);
      }
      p.out[n] = sum0;
      p.out[n + 1] = sum1;
      p.out[n + 2] = sum2;
      p.out[n + 3] = sum3;
      n += 3;
      continue;
    }
#pragma omp simd
    for (int64_t k = 0; k < p.depth; ++k) wide[k] = E::ToFloat(row[k]);
    int64_t r = 0;
    for (; r + 8 <= p.rows; r += 8) {  // eight rows of x at once: eight independent sums keep both FMA units busy
      const float* __restrict xr = p.x + r * p.depth;
      const int64_t d = p.depth;
      float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f, s4 = 0.0f, s5 = 0.0f, s6 = 0.0f, s7 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3, s4, s5, s6, s7)
      for (int64_t k = 0; k < d; ++k) {
        const float wk = wide[k];
        s0 += xr[k] * wk;
        s1 += xr[d + k] * wk;
        s2 += xr[2 * d + k] * wk;
        s3 += xr[3 * d + k] * wk;
        s4 += xr[4 * d + k] * wk;
        s5 += xr[5 * d + k] * wk;
        s6 += xr[6 * d + k] * wk;
        s7 += xr[7 * d + k] * wk;
      }
      const float sums[8] = {s0, s1, s2, s3, s4, s5, s6, s7};
      for (int64_t j = 0; j < 8; ++j) p.out[(r + j) * p.columns + n] = sums[j];
    }
    for (; r + 4 <= p.rows; r += 4) {  // four rows of x at once: four independent sums, not one FMA chain
      const float* __restrict x0 = p.x + r * p.depth;
      const float* __restrict x1 = x0 + p.depth;
      const float* __restrict x2 = x1 + p.depth;
      const float* __restrict x3 = x2 + p.depth;
      float sum0 = 0.0f, sum1 = 0.0f, sum2 = 0.0f, sum3 = 0.0f;
#pragma omp simd reduction(+ : sum0, sum1, sum2, sum3)
      for (int64_t k = 0; k < p.depth; ++k) {
        const float wk = wide[k];
        sum0 += x0[k] * wk;
        sum1 += x1[k] * wk;
        sum2 += x2[k] * wk;
        sum3 += x3[k] * wk;
      }
      p.out[r * p.columns + n] = sum0;
      p.out[(r + 1) * p.columns + n] = sum1;
      p.out[(r + 2) * p.columns + n] = sum2;
      p.out[(r + 3) * p.columns + n] = sum3;
    }
    for (; r < p.rows; ++r) {
      const float* xr = p.x + r * p.depth;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < p.depth; ++k) sum += xr[k] * wide[k];
      p.out[r * p.columns + n] = sum;
    }
  }
}

// How one weight's work is cut into items. [K, N] weights: column blocks (up to kColumns) times a fixed
// split of K into `parts` (only where there are too few column blocks to keep the threads busy); each
// part accumulates into its own [M, N] partial, and the partials are summed in part order, so that the
// result never depends on which thread took which item (the same request gets the same logprobs, to
// the last bit, however the threads ran). Transposed [N, K]: runs of weight rows (outputs), each
// written once.
struct Plan {
  Problem problem;
  int64_t first_item = 0, num_items = 0;
  int64_t blocks = 1, block_columns = kColumns, parts = 1;  // [K, N]
  int64_t outputs_per_item = 1;                              // [N, K]
  int64_t partial_offset = 0;                                // into the partials, [K, N]
};

template <typename Tag>
Plan MakePlan(const Problem& p, bool transposed, int64_t num_workers) {
  const int64_t element = sizeof(typename Element<Tag>::Stored);
  Plan plan;
  plan.problem = p;
  if (transposed) {
    plan.outputs_per_item = std::max<int64_t>(1, kItemBytes / (p.depth * element));
    plan.num_items = (p.columns + plan.outputs_per_item - 1) / plan.outputs_per_item;
    return plan;
  }
  // Columns per block: the item's accumulators, re-read for every four weight rows, must stay in L1 (at
  // eight rows of x and 1536 columns they did not, and a batch-8 step ran at half the speed).
  const int64_t fitting = kAccumulatorBytes / (int64_t(sizeof(float)) * p.rows) / 16 * 16;
  plan.block_columns = std::max<int64_t>(64, std::min(kColumns, fitting));
  plan.blocks = (p.columns + plan.block_columns - 1) / plan.block_columns;
  // Two items per thread at least, so that a late helper still gets its share.
  const int64_t wanted = 2 * num_workers;
  if (plan.blocks < wanted) plan.parts = std::min((wanted + plan.blocks - 1) / plan.blocks, std::max<int64_t>(1, p.depth / 4));
  plan.num_items = plan.blocks * plan.parts;
  return plan;
}

// Several weights times the same x (a layer's q, k and v, or gate and up) in one call: the items of
// all of them in one schedule, so the threads stay busy across the weights' boundaries.
template <typename Tag>
void Run(ffi::ThreadPool& pool, std::vector<Problem> problems, bool transposed) {
  const int64_t num_workers = std::max<int64_t>(1, pool.num_threads());
  std::vector<Plan> plans;
  int64_t num_items = 0, partial_size = 0, depth = 0;
  for (const Problem& p : problems) {
    plans.push_back(MakePlan<Tag>(p, transposed, num_workers));
    plans.back().first_item = num_items;
    plans.back().partial_offset = partial_size;
    num_items += plans.back().num_items;
    if (!transposed) partial_size += plans.back().parts * p.rows * p.columns;
    depth = std::max(depth, p.depth);
  }
  // [K, N]: every part's partial, zeroed; [N, K]: a widened weight row per worker.
  std::vector<float> scratch(transposed ? num_workers * depth : partial_size, 0.0f);
  float* scratch_data = scratch.data();
  const Plan* plan_data = plans.data();
  const int64_t num_plans = int64_t(plans.size());
  jaxserve_cpu::RunItems(num_workers, num_items, [=](int64_t worker, int64_t item) {
    const Plan* plan = plan_data;
    while (plan + 1 < plan_data + num_plans && item >= plan[1].first_item) ++plan;
    const Problem& p = plan->problem;
    const int64_t i = item - plan->first_item;
    if (transposed) {
      const int64_t n0 = i * plan->outputs_per_item;
      TransposedItem<Tag>(p, n0, std::min(plan->outputs_per_item, p.columns - n0), scratch_data + worker * depth);
      return;
    }
    const int64_t block = i % plan->blocks, part = i / plan->blocks;
    const int64_t c0 = block * plan->block_columns;
    const int64_t k0 = p.depth * part / plan->parts, k1 = p.depth * (part + 1) / plan->parts;
    float* partial = scratch_data + plan->partial_offset + part * p.rows * p.columns;
    RowBlock<Tag>(p, k0, k1, c0, std::min(plan->block_columns, p.columns - c0), partial);
  });
  if (transposed) return;
  for (const Plan& plan : plans) {
    const Problem& p = plan.problem;
    const int64_t size = p.rows * p.columns;
    const float* partials = scratch_data + plan.partial_offset;
    std::memcpy(p.out, partials, size * sizeof(float));
    for (int64_t part = 1; part < plan.parts; ++part) {
#pragma omp simd
      for (int64_t i = 0; i < size; ++i) p.out[i] += partials[part * size + i];
    }
  }
}

template <typename Tag>
void WidenRows(const void* x, int64_t count, float* out) {
  const auto* in = static_cast<const typename Element<Tag>::Stored*>(x);
  for (int64_t i = 0; i < count; ++i) out[i] = Element<Tag>::ToFloat(in[i]);
}

template <typename Tag>
void WidenAndRun(ffi::ThreadPool& pool, const ffi::AnyBuffer& x, std::vector<Problem> problems, bool transposed) {
  const int64_t count = problems[0].rows * problems[0].depth;
  std::vector<float> x_wide(count);
  WidenRows<Tag>(x.untyped_data(), count, x_wide.data());
  for (Problem& p : problems) p.x = x_wide.data();
  Run<Tag>(pool, std::move(problems), transposed);
}

// x [M, K] times each weight w_i ([K, N_i], or [N_i, K] when transposed), into out_i [M, N_i] float32.
ffi::Error SmallMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs weights, ffi::RemainingRets outs,
                       bool transposed) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return ffi::Error::InvalidArgument("small_matmul: x must be 2-d");
  const int64_t rows = x_dims[0], depth = x_dims[1];
  if (rows > kMaxRows) return ffi::Error::InvalidArgument("small_matmul: too many rows");
  if (weights.size() == 0 || weights.size() != outs.size()) {
    return ffi::Error::InvalidArgument("small_matmul: one result per weight, at least one weight");
  }
  const ffi::DataType type = x.element_type();
  std::vector<Problem> problems;
  for (size_t i = 0; i < weights.size(); ++i) {
    auto w = weights.get<ffi::AnyBuffer>(i);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !out.has_value()) return ffi::Error::InvalidArgument("small_matmul: bad weight or result");
    const auto w_dims = w->dimensions();
    if (w_dims.size() != 2) return ffi::Error::InvalidArgument("small_matmul: weights must be 2-d");
    const int64_t columns = transposed ? w_dims[0] : w_dims[1];
    if ((transposed ? w_dims[1] : w_dims[0]) != depth || (*out)->element_count() != size_t(rows * columns)) {
      return ffi::Error::InvalidArgument("small_matmul: inconsistent shapes");
    }
    if (w->element_type() != type) return ffi::Error::InvalidArgument("small_matmul: x and w must share a dtype");
    problems.push_back(Problem{w->untyped_data(), nullptr, (*out)->typed_data(), rows, depth, columns});
  }
  switch (type) {
    case ffi::DataType::BF16: WidenAndRun<BF16Tag>(pool, x, std::move(problems), transposed); break;
    case ffi::DataType::F16: WidenAndRun<F16Tag>(pool, x, std::move(problems), transposed); break;
    case ffi::DataType::F32: WidenAndRun<float>(pool, x, std::move(problems), transposed); break;
    default: return ffi::Error::InvalidArgument("small_matmul: float32, bfloat16 or float16 only");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveSmallMatmul, SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<bool>("transposed"));
