// The K-quant kernel's int8-activation tiles (AVX-512 VNNI + VBMI), llama.cpp's arithmetic: x quantized per
// 32 k as ggml's quantize_row_q8_0 (QuantizedRows, in cpu_kquant_matmul.cc), exact int32 sums of q_x * q_w
// per sub-block with vpdpbusd (u8 weights x s8 activations, four k of one column per 32-bit lane), then one
// float multiply per (sub-block, column): out += float(sum) * (d_x * d * sc) - d_x * sum(q_x) * dmin * m.
// A part of cpu_kquant_matmul.cc, included after its Weight, QuantizedRows and scale helpers; other paths
// (AVX2, portable, AVX-512 without VNNI or VBMI) have no KQUANT_INT8 and keep x in float.
//
// The planes are [K, N] (columns contiguous); a lane wants four k of one column. Two low-plane rows (k .. k + 3)
// of 16 columns, each zero-extended to 32-bit lanes (vpmovzxbd from memory), give byte 0 = row k / 2, byte 2
// = row k / 2 + 1; (u | u << 4) & 0x0F0F0F0F splits their nibbles into the four bytes in k order, in column
// order (no interleaving shuffles, no column permutation). The high plane's bits for those four k (Q5: bit 4
// s + t of the byte; Q6_K: bits 2t, 2t + 1) are moved to bit 4 of byte t by one vpmultishiftqb (it picks any
// 8-bit window of each qword; the lanes are zero-extended bytes, so the windows that wrap read zeros) and
// or'ed in under a mask. The storage offset (Q5_0 16, Q6_K 32) is the accumulators' start: -offset * sum(q_x).

#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define KQUANT_INT8 1

// vpmultishiftqb controls: byte t of each 32-bit lane takes the high plane's bit for its k to bit 4 (and the
// next bit to bit 5). Q5 (one bit per k, 8 k per byte): step s of 4 k reads bits 4 s + t; Q6_K (two bits, 4 k
// per byte): bits 2 t.
inline __m512i HighBitsControl(int bits, int step) {
  alignas(64) uint8_t control[64];
  for (int i = 0; i < 64; ++i) {
    const int lane_base = (i % 8) / 4 * 32, t = i % 4;
    const int first = bits == 1 ? 4 * step + t : 2 * t;
    control[i] = uint8_t((lane_base + first - 4) & 63);
  }
  return _mm512_load_si512(control);
}

inline __m512i WidenBytes(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// R rows of quantized x (from r0) times sub-block g at T vectors of 16 columns from c: exact int32 sums, then
// scaled into the result (see the file's comment).
template <int Kind, int R, int T>
inline void Int8Tile(const Weight& w, const QuantizedRows& x, int64_t r0, int64_t g, int64_t c, float* partial) {
  constexpr int kBits = HighBits(Kind);
  const int64_t n = w.columns, depth = x.depth, k0 = g * w.group;
  const int64_t chunk = k0 / 32, num_chunks = depth / 32;
  const __m512i nibbles = _mm512_set1_epi8(0x0F), high_mask = _mm512_set1_epi8(kBits == 1 ? 0x10 : 0x30);
  const __m512i control0 = HighBitsControl(kBits, 0), control1 = HighBitsControl(kBits, 1);
  __m512i acc[R][T];
  int32_t sums[R];  // the sub-block's sum of q_x per row (the offset's and the mins' term)
  for (int r = 0; r < R; ++r) {
    const int32_t* sum16 = x.sum16.data() + (r0 + r) * (depth / 16) + k0 / 16;
    sums[r] = w.group == 16 ? sum16[0] : sum16[0] + sum16[1];
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_set1_epi32(-Offset(Kind) * sums[r]);
  }
  for (int64_t k = k0; k < k0 + w.group; k += 4) {
    __m512i v[T];
    for (int t = 0; t < T; ++t) {
      const uint8_t* low = w.low + (k / 2) * n + c + 16 * t;
      const __m512i u = _mm512_or_si512(WidenBytes(low), _mm512_slli_epi32(WidenBytes(low + n), 16));
      v[t] = _mm512_and_si512(_mm512_or_si512(u, _mm512_slli_epi32(u, 4)), nibbles);
      if constexpr (kBits > 0) {
        const int64_t per_byte = 8 / kBits;  // k per high-plane byte
        const __m512i h = WidenBytes(w.high + (k / per_byte) * n + c + 16 * t);
        const __m512i spread = _mm512_multishift_epi64_epi8(kBits == 1 && k % 8 ? control1 : control0, h);
        v[t] = _mm512_ternarylogic_epi32(v[t], spread, high_mask, 0xF8);  // v | (spread & mask)
      }
    }
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, x.q.data() + (r0 + r) * depth + k, sizeof(four));
      const __m512i xq = _mm512_set1_epi32(four);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], v[t], xq);
    }
  }
  VecF scale[T], minimum[T];
  for (int t = 0; t < T; ++t) {
    scale[t] = ScaleVector<Kind>(w, g, c + 16 * t);
    if constexpr (HasMins(Kind)) minimum[t] = MinVector<Kind>(w, g, c + 16 * t);
  }
  for (int r = 0; r < R; ++r) {
    float* out = partial + (r0 + r) * n + c;
    const float dx = x.d[(r0 + r) * num_chunks + chunk];
    const VecF dx_vector = Splat(dx), min_factor = Splat(-dx * float(sums[r]));
    for (int t = 0; t < T; ++t) {
      VecF o = Fma(ToFloat(VecI(acc[r][t])), dx_vector * scale[t], LoadF(out + 16 * t));
      if constexpr (HasMins(Kind)) o = Fma(min_factor, minimum[t], o);
      StoreF(out + 16 * t, o);
    }
  }
}

#endif
