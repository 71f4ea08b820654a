// The int8-activation quantized kernel's (cpu_quantized_int8_dot.cc) walk over a weight stored in TILES
// (pallas_kernels/matmul/quantized_tiles.py builds them at load): per 64 columns and 32 k (a chunk) one
// contiguous block in which the four k of one column that a dot product takes in a 32-bit lane are adjacent:
//   8-bit: [quad 8][column 64][k 4]              (2048 bytes: byte 256 q + 4 c + b is k 4q + b of column c)
//   4-bit: [pair 4][column 64][byte 4]           (1024 bytes: byte b's low nibble is k 8p + b, its high 8p + 4 + b)
//   5-bit: the 4-bit block of the values' low 4 bits, then [column 64][byte 4] (256 bytes) of their bit 4:
//          byte 4c + b's bit 2p + h is that of k 8p + 4h + b (GGUF Q5_0 / Q5_1: 1280 bytes, the file's bytes)
// blocks [N / 64, K / 32] (tile-major: a tile's chunks in K's order), scales and mins [N / 64, G, 64].
// Two-level scales (GGUF Q4_K as 4-bit, Q5_K as 5-bit): scales and mins uint8 sc and m per chunk, d and dmin
// float16 per super-block of 8 chunks [N / 64, G / 8, 64]; a chunk's scale is d * sc and its min -(dmin * m),
// formed in float32 as ggml forms them (exact).
//   6-bit (GGUF Q6_K): the 4-bit block of the low nibbles, then two 256-byte blocks of bits 4-5: byte 4c + b of
//          block s / 4 holds at bits 2 (s % 4) .. +1 those of k 8p + 4h + b (s = 2p + h); 1536 bytes. Offset 32;
//          int8 sc per 16 k (two scale rows a chunk: [N / 64, 2 (K / 32), 64]), float16 d per 8 chunks, no mins.
//
// Why: on the [K, N] layout each four weight rows are interleaved in registers (two rounds of unpacks, and for
// 4-bit a mask and shift per row) before a dot product can take them; without VNNI that made one row's walk
// bound by its instructions, not by memory (an AVX2 AMD EPYC: cache-hot Q4_0 layers 6.0-7.3 ms against 2.8-3.3
// from this layout, from memory Q8_0 11.3 vs 8.2-8.6, issue 25, bench/cpu_int8_dot_repacked.cc). Here a load
// is a dot product's operand as it is (8-bit), or after one mask (low nibbles) or a shift and a mask (high),
// the tile's columns stay in column order (no tile order to undo), and a tile's chunks are one sequential run
// of memory. The sums are the [K, N] walk's exactly: the same int32 sums per chunk (start -offset * sum(q_x)),
// the same float expression per chunk in K's order, so a weight gives the same bits in either layout, at any
// rows (a row's result does not depend on the call's rows: cpu_quantized_int8_dot.cc's row invariance).
// Included once, by that file (after cpu_int8_dot_chunks.h): its names live in the file's anonymous namespace.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kTiledColumns = 64;  // a tile's columns (quantized_tiles.py's TILE_COLUMNS)
#ifndef JAXSERVE_TILED_AHEAD
#define JAXSERVE_TILED_AHEAD 2048
#endif
#ifndef JAXSERVE_TILED_STEP
#define JAXSERVE_TILED_STEP 64
#endif
constexpr int64_t kTiledAheadBytes = JAXSERVE_TILED_AHEAD;  // software prefetch this far ahead along a tile's run
constexpr int64_t kTiledPrefetchStep = JAXSERVE_TILED_STEP;  // one line of every this many bytes

#if defined(QDOT_X86)
constexpr int32_t TiledInt8Offset() { return kInt8Offset; }
#else
constexpr int32_t TiledInt8Offset() { return 0; }
#endif
constexpr int64_t kChunksPerSuperBlock = 8;  // a K-quant super-block's 256 k (two-level scales)
constexpr int64_t kTiledHighAt = kTiledColumns * kChunk / 2;  // a 5-bit chunk's plane of bit 4, after the nibbles
constexpr int64_t TiledChunkBytes(int bits) { return kTiledColumns * kChunk * bits / 8; }  // 8: 2048, 4: 1024, 5: 1280
// What the dot products add per unit of sum(q_x) beyond the signed product: taken out through the start
constexpr int32_t TiledOffset(int bits, bool has_mins) {
  return bits == 8 ? TiledInt8Offset() : has_mins ? 0 : bits == 6 ? 32 : bits == 5 ? 16 : 8;
}

#if defined(QDOT_X86) && !defined(QDOT_VNNI)
// 4-bit without VNNI: a vpmaddubsw's int16 pair sums of nibbles (0..15) and x (|q_x| <= 127) are at most 3810 in
// magnitude, so a chunk's eight of them (4 pairs of bytes, low and high nibbles) add up in int16 (30480 < 32767)
// and widen to int32 once (one vpmaddwd and add per chunk, where DotUnsigned pays them per product): the same
// exact integers, ~30% fewer instructions (8-bit's sign trick reaches 32512 a pair: no room, it stays per product).
// 5-bit values (0..31) reach 7874 a product pair: they widen every two pairs (31496).
#define QDOT_NIBBLE_PAIRS16 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline VecI PairProducts(VecI u, VecI s) { return _mm512_maddubs_epi16(u, s); }
inline VecI Add16(VecI a, VecI b) { return _mm512_add_epi16(a, b); }
inline VecI WidenPairs(VecI acc, VecI pairs) { return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1))); }
inline VecI ZeroInts() { return _mm512_setzero_si512(); }
#else
inline VecI PairProducts(VecI u, VecI s) { return _mm256_maddubs_epi16(u, s); }
inline VecI Add16(VecI a, VecI b) { return _mm256_add_epi16(a, b); }
inline VecI WidenPairs(VecI acc, VecI pairs) { return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))); }
inline VecI ZeroInts() { return _mm256_setzero_si256(); }
#endif
#endif

#if defined(QDOT_X86)
// Bit s (0..7) of each byte of a 5-bit chunk's high plane moved to bit 4, the others cleared: 16-bit shifts, left
// by at most 4 or right by at most 3, never bring another byte's bit to a bit 4 (s is a constant once unrolled).
inline VecI HighBitAtFour(VecI high, int s) {
  return And(s <= 4 ? ShiftLeft16(high, 4 - s) : ShiftRight16(high, s - 4), SplatByte(0x10));
}
// Bits 2 t .. 2 t + 1 (t 0..3) of each byte of a 6-bit chunk's high block moved to bits 4-5, the others cleared
// (as HighBitAtFour: left by at most 4, right by 2, within each byte)
inline VecI HighBitsAtFour(VecI high, int t) {
  return And(t <= 2 ? ShiftLeft16(high, 4 - 2 * t) : ShiftRight16(high, 2 * t - 4), SplatByte(0x30));
}
// The nibble vectors of pair `pair` of a chunk with their high bits (5-bit: bit 4; 6-bit: bits 4-5), in place
template <int Bits>
inline void AddHighBits(const uint8_t* block, int64_t vector_at, int pair, VecI& lo, VecI& hi) {
  if constexpr (Bits == 5) {
    const VecI high = LoadBytes(block + kTiledHighAt + vector_at);
    lo = Or(lo, HighBitAtFour(high, 2 * pair));
    hi = Or(hi, HighBitAtFour(high, 2 * pair + 1));
  } else if constexpr (Bits == 6) {  // s = 2 pair + h: block s / 4 = pair / 2, bits 2 (s % 4)
    const VecI high = LoadBytes(block + kTiledHighAt + (pair / 2) * 4 * kTiledColumns + vector_at);
    lo = Or(lo, HighBitsAtFour(high, (2 * pair) % 4));
    hi = Or(hi, HighBitsAtFour(high, (2 * pair + 1) % 4));
  }
}
// Pairs whose int16 products a chunk sums before widening (QDOT_NIBBLE_PAIRS16): 6-bit values reach 16002 a
// product pair, so a pair's two (32004) widen at once
constexpr int PairsPerWidening(int bits) { return bits == 6 ? 1 : bits == 5 ? 2 : 4; }

constexpr int kTiledVectors = int(kTiledColumns * 4 / sizeof(VecI));  // a quad's (or pair's) vectors: 8 avx2, 4 avx512
constexpr int kTiledLanes = int(sizeof(VecI) / 4);                    // columns per vector

// Rows of x (R, `xq` the first's chunk, rows `depth` apart) times one chunk `block` of a tile: the int32 sums of J
// vectors of columns at a time in registers over the chunk's 32 k, then scaled into `out` (rows `out_stride`
// apart, the tile's 64 columns in order): out += float(sum) * (d * scale) (+ d * sum(q_x) * min). 6-bit: the
// chunk's first 16 k are summed and scaled (`scale`) apart from its last 16 (`start_hi`, `scale_hi`).
template <int R, int J, int Bits, bool HasMins>
inline void TiledChunkRows(const uint8_t* block, const int8_t* xq, int64_t depth, const int32_t* start, const float* d,
                           const float* d_sum, const float* scale, const float* minimum, float* out,
                           int64_t out_stride, const int32_t* start_hi = nullptr, const float* scale_hi = nullptr) {
  for (int j0 = 0; j0 < kTiledVectors; j0 += J) {
    VecI acc[R][J];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < J; ++j) acc[r][j] = SplatInt(start[r]);
    }
    // the sums so far scaled into out (6-bit: the first half's, then the rest)
    auto flush = [&](const float* scales) {
      for (int r = 0; r < R; ++r) {
        float* o = out + r * out_stride;
        for (int j = 0; j < J; ++j) {
          const int64_t at = (j0 + j) * kTiledLanes;
          VecF v = Fma(ToFloat(acc[r][j]), Mul(SplatF(d[r]), LoadF(scales + at)), LoadF(o + at));
          if constexpr (HasMins) v = Fma(SplatF(d_sum[r]), LoadF(minimum + at), v);
          StoreF(o + at, v);
        }
      }
    };
    if constexpr (Bits == 8) {
#pragma GCC unroll 8
      for (int q = 0; q < int(kChunk / 4); ++q) {
        for (int j = 0; j < J; ++j) {
          const VecI w = PrepareInt8(LoadBytes(block + q * 4 * kTiledColumns + (j0 + j) * int(sizeof(VecI))));
          for (int r = 0; r < R; ++r) {
            int32_t four;
            std::memcpy(&four, xq + r * depth + 4 * q, sizeof(four));
            acc[r][j] = DotInt8(acc[r][j], w, SplatInt(four));
          }
        }
      }
    } else {
      const VecI low = SplatByte(0x0F);
#if defined(QDOT_NIBBLE_PAIRS16)
      VecI pairs[R][J];
      for (int r = 0; r < R; ++r) {
        for (int j = 0; j < J; ++j) pairs[r][j] = ZeroInts();
      }
#endif
#pragma GCC unroll 4
      for (int pair = 0; pair < int(kChunk / 8); ++pair) {
        for (int j = 0; j < J; ++j) {
          const VecI packed = LoadBytes(block + pair * 4 * kTiledColumns + (j0 + j) * int(sizeof(VecI)));
          VecI lo = And(packed, low), hi = And(ShiftRight4(packed), low);
          AddHighBits<Bits>(block, (j0 + j) * int(sizeof(VecI)), pair, lo, hi);
          for (int r = 0; r < R; ++r) {
            int32_t four_lo, four_hi;
            std::memcpy(&four_lo, xq + r * depth + 8 * pair, sizeof(four_lo));
            std::memcpy(&four_hi, xq + r * depth + 8 * pair + 4, sizeof(four_hi));
#if defined(QDOT_NIBBLE_PAIRS16)
            pairs[r][j] = Add16(pairs[r][j], Add16(PairProducts(lo, SplatInt(four_lo)), PairProducts(hi, SplatInt(four_hi))));
#else
            acc[r][j] = DotUnsigned(DotUnsigned(acc[r][j], lo, SplatInt(four_lo)), hi, SplatInt(four_hi));
#endif
          }
        }
#if defined(QDOT_NIBBLE_PAIRS16)
        if ((pair + 1) % PairsPerWidening(Bits) == 0) {
          for (int r = 0; r < R; ++r) {
            for (int j = 0; j < J; ++j) {
              acc[r][j] = WidenPairs(acc[r][j], pairs[r][j]);
              pairs[r][j] = ZeroInts();
            }
          }
        }
#endif
        if constexpr (Bits == 6) {
          if (pair == 1) {  // the first sub-block of 16 ends
            flush(scale);
            for (int r = 0; r < R; ++r) {
              for (int j = 0; j < J; ++j) acc[r][j] = SplatInt(start_hi[r]);
            }
          }
        }
      }
    }
    flush(Bits == 6 ? scale_hi : scale);
  }
}

// kTiledLanes scales (or mins) of one of the three widths (or uint8 sub-block scales) from `data` + offset, as
// float32
template <ffi::DataType Type>
inline VecF LoadScales(const void* data, int64_t offset) {
  if constexpr (Type == ffi::DataType::F32) {
    return LoadF(static_cast<const float*>(data) + offset);
  } else if constexpr (Type == ffi::DataType::S8) {
    const auto* in = static_cast<const int8_t*>(data) + offset;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in))));
#else
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in))));
#endif
  } else if constexpr (Type == ffi::DataType::U8) {
    const auto* in = static_cast<const uint8_t*>(data) + offset;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in))));
#else
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in))));
#endif
  } else {
    const auto* in = static_cast<const uint16_t*>(data) + offset;
#if defined(__AVX512F__) && defined(__AVX512BW__)  // (VecF's own condition: cpu_int8_dot_vectors.h)
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in));
    if constexpr (Type == ffi::DataType::F16) return _mm512_cvtph_ps(halves);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
#else
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in));
    if constexpr (Type == ffi::DataType::BF16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
    } else {
#if defined(__F16C__)
      return _mm256_cvtph_ps(halves);
#else
      alignas(32) float wide[kTiledLanes];
      for (int i = 0; i < kTiledLanes; ++i) wide[i] = jaxserve_cpu::HalfToFloat(in[i]);
      return LoadF(wide);
#endif
    }
#endif
  }
}

// ONE row of x times a tile's chunks of groups [g0, g1) (the decode step's single stream): the tile's 64 float
// results stay in registers over the whole run and each chunk's scales are widened as they are used, where a
// chunk of the rows walk (TiledChunkRows) loads and stores the results and reads widened scales (1.3x the
// instructions, which on AVX2 without VNNI a one-row walk cannot hide behind memory).
template <int Bits, bool HasMins, ffi::DataType ScaleType>
void TiledRowRun(const Problem& p, int64_t t, int64_t g0, int64_t g1, int64_t row, float* out) {
  const Activations& x = *p.x;
  const int64_t chunk_bytes = TiledChunkBytes(Bits), tile_chunks = p.depth / kChunk;
  const auto* values = static_cast<const uint8_t*>(p.values);
  const int32_t offset = TiledOffset(Bits, HasMins);
  const int8_t* xrow = x.q.data() + row * p.depth;
  VecF o[kTiledVectors];
  for (int j = 0; j < kTiledVectors; ++j) o[j] = LoadF(out + j * kTiledLanes);
  // d * sc, -(dmin * m) (Q4_K, Q5_K: uint8 sc and m); Q6_K: d * sc, int8 sc per 16 k
  constexpr bool kTwoLevel = ScaleType == ffi::DataType::U8 || ScaleType == ffi::DataType::S8;
  constexpr int64_t kScaleRows = Bits == 6 ? 2 : 1;  // scale rows a chunk
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t scale_at = (t * p.num_groups + g) * kScaleRows * kTiledColumns;
    const int64_t super_at = (t * (p.num_groups / kChunksPerSuperBlock) + g / kChunksPerSuperBlock) * kTiledColumns;
    for (int64_t i = 0; i < x.chunks_per_group; ++i) {
      const int64_t chunk = g * x.chunks_per_group + i;
      const uint8_t* block = values + (t * tile_chunks + chunk) * chunk_bytes;
      for (int64_t line = 0; line < chunk_bytes; line += kTiledPrefetchStep) __builtin_prefetch(block + kTiledAheadBytes + line, 0, 2);
      const int8_t* xq = xrow + chunk * kChunk;
      VecI acc[kTiledVectors];
      const int32_t qsum = x.qsum[row * x.chunks + chunk];
      const int32_t qsum_first = Bits == 6 ? x.qsum16[row * x.chunks + chunk] : qsum;  // (6-bit: k 0-15's)
      for (int j = 0; j < kTiledVectors; ++j) acc[j] = SplatInt(-offset * qsum_first);
      // (two-level: d and sums in float32, as ggml's q8_K for K-quant dots; else q8_0 / q8_1's float16 ones)
      const VecF d = SplatF((kTwoLevel ? x.scale32 : x.scale)[row * x.chunks + chunk]);
      auto chunk_scale = [&](int j, int64_t row_at) {
        VecF scale = LoadScales<ScaleType>(p.scales.data, row_at + j * kTiledLanes);
        if constexpr (kTwoLevel) {
          scale = Mul(LoadScales<ffi::DataType::F16>(p.super_scales.data, super_at + j * kTiledLanes), scale);
        }
        return scale;
      };
      if constexpr (Bits == 8) {
#pragma GCC unroll 8
        for (int q = 0; q < int(kChunk / 4); ++q) {
          int32_t four;
          std::memcpy(&four, xq + 4 * q, sizeof(four));
          const VecI xv = SplatInt(four);
          for (int j = 0; j < kTiledVectors; ++j) {
            acc[j] = DotInt8(acc[j], PrepareInt8(LoadBytes(block + q * 4 * kTiledColumns + j * int(sizeof(VecI)))), xv);
          }
        }
      } else {
        const VecI low = SplatByte(0x0F);
#if defined(QDOT_NIBBLE_PAIRS16)
        VecI pairs[kTiledVectors];
        for (int j = 0; j < kTiledVectors; ++j) pairs[j] = ZeroInts();
#endif
#pragma GCC unroll 4
        for (int pair = 0; pair < int(kChunk / 8); ++pair) {
          int32_t four_lo, four_hi;
          std::memcpy(&four_lo, xq + 8 * pair, sizeof(four_lo));
          std::memcpy(&four_hi, xq + 8 * pair + 4, sizeof(four_hi));
          const VecI x_lo = SplatInt(four_lo), x_hi = SplatInt(four_hi);
          for (int j = 0; j < kTiledVectors; ++j) {
            const VecI packed = LoadBytes(block + pair * 4 * kTiledColumns + j * int(sizeof(VecI)));
            VecI lo = And(packed, low), hi = And(ShiftRight4(packed), low);
            AddHighBits<Bits>(block, j * int(sizeof(VecI)), pair, lo, hi);
#if defined(QDOT_NIBBLE_PAIRS16)
            pairs[j] = Add16(pairs[j], Add16(PairProducts(lo, x_lo), PairProducts(hi, x_hi)));
#else
            acc[j] = DotUnsigned(DotUnsigned(acc[j], lo, x_lo), hi, x_hi);
#endif
          }
#if defined(QDOT_NIBBLE_PAIRS16)
          if ((pair + 1) % PairsPerWidening(Bits) == 0) {
            for (int j = 0; j < kTiledVectors; ++j) {
              acc[j] = WidenPairs(acc[j], pairs[j]);
              pairs[j] = ZeroInts();
            }
          }
#endif
          if constexpr (Bits == 6) {
            if (pair == 1) {  // the first sub-block of 16 ends: scaled by its own sc, the second's sums start
              for (int j = 0; j < kTiledVectors; ++j) {
                o[j] = Fma(ToFloat(acc[j]), Mul(d, chunk_scale(j, scale_at)), o[j]);
                acc[j] = SplatInt(-offset * (qsum - qsum_first));
              }
            }
          }
        }
      }
      for (int j = 0; j < kTiledVectors; ++j) {
        o[j] = Fma(ToFloat(acc[j]), Mul(d, chunk_scale(j, scale_at + (kScaleRows - 1) * kTiledColumns)), o[j]);
        if constexpr (HasMins) {
          VecF minimum = LoadScales<ScaleType>(p.mins.data, scale_at + j * kTiledLanes);
          float d_sum = (kTwoLevel ? x.sum32 : x.sum)[row * x.chunks + chunk];
          if constexpr (kTwoLevel) {  // -(dmin * m): the sign carried by d_sum (exact)
            minimum = Mul(LoadScales<ffi::DataType::F16>(p.super_mins.data, super_at + j * kTiledLanes), minimum);
            d_sum = -d_sum;
          }
          o[j] = Fma(SplatF(d_sum), minimum, o[j]);
        }
      }
    }
  }
  for (int j = 0; j < kTiledVectors; ++j) StoreF(out + j * kTiledLanes, o[j]);
}

// TiledRowRun for the problem's scale width and mins.
template <int Bits>
void TiledRow(const Problem& p, int64_t t, int64_t g0, int64_t g1, int64_t row, float* out) {
  const bool mins = p.mins.data != nullptr;
  switch (p.scales.type) {
    case ffi::DataType::U8:  // two-level (Q4_K, Q5_K: always with mins)
      return TiledRowRun<Bits, true, ffi::DataType::U8>(p, t, g0, g1, row, out);
    case ffi::DataType::S8:  // Q6_K (no mins)
      return TiledRowRun<Bits, false, ffi::DataType::S8>(p, t, g0, g1, row, out);
    case ffi::DataType::F16:
      return mins ? TiledRowRun<Bits, true, ffi::DataType::F16>(p, t, g0, g1, row, out)
                  : TiledRowRun<Bits, false, ffi::DataType::F16>(p, t, g0, g1, row, out);
    case ffi::DataType::BF16:
      return mins ? TiledRowRun<Bits, true, ffi::DataType::BF16>(p, t, g0, g1, row, out)
                  : TiledRowRun<Bits, false, ffi::DataType::BF16>(p, t, g0, g1, row, out);
    default:
      return mins ? TiledRowRun<Bits, true, ffi::DataType::F32>(p, t, g0, g1, row, out)
                  : TiledRowRun<Bits, false, ffi::DataType::F32>(p, t, g0, g1, row, out);
  }
}
#endif

// Rows [r0, r0 + R) times chunk `chunk` of a tile (`block`), into the tile's 64 columns of `out`.
template <int R, int Bits>
inline void TiledChunk(const Problem& p, const uint8_t* block, int64_t r0, int64_t chunk, const float* scale,
                       const float* minimum, float* out, int64_t out_stride, const float* scale_hi) {
  const Activations& x = *p.x;
  const bool has_mins = p.mins.data != nullptr;
  const int8_t* xq = x.q.data() + r0 * p.depth + chunk * kChunk;
  float d[R], d_sum[R];
  const std::vector<float>& scales = p.two_level() ? x.scale32 : x.scale;  // (as TiledRowRun)
  const std::vector<float>& sums = p.two_level() ? x.sum32 : x.sum;
  for (int r = 0; r < R; ++r) {
    d[r] = scales[(r0 + r) * x.chunks + chunk];
    d_sum[r] = has_mins ? sums[(r0 + r) * x.chunks + chunk] : 0.0f;
  }
  out += r0 * out_stride;
#if defined(QDOT_X86)
  // what the dot products add per unit of sum(q_x) beyond the signed product, taken out through the start
  const int32_t offset = TiledOffset(Bits, has_mins);
  int32_t start[R], start_hi[R];  // (6-bit: the chunk's first 16 k, and its last 16)
  for (int r = 0; r < R; ++r) {
    const int32_t qsum = x.qsum[(r0 + r) * x.chunks + chunk];
    const int32_t first = Bits == 6 ? x.qsum16[(r0 + r) * x.chunks + chunk] : qsum;
    start[r] = -offset * first;
    start_hi[r] = -offset * (qsum - first);
  }
  // J: the columns whose sums stay in registers (16 vector registers on avx2, 32 on avx512)
  constexpr int J = std::min(kTiledVectors, std::max(1, (sizeof(VecI) == 64 ? 16 : 8) / R));
  if (has_mins) {
    TiledChunkRows<R, J, Bits, true>(block, xq, p.depth, start, d, d_sum, scale, minimum, out, out_stride);
  } else {
    TiledChunkRows<R, J, Bits, false>(block, xq, p.depth, start, d, d_sum, scale, minimum, out, out_stride, start_hi,
                                      scale_hi);
  }
#else
  // portable: the layout read one weight at a time, int32 sums in column order
  for (int r = 0; r < R; ++r) {
    int32_t sums[kTiledColumns] = {}, sums_hi[kTiledColumns] = {};  // (6-bit: k 0-15 in sums, 16-31 in sums_hi)
    const int8_t* xr = xq + r * p.depth;
    for (int64_t c = 0; c < kTiledColumns; ++c) {
      for (int64_t k = 0; k < kChunk; ++k) {
        int32_t w;
        if constexpr (Bits == 8) {
          w = static_cast<const int8_t*>(static_cast<const void*>(block))[(k / 4) * 4 * kTiledColumns + c * 4 + k % 4];
        } else {
          const uint8_t byte = block[(k / 8) * 4 * kTiledColumns + c * 4 + k % 4];
          w = k % 8 < 4 ? byte & 0x0F : byte >> 4;
          if constexpr (Bits == 5) w |= ((block[kTiledHighAt + c * 4 + k % 4] >> (k / 4)) & 1) << 4;
          if constexpr (Bits == 6) {
            w |= ((block[kTiledHighAt + (k / 16) * 4 * kTiledColumns + c * 4 + k % 4] >> (2 * (k / 4 % 4))) & 3) << 4;
          }
          w -= TiledOffset(Bits, has_mins);
        }
        (Bits == 6 && k >= 16 ? sums_hi : sums)[c] += w * xr[k];
      }
    }
    float* o = out + r * out_stride;
    if constexpr (Bits == 6) {
      for (int64_t c = 0; c < kTiledColumns; ++c) o[c] += float(sums[c]) * (d[r] * scale[c]);
      for (int64_t c = 0; c < kTiledColumns; ++c) o[c] += float(sums_hi[c]) * (d[r] * scale_hi[c]);
      continue;
    }
    // (the [K, N] walk's portable expression, term for term: out += (sum * (d * scale) + d_sum * min))
    if (has_mins) {
      for (int64_t c = 0; c < kTiledColumns; ++c) o[c] += float(sums[c]) * (d[r] * scale[c]) + d_sum[r] * minimum[c];
    } else {
      for (int64_t c = 0; c < kTiledColumns; ++c) o[c] += float(sums[c]) * (d[r] * scale[c]);
    }
  }
#endif
}

// Rows [r_begin, r_end) of x times a tiled weight's columns [c0, c0 + width) (whole tiles) over groups [g0, g1),
// added into out (row r, column c0 + j at out[r * out_stride + j]). Tile by tile, each tile's chunks in K's
// order: one sequential run of memory per tile, whose chunk (2 KiB or 1 KiB) stays in L1 while the rows pass.
template <int Bits>
void TiledItem(const Problem& p, int64_t c0, int64_t width, int64_t g0, int64_t g1, float* out, int64_t out_stride,
               int64_t r_begin, int64_t r_end) {
  const Activations& x = *p.x;
  const int64_t chunk_bytes = TiledChunkBytes(Bits), tile_chunks = p.depth / kChunk;
  const auto* values = static_cast<const uint8_t*>(p.values);
  alignas(64) float scale[kTiledColumns], scale_hi[kTiledColumns];  // (6-bit: the chunk's two sub-blocks')
  alignas(64) float minimum[kTiledColumns] = {};
  constexpr int64_t kScaleRows = Bits == 6 ? 2 : 1;  // scale rows a chunk
  for (int64_t t = c0 / kTiledColumns; t < (c0 + width) / kTiledColumns; ++t) {
    float* tile_out = out + (t * kTiledColumns - c0);
#if defined(QDOT_X86)
    if (r_end - r_begin == 1) {
      TiledRow<Bits>(p, t, g0, g1, r_begin, tile_out + r_begin * out_stride);
      continue;
    }
#endif
    for (int64_t g = g0; g < g1; ++g) {
      p.scales.Widen((t * p.num_groups + g) * kScaleRows * kTiledColumns, kTiledColumns, scale);
      if (Bits == 6) p.scales.Widen(((t * p.num_groups + g) * kScaleRows + 1) * kTiledColumns, kTiledColumns, scale_hi);
      if (p.mins.data != nullptr) p.mins.Widen((t * p.num_groups + g) * kTiledColumns, kTiledColumns, minimum);
      if (p.two_level()) {  // d * sc and -(dmin * m), in float32 as ggml forms them
        alignas(64) float super_scale[kTiledColumns], super_min[kTiledColumns];
        const int64_t super_at = (t * (p.num_groups / kChunksPerSuperBlock) + g / kChunksPerSuperBlock) * kTiledColumns;
        p.super_scales.Widen(super_at, kTiledColumns, super_scale);
        for (int64_t c = 0; c < kTiledColumns; ++c) scale[c] = super_scale[c] * scale[c];
        if (Bits == 6) {
          for (int64_t c = 0; c < kTiledColumns; ++c) scale_hi[c] = super_scale[c] * scale_hi[c];
        }
        if (p.mins.data != nullptr) {
          p.super_mins.Widen(super_at, kTiledColumns, super_min);
          for (int64_t c = 0; c < kTiledColumns; ++c) minimum[c] = -(super_min[c] * minimum[c]);
        }
      }
      for (int64_t i = 0; i < x.chunks_per_group; ++i) {
        const int64_t chunk = g * x.chunks_per_group + i;
        const uint8_t* block = values + (t * tile_chunks + chunk) * chunk_bytes;
        for (int64_t line = 0; line < chunk_bytes; line += kTiledPrefetchStep) {
          __builtin_prefetch(block + kTiledAheadBytes + line, 0, 2);
        }
        int64_t r0 = r_begin;
        for (; r0 + 4 <= r_end; r0 += 4) {
          TiledChunk<4, Bits>(p, block, r0, chunk, scale, minimum, tile_out, out_stride, scale_hi);
        }
        switch (r_end - r0) {
          case 3: TiledChunk<3, Bits>(p, block, r0, chunk, scale, minimum, tile_out, out_stride, scale_hi); break;
          case 2: TiledChunk<2, Bits>(p, block, r0, chunk, scale, minimum, tile_out, out_stride, scale_hi); break;
          case 1: TiledChunk<1, Bits>(p, block, r0, chunk, scale, minimum, tile_out, out_stride, scale_hi); break;
          default: break;
        }
      }
    }
  }
}

}  // namespace
