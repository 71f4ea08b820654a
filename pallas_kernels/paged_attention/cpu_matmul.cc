// A few rows times a 16-bit weight matrix, for decode steps on the CPU, as an XLA FFI custom call:
// out [M, N] float32 = x [M, K] @ w, with w [K, N] or (transposed) [N, K], all in one of float32,
// bfloat16, float16, accumulated in float32.
//
// Why: XLA:CPU widens a 16-bit weight to float32 as a whole before a dot with few rows (issue #16),
// so a bfloat16 decode step moved five times its weights' bytes. Here each weight element is read
// once and widened in registers: the step costs the weights' bytes, which is the memory roofline.
//
// Work is split into column tiles of the output (rows of w when transposed) over XLA's intra-op
// thread pool. Built by cpu.py together with cpu_kernel.cc.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kColumns = 4096;  // output columns per tile ([K, N] weights): 8 KiB of a 16-bit row
constexpr int64_t kWeightRowsPerTile = 256;  // outputs per tile ([N, K] weights)
constexpr int64_t kMaxRows = 64;    // the wrapper sends no more

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
// partial [M, N], for x rows [r0, r0 + R). Weight rows are walked in address order (whole rows, or
// segments of kColumns elements: a stream the hardware prefetcher follows); each element is widened
// in a register and used for all R rows.
template <typename Tag, int R>
void RowGroup(const Problem& p, int64_t r0, int64_t k0, int64_t k1, int64_t c0, int64_t width, float* partial) {
  using E = Element<Tag>;
  const auto* w = static_cast<const typename E::Stored*>(p.w);
  float* acc[R];
  for (int r = 0; r < R; ++r) acc[r] = partial + (r0 + r) * p.columns + c0;
  for (int64_t k = k0; k < k1; ++k) {
    const auto* segment = w + k * p.columns + c0;
    float xv[R];
    for (int r = 0; r < R; ++r) xv[r] = p.x[(r0 + r) * p.depth + k];
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) {
      const float wv = E::ToFloat(segment[c]);
      for (int r = 0; r < R; ++r) acc[r][c] += xv[r] * wv;
    }
  }
}

template <typename Tag>
void RowBlock(const Problem& p, int64_t k0, int64_t k1, int64_t c0, int64_t width, float* partial) {
  int64_t r0 = 0;
  for (; r0 + 4 <= p.rows; r0 += 4) RowGroup<Tag, 4>(p, r0, k0, k1, c0, width, partial);
  switch (p.rows - r0) {
    case 3: RowGroup<Tag, 3>(p, r0, k0, k1, c0, width, partial); break;
    case 2: RowGroup<Tag, 2>(p, r0, k0, k1, c0, width, partial); break;
    case 1: RowGroup<Tag, 1>(p, r0, k0, k1, c0, width, partial); break;
    default: break;
  }
}

// Outputs [n0, n0 + count) of every row, w [N, K]: each is a dot product of two contiguous rows.
template <typename Tag>
void TransposedTile(const Problem& p, int64_t n0, int64_t count) {
  using E = Element<Tag>;
  const auto* w = static_cast<const typename E::Stored*>(p.w);
  std::vector<float> wide(p.depth);
  for (int64_t n = n0; n < n0 + count; ++n) {
    const auto* row = w + n * p.depth;
#pragma omp simd
    for (int64_t k = 0; k < p.depth; ++k) wide[k] = E::ToFloat(row[k]);
    for (int64_t r = 0; r < p.rows; ++r) {
      const float* xr = p.x + r * p.depth;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < p.depth; ++k) sum += xr[k] * wide[k];
      p.out[r * p.columns + n] = sum;
    }
  }
}

// Tiles handed out from a shared counter to the caller and the pool's helpers (as cpu_kernel.cc's
// attention: the caller waits for the tiles, never for helpers to start).
void ParallelTiles(ffi::ThreadPool& pool, int64_t num_tiles, std::function<void(int64_t)> tile) {
  struct Shared {
    std::function<void(int64_t)> tile;
    int64_t num_tiles = 0;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto shared = std::make_shared<Shared>();
  shared->tile = std::move(tile);
  shared->num_tiles = num_tiles;
  auto work = [shared]() {
    for (int64_t t = shared->next++; t < shared->num_tiles; t = shared->next++) {
      shared->tile(t);
      shared->done++;
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), num_tiles) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([work] { work(); });
  work();
  while (shared->done.load() < num_tiles) std::this_thread::yield();
}

// Tiles: column blocks of kColumns times parts of K, so that every thread has work even when N fits
// one block; each part accumulates into its own [M, N] partial, summed at the end.
template <typename Tag>
void Run(ffi::ThreadPool& pool, const Problem& p, bool transposed) {
  if (transposed) {
    ParallelTiles(pool, (p.columns + kWeightRowsPerTile - 1) / kWeightRowsPerTile, [p](int64_t t) {
      TransposedTile<Tag>(p, t * kWeightRowsPerTile, std::min(kWeightRowsPerTile, p.columns - t * kWeightRowsPerTile));
    });
    return;
  }
  const int64_t blocks = (p.columns + kColumns - 1) / kColumns;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t parts = std::min<int64_t>(p.depth, (threads + blocks - 1) / blocks);
  std::vector<float> partials(parts * p.rows * p.columns, 0.0f);
  float* partial_data = partials.data();
  ParallelTiles(pool, blocks * parts, [p, blocks, parts, partial_data](int64_t t) {
    const int64_t block = t % blocks, part = t / blocks;
    const int64_t c0 = block * kColumns, k0 = p.depth * part / parts, k1 = p.depth * (part + 1) / parts;
    RowBlock<Tag>(p, k0, k1, c0, std::min(kColumns, p.columns - c0), partial_data + part * p.rows * p.columns);
  });
  const int64_t size = p.rows * p.columns;
  std::memcpy(p.out, partial_data, size * sizeof(float));
  for (int64_t part = 1; part < parts; ++part) {
#pragma omp simd
    for (int64_t i = 0; i < size; ++i) p.out[i] += partial_data[part * size + i];
  }
}

template <typename Tag>
void WidenRows(const void* x, int64_t count, float* out) {
  const auto* in = static_cast<const typename Element<Tag>::Stored*>(x);
  for (int64_t i = 0; i < count; ++i) out[i] = Element<Tag>::ToFloat(in[i]);
}

ffi::Error SmallMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, bool transposed,
                       ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const auto x_dims = x.dimensions(), w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2) return ffi::Error::InvalidArgument("small_matmul: x, w must be 2-d");
  const int64_t rows = x_dims[0], depth = x_dims[1];
  const int64_t columns = transposed ? w_dims[0] : w_dims[1];
  if ((transposed ? w_dims[1] : w_dims[0]) != depth || rows > kMaxRows || out->element_count() != size_t(rows * columns)) {
    return ffi::Error::InvalidArgument("small_matmul: inconsistent shapes");
  }
  const ffi::DataType type = w.element_type();
  if (x.element_type() != type) return ffi::Error::InvalidArgument("small_matmul: x and w must share a dtype");
  std::vector<float> x_wide(rows * depth);
  Problem p{w.untyped_data(), x_wide.data(), out->typed_data(), rows, depth, columns};
  switch (type) {
    case ffi::DataType::BF16:
      WidenRows<BF16Tag>(x.untyped_data(), rows * depth, x_wide.data());
      Run<BF16Tag>(pool, p, transposed);
      break;
    case ffi::DataType::F16:
      WidenRows<F16Tag>(x.untyped_data(), rows * depth, x_wide.data());
      Run<F16Tag>(pool, p, transposed);
      break;
    case ffi::DataType::F32:
      WidenRows<float>(x.untyped_data(), rows * depth, x_wide.data());
      Run<float>(pool, p, transposed);
      break;
    default:
      return ffi::Error::InvalidArgument("small_matmul: float32, bfloat16 or float16 only");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveSmallMatmul, SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<bool>("transposed")
                                  .Ret<ffi::Buffer<ffi::F32>>());
