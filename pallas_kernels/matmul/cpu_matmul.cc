// A few rows times 16-bit (or float32) weight matrices, for decode steps on the CPU, as an XLA FFI
// custom call: out_i [M, N_i] float32 = x [M, K] @ w_i, with each w_i [K, N_i] or (transposed)
// [N_i, K], all in one of float32, bfloat16, float16, accumulated in float32.
//
// Why: XLA:CPU widens a 16-bit weight to float32 as a whole before a dot with few rows (issue #16),
// so a bfloat16 decode step moved five times its weights' bytes. Here each weight element is read
// once and widened in registers: the step costs the weights' bytes, which is the memory roofline.
// Two regimes ([K, N] weights): up to kWalkRows rows (bound by reading the weights) register tiles over
// blocks of the item's rows, read straight from memory (RowWalk -> TiledWalk, cpu_matmul_few_rows.h; one float32 row
// on AMD CPUs: whole weight rows in address order, RowSweep); with more
// rows (batched decode and verify steps up to 64 rows, prefill chunks up to kMaxRows; bound by the multiplies) each
// pass of rows is packed, widened to float32 once, and register-tiled like a GEMM's micro-kernel (KnTile), so that
// bfloat16 batches run at least as fast per row as float32 ones (issue #29); on AVX-512 BF16 CPUs without AMX
// bfloat16 runs in vdpbf16ps pairs at every row count instead (cpu_matmul_bf16_pairs.h: as fast as XLA's own
// bfloat16 dots there).
// [N, K] (a tied embedding as the head): 1-8 rows, several weight rows at once from as many long runs
// (NkStreams, cpu_matmul_few_rows.h); more, register tiles of dot products over the item's rows, packed first
// since several groups of rows reuse them.
// Every row of a call is the same bits as the 1-row call of that row (issue 26: "Row invariance" at Plan).
//
// Instruction paths (issue #29): the code is written once on GCC/Clang vector types whose width comes
// from the compiler flags cpu_library.py picked for this CPU (or JAXSERVE_CPU_KERNEL_PATH):
//   avx512    16 float lanes, 32 registers (AVX-512F/BW/VL; bfloat16 above 8 rows on AMX tiles where the CPU
//             has them, cpu_matmul_amx.h)
//   avx2      8 lanes, 16 registers, FMA and F16C
//   portable  4 lanes (SSE2 on x86-64, NEON on arm64), multiply then add, no FMA
// Each path's tiles fill its register file; JaxserveCpuKernelPath() names the path a library was built for.
//
// Work is split into items shared by the caller and helper threads (../cpu_workers.h). Built by
// pallas_kernels/cpu_library.py into one library with the attention kernel (they share the helpers).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_matmul_bf16_pairs.h"
#include "cpu_gated_rows.h"
#include "cpu_matmul_few_rows.h"
#include "cpu_matmul_vectors.h"
#include "cpu_workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 256;          // the wrapper sends no more (a prefill chunk's rows, up to 256 a call)
constexpr int64_t kBlockColumns = 384;     // [K, N], many rows: output columns per item; tile widths divide it
constexpr int64_t kWideColumns = 4096;     // [K, N], few rows: output columns per item, at most
constexpr int64_t kAccumulatorBytes = 16 * 1024;  // [K, N], few rows: an item's accumulators stay in L1
constexpr int64_t kPackFloats = 32 * 1024; // a worker's packed weights per pass (128 KiB: in L2)
constexpr int64_t kItemBytes = 32 * 1024;  // [N, K]: weight bytes per work item, about
#ifndef JAXSERVE_STREAM_ITEM_KIB
#define JAXSERVE_STREAM_ITEM_KIB 256
#endif
constexpr int64_t kStreamItemBytes = JAXSERVE_STREAM_ITEM_KIB * 1024;  // [N, K], 1-8 rows of x
constexpr int64_t kNkItemMultiple = 24;    // [N, K]: outputs per item are a multiple of every tile's
constexpr int kNkDirectRows = 8;            // [N, K]: rows of x up to which the weights are read directly

// A worker's packed weights: the rows a pass reads, copied in address order (a stream the hardware
// prefetchers follow at full speed, where tiles reading column strips of a row-major matrix hop between
// rows and ran at half the speed) and widened to float32 once (not once per group of rows).
inline float* PackBuffer(int64_t floats) {
  thread_local std::vector<float> buffer;
  if (int64_t(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

// `count` runs of `width` elements, `stride` apart, widened into packed [count, width].
template <typename T>
void Pack(const typename T::Stored* w, int64_t stride, int64_t count, int64_t width, float* packed) {
  for (int64_t i = 0; i < count; ++i) {
    const auto* row = w + i * stride;
    float* to = packed + i * width;
    int64_t c = 0;
    for (; c + 2 * kLanes <= width; c += 2 * kLanes) {
      StoreF(to + c, T::Vector(row + c));
      StoreF(to + c + kLanes, T::Vector(row + c + kLanes));
    }
    for (; c < width; ++c) to[c] = T::One(row[c]);
  }
}

// ---- [K, N] weights: out[r, c] += sum_k x[r, k] w[k, c] ----

// R rows of x by V vectors of columns, over `count` packed weight rows: the R * V accumulators stay in
// registers; each weight vector serves all R rows.
// from_zero: the first pass of an item, whose sums start at zero (out holds nothing yet: not read, so the caller
// need not clear it); later passes continue the sums through out.
template <int R, int V>
inline void KnTile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t count, float* out, int64_t ldo,
                   bool from_zero) {
  VecF acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) acc[r][v] = from_zero ? VecF{} : LoadF(out + r * ldo + v * kLanes);
  for (int64_t k = 0; k < count; ++k) {
    const float* row = w + k * ldw;
    VecF wv[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) wv[v] = LoadedOnce<R>(LoadF(row + v * kLanes));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const VecF xb = Broadcast(x[r * ldx + k]);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] = Fma(xb, wv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) StoreF(out + r * ldo + v * kLanes, acc[r][v]);
}

// R rows of x (from x, its rows ldx apart) by all `width` packed columns: whole tiles of kKnVectors[R]
// vectors, then single vectors, then single columns (N not a multiple of kLanes).
template <int R>
void KnRows(const float* x, int64_t ldx, const float* packed, int64_t count, int64_t width, float* out, int64_t ldo,
            bool from_zero) {
  constexpr int V = kKnVectors[R];
  int64_t c = 0;
  for (; c + V * kLanes <= width; c += V * kLanes) {
    KnTile<R, V>(x, ldx, packed + c, width, count, out + c, ldo, from_zero);
  }
  for (; c + kLanes <= width; c += kLanes) KnTile<R, 1>(x, ldx, packed + c, width, count, out + c, ldo, from_zero);
  for (; c < width; ++c) {
    for (int r = 0; r < R; ++r) {
      float sum = from_zero ? 0.0f : out[r * ldo + c];
      for (int64_t k = 0; k < count; ++k) sum = FmaOne(x[r * ldx + k], packed[k * width + c], sum);
      out[r * ldo + c] = sum;
    }
  }
}

template <int R>
void KnRemainder(int rows, const float* x, int64_t ldx, const float* packed, int64_t count, int64_t width, float* out,
                 int64_t ldo, bool from_zero) {
  if constexpr (R > 0) {
    if (rows == R) return KnRows<R>(x, ldx, packed, count, width, out, ldo, from_zero);
    KnRemainder<R - 1>(rows, x, ldx, packed, count, width, out, ldo, from_zero);
  }
}

// Few rows of x (a decode step of up to kWalkRows sequences, or a speculative verify step: bound by reading
// the weights): register tiles over blocks of the item's rows, straight from memory, each output's terms added
// in K's order (TiledWalk, cpu_matmul_few_rows.h; bfloat16 on AVX-512 BF16 in vdpbf16ps pairs). Until session 16
// one row read the item's two halves side by side (SplitWalk) and two rows its four quarters (QuarterWalk):
// each output's sum then ran in another order than a row of a bigger call, which a speculative verify step
// (k + 1 rows of a sequence) exposed as flipped greedy near-ties (issue 26; "Row invariance" below). The tiles
// with their software prefetch read as fast at one and two rows (bench/cpu_matmul_stream.cc 1 and 2; a walk of
// whole rows in address order with the accumulators in L1 was slower in bfloat16: docs/notes/cpu-kernels.md).
template <typename T, int R>
void RowWalk(const Problem& p, int64_t k0, int64_t k1, int64_t c0, int64_t width, float* partial) {
  TiledWalk<T, R>(p, k0, k1, c0, width, partial);
}

template <typename T, int R>
void RowWalkRows(int rows, const Problem& p, int64_t k0, int64_t k1, int64_t c0, int64_t width, float* partial) {
  if constexpr (R > 0) {
    if (rows == R) return RowWalk<T, R>(p, k0, k1, c0, width, partial);
    RowWalkRows<T, R - 1>(rows, p, k0, k1, c0, width, partial);
  }
}

// Whether an item adds into a partial cleared beforehand (the walks of a few rows, the bfloat16 pairs), rather
// than writing it from zero in its first pass (the packed many-row passes: at 192 rows clearing the outputs and the
// partials and then summing the partials, one thread while the other waited, were 7% of a prefill's projection
// samples).
template <typename T>
bool AddsIntoCleared(int64_t rows) {
  return rows <= kWalkRows || (std::is_same_v<T, BF16> && kBf16Pairs);
}

// One item: weight rows [k0, k1) by columns [c0, c0 + width), into partial [M, N], in passes of `chunk` rows: each
// pass packs its rows, then every group of rows of x runs over them from cache.
template <typename T>
void KnItem(const Problem& p, int64_t k0, int64_t k1, int64_t c0, int64_t width, int64_t chunk, float* partial) {
  if (p.rows <= kWalkRows) return RowWalkRows<T, kWalkRows>(int(p.rows), p, k0, k1, c0, width, partial);
  if constexpr (std::is_same_v<T, BF16> && kBf16Pairs) return PairItem(p, k0, k1, c0, width, chunk, partial);
  if (k0 >= k1) {  // K = 0: no pass writes the zeros
    for (int64_t r = 0; r < p.rows; ++r) std::fill_n(partial + r * p.columns + c0, width, 0.0f);
    return;
  }
  float* packed = PackBuffer(chunk * width);
  const auto* w = static_cast<const typename T::Stored*>(p.w);
  for (int64_t k = k0; k < k1; k += chunk) {
    const int64_t count = std::min(chunk, k1 - k);
    const bool from_zero = k == k0;
    Pack<T>(w + k * p.columns + c0, p.columns, count, width, packed);
    int64_t r0 = 0;
    for (; r0 + kKnRows <= p.rows; r0 += kKnRows) {
      KnRows<kKnRows>(p.x + r0 * p.depth + k, p.depth, packed, count, width, partial + r0 * p.columns + c0, p.columns,
                      from_zero);
    }
    if (r0 < p.rows) {
      KnRemainder<kKnRows - 1>(int(p.rows - r0), p.x + r0 * p.depth + k, p.depth, packed, count, width,
                               partial + r0 * p.columns + c0, p.columns, from_zero);
    }
  }
}

// ---- [N, K] weights (transposed): out[r, n] = sum_k x[r, k] w[n, k], dot products of contiguous rows ----

// R rows of x by NT packed weight rows: R * NT vector accumulators over K, summed across lanes at the end.
template <typename T, int R, int NT>
inline void NkTile(const float* x, int64_t depth, const typename T::Stored* w, float* out, int64_t ldo) {
  VecF acc[R][NT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int n = 0; n < NT; ++n) acc[r][n] = VecF{};
  int64_t k = 0;
  for (; k + kLanes <= depth; k += kLanes) {
    VecF xv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) xv[r] = LoadF(x + r * depth + k);
#pragma GCC unroll 8
    for (int n = 0; n < NT; ++n) {
      const VecF wv = T::Vector(w + n * depth + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r][n] = Fma(xv[r], wv, acc[r][n]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < NT; ++n) {
      float sum = HorizontalSum(acc[r][n]);
      for (int64_t j = k; j < depth; ++j) sum = FmaOne(x[r * depth + j], T::One(w[n * depth + j]), sum);
      out[r * ldo + n] = sum;
    }
  }
}

// R rows of x (from x) by `count` packed weight rows: tiles of kNkOutputs[R], then single rows.
template <typename T, int R>
void NkRows(const float* x, int64_t depth, const typename T::Stored* w, int64_t count, float* out, int64_t ldo) {
  constexpr int NT = kNkOutputs[R];
  int64_t n = 0;
  for (; n + NT <= count; n += NT) NkTile<T, R, NT>(x, depth, w + n * depth, out + n, ldo);
  for (; n < count; ++n) NkTile<T, R, 1>(x, depth, w + n * depth, out + n, ldo);
}

template <typename T, int R>
void NkRemainder(int rows, const float* x, int64_t depth, const typename T::Stored* w, int64_t count, float* out,
                 int64_t ldo) {
  if constexpr (R > 0) {
    if (rows == R) return NkRows<T, R>(x, depth, w, count, out, ldo);
    NkRemainder<T, R - 1>(rows, x, depth, w, count, out, ldo);
  }
}

template <typename T, int R>
void NkStreamsRows(const Problem& p, const typename T::Stored* w, int64_t count, float* out) {
  if constexpr (R > 0) {
    if (p.rows == R) return NkStreams<T, R>(p, w, count, out);
    NkStreamsRows<T, R - 1>(p, w, count, out);
  }
}

// One item: outputs [n0, n0 + count) of every row of x, written once. Every output is one dot product whose
// terms are added in the same order at every row count: a vector of kLanes partial sums over K, summed across
// lanes (HorizontalSum), then K's tail one term at a time (NkTile, NkStreamRows; bfloat16 on AVX-512 BF16:
// vdpbf16ps pairs, NkPairStreamRows). Up to 8 rows the weights are read straight from memory, S weight rows
// side by side (NkStreams; until session 16 one and two rows kept 4 and 2 partial sums a row, NkSplitDots and
// NkRowDots: another order than the tiles'); more rows, the item is packed (widened once) and register-tiled.
template <typename T>
void NkItem(const Problem& p, int64_t n0, int64_t count) {
  const auto* w = static_cast<const typename T::Stored*>(p.w) + n0 * p.depth;
  if (p.rows <= kNkDirectRows) return NkStreamsRows<T, kNkDirectRows>(p, w, count, p.out + n0);
  if constexpr (std::is_same_v<T, BF16> && kBf16Pairs) {
    // Groups of up to 8 rows as 3-8 row calls compute them (the item's 32 KiB in L1/L2 for each group). The pairs'
    // tiles with rows in lanes (x transposed in pairs, session 9) summed each output in another order.
    for (int64_t r0 = 0; r0 < p.rows; r0 += kNkDirectRows) {
      Problem group = p;
      group.rows = std::min<int64_t>(kNkDirectRows, p.rows - r0);
      group.x16 = p.x16 + r0 * p.x16_stride;
      NkStreamsRows<T, kNkDirectRows>(group, w, count, p.out + r0 * p.columns + n0);
    }
    return;
  }
  float* packed = PackBuffer(count * p.depth);
  Pack<T>(w, p.depth, count, p.depth, packed);
  int64_t r0 = 0;
  for (; r0 + kNkRows <= p.rows; r0 += kNkRows) {
    NkRows<F32, kNkRows>(p.x + r0 * p.depth, p.depth, packed, count, p.out + r0 * p.columns + n0, p.columns);
  }
  if (r0 < p.rows) {
    NkRemainder<F32, kNkRows>(int(p.rows - r0), p.x + r0 * p.depth, p.depth, packed, count, p.out + r0 * p.columns + n0,
                         p.columns);
  }
}

// ---- Scheduling ----

// How one weight's work is cut into items. [K, N] weights: column blocks times a fixed split of K into
// `parts` (only where there are too few column blocks to keep the threads busy); each part accumulates
// into its own [M, N] partial, and the partials are summed in part order, so that the result never
// depends on which thread took which item (the same request gets the same logprobs, to the last bit,
// however the threads ran). With one group of rows (decode of a few sequences: bound by reading the
// weights) the blocks are wide, so that an item reads long runs of memory; with more, kBlockColumns,
// so that the threads split the columns rather than K. Transposed [N, K]: runs of weight rows (outputs),
// each written once.
//
// Row invariance (issue 26, session 16): a speculative verify step computes k + 1 rows of a sequence (up to 64 over
// a batch) where a decode step computed one, and greedy outputs must not change with speculation on, so each row of
// a call of up to kMaxRows rows is the same bits as the 1-row call of that row (a prefill chunk's rows too, 256 a
// call since session 20). The cuts of K (`parts`, on whole `cut`s) are those of the 1-row call, whatever the rows
// (they depend on K, N and the workers); the columns may be cut by rows (block_columns, and chunk: the rows a many-
// row pass packs), since every output's terms are added in K's order within a part, whoever walks them; and every
// walk adds them so (RowWalk, KnTile, NkItem; the bfloat16 pairs on AVX-512 BF16 at every row count, PairTiledWalk
// and PairItem). The parts are added to the output in part order, whoever adds them.
struct Plan {
  Problem problem;
  int64_t first_item = 0, num_items = 0;
  int64_t block_columns = kBlockColumns, blocks = 1, parts = 1, chunk = 1, cut = 1;  // [K, N]
  int64_t outputs_per_item = 1;                                                      // [N, K]
  int64_t partial_offset = 0;  // into the scratch partials, [K, N] parts after the first
};

// [K, N]: an item's columns by rows of x. Up to kWalkRows rows, as wide as the accumulators fit in L1 (RowWalk).
inline int64_t BlockColumns(int64_t rows) {
  if (rows > kWalkRows) return kBlockColumns;
  const int64_t fitting = kAccumulatorBytes / (int64_t(sizeof(float)) * std::max<int64_t>(1, rows)) / 64 * 64;
  return std::max<int64_t>(64, std::min(kWideColumns, fitting));
}

// [K, N]: rows of the weights per pass of the many-row regime (KnItem), about kPackFloats of packed weights.
// Even: the bfloat16 pairs (cpu_matmul_bf16_pairs.h) never straddle two passes or two parts.
inline int64_t PassRows(int64_t width) {
  return std::max<int64_t>(4, std::min<int64_t>(64, kPackFloats / std::max<int64_t>(1, width)) / 2 * 2);
}

template <typename T>
Plan MakePlan(const Problem& p, bool transposed, int64_t num_workers) {
  const int64_t element = sizeof(typename T::Stored);
  Plan plan;
  plan.problem = p;
  if (transposed) {
    // 1-8 rows (NkStreams): items long enough for each of their streams to be a long run of memory (at one row,
    // 24-row items ran the bfloat16 head at 0.91-0.94 of a stream, 256 KiB ones 1.0-1.07).
    const int64_t item_bytes = p.rows <= kNkDirectRows ? kStreamItemBytes : kItemBytes;
    const int64_t fitting = item_bytes / std::max<int64_t>(1, p.depth * element) / kNkItemMultiple * kNkItemMultiple;
    plan.outputs_per_item = std::max(kNkItemMultiple, fitting);
    plan.num_items = (p.columns + plan.outputs_per_item - 1) / plan.outputs_per_item;
    return plan;
  }
  plan.block_columns = BlockColumns(p.rows);
  plan.blocks = (p.columns + plan.block_columns - 1) / plan.block_columns;
  plan.chunk = PassRows(std::min(plan.block_columns, p.columns));
  // K's cut: the 1-row call's (Row invariance), two items per thread at least, so that a late helper still gets
  // its share.
  const int64_t one_row_columns = BlockColumns(1);
  const int64_t one_row_blocks = (p.columns + one_row_columns - 1) / one_row_columns;
  plan.cut = PassRows(std::min(one_row_columns, p.columns));
  const int64_t wanted = 2 * num_workers;
  if (one_row_blocks < wanted) {
    const int64_t cuts = (p.depth + plan.cut - 1) / plan.cut;
    plan.parts = std::max<int64_t>(1, std::min((wanted + one_row_blocks - 1) / one_row_blocks, cuts));
  }
  plan.num_items = plan.blocks * plan.parts;
  return plan;
}

// Rows [k0, k1) of the weights that part `part` of a [K, N] plan adds (on whole cuts: even, Plan::cut).
inline void PartRows(const Plan& plan, int64_t part, int64_t& k0, int64_t& k1) {
  const int64_t depth = plan.problem.depth, cuts = (depth + plan.cut - 1) / plan.cut;
  k0 = std::min(depth, cuts * part / plan.parts * plan.cut);
  k1 = std::min(depth, cuts * (part + 1) / plan.parts * plan.cut);
}

// A call's scratch for the partials of [K, N] parts after the first, kept by the calling thread (a fresh vector
// each call cleared megabytes and faulted its pages in: 192-row prefill calls).
inline float* PartialsBuffer(int64_t floats) {
  thread_local std::vector<float> buffer;
  if (int64_t(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

// Outputs per item of the partials' sum (RunItems): long enough to amortise taking an item.
constexpr int64_t kSumItemFloats = 16 * 1024;

}  // namespace

#include "cpu_matmul_panels.h"
#include "cpu_matmul_amx.h"

namespace {

// Several weights times the same x (a layer's q, k and v, or gate and up) in one call: the items of
// all of them in one schedule, so the threads stay busy across the weights' boundaries. Weights in panels
// (cpu_matmul_panels.h) run as one call of their own, before the others.
template <typename T>
void Run(std::vector<Problem> problems, bool transposed, int64_t num_workers) {
  // bfloat16 above a walk's rows on AMX tiles (cpu_matmul_amx.h), [K, N] in panels or not and [N, K]
  if (OnAmxTiles<T>(problems[0].rows)) {
    return transposed ? RunAmxTransposed(problems, num_workers) : RunAmxColumns(problems, num_workers);
  }
  if (std::any_of(problems.begin(), problems.end(), [](const Problem& p) { return p.panels; })) {
    std::vector<Problem> panels, others;
    for (const Problem& p : problems) (p.panels ? panels : others).push_back(p);
    RunPanels<T>(panels, num_workers);
    if (others.empty()) return;
    problems = std::move(others);
  }
  std::vector<Plan> plans;
  int64_t num_items = 0, partial_size = 0;
  const bool cleared = AddsIntoCleared<T>(problems[0].rows);
  for (const Problem& p : problems) {
    plans.push_back(MakePlan<T>(p, transposed, num_workers));
    plans.back().first_item = num_items;
    plans.back().partial_offset = partial_size;
    num_items += plans.back().num_items;
    if (!transposed) {
      partial_size += (plans.back().parts - 1) * p.rows * p.columns;
      if (cleared) std::memset(p.out, 0, sizeof(float) * p.rows * p.columns);  // part 0 accumulates in the output
    }
  }
  float* scratch_data = PartialsBuffer(partial_size);  // [K, N]: the partials of parts 1, 2, ...
  if (cleared) std::memset(scratch_data, 0, sizeof(float) * partial_size);
  const Plan* plan_data = plans.data();
  const int64_t num_plans = int64_t(plans.size());
  jaxserve_cpu::RunItems(num_workers, num_items, [=](int64_t /*worker*/, int64_t item) {
    const Plan* plan = plan_data;
    while (plan + 1 < plan_data + num_plans && item >= plan[1].first_item) ++plan;
    const Problem& p = plan->problem;
    const int64_t i = item - plan->first_item;
    if (transposed) {
      const int64_t n0 = i * plan->outputs_per_item;
      NkItem<T>(p, n0, std::min(plan->outputs_per_item, p.columns - n0));
      return;
    }
    const int64_t block = i % plan->blocks, part = i / plan->blocks;
    const int64_t c0 = block * plan->block_columns;
    int64_t k0, k1;
    PartRows(*plan, part, k0, k1);
    float* partial = part == 0 ? p.out : scratch_data + plan->partial_offset + (part - 1) * p.rows * p.columns;
    KnItem<T>(p, k0, k1, c0, std::min(plan->block_columns, p.columns - c0), plan->chunk, partial);
  });
  if (transposed || partial_size == 0) return;
  // The partials added to the output in part order (each output's sum the same whoever adds it), the outputs
  // shared among the threads.
  std::vector<std::pair<const Plan*, int64_t>> sums;  // (plan, first output of the item)
  for (const Plan& plan : plans) {
    const int64_t size = plan.problem.rows * plan.problem.columns;
    for (int64_t start = 0; plan.parts > 1 && start < size; start += kSumItemFloats) sums.emplace_back(&plan, start);
  }
  const auto* sum_data = sums.data();
  auto add = [=](int64_t /*worker*/, int64_t item) {
    const Plan& plan = *sum_data[item].first;
    const int64_t size = plan.problem.rows * plan.problem.columns, start = sum_data[item].second;
    const int64_t end = std::min(size, start + kSumItemFloats);
    float* out = plan.problem.out;
    const float* partials = scratch_data + plan.partial_offset;
    for (int64_t part = 1; part < plan.parts; ++part) {
      const float* from = partials + (part - 1) * size;
#pragma omp simd
      for (int64_t i = start; i < end; ++i) out[i] += from[i];
    }
  };
  // a decode step's few rows: a few thousand floats, summed here sooner than the helpers would be woken for them
  if (partial_size <= kSumItemFloats) {
    for (int64_t item = 0; item < int64_t(sums.size()); ++item) add(0, item);
  } else {
    jaxserve_cpu::RunItems(num_workers, int64_t(sums.size()), add);
  }
}

template <typename T>
void WidenAndRun(int64_t num_workers, const typename T::Stored* in, std::vector<Problem> problems, bool transposed) {
  const int64_t rows = problems[0].rows, depth = problems[0].depth, count = rows * depth;
  if (OnAmxTiles<T>(rows)) {  // the tiles read x's bfloat16 as it came
    for (Problem& p : problems) p.x16 = reinterpret_cast<const uint16_t*>(in), p.x16_stride = depth;
    return Run<T>(std::move(problems), transposed, num_workers);
  }
  std::vector<float> x_wide(count);
  for (int64_t i = 0; i < count; ++i) x_wide[i] = T::One(in[i]);
  for (Problem& p : problems) p.x = x_wide.data();
  // bfloat16 on AVX-512 BF16 (cpu_matmul_bf16_pairs.h, cpu_matmul_few_rows.h): x's rows as given, K padded to even
  std::vector<uint16_t> x_pairs;
  if (std::is_same_v<T, BF16> && kBf16Pairs) {
    const int64_t stride = depth + depth % 2;
    x_pairs.assign(rows * stride, 0);
    for (int64_t r = 0; r < rows; ++r) std::memcpy(&x_pairs[r * stride], in + r * depth, depth * sizeof(uint16_t));
    for (Problem& p : problems) p.x16 = x_pairs.data(), p.x16_stride = stride;
  }
  Run<T>(std::move(problems), transposed, num_workers);
}

// Rows x [M, K] of `type` (the weights' dtype) times each weight, validated into `problems` (one per weight, its
// result's buffer).
ffi::Error MakeProblems(int64_t rows, int64_t depth, ffi::DataType type, ffi::RemainingArgs& weights,
                        ffi::RemainingRets& outs, bool transposed, std::vector<Problem>& problems) {
  if (rows > kMaxRows) return ffi::Error::InvalidArgument("small_matmul: too many rows");
  if (weights.size() == 0 || weights.size() != outs.size()) {
    return ffi::Error::InvalidArgument("small_matmul: one result per weight, at least one weight");
  }
  for (size_t i = 0; i < weights.size(); ++i) {
    auto w = weights.get<ffi::AnyBuffer>(i);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!w.has_value() || !out.has_value()) return ffi::Error::InvalidArgument("small_matmul: bad weight or result");
    const auto w_dims = w->dimensions();
    if (w->element_type() != type) return ffi::Error::InvalidArgument("small_matmul: x and w must share a dtype");
    const auto out_dims = (*out)->dimensions();
    if (w_dims.size() == 3) {  // [K, N] in panels (cpu_matmul_panels.h): N is the result's
      const int64_t columns = out_dims.size() == 2 ? out_dims[1] : -1;
      if (transposed || out_dims.size() != 2 || out_dims[0] != rows || w_dims[0] != Panels(columns) ||
          w_dims[1] != depth || w_dims[2] != kPanelColumns) {
        return ffi::Error::InvalidArgument("small_matmul: weights in panels must be [ceil(N / 16), K, 16]");
      }
      problems.push_back(Problem{w->untyped_data(), nullptr, (*out)->typed_data(), rows, depth, columns});
      problems.back().panels = true;
      continue;
    }
    if (w_dims.size() != 2) return ffi::Error::InvalidArgument("small_matmul: weights must be 2-d, or 3-d panels");
    const int64_t columns = transposed ? w_dims[0] : w_dims[1];
    if ((transposed ? w_dims[1] : w_dims[0]) != depth || (*out)->element_count() != size_t(rows * columns)) {
      return ffi::Error::InvalidArgument("small_matmul: inconsistent shapes");
    }
    problems.push_back(Problem{w->untyped_data(), nullptr, (*out)->typed_data(), rows, depth, columns});
  }
  if (type != ffi::DataType::BF16 && type != ffi::DataType::F16 && type != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("small_matmul: float32, bfloat16 or float16 only");
  }
  return ffi::Error::Success();
}

// x [M, K] times each weight, validated as above.
ffi::Error MakeProblems(const ffi::AnyBuffer& x, ffi::RemainingArgs& weights, ffi::RemainingRets& outs, bool transposed,
                        std::vector<Problem>& problems) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return ffi::Error::InvalidArgument("small_matmul: x must be 2-d");
  return MakeProblems(x_dims[0], x_dims[1], x.element_type(), weights, outs, transposed, problems);
}

// x [M, K] times each weight w_i ([K, N_i], or [N_i, K] when transposed), into out_i [M, N_i] float32.
ffi::Error SmallMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs weights, ffi::RemainingRets outs,
                       bool transposed) {
  std::vector<Problem> problems;
  if (ffi::Error error = MakeProblems(x, weights, outs, transposed, problems); error.failure()) return error;
  const int64_t num_workers = std::max<int64_t>(1, pool.num_threads());
  const void* in = x.untyped_data();
  switch (x.element_type()) {
    case ffi::DataType::BF16: WidenAndRun<BF16>(num_workers, static_cast<const uint16_t*>(in), std::move(problems), transposed); break;
    case ffi::DataType::F16: WidenAndRun<F16>(num_workers, static_cast<const uint16_t*>(in), std::move(problems), transposed); break;
    default: WidenAndRun<F32>(num_workers, static_cast<const float*>(in), std::move(problems), transposed); break;
  }
  return ffi::Error::Success();
}

template <typename T>
void NormAndRun(int64_t num_workers, const ffi::AnyBuffer& x, const ffi::AnyBuffer& scale, float eps,
                std::vector<Problem> problems) {
  const auto normed = jaxserve_cpu::NormedRows<T>(static_cast<const typename T::Stored*>(x.untyped_data()),
                                    static_cast<const typename T::Stored*>(scale.untyped_data()), problems[0].rows,
                                    problems[0].depth, eps, num_workers);
  WidenAndRun<T>(num_workers, normed.data(), std::move(problems), /*transposed=*/false);
}

// RMSNorm(x; scale, eps) [M, K] times each weight w_i [K, N_i], into out_i [M, N_i] float32 (cpu_rms_norm.h).
ffi::Error SmallMatmulNormed(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::RemainingArgs weights,
                             ffi::RemainingRets outs, float eps) {
  std::vector<Problem> problems;
  if (ffi::Error error = MakeProblems(x, weights, outs, false, problems); error.failure()) return error;
  if (!jaxserve_cpu::NormScaleFits(x, scale)) {
    return ffi::Error::InvalidArgument("small_matmul_normed: the norm's scale must be [K] in x's dtype");
  }
  const int64_t num_workers = std::max<int64_t>(1, pool.num_threads());
  switch (x.element_type()) {
    case ffi::DataType::BF16: NormAndRun<BF16>(num_workers, x, scale, eps, std::move(problems)); break;
    case ffi::DataType::F16: NormAndRun<F16>(num_workers, x, scale, eps, std::move(problems)); break;
    default: NormAndRun<F32>(num_workers, x, scale, eps, std::move(problems)); break;
  }
  return ffi::Error::Success();
}

template <typename T>
void GateAndRun(int64_t num_workers, const float* gate, const float* up, std::vector<Problem> problems) {
  const auto gated = SiluGatedRows<T>(gate, up, problems[0].rows, problems[0].depth, num_workers);
  WidenAndRun<T>(num_workers, gated.data(), std::move(problems), /*transposed=*/false);
}

// silu(gate) * up [M, F] in the weights' dtype (cpu_gated_rows.h; gate and up [M, F] float32: the gate and up
// projections' results) times each weight w_i [F, N_i], into out_i [M, N_i] float32.
ffi::Error SmallMatmulGated(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> gate, ffi::Buffer<ffi::F32> up,
                            ffi::RemainingArgs weights, ffi::RemainingRets outs) {
  const auto dims = gate.dimensions();
  if (dims.size() != 2 || up.dimensions().size() != 2 || up.dimensions()[0] != dims[0] ||
      up.dimensions()[1] != dims[1]) {
    return ffi::Error::InvalidArgument("small_matmul_gated: gate and up must be [M, F] alike");
  }
  if (weights.size() == 0) return ffi::Error::InvalidArgument("small_matmul_gated: at least one weight");
  auto first = weights.get<ffi::AnyBuffer>(0);
  if (!first.has_value()) return ffi::Error::InvalidArgument("small_matmul_gated: bad weight");
  const ffi::DataType type = first->element_type();
  std::vector<Problem> problems;
  if (ffi::Error error = MakeProblems(dims[0], dims[1], type, weights, outs, false, problems); error.failure()) {
    return error;
  }
  const int64_t num_workers = std::max<int64_t>(1, pool.num_threads());
  switch (type) {
    case ffi::DataType::BF16: GateAndRun<BF16>(num_workers, gate.typed_data(), up.typed_data(), std::move(problems)); break;
    case ffi::DataType::F16: GateAndRun<F16>(num_workers, gate.typed_data(), up.typed_data(), std::move(problems)); break;
    default: GateAndRun<F32>(num_workers, gate.typed_data(), up.typed_data(), std::move(problems)); break;
  }
  return ffi::Error::Success();
}

}  // namespace

// The instruction path this library was compiled for: "avx512", "avx2" or "portable".
extern "C" const char* JaxserveCpuKernelPath() { return kPath; }

// Whether bfloat16 weights are multiplied in vdpbf16ps pairs (cpu_matmul_bf16_pairs.h; in panels too:
// cpu_matmul_panels.h's pair tiles), whose sums round otherwise than the widened FMAs'.
extern "C" int JaxserveCpuBf16Pairs() { return kBf16Pairs ? 1 : 0; }

// Whether bfloat16 calls above a walk's rows run on AMX tiles here (cpu_matmul_amx.h): built for them and granted
// by the kernel.
extern "C" int JaxserveCpuAmxTiles() { return kAmxTiles && AmxTilesGranted() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveSmallMatmul, SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<bool>("transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveSmallMatmulNormed, SmallMatmulNormed,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveSmallMatmulGated, SmallMatmulGated,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
