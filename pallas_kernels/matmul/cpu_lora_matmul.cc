// Segmented multi-LoRA product for the CPU (Punica's SGMV), as an XLA FFI custom call:
//   out [M, N] float32 = product [M, N] + for each row m with slot s = slots[m] > 0:
//                        (x[m] @ A[:, s, :]) @ B[s]
// with x [M, K], A [K, L, r], B [L, r, N] (the scaling folded into B) in one of float32, bfloat16,
// float16, accumulated in float32; `product` is the base projection, aliased to `out` (added in place).
//
// Why: the XLA form (lora.py's masked product) multiplies every row by every active adapter's A and
// every row's n * r columns by all their B's: with 16 adapters of rank 16 that is +70% of a SmolLM2
// projection's flops, capping a 16-adapter batch near 0.6x of the base model. Here the rows are grouped
// by slot (a counting sort of M ints) and each adapter present multiplies only its own rows, its A and
// B read once per step: the work is what the rows' own adapters need (M * r * (K + N) multiplies).
//
// Two phases, each shared by the caller and the helper threads (../cpu_workers.h):
//   shrink  items (slot, block of its rows): the slot's A [K, r] (strided by L * r in the stored
//           layout) widened into a thread's packed [K, rp] (rp: r rounded up to whole vectors), then
//           register tiles of rows x rank vectors over K -> t [rows, rp], rounded to the stored dtype
//           as lora.py's reference rounds x @ A before its second dot;
//   expand  items (slot, block of its rows, block of N): out[row, cols] += t[row, :] @ B[s][:, cols],
//           register tiles of rows x column vectors over r, B widened in registers.
// Rows without an adapter (slot 0) are never touched: `out` already holds their product.
//
// The vector basics below are copied from cpu_matmul_vectors.h (owned by the small matmul; kept apart
// so that neither kernel's tuning reaches into the other). Built by pallas_kernels/cpu_library.py into
// the one CPU kernel library.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_workers.h"
#include "matmul/cpu_float_vectors.h"
#include "matmul/cpu_rms_norm.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

// A register tile: kTileRows rows by up to kTileVectors vectors; 4 x 4 accumulators plus 4 loaded
// vectors and a broadcast fit AVX-512's 32 registers; AVX2's 16 take 2 x 4 (plus 4 + 1 at most 13).
#if defined(__AVX512F__)
constexpr int kTileRows = 4;
#else
constexpr int kTileRows = 2;
#endif
constexpr int kTileVectors = 4;
constexpr int64_t kShrinkRows = 16;      // rows per shrink item (each item packs its slot's A once)
constexpr int64_t kExpandRows = 32;      // rows per expand item
constexpr int64_t kExpandColumns = 256;  // output columns per expand item (16 KiB of a rank-16 B in float32)





// The stored element types: one element (cpu_rms_norm.h's scalar types) and kLanes elements widened to float32, and
// a float32 rounded to the stored precision and kept as a float32 (Round here hides the scalar types' own, which
// returns the stored bits; bfloat16: to nearest even, as XLA's convert does, NaN and inf as they are).
struct F32 : jaxserve_cpu::Float32Scalar {
  static VecF Vector(const float* p) { return LoadF(p); }
  static float Round(float x) { return x; }
};
struct BF16 : jaxserve_cpu::BFloat16Scalar {
  static VecF Vector(const uint16_t* p) {
#if defined(__AVX512F__)
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#else
    VecH h;
    std::memcpy(&h, p, sizeof(h));
    return (VecF)(__builtin_convertvector(h, VecU) << 16);
#endif
  }
  static float Round(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    if ((bits & 0x7f800000u) != 0x7f800000u) bits += 0x7fffu + ((bits >> 16) & 1u);  // NaN / inf as they are
    return One(uint16_t(bits >> 16));
  }
};
struct F16 : jaxserve_cpu::Float16Scalar {
  static VecF Vector(const uint16_t* p) {
#if defined(__AVX512F__)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    VecHalf h;
    std::memcpy(&h, p, sizeof(h));
    return __builtin_convertvector(h, VecF);
#endif
  }
  static float Round(float x) { return float(_Float16(x)); }
};

// The step's rows grouped by adapter slot: order[first, first + count) are the rows of `slot`.
struct Group {
  int64_t slot, first, count;
};

struct Lora {
  const float* x;      // [Ma, K]: the adapter rows of x, widened, in group order
  const int64_t* row;  // [Ma]: each of those rows' index in out
  const void* a;       // [K, L, r]
  const void* b;       // [L, r, N]
  float* t;            // [Ma, rp]: x @ A, per row
  float* out;          // [M, N]
  int64_t depth, slots, rank, padded_rank, columns;  // K, L, r, rp, N
};

// R rows of x (ldx apart) by V vectors of the packed A's columns, over all K: t[R, V * kLanes].
template <int R, int V>
void ShrinkTile(const float* x, int64_t ldx, const float* packed, int64_t ldp, int64_t depth, float* t, int64_t ldt) {
  VecF acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = VecF{};
  for (int64_t k = 0; k < depth; ++k) {
    VecF av[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) av[v] = LoadF(packed + k * ldp + v * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const VecF xb = Broadcast(x[r * ldx + k]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] = Fma(xb, av[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) StoreF(t + r * ldt + v * kLanes, acc[r][v]);
}

// R rows of t by V vectors of B's columns, over the rank: out rows (their own places, `rows`) += t @ B.
template <typename T, int R, int V>
void ExpandTile(const float* t, int64_t ldt, const typename T::Stored* b, int64_t ldb, int64_t rank, float* out,
                const int64_t* rows, int64_t ldo) {
  VecF acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = LoadF(out + rows[r] * ldo + v * kLanes);
  for (int64_t j = 0; j < rank; ++j) {
    VecF bv[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) bv[v] = T::Vector(b + j * ldb + v * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const VecF tb = Broadcast(t[r * ldt + j]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] = Fma(tb, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) StoreF(out + rows[r] * ldo + v * kLanes, acc[r][v]);
}

// Dispatch a tile of `rows` (1..kTileRows) by `vectors` (1..kTileVectors) to its instantiation.
template <int R, template <int, int> class Tile, typename... Args>
void ByVectors(int vectors, Args... args) {
  switch (vectors) {
    case 1: return Tile<R, 1>::Run(args...);
    case 2: return Tile<R, 2>::Run(args...);
    case 3: return Tile<R, 3>::Run(args...);
    default: return Tile<R, 4>::Run(args...);
  }
}
template <template <int, int> class Tile, typename... Args>
void ByRowsAndVectors(int rows, int vectors, Args... args) {
  static_assert(kTileRows == 2 || kTileRows == 4, "tiles of 2 or 4 rows");
  switch (rows) {
    case 1: return ByVectors<1, Tile>(vectors, args...);
    case 2: return ByVectors<2, Tile>(vectors, args...);
    case 3: return ByVectors<3, Tile>(vectors, args...);
    default: return ByVectors<4, Tile>(vectors, args...);
  }
}
template <int R, int V>
struct Shrink {
  static void Run(const float* x, int64_t ldx, const float* packed, int64_t ldp, int64_t depth, float* t, int64_t ldt) {
    ShrinkTile<R, V>(x, ldx, packed, ldp, depth, t, ldt);
  }
};
template <typename T>
struct ExpandOf {
  template <int R, int V>
  struct Tile {
    static void Run(const float* t, int64_t ldt, const typename T::Stored* b, int64_t ldb, int64_t rank, float* out,
                    const int64_t* rows, int64_t ldo) {
      ExpandTile<T, R, V>(t, ldt, b, ldb, rank, out, rows, ldo);
    }
  };
};

// Rows [first, first + count) of one slot: t = x @ A[:, slot, :], rounded to the stored precision.
template <typename T>
void ShrinkItem(const Lora& p, int64_t slot, int64_t first, int64_t count) {
  thread_local std::vector<float> buffer;
  const int64_t ldp = p.padded_rank;
  if (int64_t(buffer.size()) < p.depth * ldp) buffer.resize(p.depth * ldp);
  float* packed = buffer.data();
  const auto* a = static_cast<const typename T::Stored*>(p.a);
  for (int64_t k = 0; k < p.depth; ++k) {  // A[k, slot, :] lie L * r apart: one run of r per k
    const auto* from = a + (k * p.slots + slot) * p.rank;
    float* to = packed + k * ldp;
    int64_t j = 0;
    for (; j + kLanes <= p.rank; j += kLanes) StoreF(to + j, T::Vector(from + j));
    for (; j < p.rank; ++j) to[j] = T::One(from[j]);
    for (; j < ldp; ++j) to[j] = 0.0f;
  }
  const int64_t vectors = ldp / kLanes;
  for (int64_t r0 = first; r0 < first + count; r0 += kTileRows) {
    const int rows = int(std::min<int64_t>(kTileRows, first + count - r0));
    for (int64_t v0 = 0; v0 < vectors; v0 += kTileVectors) {
      const int tile_vectors = int(std::min<int64_t>(kTileVectors, vectors - v0));
      ByRowsAndVectors<Shrink>(rows, tile_vectors, p.x + r0 * p.depth, p.depth, packed + v0 * kLanes, ldp, p.depth,
                               p.t + r0 * ldp + v0 * kLanes, ldp);
    }
    for (int64_t r = r0; r < r0 + rows; ++r)
      for (int64_t j = 0; j < p.rank; ++j) p.t[r * ldp + j] = T::Round(p.t[r * ldp + j]);
  }
}

// Rows [first, first + count) of one slot, columns [c0, c0 + width): out += t @ B[slot].
template <typename T>
void ExpandItem(const Lora& p, int64_t slot, int64_t first, int64_t count, int64_t c0, int64_t width) {
  const auto* b = static_cast<const typename T::Stored*>(p.b) + slot * p.rank * p.columns + c0;
  const int64_t whole = width / kLanes * kLanes;
  for (int64_t r0 = first; r0 < first + count; r0 += kTileRows) {
    const int rows = int(std::min<int64_t>(kTileRows, first + count - r0));
    const float* t = p.t + r0 * p.padded_rank;
    float* out = p.out + c0;
    for (int64_t c = 0; c < whole; c += kTileVectors * kLanes) {
      const int vectors = int(std::min<int64_t>(kTileVectors, (whole - c) / kLanes));
      ByRowsAndVectors<ExpandOf<T>::template Tile>(rows, vectors, t, p.padded_rank, b + c, p.columns, p.rank,
                                                     out + c, p.row + r0, p.columns);
    }
    for (int64_t c = whole; c < width; ++c) {  // N not a multiple of kLanes
      for (int r = 0; r < rows; ++r) {
        float sum = out[p.row[r0 + r] * p.columns + c];
        for (int64_t j = 0; j < p.rank; ++j) sum += t[r * p.padded_rank + j] * T::One(b[j * p.columns + c]);
        out[p.row[r0 + r] * p.columns + c] = sum;
      }
    }
  }
}

template <typename T>
void Run(int64_t num_workers, const void* x_data, const int32_t* slots, int64_t num_rows, Lora p) {
  // Counting sort of the rows by slot (slot 0 left out).
  std::vector<int64_t> starts(p.slots + 1, 0);
  for (int64_t m = 0; m < num_rows; ++m) ++starts[slots[m] + 1];
  const int64_t num_adapter_rows = num_rows - starts[1];
  if (num_adapter_rows == 0) return;
  for (int64_t s = 0; s < p.slots; ++s) starts[s + 1] += starts[s];
  std::vector<int64_t> order(num_rows), next(starts.begin(), starts.end() - 1);
  for (int64_t m = 0; m < num_rows; ++m) order[next[slots[m]]++] = m;
  const int64_t skipped = starts[1];  // slot 0's rows come first in `order`
  std::vector<Group> groups;
  for (int64_t s = 1; s < p.slots; ++s) {
    if (starts[s + 1] > starts[s]) groups.push_back(Group{s, starts[s] - skipped, starts[s + 1] - starts[s]});
  }
  std::vector<float> x(num_adapter_rows * p.depth);
  const auto* x_in = static_cast<const typename T::Stored*>(x_data);
  for (int64_t i = 0; i < num_adapter_rows; ++i) {
    const auto* from = x_in + order[skipped + i] * p.depth;
    for (int64_t k = 0; k < p.depth; ++k) x[i * p.depth + k] = T::One(from[k]);
  }
  std::vector<float> t(num_adapter_rows * p.padded_rank);
  p.x = x.data();
  p.row = order.data() + skipped;
  p.t = t.data();

  struct Item {
    int64_t slot, first, count, c0, width;
  };
  std::vector<Item> items;
  for (const Group& g : groups) {
    for (int64_t r = 0; r < g.count; r += kShrinkRows) {
      items.push_back(Item{g.slot, g.first + r, std::min(kShrinkRows, g.count - r), 0, 0});
    }
  }
  const Item* shrink = items.data();
  jaxserve_cpu::RunItems(num_workers, int64_t(items.size()), [&p, shrink](int64_t, int64_t i) {
    ShrinkItem<T>(p, shrink[i].slot, shrink[i].first, shrink[i].count);
  });
  items.clear();
  for (const Group& g : groups) {
    for (int64_t r = 0; r < g.count; r += kExpandRows) {
      for (int64_t c = 0; c < p.columns; c += kExpandColumns) {
        items.push_back(Item{g.slot, g.first + r, std::min(kExpandRows, g.count - r), c,
                             std::min(kExpandColumns, p.columns - c)});
      }
    }
  }
  const Item* expand = items.data();
  jaxserve_cpu::RunItems(num_workers, int64_t(items.size()), [&p, expand](int64_t, int64_t i) {
    const Item& item = expand[i];
    ExpandItem<T>(p, item.slot, item.first, item.count, item.c0, item.width);
  });
}

ffi::Error LoraMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer a, ffi::AnyBuffer b,
                      ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32> product, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const auto x_dims = x.dimensions(), a_dims = a.dimensions(), b_dims = b.dimensions();
  if (x_dims.size() != 2 || a_dims.size() != 3 || b_dims.size() != 3) {
    return ffi::Error::InvalidArgument("lora_matmul: x [M, K], a [K, L, r], b [L, r, N]");
  }
  const int64_t num_rows = x_dims[0], depth = x_dims[1], num_slots = a_dims[1], rank = a_dims[2];
  const int64_t columns = b_dims[2];
  if (a_dims[0] != depth || b_dims[0] != num_slots || b_dims[1] != rank || slots.element_count() != size_t(num_rows) ||
      product.element_count() != size_t(num_rows * columns) || out->element_count() != size_t(num_rows * columns)) {
    return ffi::Error::InvalidArgument("lora_matmul: inconsistent shapes");
  }
  const ffi::DataType type = x.element_type();
  if (a.element_type() != type || b.element_type() != type) {
    return ffi::Error::InvalidArgument("lora_matmul: x, a and b must share a dtype");
  }
  const int32_t* slot_data = slots.typed_data();
  for (int64_t m = 0; m < num_rows; ++m) {
    if (slot_data[m] < 0 || slot_data[m] >= num_slots) return ffi::Error::InvalidArgument("lora_matmul: slot out of range");
  }
  float* out_data = out->typed_data();
  if (out_data != product.typed_data()) {  // aliased by the wrapper; copied where XLA kept them apart
    std::memcpy(out_data, product.typed_data(), sizeof(float) * num_rows * columns);
  }
  const int64_t padded_rank = (rank + kLanes - 1) / kLanes * kLanes;
  Lora p{nullptr, nullptr, a.untyped_data(), b.untyped_data(), nullptr, out_data, depth, num_slots, rank, padded_rank,
         columns};
  const int64_t num_workers = std::max<int64_t>(1, pool.num_threads());
  switch (type) {
    case ffi::DataType::BF16: Run<BF16>(num_workers, x.untyped_data(), slot_data, num_rows, p); break;
    case ffi::DataType::F16: Run<F16>(num_workers, x.untyped_data(), slot_data, num_rows, p); break;
    case ffi::DataType::F32: Run<F32>(num_workers, x.untyped_data(), slot_data, num_rows, p); break;
    default: return ffi::Error::InvalidArgument("lora_matmul: float32, bfloat16 or float16 only");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveLoraMatmul, LoraMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x [M, K]
                                  .Arg<ffi::AnyBuffer>()          // a [K, L, r]
                                  .Arg<ffi::AnyBuffer>()          // b [L, r, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slots [M]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // product [M, N]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N], aliased to product
