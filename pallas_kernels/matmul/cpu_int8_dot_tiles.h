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

// kTiledLanes scales (or mins) of one of the three widths (or uint8 sub-block scales) from `data` + offset, as
// float32
template <ffi::DataType Type>
inline VecF LoadScales(const void* data, int64_t offset) {
  if constexpr (Type == ffi::DataType::F32) {
    return LoadF(static_cast<const float*>(data) + offset);
  } else if constexpr (Type == ffi::DataType::S8 || Type == ffi::DataType::U8) {  // (sign- or zero-extended)
    const auto* in = reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(data) + offset);
    constexpr bool kSigned = Type == ffi::DataType::S8;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m128i bytes = _mm_loadu_si128(in);
    return _mm512_cvtepi32_ps(kSigned ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
#else
    const __m128i bytes = _mm_loadl_epi64(in);
    return _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
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

// Rows [r0, r0 + R) of x times a tile's chunks of groups [g0, g1) (rows `out_stride` apart in `out`, the tile's
// 64 columns in order), J vectors of columns at a time: their float results stay in registers (or L1) over the
// whole run, each chunk's int32 sums scaled into them as the chunk ends and its scales widened as they are
// used. A tile's run (K x 64 weights: 18-96 KiB on SmolLM2-135M; at K = 14336 a Q8_0 tile is 896 KiB, past L2)
// is read once per J columns, the later passes from cache where it fits. Each row's float operations are the
// same whatever R and J, and the same as the [K, N] walk's on the same instruction path (one expression per
// chunk, in K's order): a row's result does not depend on the call's rows, nor on the weight's layout.
template <int R, int J, int Bits, bool HasMins, ffi::DataType ScaleType>
void TiledRowsRun(const Problem& p, int64_t t, int64_t g0, int64_t g1, int64_t r0, float* out, int64_t out_stride) {
  static_assert(kTiledVectors % J == 0, "whole passes of J vectors");
  const Activations& x = *p.x;
  const int64_t chunk_bytes = TiledChunkBytes(Bits), tile_chunks = p.depth / kChunk;
  const auto* values = static_cast<const uint8_t*>(p.values);
  const int32_t offset = TiledOffset(Bits, HasMins);
  // d * sc, -(dmin * m) (Q4_K, Q5_K: uint8 sc and m); Q6_K: d * sc, int8 sc per 16 k
  constexpr bool kTwoLevel = ScaleType == ffi::DataType::U8 || ScaleType == ffi::DataType::S8;
  constexpr int64_t kScaleRows = Bits == 6 ? 2 : 1;  // scale rows a chunk
  // (two-level: x's d and sums in float32, as ggml's q8_K for K-quant dots; else q8_0 / q8_1's float16 ones)
  const float* x_scale = (kTwoLevel ? x.scale32 : x.scale).data() + r0 * x.chunks;
  const float* x_sum = (kTwoLevel ? x.sum32 : x.sum).data() + r0 * x.chunks;
  const int32_t* x_qsum = x.qsum.data() + r0 * x.chunks;
  const int32_t* x_qsum16 = x.qsum16.data() + r0 * x.chunks;
  const int8_t* xq0 = x.q.data() + r0 * p.depth;
  for (int j0 = 0; j0 < kTiledVectors; j0 += J) {
    VecF o[R][J];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < J; ++j) o[r][j] = LoadF(out + r * out_stride + (j0 + j) * kTiledLanes);
    }
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t scale_at = (t * p.num_groups + g) * kScaleRows * kTiledColumns;
      const int64_t super_at = (t * (p.num_groups / kChunksPerSuperBlock) + g / kChunksPerSuperBlock) * kTiledColumns;
      auto chunk_scale = [&](int j, int64_t row_at) {
        VecF scale = LoadScales<ScaleType>(p.scales.data, row_at + (j0 + j) * kTiledLanes);
        if constexpr (kTwoLevel) {
          scale = Mul(LoadScales<ffi::DataType::F16>(p.super_scales.data, super_at + (j0 + j) * kTiledLanes), scale);
        }
        return scale;
      };
      for (int64_t i = 0; i < x.chunks_per_group; ++i) {
        const int64_t chunk = g * x.chunks_per_group + i;
        const uint8_t* block = values + (t * tile_chunks + chunk) * chunk_bytes;
        if (j0 == 0) {  // (the later passes find the tile's run in L1 or L2)
          for (int64_t line = 0; line < chunk_bytes; line += kTiledPrefetchStep) {
            __builtin_prefetch(block + kTiledAheadBytes + line, 0, 2);
          }
        }
        const int8_t* xq = xq0 + chunk * kChunk;
        VecI acc[R][J];
        int32_t qsum[R], qsum_first[R];
        for (int r = 0; r < R; ++r) {
          qsum[r] = x_qsum[r * x.chunks + chunk];
          qsum_first[r] = Bits == 6 ? x_qsum16[r * x.chunks + chunk] : qsum[r];  // (6-bit: k 0-15's)
          for (int j = 0; j < J; ++j) acc[r][j] = SplatInt(-offset * qsum_first[r]);
        }
        // the sums so far scaled into the results (6-bit: the first half's, then the rest)
        auto flush = [&](int64_t row_at) {
          for (int j = 0; j < J; ++j) {
            const VecF scale = chunk_scale(j, row_at);
            for (int r = 0; r < R; ++r) {
              o[r][j] = Fma(ToFloat(acc[r][j]), Mul(SplatF(x_scale[r * x.chunks + chunk]), scale), o[r][j]);
            }
          }
        };
        if constexpr (Bits == 8) {
#pragma GCC unroll 8
          for (int q = 0; q < int(kChunk / 4); ++q) {
            VecI xv[R];
            for (int r = 0; r < R; ++r) {
              int32_t four;
              std::memcpy(&four, xq + r * p.depth + 4 * q, sizeof(four));
              xv[r] = SplatInt(four);
            }
            for (int j = 0; j < J; ++j) {
              const VecI w = PrepareInt8(LoadBytes(block + q * 4 * kTiledColumns + (j0 + j) * int(sizeof(VecI))));
              for (int r = 0; r < R; ++r) {
                acc[r][j] = DotInt8(acc[r][j], w, xv[r]);
                KeepInRegister(acc[r][j]);
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
            VecI x_lo[R], x_hi[R];
            for (int r = 0; r < R; ++r) {
              int32_t four_lo, four_hi;
              std::memcpy(&four_lo, xq + r * p.depth + 8 * pair, sizeof(four_lo));
              std::memcpy(&four_hi, xq + r * p.depth + 8 * pair + 4, sizeof(four_hi));
              x_lo[r] = SplatInt(four_lo);
              x_hi[r] = SplatInt(four_hi);
            }
            for (int j = 0; j < J; ++j) {
              const int64_t vector_at = (j0 + j) * int(sizeof(VecI));
              const VecI packed = LoadBytes(block + pair * 4 * kTiledColumns + vector_at);
              VecI lo = And(packed, low), hi = And(ShiftRight4(packed), low);
              AddHighBits<Bits>(block, vector_at, pair, lo, hi);
              for (int r = 0; r < R; ++r) {
#if defined(QDOT_NIBBLE_PAIRS16)
                pairs[r][j] = Add16(pairs[r][j], Add16(PairProducts(lo, x_lo[r]), PairProducts(hi, x_hi[r])));
                KeepInRegister(pairs[r][j]);
#else
                acc[r][j] = DotUnsigned(DotUnsigned(acc[r][j], lo, x_lo[r]), hi, x_hi[r]);
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
              if (pair == 1) {  // the first sub-block of 16 ends: scaled by its own sc, the second's sums start
                flush(scale_at);
                for (int r = 0; r < R; ++r) {
                  for (int j = 0; j < J; ++j) acc[r][j] = SplatInt(-offset * (qsum[r] - qsum_first[r]));
                }
              }
            }
          }
        }
        flush(scale_at + (kScaleRows - 1) * kTiledColumns);
        if constexpr (HasMins) {
          for (int j = 0; j < J; ++j) {
            VecF minimum = LoadScales<ScaleType>(p.mins.data, scale_at + (j0 + j) * kTiledLanes);
            if constexpr (kTwoLevel) {  // -(dmin * m): the sign carried by d_sum (exact)
              minimum = Mul(LoadScales<ffi::DataType::F16>(p.super_mins.data, super_at + (j0 + j) * kTiledLanes), minimum);
            }
            for (int r = 0; r < R; ++r) {
              const float d_sum = x_sum[r * x.chunks + chunk];
              o[r][j] = Fma(SplatF(kTwoLevel ? -d_sum : d_sum), minimum, o[r][j]);
            }
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < J; ++j) StoreF(out + r * out_stride + (j0 + j) * kTiledLanes, o[r][j]);
    }
  }
}

// Vectors of columns a TiledRowsRun of R rows takes at once: on AVX2, one row all eight (its 8 results and 8
// pair sums alone are the 16 registers: some spill), more rows four (their results spill to L1, a load and a
// store per chunk, which costs little beside the products; fewer columns re-read x's rows and the scales more
// often). Cache-hot Q4_0 layers, one thread, alternating with the chunk-by-chunk walk this replaced
// (bench/cpu_int8_dot_rows.cc): rows 1 1.06-1.21x, 2 1.43-1.49x, 3-7 1.29-1.55x, 64 1.41-1.45x; Q8_0 0.98-1.5x.
// On AVX-512 (32 registers, 64 columns a vector) all four for 8-bit rows and for up to 3 4-bit rows, two for the
// rest: two passes re-read a tile's run (up to 96 KiB on SmolLM2-135M, past L1) from L2, and the second pass's
// columns wait for it. bench/cpu_int8_dot_calls.cc TILED=1, one worker, a step's 121 calls (AMD EPYC Zen 4, session
// 52): 8-bit 2 rows 8.1-8.4 -> 5.7-6.2 ms, 3 rows 8.4-8.7 -> 7.4-7.6, 4 rows 9.3-9.9 -> 7.9-8.2, 8 rows 14.7-15.0 ->
// 13.4-13.6, 32 rows 47.3-48.3 -> 41.6-41.9; 4-bit 2 rows 4.8-4.9 -> 3.6-3.8, 3 rows 5.5-5.7 -> 4.4-4.6, but 4-row
// runs 0.96x (8 and 32 rows: the four rows' nibbles and sums spill). K-quants' two-level scales (Q4_K, Q5_K) and
// 5- and 6-bit values were not measured: two, as before (`measured` false). Per-output-channel int8 (an int8
// self-draft's weights: float32 scales, one group over K), two workers, wall (session 53): 2 rows 6.5-6.9 -> 5.2-5.9
// ms, 3 rows 7.0-7.3 -> 5.4-5.7, 4 rows 6.7-7.6 -> 6.1-6.5, 8 rows 10.3-11.0 -> 9.1-9.9, 32 rows within noise; in
// the engine the draft's two-token catch-up step went from 1.30-1.51x its one-token step to 1.14-1.27x.
constexpr int TiledJ(int R, int Bits, bool measured = true) {
  if (sizeof(VecI) != 64) return R == 1 ? 8 : 4;
  return R == 1 || (measured && (Bits == 8 || (Bits == 4 && R <= 3))) ? 4 : 2;
}

// TiledRowsRun for the problem's scale width and mins.
template <int R, int Bits>
void TiledRows(const Problem& p, int64_t t, int64_t g0, int64_t g1, int64_t r0, float* out, int64_t out_stride) {
  constexpr int J = TiledJ(R, Bits);
  if constexpr (Bits == 6) {  // Q6_K only (the FFI refuses other 6-bit scales): int8 sc per 16 k, no mins
    return TiledRowsRun<R, J, Bits, false, ffi::DataType::S8>(p, t, g0, g1, r0, out, out_stride);
  } else {
    const bool mins = p.mins.data != nullptr;
    if constexpr (Bits == 4 || Bits == 5) {
      if (p.scales.type == ffi::DataType::U8) {  // two-level (Q4_K, Q5_K: always with mins)
        constexpr int kTwoLevelJ = TiledJ(R, Bits, false);
        return TiledRowsRun<R, kTwoLevelJ, Bits, true, ffi::DataType::U8>(p, t, g0, g1, r0, out, out_stride);
      }
    }
    switch (p.scales.type) {
      case ffi::DataType::F16:
        return mins ? TiledRowsRun<R, J, Bits, true, ffi::DataType::F16>(p, t, g0, g1, r0, out, out_stride)
                    : TiledRowsRun<R, J, Bits, false, ffi::DataType::F16>(p, t, g0, g1, r0, out, out_stride);
      case ffi::DataType::BF16:
        return mins ? TiledRowsRun<R, J, Bits, true, ffi::DataType::BF16>(p, t, g0, g1, r0, out, out_stride)
                    : TiledRowsRun<R, J, Bits, false, ffi::DataType::BF16>(p, t, g0, g1, r0, out, out_stride);
      default:
        return mins ? TiledRowsRun<R, J, Bits, true, ffi::DataType::F32>(p, t, g0, g1, r0, out, out_stride)
                    : TiledRowsRun<R, J, Bits, false, ffi::DataType::F32>(p, t, g0, g1, r0, out, out_stride);
    }
  }
}
#endif

#if !defined(QDOT_X86)
// Rows [r0, r0 + R) times chunk `chunk` of a tile (`block`), into the tile's 64 columns of `out` (portable: the
// layout read one weight at a time, int32 sums in column order; chunk by chunk over the rows)
template <int R, int Bits>
inline void TiledChunk(const Problem& p, const uint8_t* block, int64_t r0, int64_t chunk, const float* scale,
                       const float* minimum, float* out, int64_t out_stride, const float* scale_hi) {
  const Activations& x = *p.x;
  const bool has_mins = p.mins.data != nullptr;
  const int8_t* xq = x.q.data() + r0 * p.depth + chunk * kChunk;
  float d[R], d_sum[R];
  const std::vector<float>& scales = p.two_level() ? x.scale32 : x.scale;  // (as TiledRowsRun)
  const std::vector<float>& sums = p.two_level() ? x.sum32 : x.sum;
  for (int r = 0; r < R; ++r) {
    d[r] = scales[(r0 + r) * x.chunks + chunk];
    d_sum[r] = has_mins ? sums[(r0 + r) * x.chunks + chunk] : 0.0f;
  }
  out += r0 * out_stride;
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
}

#endif

constexpr int kTiledRows = 4;  // rows a TiledRowsRun takes at most (5, 6 or 8 measured no faster on AVX2)

#if defined(QDOT_X86)
// `rows` (fewer than R + 1) rows from r0 as one TiledRowsRun
template <int R, int Bits>
void TiledRowsRest(const Problem& p, int64_t t, int64_t g0, int64_t g1, int64_t r0, int64_t rows, float* out,
                   int64_t out_stride) {
  if constexpr (R >= 1) {
    if (rows == R) return TiledRows<R, Bits>(p, t, g0, g1, r0, out, out_stride);
    TiledRowsRest<R - 1, Bits>(p, t, g0, g1, r0, rows, out, out_stride);
  }
}
#endif

// Rows [r_begin, r_end) of x times a tiled weight's columns [c0, c0 + width) (whole tiles) over groups [g0, g1),
// added into out (row r, column c0 + j at out[r * out_stride + j]). Tile by tile: one sequential run of memory
// per tile, which stays in L1 or L2 while blocks of the rows pass over it (TiledRowsRun), K innermost.
template <int Bits>
void TiledItem(const Problem& p, int64_t c0, int64_t width, int64_t g0, int64_t g1, float* out, int64_t out_stride,
               int64_t r_begin, int64_t r_end) {
#if defined(QDOT_X86)
  for (int64_t t = c0 / kTiledColumns; t < (c0 + width) / kTiledColumns; ++t) {
    float* tile_out = out + (t * kTiledColumns - c0);
    int64_t r0 = r_begin;
    for (; r0 + kTiledRows <= r_end; r0 += kTiledRows) {
      TiledRows<kTiledRows, Bits>(p, t, g0, g1, r0, tile_out + r0 * out_stride, out_stride);
    }
    TiledRowsRest<kTiledRows - 1, Bits>(p, t, g0, g1, r0, r_end - r0, tile_out + r0 * out_stride, out_stride);
  }
#else
  const Activations& x = *p.x;
  const int64_t chunk_bytes = TiledChunkBytes(Bits), tile_chunks = p.depth / kChunk;
  const auto* values = static_cast<const uint8_t*>(p.values);
  alignas(64) float scale[kTiledColumns], scale_hi[kTiledColumns];  // (6-bit: the chunk's two sub-blocks')
  alignas(64) float minimum[kTiledColumns] = {};
  constexpr int64_t kScaleRows = Bits == 6 ? 2 : 1;  // scale rows a chunk
  for (int64_t t = c0 / kTiledColumns; t < (c0 + width) / kTiledColumns; ++t) {
    float* tile_out = out + (t * kTiledColumns - c0);
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
        for (int64_t r = r_begin; r < r_end; ++r) {
          TiledChunk<1, Bits>(p, block, r, chunk, scale, minimum, tile_out, out_stride, scale_hi);
        }
      }
    }
  }
#endif
}

}  // namespace
