// The K-quant kernel's int8-activation tiles, llama.cpp's arithmetic: x quantized per 32 k as ggml's
// quantize_row_q8_0 (QuantizedRows, in cpu_kquant_matmul.cc), exact int32 sums of q_x * q_w per sub-block (u8
// weights x s8 activations, four k of one column per 32-bit lane: vpdpbusd with AVX-512 VNNI, else vpmaddubsw and
// vpmaddwd, the same integers), then one float multiply per (sub-block, column):
// out += float(sum) * (d_x * d * sc) - d_x * sum(q_x) * dmin * m.
// A part of cpu_kquant_matmul.cc, included after its Weight, Target, QuantizedRows and scale helpers. The avx512
// (AVX-512BW) and avx2 paths have it (KQUANT_INT8); the portable one keeps x in float.
//
// The planes are [K, N] (columns contiguous); a lane wants four k of one column. Two low-plane rows (k .. k + 3)
// of kLanes columns, each zero-extended to 32-bit lanes (vpmovzxbd from memory), give byte 0 = row k / 2, byte 2
// = row k / 2 + 1; (u | u << 4) & 0x0F0F0F0F splits their nibbles into the four bytes in k order, in column
// order (no interleaving shuffles, no column permutation). The high plane's bits for those four k (Q5: bit 4
// s + t of the byte; Q6_K: bits 2t, 2t + 1) are moved to bit 4 of byte t (one vpmultishiftqb with AVX-512 VBMI:
// it picks any 8-bit window of each qword, and the lanes are zero-extended bytes, so the windows that wrap read
// zeros; else shifted copies of the byte under a mask, SpreadHighBits) and or'ed in. The storage offset (Q5_0 16,
// Q6_K 32) is the accumulators' start: -offset * sum(q_x).
// One to 8 rows widen the weights as the tiles go (Int8Tile; on AVX2 one or two rows in 16-bit lanes of a byte's
// two k instead, Int8PairTile); more rows widen each item once into a buffer that every row group reads, holding
// their results in registers across the sub-blocks (ManyRowsItem).

#pragma once

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__))
#define KQUANT_INT8 1

// A vector of kLanes 32-bit lanes, each four k of one column as bytes (the dot's u8 operand) or their int32 sum.
#if defined(__AVX512F__)
typedef __m512i IntVec;
inline IntVec Int8Broadcast(int32_t four) { return _mm512_set1_epi32(four); }
#else
typedef __m256i IntVec;
inline IntVec Int8Broadcast(int32_t four) { return _mm256_set1_epi32(four); }
#endif

// acc + the sums of each lane's four u8 weights times x's four s8 (exact in int32: |q_w| <= 63, |q_x| <= 127).
// vpdpbusd where the CPU has VNNI; else vpmaddubsw (pairs into int16, at most 2 * 63 * 127, so never
// saturating) and vpmaddwd by ones (the pairs into int32): the same integers.
inline IntVec DotAdd(IntVec acc, IntVec weights, IntVec x) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  return _mm512_dpbusd_epi32(acc, weights, x);
#elif defined(__AVX512F__)
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(weights, x), _mm512_set1_epi16(1)));
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(weights, x), _mm256_set1_epi16(1)));
#endif
}

// Without VNNI, two steps a dot: acc + DotAdd's sums of both (weights, x) pairs, their vpmaddubsw pairs added in
// int16 first (each at most 2 * 63 * 127 in size, their sum 32004 < 32767: exact) and widened once.
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define KQUANT_PAIRED_DOTS 0
#else
#define KQUANT_PAIRED_DOTS 1
#endif
inline IntVec DotAdd2(IntVec acc, IntVec weights0, IntVec x0, IntVec weights1, IntVec x1) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  return DotAdd(DotAdd(acc, weights0, x0), weights1, x1);
#elif defined(__AVX512F__)
  const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(weights0, x0), _mm512_maddubs_epi16(weights1, x1));
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#else
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(weights0, x0), _mm256_maddubs_epi16(weights1, x1));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

#if defined(__AVX512VBMI__) && defined(__AVX512F__)
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
#endif

// Each lane's high-plane byte h (zero-extended) spread so that byte t holds its k's high bit(s) at bit 4 (5):
// Q5 step s (k % 8 / 4) wants bit 4 s + t at bit 8 t + 4, a shift of 7 t + 4 - 4 s; Q6_K bits 2 t, 2 t + 1 at
// 8 t + 4, a shift of 6 t + 4. h has 8 bits, so under the mask each byte sees only its own copy of h.
template <int Bits>
inline VecI SpreadHighBits(VecI h, int step) {
  if constexpr (Bits == 1) {
    const VecI pairs = h | (h << 7);
    const VecI four = pairs | (pairs << 14);  // copies shifted by 0, 7, 14, 21
    return (step ? four : four << 4) & 0x10101010;
  } else {
    const VecI pairs = h | (h << 6);
    return ((pairs | (pairs << 12)) << 4) & 0x30303030;  // 4, 10, 16, 22
  }
}

#if !defined(__AVX512F__)
// 16-bit lanes shifted left by a constant (right where it is negative): Int8PairTile's high bits.
inline __m256i ShiftLeft16(__m256i v, int bits) {
  return bits >= 0 ? _mm256_slli_epi16(v, bits) : _mm256_srli_epi16(v, -bits);
}
#endif

// A kind's weights as the dot's operands: 4 k (from k, a multiple of 4) of kLanes columns (from c), the stored
// q (offset included) of one column per 32-bit lane in k order (see the file's comment).
template <int Kind>
struct Int8Widener {
  static constexpr int kBits = HighBits(Kind);
#if defined(__AVX512VBMI__) && defined(__AVX512F__)
  const __m512i high_mask = _mm512_set1_epi8(kBits == 1 ? 0x10 : 0x30);
  const __m512i control0 = HighBitsControl(kBits, 0), control1 = HighBitsControl(kBits, 1);
#endif

  inline IntVec operator()(const Weight& w, int64_t k, int64_t c) const {
    const int64_t n = w.columns;
    const uint8_t* low = w.low + (k / 2) * n + c;
    const VecI u = Bytes(low) | (Bytes(low + n) << 16);
    VecI v = (u | (u << 4)) & 0x0F0F0F0F;
    if constexpr (kBits > 0) {
      const int64_t per_byte = 8 / kBits;  // k per high-plane byte
      const VecI h = Bytes(w.high + (k / per_byte) * n + c);
#if defined(__AVX512VBMI__) && defined(__AVX512F__)
      const __m512i spread = _mm512_multishift_epi64_epi8(kBits == 1 && k % 8 ? control1 : control0, __m512i(h));
      return _mm512_ternarylogic_epi32(__m512i(v), spread, high_mask, 0xF8);  // v | (spread & mask)
#else
      v |= SpreadHighBits<kBits>(h, kBits == 1 && k % 8);
#endif
    }
    return IntVec(v);
  }
};

// R rows of quantized x (from r0) times sub-block g at T vectors of kLanes columns, their weights from
// `weights(k, t)`, scaled by `scale` and `minimum` (ScaleVector, MinVector of those columns) and added into
// the results, `result(r, t, add)` applying `add` to (row r, vector t)'s: exact int32 sums, then one float
// multiply per (row, column) (see the file's comment).
template <int Kind, int R, int T, class Weights, class Result>
inline void Int8SubBlock(const Weight& w, const QuantizedRows& x, int64_t r0, int64_t g, const Weights& weights,
                         const VecF (&scale)[T], const VecF (&minimum)[T], const Result& result) {
  const int64_t depth = x.depth, k0 = g * w.group;
  IntVec acc[R][T];
  int32_t sums[R];  // the sub-block's sum of q_x per row (the offset's and the mins' term)
  for (int r = 0; r < R; ++r) {
    const int32_t* sum16 = x.sum16.data() + (r0 + r) * (depth / 16) + k0 / 16;
    sums[r] = w.group == 16 ? sum16[0] : sum16[0] + sum16[1];
    for (int t = 0; t < T; ++t) acc[r][t] = Int8Broadcast(-Offset(Kind) * sums[r]);
  }
  // two steps of 4 k a dot (DotAdd2) where several rows share the weights and there is no VNNI; one row: the
  // widening bounds it, and the second step's weights in registers cost more than the dots save (avx2: 8.5 vs
  // 8.1 ms for a token's layers, one thread)
  if constexpr (KQUANT_PAIRED_DOTS && R > 1) {
    for (int64_t k = k0; k < k0 + w.group; k += 8) {
      IntVec v[T], u[T];
      for (int t = 0; t < T; ++t) {
        v[t] = weights(k, t);
        u[t] = weights(k + 4, t);
      }
      for (int r = 0; r < R; ++r) {
        int32_t eight[2];
        std::memcpy(eight, x.q.data() + (r0 + r) * depth + k, sizeof(eight));
        const IntVec xv = Int8Broadcast(eight[0]), xu = Int8Broadcast(eight[1]);
        for (int t = 0; t < T; ++t) acc[r][t] = DotAdd2(acc[r][t], v[t], xv, u[t], xu);
      }
    }
  } else {
    for (int64_t k = k0; k < k0 + w.group; k += 4) {
      IntVec v[T];
      for (int t = 0; t < T; ++t) v[t] = weights(k, t);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, x.q.data() + (r0 + r) * depth + k, sizeof(four));
        const IntVec xq = Int8Broadcast(four);
        for (int t = 0; t < T; ++t) acc[r][t] = DotAdd(acc[r][t], v[t], xq);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const float dx = x.d[(r0 + r) * (depth / 32) + k0 / 32];
    const VecF dx_vector = Broadcast(dx), min_factor = Broadcast(-dx * float(sums[r]));
    for (int t = 0; t < T; ++t) {
      result(r, t, [&](VecF o) {
        o = Fma(ToFloat(VecI(acc[r][t])), dx_vector * scale[t], o);
        if constexpr (HasMins(Kind)) o = Fma(min_factor, minimum[t], o);
        return o;
      });
    }
  }
}

// One to a few rows: R rows times sub-block g at T vectors of columns from c, widened from the planes as the
// tile goes (a weight byte serves few rows), added into the result.
template <int Kind, int R, int T>
inline void Int8Tile(const Weight& w, const QuantizedRows& x, int64_t r0, int64_t g, int64_t c, const Target& target) {
  const Int8Widener<Kind> widen;
  VecF scale[T], minimum[T];
  for (int t = 0; t < T; ++t) {
    scale[t] = ScaleVector<Kind>(w, g, c + kLanes * t);
    if constexpr (HasMins(Kind)) minimum[t] = MinVector<Kind>(w, g, c + kLanes * t);
  }
  const auto weights = [&](int64_t k, int t) { return widen(w, k, c + kLanes * t); };
  const auto result = [&](int r, int t, auto add) {
    float* out = target.At(r0 + r, c + kLanes * t);
    StoreF(out, add(LoadF(out)));
  };
  Int8SubBlock<Kind, R, T>(w, x, r0, g, weights, scale, minimum, result);
}

#if !defined(__AVX512F__)
// One or two rows on AVX2, R rows times T vectors of 8 columns (T even) at sub-block g from c: the weights in
// 16-bit lanes, the two k of one low-plane byte (k even, k + 1) as a vpmaddubsw pair, 16 columns a vector (one
// vpmovzxbw a low-plane row, against two vpmovzxbd a 4-k lane), their pair sums added in int16 over a chunk of k
// (at most 32767: 8 pairs of Q4_K's q <= 15, 4 of Q5's <= 31 (a high-plane byte's 8 k), 2 of Q6_K's <= 63 (its
// byte's 4 k); |q_x| <= 127), then widened into int32 column order (low 128 bits: columns 0-7, high: 8-15). The
// same integers as Int8SubBlock, the same float operations after: the same results (about two thirds of its
// instructions at one row).
template <int Kind, int R, int T>
inline void Int8PairTile(const Weight& w, const QuantizedRows& x, int64_t r0, int64_t g, int64_t c,
                         const Target& target) {
  static_assert(T % 2 == 0, "16 columns a pair vector");
  constexpr int kPairVectors = T / 2, kBits = HighBits(Kind);
  constexpr int64_t kChunk = kBits == 1 ? 8 : kBits == 2 ? 4 : 16;  // k summed in int16 before widening
  const int64_t n = w.columns, depth = x.depth, k0 = g * w.group;
  int32_t q_sums[R];
  __m256i acc[R][T];
  for (int r = 0; r < R; ++r) {
    const int32_t* sum16 = x.sum16.data() + (r0 + r) * (depth / 16) + k0 / 16;
    q_sums[r] = w.group == 16 ? sum16[0] : sum16[0] + sum16[1];
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_set1_epi32(-Offset(Kind) * q_sums[r]);
  }
  const __m256i nibbles = _mm256_set1_epi16(0x0F0F), high_mask = _mm256_set1_epi16(kBits == 1 ? 0x1010 : 0x3030);
  for (int64_t k = k0; k < k0 + w.group; k += kChunk) {
    __m256i high[kPairVectors], sums[R][kPairVectors];
    for (int v = 0; v < kPairVectors; ++v) {
      for (int r = 0; r < R; ++r) sums[r][v] = _mm256_setzero_si256();
      if constexpr (kBits > 0) {
        const uint8_t* h = w.high + (k / kChunk) * n + c + 16 * v;
        high[v] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
      }
    }
#pragma GCC unroll 8
    for (int p = 0; p < kChunk / 2; ++p) {
      __m256i xq[R];
      for (int r = 0; r < R; ++r) {
        int16_t pair;
        std::memcpy(&pair, x.q.data() + (r0 + r) * depth + k + 2 * p, sizeof(pair));
        xq[r] = _mm256_set1_epi16(pair);
      }
      for (int v = 0; v < kPairVectors; ++v) {
        const uint8_t* low = w.low + (k / 2 + p) * n + c + 16 * v;
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low)));
        __m256i lane = _mm256_and_si256(_mm256_or_si256(b, _mm256_slli_epi16(b, 4)), nibbles);
        if constexpr (kBits == 1) {  // bits 2p, 2p + 1 of the byte to bits 4 and 12
          const __m256i spread = _mm256_or_si256(ShiftLeft16(high[v], 4 - 2 * p), ShiftLeft16(high[v], 11 - 2 * p));
          lane = _mm256_or_si256(lane, _mm256_and_si256(spread, high_mask));
        } else if constexpr (kBits == 2) {  // bits 4p .. 4p + 3 to bits 4-5 and 12-13
          const __m256i spread = _mm256_or_si256(ShiftLeft16(high[v], 4 - 4 * p), ShiftLeft16(high[v], 10 - 4 * p));
          lane = _mm256_or_si256(lane, _mm256_and_si256(spread, high_mask));
        }
        for (int r = 0; r < R; ++r) sums[r][v] = _mm256_add_epi16(sums[r][v], _mm256_maddubs_epi16(lane, xq[r]));
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < kPairVectors; ++v) {
        const __m256i low_half = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(sums[r][v]));
        const __m256i high_half = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(sums[r][v], 1));
        acc[r][2 * v] = _mm256_add_epi32(acc[r][2 * v], low_half);
        acc[r][2 * v + 1] = _mm256_add_epi32(acc[r][2 * v + 1], high_half);
      }
    }
  }
  VecF scale[T], minimum[T];
  for (int t = 0; t < T; ++t) {
    scale[t] = ScaleVector<Kind>(w, g, c + kLanes * t);
    if constexpr (HasMins(Kind)) minimum[t] = MinVector<Kind>(w, g, c + kLanes * t);
  }
  for (int r = 0; r < R; ++r) {  // as Int8SubBlock's
    const float dx = x.d[(r0 + r) * (depth / 32) + k0 / 32];
    const VecF dx_vector = Broadcast(dx), min_factor = Broadcast(-dx * float(q_sums[r]));
    for (int t = 0; t < T; ++t) {
      float* out = target.At(r0 + r, c + kLanes * t);
      VecF o = Fma(ToFloat(VecI(acc[r][t])), dx_vector * scale[t], LoadF(out));
      if constexpr (HasMins(Kind)) o = Fma(min_factor, minimum[t], o);
      StoreF(out, o);
    }
  }
}
#endif

// Many rows: an item's weights widened once (WidenItem), with their sub-blocks' scales and mins, for every row
// group to read (the widening costs about as many instructions as 8 rows' vpdpbusd).
struct WidenedItem {
  const IntVec* vectors;   // [(g1 - g0) * group / 4 steps of 4 k, stride]
  const VecF* scales;      // [g1 - g0, stride]: ScaleVector
  const VecF* mins;        // [g1 - g0, stride]: MinVector (kinds with mins)
  int64_t g0, g1, c0, stride;  // sub-blocks, first column, full vectors of columns
};

// Sub-blocks g0 .. g1 of columns c0 .. c0 + kLanes * stride into `item`'s arrays (planes walked along their rows).
template <int Kind>
void WidenItem(const Weight& w, const WidenedItem& item) {
  const Int8Widener<Kind> widen;
  IntVec* vectors = const_cast<IntVec*>(item.vectors);
  for (int64_t k = item.g0 * w.group; k < item.g1 * w.group; k += 4, vectors += item.stride) {
    for (int64_t v = 0; v < item.stride; ++v) vectors[v] = widen(w, k, item.c0 + kLanes * v);
  }
  for (int64_t g = item.g0; g < item.g1; ++g) {
    for (int64_t v = 0; v < item.stride; ++v) {
      const int64_t i = (g - item.g0) * item.stride + v;
      const_cast<VecF*>(item.scales)[i] = ScaleVector<Kind>(w, g, item.c0 + kLanes * v);
      if constexpr (HasMins(Kind)) const_cast<VecF*>(item.mins)[i] = MinVector<Kind>(w, g, item.c0 + kLanes * v);
    }
  }
}

// Rows per widened tile and its vectors of columns: R * T int32 sums, R * T float results and T weights in
// the registers (x's four bytes are the dot's broadcast operand: 32 on AVX-512, 16 on AVX2); the vectors divide
// the items' 64-column widths.
#if defined(__AVX512F__)
constexpr int kWidenedRows = 3, kWidenedVectors = 4;
#else
constexpr int kWidenedRows = 2, kWidenedVectors = 2;
#endif

// R rows times the widened item's sub-blocks at T vectors from vector v0: the results held in registers
// over all the sub-blocks (added in sub-block order, as the one-pass tiles add them: the same floats).
template <int Kind, int R, int T>
inline void Int8WidenedTile(const Weight& w, const QuantizedRows& x, int64_t r0, const WidenedItem& item, int64_t v0,
                            const Target& target) {
  const int64_t c = item.c0 + kLanes * v0;
  VecF out[R][T];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) out[r][t] = LoadF(target.At(r0 + r, c + kLanes * t));
  }
  for (int64_t g = item.g0; g < item.g1; ++g) {
    const int64_t first = (g - item.g0) * item.stride + v0;
    const IntVec* vectors = item.vectors + (g - item.g0) * (w.group / 4) * item.stride + v0;
    const int64_t k0 = g * w.group;
    const auto weights = [&](int64_t k, int t) { return vectors[(k - k0) / 4 * item.stride + t]; };
    VecF scale[T], minimum[T];
    for (int t = 0; t < T; ++t) {
      scale[t] = item.scales[first + t];
      if constexpr (HasMins(Kind)) minimum[t] = item.mins[first + t];
    }
    Int8SubBlock<Kind, R, T>(w, x, r0, g, weights, scale, minimum,
                             [&](int r, int t, auto add) { out[r][t] = add(out[r][t]); });
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) StoreF(target.At(r0 + r, c + kLanes * t), out[r][t]);
  }
}

template <int Kind, int R>
void Int8WidenedRows(const Weight& w, const QuantizedRows& x, int64_t r0, const WidenedItem& item,
                     const Target& target) {
  int64_t v = 0;
  for (; v + kWidenedVectors <= item.stride; v += kWidenedVectors) {
    Int8WidenedTile<Kind, R, kWidenedVectors>(w, x, r0, item, v, target);
  }
  for (; v < item.stride; ++v) Int8WidenedTile<Kind, R, 1>(w, x, r0, item, v, target);
}

// R rows of quantized x times sub-block g at column c, one column (the tails: the same integers, the same
// scaling as the tiles).
template <int Kind, int R>
inline void Int8Column(const Weight& w, const QuantizedRows& x, int64_t r0, int64_t g, int64_t c,
                       const Target& target) {
  const float scale = ScaleAt<Kind>(w, g, c), minimum = MinAt<Kind>(w, g, c);
  for (int r = 0; r < R; ++r) {
    const int8_t* q = x.q.data() + (r0 + r) * x.depth;
    int32_t sum = 0, q_sum = 0;
    for (int64_t k = g * w.group; k < (g + 1) * w.group; ++k) {
      sum += int32_t(q[k]) * Integer<Kind>(w, k, c);
      q_sum += q[k];
    }
    const float dx = x.d[(r0 + r) * (x.depth / 32) + g * w.group / 32];
    float& out = *target.At(r0 + r, c);
    out += float(sum) * (dx * scale);
    if (HasMins(Kind)) out -= dx * float(q_sum) * minimum;
  }
}

// Many rows, x quantized: the item's full vectors of columns widened once (WidenItem, into this thread's
// buffer: K / 4 * 16 vectors at most, 1.5 MB for K 6144), then every kWidenedRows rows pass over all of it
// with their results in registers; the columns past the last vector one at a time. A weight byte is read
// from memory and widened once per call (the one-pass tiles: once per 8 rows, and results loaded and stored
// per sub-block). The same integers and float operations as the one-pass tiles: the same results.
template <int Kind>
void ManyRowsItem(const Weight& w, const QuantizedRows& x, int64_t g0, int64_t g1, int64_t c0, int64_t width,
                  const Target& target) {
  struct alignas(64) Line {
    uint8_t bytes[64];
  };
  thread_local std::vector<Line> buffer;
  const int64_t stride = width / kLanes, steps = (g1 - g0) * w.group / 4, scales = (g1 - g0) * stride;
  buffer.resize(std::max<size_t>(buffer.size(), size_t(steps * stride + 2 * scales)));
  const IntVec* vectors = reinterpret_cast<const IntVec*>(buffer.data());
  const VecF* scale_vectors = reinterpret_cast<const VecF*>(buffer.data() + steps * stride);
  const WidenedItem item{vectors, scale_vectors, scale_vectors + scales, g0, g1, c0, stride};
  WidenItem<Kind>(w, item);
  int64_t r0 = 0;
  for (; r0 + kWidenedRows <= x.rows; r0 += kWidenedRows) Int8WidenedRows<Kind, kWidenedRows>(w, x, r0, item, target);
  static_assert(kWidenedRows <= 3, "the rest below");
  if (x.rows - r0 == 2) Int8WidenedRows<Kind, 2>(w, x, r0, item, target);
  if (x.rows - r0 == 1) Int8WidenedRows<Kind, 1>(w, x, r0, item, target);
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t c = c0 + stride * kLanes; c < c0 + width; ++c) {
      for (r0 = 0; r0 < x.rows; ++r0) Int8Column<Kind, 1>(w, x, r0, g, c, target);
    }
  }
}
#endif
