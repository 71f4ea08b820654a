// The int8-activation quantized kernel's (cpu_quantized_int8_dot.cc) walk over one chunk of a weight (32 k of
// a group, a block of columns) for up to 8 rows of x: exact int32 sums per chunk, scaled into the output
// (ChunkRows; one or two rows with a whole chunk's sums in registers, ChunkInRegisters). The problem it reads
// (Problem) and the weights' layout (Weight, the tiles' column order) are here too. Included once, by that
// file (after cpu_int8_dot_vectors.h and cpu_int8_dot_activations.h): its names live in the file's anonymous
// namespace.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "matmul/cpu_weight_basics.h"

namespace {

// The column (within its tile) whose sum sits at position `pos` of the tile's accumulators.
constexpr int ColumnInTile(int pos) {
#if defined(QDOT_X86)
  return (pos % kDwords) / 4 * 16 + 4 * (pos / kDwords) + pos % 4;
#else
  return pos;
#endif
}

constexpr int kRowGroup = 8;  // rows of x per walk over a chunk's weights
// Software prefetch this far ahead along the walk, into L2 (prefetcht1): a prefetcht0 from memory holds one
// of L1's few miss buffers for the whole memory latency, and one row's walk read 0.3 of a stream with t0
// against 0.5-0.55 with t1 (4-16 KiB ahead alike; issue 25).
constexpr int64_t kPrefetchBytes = 8192;

// One or two rows (ChunkInRegisters): the next chunk's weights are prefetched into L2 in ADDRESS order, a
// few lines per tile of this chunk (AheadLines), where they were prefetched tile by tile (the same 64 columns
// of the chunk's 32 rows, N bytes apart). Software prefetches in address order let one core keep more lines
// in flight: one thread, loads alone in a /tmp pattern bench, 0.57-0.70 -> 0.7-0.8 of a read stream on
// SmolLM2's layers (issue 25, session 11). Prefetching only every 2nd-16th line (to let the hardware
// streamer fill in) fell to 0.2-0.3: it does not train on software prefetches. A/B builds:
// -DJAXSERVE_QDOT_AHEAD=0 (the tile-by-tile prefetch), -DJAXSERVE_QDOT_LOCALITY=1 (prefetcht2).
#ifndef JAXSERVE_QDOT_AHEAD
#define JAXSERVE_QDOT_AHEAD 1
#endif
#ifndef JAXSERVE_QDOT_LOCALITY
#define JAXSERVE_QDOT_LOCALITY 2
#endif

// cpu_weight_basics.h's address-order prefetch
using AheadLines = jaxserve_cpu::AheadLines<JAXSERVE_QDOT_LOCALITY>;

struct Problem {
  const void* values;  // int8 [K, N] or uint8 [K / 2, N]; tiled: [N / 64, K / 32, chunk bytes] (cpu_int8_dot_tiles.h)
  FloatArray scales;   // [G, N]; tiled: [N / 64, G, 64]
  FloatArray mins;     // like scales; data null: none
  float* out;          // [M, N]
  const Activations* x;
  int64_t columns, depth, group, num_groups;
  int bits;
  int64_t block_columns, blocks, parts, row_blocks;  // the split into work items (Plan)
  bool tiled = false;                                // the weight in tiles (cpu_int8_dot_tiles.h)
  // Two-level scales (GGUF Q4_K / Q5_K, tiled only): scales and mins are uint8 sc and m per chunk, these the
  // float16 d and dmin per 8 chunks (a super-block) [N / 64, G / 8, 64]: scale d * sc, min -(dmin * m)
  // Q6_K (6-bit tiles): scales int8 sc per 16 k, two rows [N / 64, 2G, 64] per chunk, d per 8 chunks, no mins
  FloatArray super_scales = {}, super_mins = {};
  bool two_level() const { return super_scales.data != nullptr; }
};

// One stored weight as the signed integer it stands for (4-bit without mins: the nibble less 8).
template <int Bits>
inline int32_t Weight(const Problem& p, int64_t k, int64_t col) {
  if (Bits == 8) return static_cast<const int8_t*>(p.values)[k * p.columns + col];
  const uint8_t byte = static_cast<const uint8_t*>(p.values)[(k / 2) * p.columns + col];
  const int32_t nibble = k % 2 ? byte >> 4 : byte & 0x0F;
  return p.mins.data != nullptr ? nibble : nibble - 8;
}

// Position of column c (of the item's block, `vectors` of its columns in whole tiles) among the sums.
inline int64_t PositionOf(int64_t c, int64_t vectors) {
  if (c >= vectors) return c;
  int64_t in_tile = c % kTile;
  for (int pos = 0; pos < kTile; ++pos) {
    if (ColumnInTile(pos) == in_tile) return c - in_tile + pos;
  }
  return c;
}

#if defined(QDOT_X86)
// One or two rows of x (R) times one whole chunk (32 k, all in vector steps) of a block's whole tiles (the
// first `vectors` columns at s0, the chunk's first stored row): tile by tile, the tile's int32 sums stay in
// registers over the chunk's 32 weight rows, then go straight into `out` (rows `out_stride` apart, tile
// order), scaled. The row walk below stores and reloads its sums every 8 k and sets up each step anew; at
// one row that was a third of the instructions (issue 25). Prefetch: `next` (the next chunk), a share of
// its lines per tile, in address order.
template <int R, int Bits, bool HasMins>
void ChunkInRegisters(const uint8_t* s0, int64_t row_bytes, int64_t vectors, const int8_t* xq, int64_t depth,
                      const int32_t* start, const float* d, const float* d_sum, const float* scale,
                      const float* minimum, float* out, int64_t out_stride, AheadLines& next) {
  constexpr int kQuads = kChunk / 4;
  constexpr int64_t byte_rows = Bits == 8 ? kChunk : kChunk / 2;
  const int64_t ahead = byte_rows * row_bytes;
  AheadLines lines = next;  // (a local: kept in registers)
  for (int64_t c = 0; c < vectors; c += kTile) {
#if JAXSERVE_QDOT_AHEAD
    lines.IssueTile();
    (void)ahead;
#else
    (void)next;
    for (int64_t j = 0; j < byte_rows; ++j) __builtin_prefetch(s0 + ahead + j * row_bytes + c, 0, 2);
#endif
    VecI acc[R][4];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < 4; ++j) acc[r][j] = SplatInt(start[r]);
    }
#pragma GCC unroll 8
    for (int q = 0; q < kQuads; ++q) {
      VecI w[4];
      if constexpr (Bits == 8) {
        for (int j = 0; j < 4; ++j) w[j] = LoadBytes(s0 + (4 * q + j) * row_bytes + c);
      } else {
        const VecI low = SplatByte(0x0F);
        for (int j = 0; j < 2; ++j) {
          const VecI packed = LoadBytes(s0 + (2 * q + j) * row_bytes + c);
          w[2 * j] = And(packed, low);
          w[2 * j + 1] = And(ShiftRight4(packed), low);
        }
      }
      Interleave(w[0], w[1], w[2], w[3]);
      VecI xv[R];  // (broadcast here, not held over the chunk: 8 per row would take the registers the sums need)
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * depth + 4 * q, sizeof(four));
        xv[r] = SplatInt(four);
      }
      for (int j = 0; j < 4; ++j) {
        if constexpr (Bits == 8) w[j] = PrepareInt8(w[j]);
        for (int r = 0; r < R; ++r) {
          acc[r][j] = Bits == 8 ? DotInt8(acc[r][j], w[j], xv[r]) : DotUnsigned(acc[r][j], w[j], xv[r]);
          KeepInRegister(acc[r][j]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      float* o = out + r * out_stride + c;
      for (int j = 0; j < 4; ++j) {
        const int64_t at = c + j * kDwords;
        VecF v = Fma(ToFloat(acc[r][j]), Mul(SplatF(d[r]), LoadF(scale + at)), LoadF(o + j * kDwords));
        if constexpr (HasMins) v = Fma(SplatF(d_sum[r]), LoadF(minimum + at), v);
        StoreF(o + j * kDwords, v);
      }
    }
  }
}
#endif

// Up to 8 rows r0 .. r0 + R of x times chunk `chunk` (k in [k0, k1)) of the weight at columns
// [c0, c0 + width): exact int32 sums in `sums` [R, width] (tile order), then added into `out`'s rows (row r,
// the block's column j at out[r * out_stride + j]), scaled: float(sum) * d * scale (+ d * sum(q_x) * min).
template <int R, int Bits>
void ChunkRows(const Problem& p, int64_t r0, int64_t chunk, int64_t k0, int64_t k1, int64_t c0, int64_t width,
               const float* scale, const float* minimum, int32_t* sums, float* block_out, int64_t out_stride,
               AheadLines* next) {
  const Activations& x = *p.x;
  const int64_t depth = p.depth, row_bytes = p.columns;
  const int64_t vectors = width / kTile * kTile;
  const bool has_mins = p.mins.data != nullptr;
  // what the vector steps' arithmetic adds per unit of sum(q_x) beyond the signed product
#if defined(QDOT_X86)
  const int32_t offset = Bits == 8 ? kInt8Offset : (has_mins ? 0 : 8);
  const int64_t vector_end = k0 + (k1 - k0) / 4 * 4;  // k the vector steps take; the rest one by one
#endif
  const int8_t* xq = x.q.data() + r0 * depth;
  // per row: d, and d * sum(q_x) (for the mins)
  float d[R], d_sum[R];
  for (int r = 0; r < R; ++r) {
    d[r] = x.scale[(r0 + r) * x.chunks + chunk];
    d_sum[r] = has_mins ? x.sum[(r0 + r) * x.chunks + chunk] : 0.0f;
  }
  // the sums start at -offset * sum(q_x) over the vector steps' k (vector columns; the first step starts
  // from it), 0 elsewhere
  for (int r = 0; r < R; ++r) std::fill(sums + r * width + vectors, sums + (r + 1) * width, 0);
  const auto* base = static_cast<const uint8_t*>(p.values);
  // whether the vector columns are done: the last vector step scales its sums straight into out
  bool finished = false;
#if defined(QDOT_X86)
  int32_t start[R];
  for (int r = 0; r < R; ++r) {
    start[r] = 0;
    for (int64_t k = k0; k < vector_end; ++k) start[r] -= offset * xq[r * depth + k];
  }
  if (vector_end == k0) {
    for (int r = 0; r < R; ++r) std::fill(sums + r * width, sums + r * width + vectors, 0);
  }
  if constexpr (R <= 2) {
    if (k1 - k0 == kChunk) {  // a whole chunk (vector_end == k1): the tiles' sums in registers
      const uint8_t* s0 = base + (Bits == 8 ? k0 : k0 / 2) * row_bytes + c0;
      float* out = block_out + r0 * out_stride;
      if (has_mins) {
        ChunkInRegisters<R, Bits, true>(s0, row_bytes, vectors, xq + k0, depth, start, d, d_sum, scale, minimum,
                                        out, out_stride, *next);
      } else {
        ChunkInRegisters<R, Bits, false>(s0, row_bytes, vectors, xq + k0, depth, start, d, d_sum, scale, minimum,
                                         out, out_stride, *next);
      }
      finished = true;
    }
  }
  int64_t k = finished ? k1 : k0;  // (finished: the steps below have nothing left to do)
  // eight k per step (two interleaved quads) where the chunk has them, then four
  auto step = [&](auto quads_constant, auto first_constant, auto last_constant) {
    constexpr int Q = decltype(quads_constant)::value;
    constexpr bool First = decltype(first_constant)::value, Last = decltype(last_constant)::value;
    constexpr int64_t byte_rows = Bits == 8 ? 4 * Q : 2 * Q;
    const uint8_t* s0 = base + (Bits == 8 ? k : k / 2) * row_bytes + c0;
    const int64_t ahead_steps = std::max<int64_t>(1, (kPrefetchBytes + width * byte_rows - 1) / (width * byte_rows));
    const int64_t ahead = ahead_steps * byte_rows * row_bytes;
    VecI xv[R][Q];
    for (int r = 0; r < R; ++r) {
      for (int q = 0; q < Q; ++q) {
        int32_t four;
        std::memcpy(&four, xq + r * depth + k + 4 * q, sizeof(four));
        xv[r][q] = SplatInt(four);
      }
    }
    for (int64_t c = 0; c < vectors; c += kTile) {
      if (c % 64 == 0) {
        for (int64_t j = 0; j < byte_rows; ++j) __builtin_prefetch(s0 + ahead + j * row_bytes + c, 0, 2);
      }
      VecI w[4 * Q];
      if constexpr (Bits == 8) {
        for (int j = 0; j < 4 * Q; ++j) w[j] = LoadBytes(s0 + j * row_bytes + c);
      } else {
        const VecI low = SplatByte(0x0F);
        for (int j = 0; j < 2 * Q; ++j) {
          const VecI packed = LoadBytes(s0 + j * row_bytes + c);
          w[2 * j] = And(packed, low);
          w[2 * j + 1] = And(ShiftRight4(packed), low);
        }
      }
      for (int q = 0; q < Q; ++q) {
        Interleave(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
        if constexpr (Bits == 8) {
          for (int j = 0; j < 4; ++j) w[4 * q + j] = PrepareInt8(w[4 * q + j]);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t* sum = sums + r * width + c;
        float* out = block_out + (r0 + r) * out_stride + c;
        for (int j = 0; j < 4; ++j) {
          VecI a = First ? SplatInt(start[r]) : LoadInts(sum + j * kDwords);
          for (int q = 0; q < Q; ++q) {
            a = Bits == 8 ? DotInt8(a, w[4 * q + j], xv[r][q]) : DotUnsigned(a, w[4 * q + j], xv[r][q]);
          }
          if constexpr (Last) {
            const int64_t at = c + j * kDwords;
            VecF o = Fma(ToFloat(a), Mul(SplatF(d[r]), LoadF(scale + at)), LoadF(out + j * kDwords));
            if (has_mins) o = Fma(SplatF(d_sum[r]), LoadF(minimum + at), o);
            StoreF(out + j * kDwords, o);
          } else {
            StoreInts(sum + j * kDwords, a);
          }
        }
      }
    }
    k += 4 * Q;
  };
  using Yes = std::true_type;
  using No = std::false_type;
  // (instantiated sparingly: each variant is compiled for 8 row counts and 2 widths on 3 paths)
  const bool fuse = vector_end == k1;  // no k left for one-by-one sums after the vector steps
  if ((vector_end - k0) % 8 != 0 || vector_end - k0 == 8) {
    // a step of four, or a single step of eight: start from filled sums, scale in the pass below
    for (int r = 0; r < R; ++r) std::fill(sums + r * width, sums + r * width + vectors, start[r]);
    for (; k + 8 <= vector_end;) step(std::integral_constant<int, 2>(), No(), No());
    for (; k + 4 <= vector_end;) step(std::integral_constant<int, 1>(), No(), No());
  } else {
    while (k < vector_end) {
      if (k == k0) {
        step(std::integral_constant<int, 2>(), Yes(), No());
      } else if (fuse && k + 8 == vector_end) {
        step(std::integral_constant<int, 2>(), No(), Yes());
        finished = true;
      } else {
        step(std::integral_constant<int, 2>(), No(), No());
      }
    }
  }
  // the chunk's last k (fewer than four) of the vector columns
  for (; k < k1; ++k) {
    for (int64_t c = 0; c < vectors; ++c) {
      const int32_t w = Weight<Bits>(p, k, c0 + c);
      const int64_t pos = PositionOf(c, vectors);
      for (int r = 0; r < R; ++r) sums[r * width + pos] += w * xq[r * depth + k];
    }
  }
#else
  // portable: column order, int32 sums the compiler vectorizes
  for (int r = 0; r < R; ++r) std::fill(sums + r * width, sums + r * width + vectors, 0);
  for (int64_t k = k0; k < k1; ++k) {
    if (Bits == 8) {
      const int8_t* row = static_cast<const int8_t*>(p.values) + k * row_bytes + c0;
      for (int r = 0; r < R; ++r) {
        const int32_t xk = xq[r * depth + k];
        int32_t* __restrict s = sums + r * width;
#pragma omp simd
        for (int64_t c = 0; c < vectors; ++c) s[c] += int32_t(row[c]) * xk;
      }
    } else {
      const uint8_t* row = base + (k / 2) * row_bytes + c0;
      const int shift = k % 2 ? 4 : 0;
      const int32_t bias = has_mins ? 0 : 8;
      for (int r = 0; r < R; ++r) {
        const int32_t xk = xq[r * depth + k];
        int32_t* __restrict s = sums + r * width;
#pragma omp simd
        for (int64_t c = 0; c < vectors; ++c) s[c] += (int32_t((row[c] >> shift) & 0x0F) - bias) * xk;
      }
    }
  }
#endif
  // the block's last columns (N not a multiple of the tile), one at a time, in column order
  for (int64_t c = vectors; c < width; ++c) {
    for (int64_t kk = k0; kk < k1; ++kk) {
      const int32_t w = Weight<Bits>(p, kk, c0 + c);
      for (int r = 0; r < R; ++r) sums[r * width + c] += w * xq[r * depth + kk];
    }
  }
  const int64_t from = finished ? vectors : 0;  // what is left to scale into out
  for (int r = 0; r < R; ++r) {
    float* __restrict out = block_out + (r0 + r) * out_stride;
    const int32_t* __restrict sum = sums + r * width;
    const float dr = d[r], dr_sum = d_sum[r];
    if (has_mins) {
#pragma omp simd
      for (int64_t c = from; c < width; ++c) out[c] += float(sum[c]) * (dr * scale[c]) + dr_sum * minimum[c];
    } else {
#pragma omp simd
      for (int64_t c = from; c < width; ++c) out[c] += float(sum[c]) * (dr * scale[c]);
    }
  }
}

}  // namespace
