// Rows times GGUF K-quant weights (Q4_K, Q5_K, Q6_K, and the Q5_0 / Q5_1 of Q4_K_M / Q5_K_M files) at the
// file's bytes, for decode steps and (x in int8) prefill chunks on the CPU, as an XLA FFI custom call:
// out_i [M, N_i] float32 = x [M, K] @ w_i, with w_i in kquant.py's planes:
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
// through the sub-block's sum of x (sum x w = d sc sum x q - dmin m sum x). Many rows with x in int8
// (ManyRowsItem): an item's weights are widened once into a buffer that every row group reads.
//
// Threads: up to 64 rows (decode and verify steps), one plan per call (PlanCall, cpu_call_plan.h as the
// int8-dot kernel's): the call's weights in whole-row column blocks, their bytes cut into one contiguous run
// per worker, K split only where a run ends inside a block (that part into its own partial), each piece
// prefetching the start of the next; the cut is a one-row call's whatever the rows, so each row's result is
// the bits a one-row call gives it. More rows (prefill chunks): per weight, column blocks, and where there
// are too few for the threads a fixed split of the sub-blocks into parts, each into its own partial. Partials
// are summed in K's order, and the cuts depend on shapes, kinds and workers only (prefill's on the rows too):
// results do not depend on which thread took which item.
// Built by pallas_kernels/cpu_library.py into the kernels' one library; the loops are plain C++ that the
// compiler vectorizes for the path's flags.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_workers.h"
#include "matmul/cpu_call_plan.h"
#include "matmul/cpu_kquant_vectors.h"
#include "matmul/cpu_weight_basics.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace kquant_vectors;

constexpr int64_t kSuperBlock = 256;      // values per super-block
constexpr int64_t kBlockColumns = 256;    // an item's columns at most
// Narrower blocks where a weight has too few columns for the threads, in whole 64-byte lines of the planes: a
// block edge inside a line has two items read it (SmolLM2's 192 / 576 columns were cut in 48 / 144; one row,
// int8, under load: 0.23-0.26 of a read stream before, 0.25-0.30 after, bench/cpu_kquant_stream.cc)
constexpr int64_t kMinBlockColumns = 64;
constexpr int64_t kPrefetchGroups = 2;    // software prefetch this many sub-blocks ahead along K
constexpr int64_t kWideColumns = 4096;    // one or two rows: an item's columns at most (whole rows below)
constexpr int64_t kCallRows = 64;         // a call of up to this many rows (decode, verify) is planned as a whole

#ifndef JAXSERVE_KQ_AHEAD
#define JAXSERVE_KQ_AHEAD 1
#endif

// One or two rows: the next sub-block's bytes of one plane ([runs, run_bytes], runs `stride` apart; whole
// rows: one run), prefetched into L2 (prefetcht1) in address order, a few lines per register tile while
// this sub-block's tiles are read (a tile reads one line of each of the sub-block's 16-20 plane rows, and
// lines prefetched tile by tile in that order ran at ~0.25 of a read stream).
using AheadLines = jaxserve_cpu::AheadLines<2>;  // cpu_weight_basics.h
using jaxserve_cpu::BFloat16ToFloat;

constexpr int kQ5_0 = 50, kQ5_1 = 51;

// x quantized to int8 per 32 k as ggml's quantize_row_q8_0_ref (d = max|x| / 127, q = roundf(x / d) as
// x * (1 / d), ties away from zero; d kept in float32), for the int8-activation tiles (cpu_kquant_int8.h).
struct QuantizedRows {
  std::vector<int8_t> q;       // [M, K]
  std::vector<float> d;        // [M, K / 32]
  std::vector<int32_t> sum16;  // [M, K / 16]: each 16 k's sum of q (Q6_K's sub-blocks; two make a 32)
  int64_t rows = 0, depth = 0;
};

QuantizedRows QuantizeRows(const float* x, int64_t rows, int64_t depth) {
  QuantizedRows a;
  a.rows = rows;
  a.depth = depth;
  a.q.resize(rows * depth);
  a.d.resize(rows * (depth / 32));
  a.sum16.assign(rows * (depth / 16), 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k0 = 0; k0 < depth; k0 += 32) {
      const float* xr = x + r * depth;
      float amax = 0.0f;
      for (int64_t k = k0; k < k0 + 32; ++k) amax = std::max(amax, std::fabs(xr[k]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      for (int64_t k = k0; k < k0 + 32; ++k) {
        const int8_t q = int8_t(std::round(xr[k] * id));
        a.q[r * depth + k] = q;
        a.sum16[r * (depth / 16) + k / 16] += q;
      }
      a.d[r * (depth / 32) + k0 / 32] = d;
    }
  }
  return a;
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
  const QuantizedRows* x_int8 = nullptr;  // x quantized: the int8-activation tiles serve this weight
  int64_t columns = 0, group = 32;
  int64_t groups_per_d = 8;  // sub-blocks per row of d: 8 (Q4_K, Q5_K), 16 (Q6_K), 1 (Q5_0, Q5_1)
  int64_t block_columns = 0, blocks = 0, parts = 1;  // the split into work items (PlanWeight, past 8 rows)
};

// Where an item adds its sums: the result [M, N] (rows N apart, columns from 0), or a piece's partial
// [M, width] (rows width apart, its first column c0), so that a part of K needs no [M, N] buffer.
struct Target {
  float* data;
  int64_t stride, c0;
  float* At(int64_t r, int64_t c) const { return data + r * stride + (c - c0); }
};

struct Rows {
  const float* data;  // [rows, depth] float32
  int64_t rows, depth;
};

// How a kind's planes widen: the bits above the low nibble and the offset stored in q.
constexpr int HighBits(int kind) { return kind == 4 ? 0 : kind == 6 ? 2 : 1; }
constexpr int Offset(int kind) { return kind == 6 ? 32 : kind == kQ5_0 ? 16 : 0; }
constexpr bool HasMins(int kind) { return kind == 4 || kind == 5 || kind == kQ5_1; }

// One stored q less its offset (the column tails, and the portable reference of the vector widening).
template <int Kind>
inline int32_t Integer(const Weight& w, int64_t k, int64_t c) {
  const int64_t n = w.columns;
  const uint8_t byte = w.low[(k / 2) * n + c];
  int32_t q = k % 2 ? byte >> 4 : byte & 0x0F;
  if (HighBits(Kind) == 1) q |= ((w.high[(k / 8) * n + c] >> (k % 8)) & 1) << 4;
  if (HighBits(Kind) == 2) q |= ((w.high[(k / 4) * n + c] >> (2 * (k % 4))) & 3) << 4;
  return q - Offset(Kind);
}

// Sub-block g's scale (d * sc, formed in float32 as ggml does) and subtracted min (dmin * m; Q5_1: -m) of
// column c.
template <int Kind>
inline float ScaleAt(const Weight& w, int64_t g, int64_t c) {
  const float d = HalfToFloat(w.d[(g / w.groups_per_d) * w.columns + c]);
  if (Kind == 6) return d * float(static_cast<const int8_t*>(w.sub_scales)[g * w.columns + c]);
  if (Kind == 4 || Kind == 5) return d * float(static_cast<const uint8_t*>(w.sub_scales)[g * w.columns + c]);
  return d;
}
template <int Kind>
inline float MinAt(const Weight& w, int64_t g, int64_t c) {
  if (Kind == kQ5_1) return -HalfToFloat(w.dmin[g * w.columns + c]);
  if (Kind == 4 || Kind == 5) {
    return HalfToFloat(w.dmin[(g / w.groups_per_d) * w.columns + c]) * float(w.sub_mins[g * w.columns + c]);
  }
  return 0.0f;
}

// The same for kLanes columns from c.
template <int Kind>
inline VecF ScaleVector(const Weight& w, int64_t g, int64_t c) {
  const VecF d = Halves(w.d + (g / w.groups_per_d) * w.columns + c);
  if (Kind == 6) return d * ToFloat(SignedBytes(static_cast<const int8_t*>(w.sub_scales) + g * w.columns + c));
  if (Kind == 4 || Kind == 5) return d * ToFloat(Bytes(static_cast<const uint8_t*>(w.sub_scales) + g * w.columns + c));
  return d;
}
template <int Kind>
inline VecF MinVector(const Weight& w, int64_t g, int64_t c) {
  if (Kind == kQ5_1) return -Halves(w.dmin + g * w.columns + c);
  const VecF dmin = Halves(w.dmin + (g / w.groups_per_d) * w.columns + c);
  return dmin * ToFloat(Bytes(w.sub_mins + g * w.columns + c));
}

#include "matmul/cpu_kquant_int8.h"

// R rows of x (from r0) times sub-block g of the weight at T vectors of columns from c, widened in registers:
// per pair of k, T vectors of the low plane's bytes zero-extended to 32-bit lanes, split into their nibbles,
// the high plane's bits (loaded once per byte's worth of k) or'ed in, the offset taken out, converted to
// float and multiplied into R x T accumulators; at the sub-block's end the sums are scaled into the result
// once per column (and the min applied through the sub-block's sum of x).
template <int Kind, int R, int T>
inline void Tile(const Weight& w, const Rows& x, int64_t r0, int64_t g, int64_t c, const Target& target) {
  constexpr int kBits = HighBits(Kind);
  constexpr int kPerHigh = kBits == 0 ? 2 : 8 / kBits;  // k per high-plane byte: the step (Q4_K: a pair)
  const int64_t n = w.columns, depth = x.depth;
  const float* xr = x.data + r0 * depth;
  VecF acc[R][T];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) acc[r][t] = VecF{};
  }
  const VecI nibble = VecI{} + 0x0F, offset = VecI{} + Offset(Kind);
  for (int64_t k = g * w.group; k < (g + 1) * w.group; k += kPerHigh) {
    VecI high[T];
    if constexpr (kBits > 0) {  // shifted up 4: bit (or bits) j of a k lands at bit 4 after >> j
      const uint8_t* h = w.high + (k / kPerHigh) * n + c;
      for (int t = 0; t < T; ++t) high[t] = Bytes(h + t * kLanes) << 4;
    }
#pragma GCC unroll 4
    for (int p = 0; p < kPerHigh / 2; ++p) {
      const uint8_t* low = w.low + (k / 2 + p) * n + c;
      VecF even[T], odd[T];
      for (int t = 0; t < T; ++t) {
        const VecI l = Bytes(low + t * kLanes);
        VecI e = l & nibble, o = l >> 4;
        if constexpr (kBits == 1) {
          e |= (high[t] >> (2 * p)) & 0x10;
          o |= (high[t] >> (2 * p + 1)) & 0x10;
        } else if constexpr (kBits == 2) {
          e |= (high[t] >> (4 * p)) & 0x30;
          o |= (high[t] >> (4 * p + 2)) & 0x30;
        }
        if constexpr (Offset(Kind) != 0) {
          e -= offset;
          o -= offset;
        }
        even[t] = ToFloat(e);
        odd[t] = ToFloat(o);
      }
      const int64_t kk = k + 2 * p;
      for (int r = 0; r < R; ++r) {
        const VecF xe = Broadcast(xr[r * depth + kk]), xo = Broadcast(xr[r * depth + kk + 1]);
        for (int t = 0; t < T; ++t) acc[r][t] = Fma(odd[t], xo, Fma(even[t], xe, acc[r][t]));
      }
    }
  }
  VecF scale[T], minimum[T];
  for (int t = 0; t < T; ++t) {
    scale[t] = ScaleVector<Kind>(w, g, c + t * kLanes);
    if constexpr (HasMins(Kind)) minimum[t] = MinVector<Kind>(w, g, c + t * kLanes);
  }
  const int64_t num_x_groups = depth / 32;
  for (int r = 0; r < R; ++r) {
    float* out = target.At(r0 + r, c);
    if constexpr (HasMins(Kind)) {
      const VecF x_sum = Broadcast(-w.x_sums[(r0 + r) * num_x_groups + g]);
      for (int t = 0; t < T; ++t) {
        StoreF(out + t * kLanes, Fma(x_sum, minimum[t], Fma(acc[r][t], scale[t], LoadF(out + t * kLanes))));
      }
    } else {
      for (int t = 0; t < T; ++t) StoreF(out + t * kLanes, Fma(acc[r][t], scale[t], LoadF(out + t * kLanes)));
    }
  }
}

// R rows of x times sub-block g at column c, one column (the tails of a width not a multiple of kLanes).
template <int Kind, int R>
inline void Column(const Weight& w, const Rows& x, int64_t r0, int64_t g, int64_t c, const Target& target) {
  const float scale = ScaleAt<Kind>(w, g, c), minimum = MinAt<Kind>(w, g, c);
  for (int r = 0; r < R; ++r) {
    const float* xr = x.data + (r0 + r) * x.depth;
    float sum = 0.0f;
    for (int64_t k = g * w.group; k < (g + 1) * w.group; ++k) sum += xr[k] * float(Integer<Kind>(w, k, c));
    float& out = *target.At(r0 + r, c);
    out += sum * scale;
    if (HasMins(Kind)) out -= w.x_sums[(r0 + r) * (x.depth / 32) + g] * minimum;
  }
}

// Columns c0 .. c0 + width: register tiles of T vectors (`tile(std::integral_constant<int, T>(), c)`), then
// single vectors, then the last columns one at a time (`column(c)`). One or two rows: `ahead` (the next
// sub-block's low and high planes) prefetched a share before each tile, the rest after the tiles.
template <int T, class TileAt, class ColumnAt>
inline void WalkColumns(int64_t c0, int64_t width, const AheadLines* ahead, TileAt tile, ColumnAt column) {
  const int64_t end = c0 + width, vectors_end = c0 + width / kLanes * kLanes;
  AheadLines lines[2];  // locals: kept in registers
  int64_t per_tile[2] = {0, 0};
  if (ahead != nullptr) {
    const int64_t tiles = std::max<int64_t>(1, width / (T * kLanes));
    for (int i = 0; i < 2; ++i) {
      lines[i] = ahead[i];
      per_tile[i] = (lines[i].Lines() + tiles - 1) / tiles;
    }
  }
  int64_t c = c0;
  for (; c + T * kLanes <= vectors_end; c += T * kLanes) {
    lines[0].Issue(per_tile[0]);
    lines[1].Issue(per_tile[1]);
    tile(std::integral_constant<int, T>(), c);
  }
  lines[0].Issue(INT64_MAX);
  lines[1].Issue(INT64_MAX);
  for (; c < vectors_end; c += kLanes) tile(std::integral_constant<int, 1>(), c);
  for (; c < end; ++c) column(c);
}

// R rows from r0, sub-block g, columns c0 .. c0 + width: the int8 tiles where x is quantized (their weights
// widened from the planes as they go), else the float ones.
template <int Kind, int R>
void RowGroup(const Weight& w, const Rows& x, int64_t r0, int64_t g, int64_t c0, int64_t width, const Target& target,
              const AheadLines* ahead = nullptr) {
#if defined(KQUANT_INT8)
  if (w.x_int8 != nullptr) {
    const QuantizedRows& xq = *w.x_int8;
    const auto column = [&](int64_t c) { Int8Column<Kind, R>(w, xq, r0, g, c, target); };
#if !defined(__AVX512F__)
    if constexpr (R <= 2) {  // AVX2: 32 (two rows: 16) columns a tile in 16-bit pair lanes (Int8PairTile)
      const auto pair_tile = [&](auto vectors, int64_t c) {
        constexpr int kVectors = decltype(vectors)::value;
        if constexpr (kVectors % 2 == 0) {
          Int8PairTile<Kind, R, kVectors>(w, xq, r0, g, c, target);
        } else {
          Int8Tile<Kind, R, kVectors>(w, xq, r0, g, c, target);
        }
      };
      WalkColumns<R == 1 ? 4 : 2>(c0, width, ahead, pair_tile, column);
      return;
    }
#endif
    const auto tile = [&](auto vectors, int64_t c) {
      Int8Tile<Kind, R, decltype(vectors)::value>(w, xq, r0, g, c, target);
    };
    WalkColumns<kTileVectors[R]>(c0, width, ahead, tile, column);
    return;
  }
#endif
  const auto tile = [&](auto vectors, int64_t c) { Tile<Kind, R, decltype(vectors)::value>(w, x, r0, g, c, target); };
  const auto column = [&](int64_t c) { Column<Kind, R>(w, x, r0, g, c, target); };
  WalkColumns<kTileVectors[R]>(c0, width, ahead, tile, column);
}

// Rows r0 .. r1 of sub-block g: row groups of kTileRows, then the rest in one.
template <int Kind>
void RowGroups(const Weight& w, const Rows& x, int64_t r0, int64_t r1, int64_t g, int64_t c0, int64_t width,
               const Target& target) {
  for (; r0 + kTileRows <= r1; r0 += kTileRows) RowGroup<Kind, kTileRows>(w, x, r0, g, c0, width, target);
  switch (r1 - r0) {
    case 7: RowGroup<Kind, 7>(w, x, r0, g, c0, width, target); break;
    case 6: RowGroup<Kind, 6>(w, x, r0, g, c0, width, target); break;
    case 5: RowGroup<Kind, 5>(w, x, r0, g, c0, width, target); break;
    case 4: RowGroup<Kind, 4>(w, x, r0, g, c0, width, target); break;
    case 3: RowGroup<Kind, 3>(w, x, r0, g, c0, width, target); break;
    case 2: RowGroup<Kind, 2>(w, x, r0, g, c0, width, target); break;
    case 1: RowGroup<Kind, 1>(w, x, r0, g, c0, width, target); break;
    default: break;
  }
}

// Sub-block g's planes at columns c0 .. c0 + width, one touch per cache line (3 rows and more: kPrefetchGroups
// sub-blocks ahead of the one being read).
void PrefetchSubBlock(const Weight& w, int64_t g, int64_t c0, int64_t width) {
  const int64_t n = w.columns, k0 = g * w.group;
  const int bits = HighBits(w.kind);
  for (int64_t c = 0; c < width; c += 64) {
    for (int64_t i = 0; i < w.group / 2; ++i) __builtin_prefetch(w.low + (k0 / 2 + i) * n + c0 + c);
    for (int64_t i = 0; i < w.group * bits / 8; ++i) __builtin_prefetch(w.high + (k0 * bits / 8 + i) * n + c0 + c);
  }
}

// Sub-block g's scales (d, dmin, sc, m: a few lines per sub-block), prefetched into L2; d and dmin where a
// super-block starts, or where a piece does (`start`).
void PrefetchScales(const Weight& w, int64_t g, int64_t c0, int64_t width, bool start) {
  const int64_t n = w.columns;
  if (start || g % w.groups_per_d == 0) {
    AheadLines(reinterpret_cast<const uint8_t*>(w.d + (g / w.groups_per_d) * n + c0), 2 * width, 0, 1).IssueAll();
    if (w.dmin != nullptr) {
      AheadLines(reinterpret_cast<const uint8_t*>(w.dmin + (g / w.groups_per_d) * n + c0), 2 * width, 0, 1).IssueAll();
    }
  }
  if (w.sub_scales != nullptr) {
    AheadLines(static_cast<const uint8_t*>(w.sub_scales) + g * n + c0, width, 0, 1).IssueAll();
  }
  if (w.sub_mins != nullptr) AheadLines(w.sub_mins + g * n + c0, width, 0, 1).IssueAll();
}

// One or two rows: the planes of sub-block g (low, high) at columns c0 .. c0 + width as lines to prefetch.
void SubBlockLines(const Weight& w, int64_t g, int64_t c0, int64_t width, AheadLines lines[2]) {
  const int64_t n = w.columns, k0 = g * w.group;
  const int bits = HighBits(w.kind);
  lines[0] = AheadLines(w.low + (k0 / 2) * n + c0, width, n, w.group / 2);
  lines[1] = bits > 0 ? AheadLines(w.high + (k0 * bits / 8) * n + c0, width, n, w.group * bits / 8) : AheadLines();
}

// A work item: sub-blocks [g0, g1) of a weight's columns [c0, c0 + width), added into `target`.
struct Piece {
  const Weight* w;
  int64_t c0, width, g0, g1;
  Target target;
};

// One piece. `after`: the piece the same thread runs next (null: none), whose start this one prefetches while
// it ends; `first`: nothing before fetched this piece's start.
template <int Kind>
void ItemOfKind(const Piece& piece, const Rows& x, bool first, const Piece* after) {
  const Weight& w = *piece.w;
  const int64_t g0 = piece.g0, g1 = piece.g1, c0 = piece.c0, width = piece.width;
  const Target& target = piece.target;
#if JAXSERVE_KQ_AHEAD
  if (x.rows <= 2) {
    // the first sub-block at once where nothing fetched it; then each sub-block's tiles prefetch the next one,
    // and the last one's the first sub-block and scales of `after`, so that the memory latency of a piece's
    // start overlaps work (a call's first sub-block still waits: the kernel does not know the next call)
    AheadLines next[2];
    if (first) {
      SubBlockLines(w, g0, c0, width, next);
      next[0].IssueAll();
      next[1].IssueAll();
      PrefetchScales(w, g0, c0, width, true);
    }
    for (int64_t g = g0; g < g1; ++g) {
      if (g + 1 < g1) {
        PrefetchScales(w, g + 1, c0, width, false);
        SubBlockLines(w, g + 1, c0, width, next);
      } else if (after != nullptr) {
        PrefetchScales(*after->w, after->g0, after->c0, after->width, true);
        SubBlockLines(*after->w, after->g0, after->c0, after->width, next);
      } else {
        next[0] = next[1] = AheadLines();
      }
      if (x.rows == 2) {
        RowGroup<Kind, 2>(w, x, 0, g, c0, width, target, next);
      } else {
        RowGroup<Kind, 1>(w, x, 0, g, c0, width, target, next);
      }
    }
    return;
  }
#endif
#if defined(KQUANT_INT8)
  if (w.x_int8 != nullptr && x.rows > kTileRows) {
    ManyRowsItem<Kind>(w, *w.x_int8, g0, g1, c0, width, target);
    return;
  }
#endif
  (void)first;
  for (int64_t g = g0; g < g1; ++g) {
    // kPrefetchGroups sub-blocks ahead; past the piece's end, into `after`'s first ones
    const int64_t ahead = g + kPrefetchGroups;
    if (ahead < g1) {
      PrefetchSubBlock(w, ahead, c0, width);
    } else if (after != nullptr && after->g0 + (ahead - g1) < after->g1) {
      PrefetchSubBlock(*after->w, after->g0 + (ahead - g1), after->c0, after->width);
    }
    RowGroups<Kind>(w, x, 0, x.rows, g, c0, width, target);
  }
}

void Item(const Piece& piece, const Rows& x, bool first, const Piece* after) {
  switch (piece.w->kind) {
    case 4: ItemOfKind<4>(piece, x, first, after); break;
    case 5: ItemOfKind<5>(piece, x, first, after); break;
    case 6: ItemOfKind<6>(piece, x, first, after); break;
    case kQ5_0: ItemOfKind<kQ5_0>(piece, x, first, after); break;
    default: ItemOfKind<kQ5_1>(piece, x, first, after); break;
  }
}

// A call of up to kCallRows rows (a decode step, or a verify step of k + 1 rows per sequence), planned as a
// whole (cpu_call_plan.h, as the int8-dot kernel's): each weight in whole-row column blocks as a one-row call
// has them (up to kWideColumns, so that an item's planes are contiguous runs for the address-order prefetch:
// with 192-column blocks a one-row int8 walk read 0.25 of a stream, with whole rows 0.5-0.6, session 11), the
// blocks' bytes cut at sub-block boundaries into one contiguous run per worker, K split only where a run ends
// inside a block. More rows only split each piece along its columns (3 rows and more: up to kBlockColumns,
// the walk that prefetches kPrefetchGroups sub-blocks ahead at once), the same sub-blocks: a row's K sums are
// added in the same order in a call of 1 row as of 8 or 64 (session 16: a verify row computes what a decode
// row does, bit for bit). Planning weight by weight (2 x workers parts of K, each its own partial) started
// every part with a memory latency (issue 25).
struct CallPlan {
  std::vector<Piece> pieces;        // run by run, each run's pieces in the blocks' order
  std::vector<int64_t> run_starts;  // each run's first piece, then pieces.size()
  std::vector<float> partials;      // [rows, width] per piece that starts past its block's sub-block 0
};

// The bytes a sub-block of `width` columns reads: the planes, sc and m, and its share of d and dmin.
int64_t SubBlockBytes(const Weight& w, int64_t width) {
  const int64_t per_column = w.group / 2 + w.group * HighBits(w.kind) / 8 + (w.sub_scales != nullptr ? 1 : 0) +
                             (w.sub_mins != nullptr ? 1 : 0);
  const int64_t d_bytes = w.dmin != nullptr ? 4 : 2;  // per column and row of d (a super-block; Q5_0 / Q5_1: 32 k)
  return width * (per_column * w.groups_per_d + d_bytes) / w.groups_per_d;
}

// Block columns at most for `rows` rows: whole rows where one or two rows prefetch along them (ItemOfKind).
constexpr int64_t WidestColumns(int64_t rows) { return JAXSERVE_KQ_AHEAD && rows <= 2 ? kWideColumns : kBlockColumns; }

CallPlan PlanCall(const std::vector<Weight>& weights, int64_t depth, int64_t rows, int64_t num_workers) {
  std::vector<jaxserve_cpu::CallBlock> blocks;  // a one-row call's
  for (size_t i = 0; i < weights.size(); ++i) {
    const Weight& w = weights[i];
    const int64_t width = jaxserve_cpu::EvenBlockWidth(w.columns, WidestColumns(1), kMinBlockColumns);
    for (int64_t c0 = 0; c0 < w.columns; c0 += width) {
      const int64_t block_width = std::min(width, w.columns - c0);
      blocks.push_back({int64_t(i), c0, block_width, depth / w.group, SubBlockBytes(w, block_width)});
    }
  }
  const jaxserve_cpu::CallCut cut = jaxserve_cpu::SplitColumns(jaxserve_cpu::CutCall(blocks, 1, num_workers), rows,
                                                               WidestColumns(rows), kMinBlockColumns);
  CallPlan plan;
  plan.run_starts = cut.run_starts;
  plan.partials.assign(cut.partial_floats, 0.0f);
  for (const jaxserve_cpu::CallPiece& c : cut.pieces) {
    const Weight& w = weights[c.weight];
    const Target target = c.partial < 0 ? Target{w.out, w.columns, 0}
                                        : Target{plan.partials.data() + c.partial, c.width, c.c0};
    plan.pieces.push_back(Piece{&w, c.c0, c.width, c.g0, c.g1, target});
  }
  return plan;
}

// Run `run` of the plan: its pieces in order, each prefetching the next one's start.
void RunCallPieces(const CallPlan& plan, int64_t run, const Rows& x) {
  const int64_t begin = plan.run_starts[run], end = plan.run_starts[run + 1];
  for (int64_t i = begin; i < end; ++i) {
    Item(plan.pieces[i], x, i == begin, i + 1 < end ? &plan.pieces[i + 1] : nullptr);
  }
}

// The parts of K past a block's first added into the result, in K's order (a block's pieces are in K's order).
void AddPartials(const CallPlan& plan, int64_t rows) {
  for (const Piece& piece : plan.pieces) {
    if (piece.target.data == piece.w->out) continue;
    jaxserve_cpu::AddPartial(piece.target.data, rows, piece.width, piece.w->out + piece.c0, piece.w->columns);
  }
}

// More than kCallRows rows (prefill chunks): per weight, column blocks (narrower where there are too few for the
// threads), then parts of K along sub-blocks, each part past the first into its own [M, N] partial. The parts
// are not PlanCall's: a prefill row's sums may be added in another order than a decode row's (they agree to
// float rounding, not bits).
void PlanWeight(Weight& w, int64_t depth, int64_t num_workers) {
  const int64_t wanted = 2 * num_workers;
  int64_t width = kBlockColumns;
  if ((w.columns + width - 1) / width < wanted) {
    const int64_t even = (w.columns + wanted - 1) / wanted;
    width = std::min(kBlockColumns, (even + kMinBlockColumns - 1) / kMinBlockColumns * kMinBlockColumns);
  }
  w.block_columns = width;
  w.blocks = (w.columns + width - 1) / width;
  w.parts = 1;
  if (w.blocks < wanted) w.parts = std::min((wanted + w.blocks - 1) / w.blocks, depth / w.group);
}

void RunWeights(int64_t num_workers, std::vector<Weight>& weights, const Rows& x) {
  std::vector<int64_t> first_item;
  std::vector<std::vector<float>> partials(weights.size());  // parts beyond the first, where K is split
  int64_t num_items = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    Weight& w = weights[i];
    PlanWeight(w, x.depth, num_workers);
    first_item.push_back(num_items);
    num_items += w.blocks * w.parts;
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
    const Piece piece{&w, c0, width, g0, g1, Target{partial, w.columns, 0}};
    // (the prefetch runs on into the next part of K: a thread's next item is likely that one)
    const Piece after{&w, c0, width, g1, groups, Target{nullptr, 0, 0}};
    Item(piece, x, true, g1 < groups ? &after : nullptr);
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

void Run(int64_t num_workers, std::vector<Weight>& weights, const Rows& x) {
  for (Weight& w : weights) std::fill(w.out, w.out + x.rows * w.columns, 0.0f);
  if (x.rows > kCallRows) {
    RunWeights(num_workers, weights, x);
    return;
  }
  const CallPlan plan = PlanCall(weights, x.depth, x.rows, num_workers);
  const int64_t num_runs = int64_t(plan.run_starts.size()) - 1;
  jaxserve_cpu::RunItems(num_workers, num_runs, [&](int64_t, int64_t run) { RunCallPieces(plan, run, x); });
  AddPartials(plan, x.rows);
}

// Whether `buffer` is 2-d [rows, columns] of `type`.
bool Is(const ffi::AnyBuffer& buffer, ffi::DataType type, int64_t rows, int64_t columns) {
  const auto dims = buffer.dimensions();
  return buffer.element_type() == type && dims.size() == 2 && dims[0] == rows && dims[1] == columns;
}

constexpr int kArraysPerWeight = 6;  // low, high, sub_scales, sub_mins, d, dmin (dummies where a kind has none)

ffi::Error KQuantMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs arrays, ffi::RemainingRets outs,
                        ffi::Span<const int64_t> kinds, int64_t int8_activations) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return ffi::Error::InvalidArgument("kquant_matmul: x must be 2-d");
  const int64_t rows = x_dims[0], depth = x_dims[1];
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
#if defined(KQUANT_INT8)
  QuantizedRows x_int8;  // llama.cpp's arithmetic where asked for and this path has it; else x stays float
  if (int8_activations) {
    x_int8 = QuantizeRows(x_wide.data(), rows, depth);
    for (Weight& w : weights) w.x_int8 = &x_int8;
  }
#else
  (void)int8_activations;
#endif
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
                                  .Attr<ffi::Span<const int64_t>>("kinds")
                                  .Attr<int64_t>("int8_activations"));
