// A few rows times quantized weights with integer dot products (llama.cpp's arithmetic), as an XLA FFI
// custom call: out_i [M, N_i] float32 = x [M, K] @ w_i, w [K, N] = q * scales[k / G] (+ mins[k / G])
// (pallas_kernels/matmul/quantized.py's layout: q int8 [K, N], or 4-bit packed two rows to a byte [K / 2, N],
// low nibble row 2i, offset 8 where there are no mins). Same interface as cpu_quantized_matmul.cc (the
// float-widening kernel it replaces by default; the engine option quantized_activations=float picks that one).
//
// Why: widening every weight to float32 and doing an FMA runs at the float instruction rate, so int8 could
// never beat llama.cpp, which quantizes each row of x to int8 per 32-block of K (ggml's quantize_row_q8_0:
// d = max|x| / 127, q = round(x / d), ties away from zero) and does integer dot products, four int8 pairs
// per 32-bit lane and instruction, then one float multiply per block by (weight scale * d). Here too:
//  - x is quantized once per call, per "chunk": 32 consecutive k within a weight group (a group of 16, or
//    a per-channel group's last k, gives a shorter chunk). d and d * sum(q) are used rounded to float16,
//    as ggml's q8_0 / q8_1 blocks hold them (x itself is quantized with the float32 d, as there).
//  - each chunk's integer sums are exact int32; a chunk adds float(sum) * d * scale (+ d * sum(q_x) * min)
//    to the result, so the only other float rounding is that of these per-chunk products and their sum.
//  - AVX-512 VNNI: vpdpbusd takes u8 x s8. int8 weights are made unsigned (w ^ 0x80 = w + 128) and the
//    128 * sum(q_x) this adds is taken out through the accumulator's start; 4-bit nibbles are unsigned
//    already (the offset 8 is taken out the same way). Without VNNI (AVX2, or AVX-512BW alone):
//    vpmaddubsw + vpmaddwd, int8 through the sign trick (|w| x sign(x, w): |w| <= 128, no saturation).
//    Portable: plain int32 loops the compiler vectorizes.
//  - the layout is [K, N] (columns contiguous), the dot wants four k of one column in a 32-bit lane: four
//    weight rows of a tile of columns are interleaved in registers (two rounds of unpacks, within 128-bit
//    lanes), which leaves the tile's columns in a fixed order; scales are widened in that order and the
//    item's results put back in column order at its end.
// The walk over the weights is cpu_quantized_matmul.cc's: per work item a block of columns and a range of
// groups; within a chunk, weight rows eight at a time in address order (the int32 sums of up to 8 rows of
// x, [8, width], in L1), software prefetch ahead along the walk; the same thread split (column blocks, then
// parts of K summed in part order: deterministic). One or two rows take a whole chunk per tile with the sums
// in registers (ChunkInRegisters), and up to 8 rows read whole weight rows with the threads splitting K
// (Plan). The vector basics are in cpu_int8_dot_vectors.h.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <vector>

#include "cpu_int8_dot_vectors.h"
#include "matmul/cpu_weight_basics.h"
#include "cpu_workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The column (within its tile) whose sum sits at position `pos` of the tile's accumulators.
constexpr int ColumnInTile(int pos) {
#if defined(QDOT_X86)
  return (pos % kDwords) / 4 * 16 + 4 * (pos / kDwords) + pos % 4;
#else
  return pos;
#endif
}

constexpr int64_t kBlockColumns = 4096;   // an item's columns at most
constexpr int64_t kSumsBytes = 16 * 1024;  // an item's int32 sums [rows, width], in L1
constexpr int64_t kMinBlockColumns = 64;   // narrower blocks where a weight has too few columns for the threads
constexpr int64_t kMaxRows = 64;           // the wrapper sends no more
constexpr int kRowGroup = 8;               // rows of x per walk over a chunk's weights
constexpr int64_t kChunk = 32;             // k per activation scale (ggml's QK8_0)
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

// AheadLines, HalfToFloat, BFloat16ToFloat: cpu_weight_basics.h.
using AheadLines = jaxserve_cpu::AheadLines<JAXSERVE_QDOT_LOCALITY>;
using jaxserve_cpu::BFloat16ToFloat;
using jaxserve_cpu::HalfToFloat;

// A float array of one of the three widths, read as float32.
struct FloatArray {
  const void* data = nullptr;
  ffi::DataType type = ffi::DataType::F32;

  float At(int64_t i) const {
    switch (type) {
      case ffi::DataType::F16: return HalfToFloat(static_cast<const uint16_t*>(data)[i]);
      case ffi::DataType::BF16: return BFloat16ToFloat(static_cast<const uint16_t*>(data)[i]);
      default: return static_cast<const float*>(data)[i];
    }
  }

  void Widen(int64_t offset, int64_t count, float* out) const {
    switch (type) {
      case ffi::DataType::F16: {
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
      case ffi::DataType::BF16: {
        const auto* in = static_cast<const uint16_t*>(data) + offset;
        for (int64_t i = 0; i < count; ++i) out[i] = BFloat16ToFloat(in[i]);
        break;
      }
      default:
        std::memcpy(out, static_cast<const float*>(data) + offset, count * sizeof(float));
    }
  }

  // `count` values from `offset` in the sums' order: whole tiles (the first `vectors`) in tile order
  void WidenInTileOrder(int64_t offset, int64_t count, int64_t vectors, float* natural, float* out) const {
    Widen(offset, count, natural);
#if defined(QDOT_X86)
    for (int64_t t = 0; t < vectors; t += kTile) TileOrder(natural + t, out + t);
#else
    vectors = 0;  // portable tiles are in column order
#endif
    std::memcpy(out + vectors, natural + vectors, (count - vectors) * sizeof(float));
  }
};

// x quantized for one chunking (chunks of up to 32 k within groups of `group`).
struct Activations {
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> scale;   // [M, chunks]: d, as float16 holds it
  std::vector<float> sum;     // [M, chunks]: d * sum of q over the chunk, as float16 holds it
  int64_t chunks_per_group = 0, chunks = 0;
};

// ggml keeps a q8_0 / q8_1 block's d (and q8_1's s = d * sum q) in float16, and its dot products use those
// rounded values: doing the same makes the products equal llama.cpp's up to the order of additions (x is
// quantized with the float32 d, as there). Beyond float16's range the float32 value stays.
inline float AsHalf(float v) { return std::fabs(v) <= 65504.0f ? static_cast<float>(static_cast<_Float16>(v)) : v; }

// ggml's quantize_row_q8_0_ref (q8_1's s too) per chunk.
Activations Quantize(const std::vector<float>& x, int64_t rows, int64_t depth, int64_t group) {
  Activations a;
  a.chunks_per_group = (group + kChunk - 1) / kChunk;
  a.chunks = depth / group * a.chunks_per_group;
  a.q.resize(rows * depth);
  a.scale.resize(rows * a.chunks);
  a.sum.resize(rows * a.chunks);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < a.chunks; ++c) {
      const int64_t k0 = c / a.chunks_per_group * group + c % a.chunks_per_group * kChunk;
      const int64_t k1 = std::min(k0 + kChunk, c / a.chunks_per_group * group + group);
      const float* xr = x.data() + r * depth;
      float amax = 0.0f;
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(xr[k]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      int32_t sum = 0;
      for (int64_t k = k0; k < k1; ++k) {
        const int8_t q = int8_t(std::round(xr[k] * id));
        a.q[r * depth + k] = q;
        sum += q;
      }
      a.scale[r * a.chunks + c] = AsHalf(d);
      a.sum[r * a.chunks + c] = AsHalf(d * float(sum));
    }
  }
  return a;
}

struct Problem {
  const void* values;  // int8 [K, N] or uint8 [K / 2, N]
  FloatArray scales;   // [G, N]
  FloatArray mins;     // [G, N]; data null: none
  float* out;          // [M, N]
  const Activations* x;
  int64_t columns, depth, group, num_groups;
  int bits;
  int64_t block_columns, blocks, parts;  // the split into work items (Plan)
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
  VecI xv[R][kQuads];
  for (int r = 0; r < R; ++r) {
    for (int q = 0; q < kQuads; ++q) {
      int32_t four;
      std::memcpy(&four, xq + r * depth + 4 * q, sizeof(four));
      xv[r][q] = SplatInt(four);
    }
  }
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
      for (int j = 0; j < 4; ++j) {
        if constexpr (Bits == 8) w[j] = PrepareInt8(w[j]);
        for (int r = 0; r < R; ++r) {
          acc[r][j] = Bits == 8 ? DotInt8(acc[r][j], w[j], xv[r][q]) : DotUnsigned(acc[r][j], w[j], xv[r][q]);
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
// [c0, c0 + width): exact int32 sums in `sums` [R, width] (tile order), then added into `partial`'s rows,
// scaled: float(sum) * d * scale (+ d * sum(q_x) * min).
template <int R, int Bits>
void ChunkRows(const Problem& p, int64_t r0, int64_t chunk, int64_t k0, int64_t k1, int64_t c0, int64_t width,
               const float* scale, const float* minimum, int32_t* sums, float* partial, AheadLines* next) {
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
  // whether the vector columns are done: the last vector step scales its sums straight into partial
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
      float* out = partial + r0 * p.columns + c0;
      if (has_mins) {
        ChunkInRegisters<R, Bits, true>(s0, row_bytes, vectors, xq + k0, depth, start, d, d_sum, scale, minimum,
                                        out, p.columns, *next);
      } else {
        ChunkInRegisters<R, Bits, false>(s0, row_bytes, vectors, xq + k0, depth, start, d, d_sum, scale, minimum,
                                         out, p.columns, *next);
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
        float* out = partial + (r0 + r) * p.columns + c0 + c;
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
  const int64_t from = finished ? vectors : 0;  // what is left to scale into partial
  for (int r = 0; r < R; ++r) {
    float* __restrict out = partial + (r0 + r) * p.columns + c0;
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

// Block columns for `rows` rows of x: the int32 sums of up to 8 rows, [8, width], stay in L1.
inline int64_t BlockColumns(int64_t rows) {
  const int64_t fits = kSumsBytes / int64_t(sizeof(int32_t) * std::min<int64_t>(rows, kRowGroup));
  return std::min<int64_t>(kBlockColumns, fits / kMinBlockColumns * kMinBlockColumns);  // whole tiles
}

template <int Bits>
void Item(const Problem& p, int64_t rows, int64_t g0, int64_t g1, int64_t c0, int64_t width, float* partial) {
  alignas(64) float scale[kBlockColumns];
  alignas(64) float minimum[kBlockColumns];
  alignas(64) float natural[kBlockColumns];
  alignas(64) int32_t sums[kSumsBytes / sizeof(int32_t)];
  const int64_t vectors = width / kTile * kTile;
  // each position's column: tiles in their sums' order, the last columns in column order
  int64_t column_at[kTile];
  for (int pos = 0; pos < kTile; ++pos) column_at[pos] = ColumnInTile(pos);
  if (p.mins.data == nullptr) std::fill(minimum, minimum + width, 0.0f);
  const Activations& x = *p.x;
  const auto* base = static_cast<const uint8_t*>(p.values);
  const int64_t per_byte_row = Bits == 8 ? 1 : 2;  // k per stored row
  const int64_t tiles = vectors / kTile;
  // the chunk starting at k as lines to prefetch: past the item's end too (the threads take runs of
  // consecutive items, and with whole rows the next part of K follows in memory), not past the weight's
  auto chunk_lines = [&](int64_t k) {
    if (k >= p.depth) return AheadLines();
    const int64_t k_end = std::min(k + kChunk, (k / p.group + 1) * p.group);
    return AheadLines(base + k / per_byte_row * p.columns + c0, width, p.columns, (k_end - k) / per_byte_row, tiles);
  };
  if (JAXSERVE_QDOT_AHEAD && rows <= 2) {  // (ChunkInRegisters prefetches the chunks after the first)
    AheadLines first = chunk_lines(g0 * p.group);
    first.IssueAll();
  }
  const int64_t scale_bytes = p.scales.type == ffi::DataType::F32 ? 4 : 2;
  for (int64_t g = g0; g < g1; ++g) {
#if JAXSERVE_QDOT_AHEAD
    if (rows <= 2 && g + 1 < p.num_groups) {  // the next group's scales (and mins), in address order
      AheadLines(static_cast<const uint8_t*>(p.scales.data) + ((g + 1) * p.columns + c0) * scale_bytes,
                 width * scale_bytes, 0, 1, 1).IssueAll();
      if (p.mins.data != nullptr) {
        AheadLines(static_cast<const uint8_t*>(p.mins.data) + ((g + 1) * p.columns + c0) * scale_bytes,
                   width * scale_bytes, 0, 1, 1).IssueAll();
      }
    }
#endif
    p.scales.WidenInTileOrder(g * p.columns + c0, width, vectors, natural, scale);
    if (p.mins.data != nullptr) p.mins.WidenInTileOrder(g * p.columns + c0, width, vectors, natural, minimum);
    for (int64_t i = 0; i < x.chunks_per_group; ++i) {
      const int64_t chunk = g * x.chunks_per_group + i;
      const int64_t k0 = g * p.group + i * kChunk, k1 = std::min(k0 + kChunk, (g + 1) * p.group);
      AheadLines next = chunk_lines(k1);
      int64_t r0 = 0;
      for (; r0 + kRowGroup <= rows; r0 += kRowGroup) {
        ChunkRows<kRowGroup, Bits>(p, r0, chunk, k0, k1, c0, width, scale, minimum, sums, partial, &next);
      }
      switch (rows - r0) {
        case 7: ChunkRows<7, Bits>(p, r0, chunk, k0, k1, c0, width, scale, minimum, sums, partial, &next); break;
        case 6: ChunkRows<6, Bits>(p, r0, chunk, k0, k1, c0, width, scale, minimum, sums, partial, &next); break;
        case 5: ChunkRows<5, Bits>(p, r0, chunk, k0, k1, c0, width, scale, minimum, sums, partial, &next); break;
        case 4: ChunkRows<4, Bits>(p, r0, chunk, k0, k1, c0, width, scale, minimum, sums, partial, &next); break;
        case 3: ChunkRows<3, Bits>(p, r0, chunk, k0, k1, c0, width, scale, minimum, sums, partial, &next); break;
        case 2: ChunkRows<2, Bits>(p, r0, chunk, k0, k1, c0, width, scale, minimum, sums, partial, &next); break;
        case 1: ChunkRows<1, Bits>(p, r0, chunk, k0, k1, c0, width, scale, minimum, sums, partial, &next); break;
        default: break;
      }
    }
  }
  // the item's results back in column order
  alignas(64) float tile[kTile];
  for (int64_t r = 0; r < rows; ++r) {
    float* out = partial + r * p.columns + c0;
    for (int64_t t = 0; t < vectors; t += kTile) {
#if defined(QDOT_X86)
      FromTileOrder(out + t, tile);
      (void)column_at;
#else
      for (int pos = 0; pos < kTile; ++pos) tile[column_at[pos]] = out[t + pos];
#endif
      std::memcpy(out + t, tile, sizeof(tile));
    }
  }
}

// A weight's split: column blocks (narrower where there are too few for the threads), then parts of K.
void Plan(Problem& p, int64_t rows, int64_t num_workers) {
  const int64_t wanted = 2 * num_workers;  // two items per thread at least, so that a late helper gets its share
  const int64_t widest = BlockColumns(rows);
  int64_t width = widest;
  if (rows <= kRowGroup) {
    // Few rows: whole rows of the weight (blocks as even as whole tiles allow), the threads splitting K. A
    // block narrower than a row reads short runs N bytes apart that the hardware prefetchers lose, and pays
    // each chunk's fixed costs on fewer columns (one row: 0.2-0.3 of a read stream with 192-column blocks);
    // the parts' partial sums ([rows, N] floats each) cost little at these row counts.
    const int64_t blocks = (p.columns + widest - 1) / widest;
    width = ((p.columns + blocks - 1) / blocks + kMinBlockColumns - 1) / kMinBlockColumns * kMinBlockColumns;
  } else if ((p.columns + width - 1) / width < wanted) {
    const int64_t even = (p.columns + wanted - 1) / wanted;
    width = std::min(widest, std::max(kMinBlockColumns, (even + kMinBlockColumns - 1) / kMinBlockColumns * kMinBlockColumns));
  }
  p.block_columns = width;
  p.blocks = (p.columns + width - 1) / width;
  p.parts = 1;
  if (p.blocks < wanted) p.parts = std::min((wanted + p.blocks - 1) / p.blocks, p.num_groups);
}

void Run(int64_t num_workers, std::vector<Problem>& problems, int64_t rows) {
  std::vector<int64_t> first_item;  // each problem's first work item
  std::vector<std::vector<float>> partials(problems.size());  // parts beyond the first, where K is split
  int64_t num_items = 0;
  for (size_t i = 0; i < problems.size(); ++i) {
    Problem& p = problems[i];
    Plan(p, rows, num_workers);
    first_item.push_back(num_items);
    num_items += p.blocks * p.parts;
    std::fill(p.out, p.out + rows * p.columns, 0.0f);
    if (p.parts > 1) partials[i].assign((p.parts - 1) * rows * p.columns, 0.0f);
  }
  jaxserve_cpu::RunItems(num_workers, num_items, [&](int64_t, int64_t item) {
    const size_t i = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
    const Problem& p = problems[i];
    const int64_t local = item - first_item[i];
    const int64_t block = local % p.blocks, part = local / p.blocks;
    const int64_t c0 = block * p.block_columns, width = std::min(p.block_columns, p.columns - c0);
    const int64_t g0 = p.num_groups * part / p.parts, g1 = p.num_groups * (part + 1) / p.parts;
    float* partial = part == 0 ? p.out : partials[i].data() + (part - 1) * rows * p.columns;
    if (p.bits == 8) {
      Item<8>(p, rows, g0, g1, c0, width, partial);
    } else {
      Item<4>(p, rows, g0, g1, c0, width, partial);
    }
  });
  for (size_t i = 0; i < problems.size(); ++i) {
    const Problem& p = problems[i];
    const int64_t size = rows * p.columns;
    for (int64_t part = 1; part < p.parts; ++part) {
      const float* from = partials[i].data() + (part - 1) * size;
#pragma omp simd
      for (int64_t j = 0; j < size; ++j) p.out[j] += from[j];
    }
  }
}

ffi::Error QuantizedInt8Dot(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs arrays, ffi::RemainingRets outs,
                            ffi::Span<const int64_t> bits, ffi::Span<const int64_t> has_mins) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return ffi::Error::InvalidArgument("quantized_int8_dot: x must be 2-d");
  const int64_t rows = x_dims[0], depth = x_dims[1];
  if (rows > kMaxRows) return ffi::Error::InvalidArgument("quantized_int8_dot: too many rows");
  const size_t count = outs.size();
  if (count == 0 || arrays.size() != 3 * count || bits.size() != count || has_mins.size() != count) {
    return ffi::Error::InvalidArgument("quantized_int8_dot: values, scales and mins, bits and has_mins per result");
  }
  std::vector<Problem> problems;
  for (size_t i = 0; i < count; ++i) {
    auto values = arrays.get<ffi::AnyBuffer>(3 * i);
    auto scales = arrays.get<ffi::AnyBuffer>(3 * i + 1);
    auto mins = arrays.get<ffi::AnyBuffer>(3 * i + 2);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!values.has_value() || !scales.has_value() || !mins.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument("quantized_int8_dot: bad weight or result");
    }
    const auto v_dims = values->dimensions(), s_dims = scales->dimensions(), m_dims = mins->dimensions();
    if (v_dims.size() != 2 || s_dims.size() != 2) {
      return ffi::Error::InvalidArgument("quantized_int8_dot: values and scales must be 2-d");
    }
    if (bits[i] != 8 && bits[i] != 4) return ffi::Error::InvalidArgument("quantized_int8_dot: bits must be 8 or 4");
    const int64_t columns = v_dims[1], num_groups = s_dims[0];
    const ffi::DataType value_type = bits[i] == 8 ? ffi::DataType::S8 : ffi::DataType::U8;
    if (values->element_type() != value_type || v_dims[0] * (8 / bits[i]) != depth || s_dims[1] != columns ||
        num_groups < 1 || depth % num_groups || (bits[i] == 4 && (depth / num_groups) % 2) ||
        (*out)->element_count() != size_t(rows * columns)) {
      return ffi::Error::InvalidArgument("quantized_int8_dot: inconsistent shapes or types");
    }
    if (has_mins[i] && (m_dims.size() != 2 || m_dims[0] != num_groups || m_dims[1] != columns ||
                        mins->element_type() != scales->element_type())) {
      return ffi::Error::InvalidArgument("quantized_int8_dot: mins must be shaped and typed as scales");
    }
    problems.push_back(Problem{values->untyped_data(),
                               FloatArray{scales->untyped_data(), scales->element_type()},
                               FloatArray{has_mins[i] ? mins->untyped_data() : nullptr, mins->element_type()},
                               (*out)->typed_data(),
                               nullptr,
                               columns,
                               depth,
                               depth / num_groups,
                               num_groups,
                               int(bits[i]),
                               0,
                               0,
                               0});
  }
  std::vector<float> x_wide(rows * depth);
  const FloatArray x_array{x.untyped_data(), x.element_type()};
  for (int64_t i = 0; i < rows * depth; ++i) x_wide[i] = x_array.At(i);
  std::map<int64_t, Activations> by_group;  // x quantized once per chunking (weights of one group size share)
  for (Problem& p : problems) {
    auto found = by_group.find(p.group);
    if (found == by_group.end()) found = by_group.emplace(p.group, Quantize(x_wide, rows, depth, p.group)).first;
    p.x = &found->second;
  }
  Run(std::max<int64_t>(1, pool.num_threads()), problems, rows);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantizedInt8Dot, QuantizedInt8Dot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("bits")
                                  .Attr<ffi::Span<const int64_t>>("has_mins"));
