// The int8-activation quantized kernel's (cpu_quantized_int8_dot.cc) vector basics: one name per operation
// on the path the compiler flags pick (AVX-512 BW with or without VNNI: 64 columns a tile; AVX2 with or
// without AVX-VNNI: 32; portable: no vectors, tiles of 16 in column order), the dot products of u8 x s8
// (VNNI's vpdpbusd, else vpmaddubsw + vpmaddwd with the sign trick for signed weights), and the
// interleave that puts four k of one column into a 32-bit lane (which fixes the tile's column order).
// Included once, by that file: its names live in the file's anonymous namespace.

#pragma once

#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QDOT_X86 1
constexpr int kTile = 64;  // columns per tile: one weight row's bytes in a vector
typedef __m512i VecI;
inline VecI LoadBytes(const void* p) { return _mm512_loadu_si512(p); }
inline void StoreInts(int32_t* p, VecI v) { _mm512_storeu_si512(p, v); }
inline VecI LoadInts(const int32_t* p) { return _mm512_loadu_si512(p); }
inline VecI SplatInt(int32_t v) { return _mm512_set1_epi32(v); }
inline VecI SplatByte(int8_t v) { return _mm512_set1_epi8(v); }
inline VecI And(VecI a, VecI b) { return _mm512_and_si512(a, b); }
inline VecI Xor(VecI a, VecI b) { return _mm512_xor_si512(a, b); }
inline VecI Or(VecI a, VecI b) { return _mm512_or_si512(a, b); }
inline VecI ShiftRight4(VecI a) { return _mm512_srli_epi16(a, 4); }
inline VecI ShiftLeft16(VecI a, int n) { return _mm512_sll_epi16(a, _mm_cvtsi32_si128(n)); }
inline VecI ShiftRight16(VecI a, int n) { return _mm512_srl_epi16(a, _mm_cvtsi32_si128(n)); }
inline VecI UnpackLo8(VecI a, VecI b) { return _mm512_unpacklo_epi8(a, b); }
inline VecI UnpackHi8(VecI a, VecI b) { return _mm512_unpackhi_epi8(a, b); }
inline VecI UnpackLo16(VecI a, VecI b) { return _mm512_unpacklo_epi16(a, b); }
inline VecI UnpackHi16(VecI a, VecI b) { return _mm512_unpackhi_epi16(a, b); }
typedef __m512 VecF;
inline VecF LoadF(const float* p) { return _mm512_loadu_ps(p); }
inline void StoreF(float* p, VecF v) { _mm512_storeu_ps(p, v); }
inline VecF SplatF(float v) { return _mm512_set1_ps(v); }
inline VecF ToFloat(VecI v) { return _mm512_cvtepi32_ps(v); }
inline VecF Fma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF Mul(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
// 64 columns' floats (in[0] columns 0-15, ...) into the tile's order: a 4 x 4 transpose of 128-bit blocks
inline void TileOrder(const float* in, float* out) {
  const VecF a = LoadF(in), b = LoadF(in + 16), c = LoadF(in + 32), d = LoadF(in + 48);
  const VecF ab_lo = _mm512_shuffle_f32x4(a, b, 0x44), ab_hi = _mm512_shuffle_f32x4(a, b, 0xEE);
  const VecF cd_lo = _mm512_shuffle_f32x4(c, d, 0x44), cd_hi = _mm512_shuffle_f32x4(c, d, 0xEE);
  StoreF(out, _mm512_shuffle_f32x4(ab_lo, cd_lo, 0x88));
  StoreF(out + 16, _mm512_shuffle_f32x4(ab_lo, cd_lo, 0xDD));
  StoreF(out + 32, _mm512_shuffle_f32x4(ab_hi, cd_hi, 0x88));
  StoreF(out + 48, _mm512_shuffle_f32x4(ab_hi, cd_hi, 0xDD));
}
// and back: the 4 x 4 block transpose is its own inverse
inline void FromTileOrder(const float* in, float* out) { TileOrder(in, out); }
#if defined(__AVX512VNNI__)
#define QDOT_VNNI 1
inline VecI DotUnsigned(VecI acc, VecI u, VecI s) { return _mm512_dpbusd_epi32(acc, u, s); }
#else
inline VecI DotUnsigned(VecI acc, VecI u, VecI s) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}
// sign(x, w): x negated where w < 0 (where w is 0 the product is 0 anyway: |w| is)
inline VecI DotSigned(VecI acc, VecI w, VecI x) {
  const __mmask64 negative = _mm512_movepi8_mask(w);
  return DotUnsigned(acc, _mm512_abs_epi8(w), _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x));
}
#endif
#elif defined(__AVX2__)
#define QDOT_X86 1
constexpr int kTile = 32;
typedef __m256i VecI;
inline VecI LoadBytes(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline void StoreInts(int32_t* p, VecI v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline VecI LoadInts(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VecI SplatInt(int32_t v) { return _mm256_set1_epi32(v); }
inline VecI SplatByte(int8_t v) { return _mm256_set1_epi8(v); }
inline VecI And(VecI a, VecI b) { return _mm256_and_si256(a, b); }
inline VecI Xor(VecI a, VecI b) { return _mm256_xor_si256(a, b); }
inline VecI Or(VecI a, VecI b) { return _mm256_or_si256(a, b); }
inline VecI ShiftRight4(VecI a) { return _mm256_srli_epi16(a, 4); }
inline VecI ShiftLeft16(VecI a, int n) { return _mm256_sll_epi16(a, _mm_cvtsi32_si128(n)); }
inline VecI ShiftRight16(VecI a, int n) { return _mm256_srl_epi16(a, _mm_cvtsi32_si128(n)); }
inline VecI UnpackLo8(VecI a, VecI b) { return _mm256_unpacklo_epi8(a, b); }
inline VecI UnpackHi8(VecI a, VecI b) { return _mm256_unpackhi_epi8(a, b); }
inline VecI UnpackLo16(VecI a, VecI b) { return _mm256_unpacklo_epi16(a, b); }
inline VecI UnpackHi16(VecI a, VecI b) { return _mm256_unpackhi_epi16(a, b); }
typedef __m256 VecF;
inline VecF LoadF(const float* p) { return _mm256_loadu_ps(p); }
inline void StoreF(float* p, VecF v) { _mm256_storeu_ps(p, v); }
inline VecF SplatF(float v) { return _mm256_set1_ps(v); }
inline VecF ToFloat(VecI v) { return _mm256_cvtepi32_ps(v); }
inline VecF Fma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF Mul(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
// 32 columns' floats into the tile's order: vector j holds columns 4j..4j+3 and 16+4j..16+4j+3
inline void TileOrder(const float* in, float* out) {
  const VecF a = LoadF(in), b = LoadF(in + 8), c = LoadF(in + 16), d = LoadF(in + 24);
  StoreF(out, _mm256_permute2f128_ps(a, c, 0x20));
  StoreF(out + 8, _mm256_permute2f128_ps(a, c, 0x31));
  StoreF(out + 16, _mm256_permute2f128_ps(b, d, 0x20));
  StoreF(out + 24, _mm256_permute2f128_ps(b, d, 0x31));
}
// and back: out holds columns 0-3, 4-7, ... again (blocks 0, 2, 4, 6 of the input, then 1, 3, 5, 7)
inline void FromTileOrder(const float* in, float* out) {
  const VecF a = LoadF(in), b = LoadF(in + 8), c = LoadF(in + 16), d = LoadF(in + 24);
  StoreF(out, _mm256_permute2f128_ps(a, b, 0x20));
  StoreF(out + 8, _mm256_permute2f128_ps(c, d, 0x20));
  StoreF(out + 16, _mm256_permute2f128_ps(a, b, 0x31));
  StoreF(out + 24, _mm256_permute2f128_ps(c, d, 0x31));
}
#if defined(__AVXVNNI__)
#define QDOT_VNNI 1
inline VecI DotUnsigned(VecI acc, VecI u, VecI s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
inline VecI DotUnsigned(VecI acc, VecI u, VecI s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline VecI DotSigned(VecI acc, VecI w, VecI x) {
  return DotUnsigned(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}
#endif
#else
constexpr int kTile = 16;  // portable: no interleaving, tiles in column order
#endif

#if defined(QDOT_X86)
constexpr int kDwords = kTile / 4;  // 32-bit lanes per vector: columns of a vector after interleaving
// int8 weights: what DotInt8 adds per unit of sum(q_x) beyond w * x (VNNI's w + 128)
#if defined(QDOT_VNNI)
constexpr int kInt8Offset = 128;
inline VecI PrepareInt8(VecI w) { return Xor(w, SplatByte(int8_t(0x80))); }
inline VecI DotInt8(VecI acc, VecI w, VecI x) { return DotUnsigned(acc, w, x); }
#else
constexpr int kInt8Offset = 0;
inline VecI PrepareInt8(VecI w) { return w; }
inline VecI DotInt8(VecI acc, VecI w, VecI x) { return DotSigned(acc, w, x); }
#endif

// The sum so far made to exist here, in a register: without it GCC computed all of a chunk's products first and
// added them at its end, R x J x 8 intermediate vectors spilled to the stack (60 spills a chunk at 4 rows on
// AVX2; cpu_int8_dot_tiles.h's chunk-by-chunk walk before session 42 spilled the same way, and 4 rows ran no faster per
// row than one)
#if defined(__AVX512F__)
inline void KeepInRegister(VecI& v) { __asm__("" : "+v"(v)); }  // (any of zmm0-31)
#else
inline void KeepInRegister(VecI& v) { __asm__("" : "+x"(v)); }
#endif

// Rows k .. k + 3 of a tile (a, b, c, d: kTile bytes each) -> four vectors whose 32-bit lanes hold the four
// k of one column. Unpacks work within 128-bit lanes: vector j, lane t holds column
// (t / 4) * 16 + 4 * j + t % 4 (ColumnInTile).
inline void Interleave(VecI& a, VecI& b, VecI& c, VecI& d) {
  const VecI ab_lo = UnpackLo8(a, b), ab_hi = UnpackHi8(a, b);
  const VecI cd_lo = UnpackLo8(c, d), cd_hi = UnpackHi8(c, d);
  a = UnpackLo16(ab_lo, cd_lo);
  b = UnpackHi16(ab_lo, cd_lo);
  c = UnpackLo16(ab_hi, cd_hi);
  d = UnpackHi16(ab_hi, cd_hi);
}
#endif

}  // namespace
