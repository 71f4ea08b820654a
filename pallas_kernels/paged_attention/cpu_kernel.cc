// Paged attention for the CPU, as XLA FFI custom calls: the same contracts as reference.py, for
// float32, bfloat16 and float16 pages (16-bit pages also beside float32 queries: cache.kv_dtype).
//
// Attention is split by query block: each block (one sequence's query tokens) walks its sequence's
// pages in tiles of kKeysPerTile keys, reading K/V in place through the page table, with an online
// softmax in float32. 16-bit keys and values are widened to float32 a tile at a time, so a step
// converts only the keys it reads: XLA:CPU itself widens 16-bit gathers and scatters over the whole
// page pool. Blocks (and, when there are few, ranges of their keys) are spread over the caller and
// helper threads (../cpu_workers.h).
//
// Attention sinks (GPT-OSS), when given, are one logit per query head that joins every row's softmax
// denominator without a value: a row's output is its values' weighted sum over (sum of key weights +
// exp(sink)), all taken relative to one max.
//
// Quantized pages (cache.kv_dtype int8 / float8_e4m3, kv_quantization.py) hold one byte per value and a
// float32 scale per token and KV head: a tile's keys and values are widened to float32 and scaled as they
// are read, so the step reads a quarter (of float32 pages) or half (of 16-bit pages) of the bytes.
//
// The KV write copies each token's [K, D] row into its KV index (page * page_size + offset) of the pages, which the call returns
// aliased (XLA passes the donated pool itself, so the write is in place).
//
// Compiled at first use by pallas_kernels/cpu_library.py with -march=native, into one library with
// the small matmul (matmul/cpu_matmul.cc): they share the helper threads.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "cpu_attention_basics.h"
#include "cpu_workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kKeysPerTile = 64;
// A block's keys are attended in ranges of whole tiles, each with its own online softmax, folded in key order:
// fixed by the key positions alone, so that one thread or several may attend a block's ranges with the same
// result (AttendRange). The ranges start at keys 0, 64, 128, 256 and 512, then every 512 keys (RangeStart): fine
// at the start, where a single stream's keys then split over the threads in whole key rows from 65 keys on, and
// 512 keys from 512 on, where every range's fold (FoldState: two exps and a D-wide update a row, on the thread
// that merges them) would cost more than a finer split gains (session 37: ranges of 64 keys throughout took
// 1.08-1.1x the time at 1000-2000 keys). Before, every range was 512 keys, and one sequence under 512 keys split
// its kv heads instead: two heads on one thread and one on the other (3 kv heads), each reading a third of every
// key row.
constexpr int64_t kKeysPerLongRange = 512;
// The first key of range `index`, and the range of `key`.
inline int64_t RangeStart(int64_t index) {
  return index <= 3 ? (index == 0 ? 0 : kKeysPerTile << (index - 1)) : kKeysPerLongRange * (index - 3);
}
inline int64_t RangeOf(int64_t key) {
  if (key >= kKeysPerLongRange) return 3 + key / kKeysPerLongRange;
  return key < kKeysPerTile ? 0 : key < 2 * kKeysPerTile ? 1 : key < 4 * kKeysPerTile ? 2 : 3;
}
// The 16-bit float types, their widening and rounding, the online softmax's exp and the dot product are
// shared with the latent kernel (cpu_attention_basics.h); this kernel adds the quantized page types.
using jaxserve_cpu_attention::BFloat16;
using jaxserve_cpu_attention::ExpNonpositive;
using jaxserve_cpu_attention::ExpOfReduced;
using jaxserve_cpu_attention::kExpLowest;
using jaxserve_cpu_attention::kLog2E;
using jaxserve_cpu_attention::ReduceByLn2;
using jaxserve_cpu_attention::Float16;
using jaxserve_cpu_attention::FromFloat;
using jaxserve_cpu_attention::kNegativeInfinity;
using jaxserve_cpu_attention::ToFloat;

// float8_e4m3fn as stored: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities.
struct Float8E4M3 {
  uint8_t bits;
};

inline float ToFloat(int8_t x) { return float(x); }

// All 256 float8_e4m3fn values, decoded once: a table lookup widens a byte.
struct Float8Table {
  float values[256];
  Float8Table() {
    for (int bits = 0; bits < 256; ++bits) {
      const int exponent = (bits >> 3) & 0xf, mantissa = bits & 0x7;
      float magnitude = exponent == 0 ? std::ldexp(float(mantissa), -9)  // subnormal: m / 8 * 2^-6
                                      : std::ldexp(1.0f + float(mantissa) / 8.0f, exponent - 7);
      if (exponent == 0xf && mantissa == 0x7) magnitude = std::numeric_limits<float>::quiet_NaN();
      values[bits] = (bits & 0x80) ? -magnitude : magnitude;
    }
  }
};

inline float ToFloat(Float8E4M3 x) {
  static const Float8Table table;
  return table.values[x.bits];
}

// n values as float32: the source itself when it is float32, else widened into `scratch`.
template <typename T>
inline const float* AsFloat(const T* source, int64_t n, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return source;
  } else if constexpr (std::is_same_v<T, Float16>) {
    WidenFloat16(source, n, scratch);
    return scratch;
  } else {
    for (int64_t i = 0; i < n; ++i) scratch[i] = ToFloat(source[i]);
    return scratch;
  }
}

// Kv heads [kv_begin, kv_end) of one token's page row ([K, D]) as float32, at their offsets in the row (k * D),
// each kv head's D scaled by its scale when the pages are quantized (scales non-null: [K]); the source itself
// when it is float32 and unscaled. An item attending some kv heads widens only theirs.
template <typename PageT>
inline const float* RowAsFloat(const PageT* source, const float* scales, int64_t kv_begin, int64_t kv_end,
                               int64_t head_dim, float* scratch) {
  const int64_t begin = kv_begin * head_dim;
  if (scales == nullptr) return AsFloat(source + begin, (kv_end - kv_begin) * head_dim, scratch + begin) - begin;
  for (int64_t k = kv_begin; k < kv_end; ++k) {
    const float scale = scales[k];
    for (int64_t d = 0; d < head_dim; ++d) scratch[k * head_dim + d] = ToFloat(source[k * head_dim + d]) * scale;
  }
  return scratch;
}

// One vector register of floats on the instruction path the flags chose (cpu_library.py): 16 lanes on AVX-512, 8 on
// AVX2, 4 otherwise. (A 16-lane vector type on AVX2 compiled to code three times slower than the scalar loop.)
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
constexpr int kValueVectors = 4;  // AddWeightedRows' accumulators: 64 columns
#elif defined(__AVX2__)
constexpr int64_t kLanes = 8;
constexpr int kValueVectors = 8;  // 64 columns in 8 of the 16 registers
#else
constexpr int64_t kLanes = 4;
constexpr int kValueVectors = 4;
#endif
typedef float Lanes __attribute__((vector_size(4 * kLanes)));
typedef float Floats4 __attribute__((vector_size(16)));

inline Lanes LoadLanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// A vector that `Uses` rows' FMAs read, loaded once into a register: GCC otherwise folds the load into each row's
// FMA (a memory operand per row) and the loads bound the loop (as the matmul tiles' LoadedOnce,
// cpu_matmul_few_rows.h, session 43). The same arithmetic: the same bits.
template <int Uses>
inline Lanes LoadedOnce(const float* p) {
  Lanes v = LoadLanes(p);
  if constexpr (Uses > 1) {
#if defined(__x86_64__) || defined(__i386__)
    asm("" : "+v"(v));
#elif defined(__aarch64__)
    asm("" : "+w"(v));
#endif
  }
  return v;
}

// A vector's lanes added in a tree of halves (the upper half onto the lower) down to 4, then pairs.
inline float SumLanes(Lanes v) {
  Floats4 sum4;
  if constexpr (kLanes == 16) {
    typedef float Floats8 __attribute__((vector_size(32)));
    Floats8 low8, high8;
    std::memcpy(&low8, &v, sizeof(low8));
    std::memcpy(&high8, reinterpret_cast<const char*>(&v) + sizeof(low8), sizeof(high8));
    const Floats8 sum8 = low8 + high8;
    Floats4 low4, high4;
    std::memcpy(&low4, &sum8, sizeof(low4));
    std::memcpy(&high4, reinterpret_cast<const char*>(&sum8) + sizeof(low4), sizeof(high4));
    sum4 = low4 + high4;
  } else if constexpr (kLanes == 8) {
    Floats4 low4, high4;
    std::memcpy(&low4, &v, sizeof(low4));
    std::memcpy(&high4, reinterpret_cast<const char*>(&v) + sizeof(low4), sizeof(high4));
    sum4 = low4 + high4;
  } else {
    std::memcpy(&sum4, &v, sizeof(sum4));
  }
  return (sum4[0] + sum4[2]) + (sum4[1] + sum4[3]);
}

typedef int32_t LaneInts __attribute__((vector_size(4 * kLanes)));

inline Lanes LanesMax(Lanes a, Lanes b) { return a > b ? a : b; }

// ExpNonpositive's arithmetic on a vector (a tile's weights): floor by truncation and a correction, for every
// path's vector type (SSE2 has no vector floor). Within a few ulp of expf as the scalar form; the weights of a
// tile all come from this one function, whatever the row's block.
inline Lanes ExpNonpositiveLanes(Lanes x) {
  const Lanes clamped = LanesMax(x, Lanes{} + kExpLowest);
  const Lanes y = clamped * kLog2E + 0.5f;
  const LaneInts truncated = __builtin_convertvector(y, LaneInts);
  const Lanes n = __builtin_convertvector(truncated, Lanes) - (__builtin_convertvector(truncated, Lanes) > y ? 1.0f : 0.0f);
  const Lanes r = ExpOfReduced(ReduceByLn2(clamped, n));
  const LaneInts exponent_bits = (__builtin_convertvector(n, LaneInts) + 127) << 23;
  Lanes scale;
  std::memcpy(&scale, &exponent_bits, sizeof(scale));
  return x < kExpLowest ? Lanes{} : r * scale;
}

// LaneTreeDot: a query row's dot product with a key row (decode: a few query rows per kv head), in lanes of
// partial sums (two vectors of them, sum0 and sum1, over alternate vectors of the row) added in a tree at the end
// (SumLanes), then the row's tail fused one term at a time. The omp simd reduction it replaced
// (jaxserve_cpu_attention::Dot) ended every score with kLanes dependent scalar adds: most of a decode step's
// attention (issue 29). Here for R query rows with one key row: each row the same bits as alone, the key's vectors
// loaded once for the R rows (a decode token's query heads that share a kv head; session 30: 0.8x the time).
template <int R>
inline void LaneTreeDotRows(const float* const* queries, const float* key, int64_t n, float* const* scores,
                            int64_t t) {
  Lanes sum0[R] = {}, sum1[R] = {};
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    const Lanes k0 = LoadLanes(key + i), k1 = LoadLanes(key + i + kLanes);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      sum0[r] += LoadLanes(queries[r] + i) * k0;
      sum1[r] += LoadLanes(queries[r] + i + kLanes) * k1;
    }
  }
  for (; i + kLanes <= n; i += kLanes) {
    const Lanes k0 = LoadLanes(key + i);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) sum0[r] += LoadLanes(queries[r] + i) * k0;
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    float sum = SumLanes(sum0[r] + sum1[r]);
    for (int64_t j = i; j < n; ++j) sum = std::fma(queries[r][j], key[j], sum);  // as LaneTreeDotsTransposed's tail
    scores[r][t] = sum;
  }
}

// accumulator[d] += sum over keys t (in order) of weights[t] * rows[t][offset + d], d < n, keys of weight 0
// skipped (a masked key's value may be anything). kValueVectors vectors of columns stay in registers across
// the keys: the loop this replaces loaded and stored the accumulator at every key, each key's adds waiting
// on the previous key's stores.
inline void AddWeightedRows(float* accumulator, const float* const* rows, int64_t offset, const float* weights,
                            int64_t count, int64_t n) {
  constexpr int64_t kBlock = kValueVectors * kLanes;
  int64_t d = 0;
  for (; d + kBlock <= n; d += kBlock) {
    Lanes sums[kValueVectors];
#pragma GCC unroll 8
    for (int v = 0; v < kValueVectors; ++v) sums[v] = LoadLanes(accumulator + d + v * kLanes);
    for (int64_t t = 0; t < count; ++t) {
      const float weight = weights[t];
      if (weight == 0.0f) continue;
      const float* value = rows[t] + offset + d;
#pragma GCC unroll 8
      for (int v = 0; v < kValueVectors; ++v) sums[v] += weight * LoadLanes(value + v * kLanes);
    }
#pragma GCC unroll 8
    for (int v = 0; v < kValueVectors; ++v) std::memcpy(accumulator + d + v * kLanes, &sums[v], sizeof(Lanes));
  }
  for (; d + kLanes <= n; d += kLanes) {
    Lanes sum = LoadLanes(accumulator + d);
    for (int64_t t = 0; t < count; ++t) {
      if (weights[t] != 0.0f) sum += weights[t] * LoadLanes(rows[t] + offset + d);
    }
    std::memcpy(accumulator + d, &sum, sizeof(sum));
  }
  for (; d < n; ++d) {
    float sum = accumulator[d];
    // Fused whatever the compiler makes of the loop: an if-converted vector body multiplied, then added, while
    // its scalar remainder fused, so a row's result depended on how many keys its block read.
    for (int64_t t = 0; t < count; ++t) {
      if (weights[t] != 0.0f) sum = std::fma(weights[t], rows[t][offset + d], sum);
    }
    accumulator[d] = sum;
  }
}

// T: the queries' and output's type; PageT: the pages' (T, or int8_t / Float8E4M3 with scales).
template <typename T, typename PageT>
struct Problem {
  const T* q;                    // [T, H, D]
  const PageT* k_pages;          // [num_pages, page_size, K, D]
  const PageT* v_pages;          // [num_pages, page_size, K, D]
  const float* k_scales;         // [num_pages, page_size, K] for quantized pages, else null
  const float* v_scales;         // [num_pages, page_size, K] for quantized pages, else null
  const int32_t* page_table;     // [S, P]
  const int32_t* token_seq_ids;  // [T]
  const int32_t* positions;      // [T]
  const float* sinks;            // [H], or null: no sinks
  T* out;                        // [T, H, D]
  int64_t num_heads, num_kv_heads, head_dim, page_size, pages_per_seq, query_block, sliding_window;
  float scale;
  float soft_cap;  // scores become soft_cap * tanh(score / soft_cap) when > 0 (Gemma 2)
};

// A worker's buffers, kept across the blocks it takes. `running_*` and `accumulator`: the softmax state of the
// range being attended; `folded_*`: the ranges before it, folded (FoldState).
struct Scratch {
  std::vector<float> queries, accumulator, scores, running_max, denominator, keys_transposed, key_tile, value_tile;
  std::vector<float> folded_max, folded_denominator, folded_accumulator;
};

// A row's output scale, 1 / denominator, with the row's sink (if any) folded into its softmax state: the
// accumulator is rescaled by `rescale` to the max both share. Zero for a row that saw nothing.
inline float OutputScale(float running_max, float denominator, const float* sink, float& rescale) {
  rescale = 1.0f;
  if (sink != nullptr) {
    const float max = std::max(running_max, *sink);
    rescale = ExpNonpositive(running_max - max);  // 0 when no key was seen (-inf)
    denominator = denominator * rescale + ExpNonpositive(*sink - max);
  }
  return denominator > 0.0f ? rescale / denominator : 0.0f;
}

// One row's softmax state over some keys: the running max, the denominator and the unnormalized [D] accumulator.
// A key range's state is folded into the state of the ranges before it, in key order. One function, not
// inlined, so that the fold is the same arithmetic whether one thread attended all of a block's ranges or each
// range ran on its own thread (AttendAllBlocks).
__attribute__((noinline)) void FoldState(float& max, float& denominator, float* accumulator, float range_max,
                                         float range_denominator, const float* range_accumulator, int64_t D) {
  if (range_denominator <= 0.0f) return;  // the range saw no key of this row
  if (denominator <= 0.0f) {
    max = range_max;
    denominator = range_denominator;
    std::copy(range_accumulator, range_accumulator + D, accumulator);
    return;
  }
  const float new_max = std::max(max, range_max);
  const float before = ExpNonpositive(max - new_max), range = ExpNonpositive(range_max - new_max);
  denominator = denominator * before + range_denominator * range;
  for (int64_t d = 0; d < D; ++d) accumulator[d] = accumulator[d] * before + range_accumulator[d] * range;
  max = new_max;
}

// A block's state over one range of keys (AttendAllBlocks' items when a few blocks split their ranges over
// the threads), per row.
struct PartialState {
  float* max;          // [rows]
  float* denominator;  // [rows]
  float* accumulator;  // [rows, D]
};

// Scores of a query row against a tile of keys stored transposed ([n][kKeysPerTile]), each the same bits as
// LaneTreeDot(query, key, n): the same products in the same lanes, the same tree. So a row scores alike whether
// its block computed per key (few query rows per kv head: decode) or across keys (many: prefill, verify).
inline void LaneTreeDotsTransposed(const float* query, const float* keys_transposed, int64_t n, float* scores) {
  constexpr int64_t T = kKeysPerTile;
  const int64_t pairs_end = n / (2 * kLanes) * (2 * kLanes);  // LaneTreeDot's sum0 / sum1 loop
  const int64_t lanes_end = n / kLanes * kLanes;              // then one more vector into sum0, or none
  float lanes[kLanes][T];
  for (int64_t l = 0; l < kLanes; ++l) {
    float sum0[T] = {}, sum1[T] = {};
    for (int64_t i = 0; i < pairs_end; i += 2 * kLanes) {
      const float q0 = query[i + l], q1 = query[i + kLanes + l];
      const float* k0 = keys_transposed + (i + l) * T;
      const float* k1 = keys_transposed + (i + kLanes + l) * T;
#pragma omp simd
      for (int64_t t = 0; t < T; ++t) {
        sum0[t] += q0 * k0[t];
        sum1[t] += q1 * k1[t];
      }
    }
    if (lanes_end > pairs_end) {
      const float q0 = query[pairs_end + l];
      const float* k0 = keys_transposed + (pairs_end + l) * T;
#pragma omp simd
      for (int64_t t = 0; t < T; ++t) sum0[t] += q0 * k0[t];
    }
#pragma omp simd
    for (int64_t t = 0; t < T; ++t) lanes[l][t] = sum0[t] + sum1[t];
  }
  for (int64_t half = kLanes / 2; half >= 4; half /= 2) {  // SumLanes: the upper half onto the lower, down to 4
    for (int64_t l = 0; l < half; ++l) {
#pragma omp simd
      for (int64_t t = 0; t < T; ++t) lanes[l][t] = lanes[l][t] + lanes[l + half][t];
    }
  }
#pragma omp simd
  for (int64_t t = 0; t < T; ++t) scores[t] = (lanes[0][t] + lanes[2][t]) + (lanes[1][t] + lanes[3][t]);
  for (int64_t d = lanes_end; d < n; ++d) {  // LaneTreeDot's scalar tail
    const float q_d = query[d];
    const float* k_d = keys_transposed + d * T;
#pragma omp simd
    for (int64_t t = 0; t < T; ++t) scores[t] = std::fma(q_d, k_d[t], scores[t]);
  }
}

// Rows of a kv head attended together in a prefill or verify block (LaneTreeDotsTransposedRows,
// AddWeightedRowsRows).
constexpr int kRowGroup = 4;

// f(std::integral_constant<int, rows>) for rows in 1..kRowGroup (nothing for 0).
template <typename F>
inline void WithRows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    default: return;
  }
}

// LaneTreeDotsTransposed for R query rows at once (prefill and verify blocks: the rows of a kv head share the
// tile's keys), each row's scores the same bits: every lane sums the same products in the same order and the
// lanes meet in the same tree, here in registers, a chunk of kLanes keys at a time (the lanes and the tree went
// through memory: 4 KiB-apart stores and loads), each key vector loaded once for the rows of a pair.
template <int R>
inline void LaneTreeDotsTransposedRowPair(const float* const* queries, const float* keys_transposed, int64_t n,
                                          float* const* scores) {
  constexpr int64_t T = kKeysPerTile;
  constexpr int64_t kKept = kLanes >= 8 ? kLanes / 2 : kLanes;  // lanes left after the tree's first level
  const int64_t pairs_end = n / (2 * kLanes) * (2 * kLanes), lanes_end = n / kLanes * kLanes;
  // lane l's sums (sum0 + sum1 of LaneTreeDotsTransposed) for keys [c, c + kLanes), per row
  auto lane_sums = [&](int64_t l, int64_t c, Lanes* out) {
    Lanes sum0[R] = {}, sum1[R] = {};
    for (int64_t i = 0; i < pairs_end; i += 2 * kLanes) {
      const Lanes k0 = LoadedOnce<R>(keys_transposed + (i + l) * T + c);
      const Lanes k1 = LoadedOnce<R>(keys_transposed + (i + kLanes + l) * T + c);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) {
        sum0[r] += queries[r][i + l] * k0;
        sum1[r] += queries[r][i + kLanes + l] * k1;
      }
    }
    if (lanes_end > pairs_end) {
      const Lanes k0 = LoadedOnce<R>(keys_transposed + (pairs_end + l) * T + c);
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) sum0[r] += queries[r][pairs_end + l] * k0;
    }
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) out[r] = sum0[r] + sum1[r];
  };
  for (int64_t c = 0; c < T; c += kLanes) {
    Lanes kept[R][kKept];
#pragma GCC unroll 8
    for (int64_t l = 0; l < kKept; ++l) {
      Lanes low[R];
      lane_sums(l, c, low);
      if constexpr (kLanes >= 8) {
        Lanes high[R];
        lane_sums(l + kKept, c, high);
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) kept[r][l] = low[r] + high[r];
      } else {
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) kept[r][l] = low[r];
      }
    }
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int64_t half = kKept / 2; half >= 4; half /= 2) {
#pragma GCC unroll 8
        for (int64_t l = 0; l < half; ++l) kept[r][l] = kept[r][l] + kept[r][l + half];
      }
      const Lanes chunk = (kept[r][0] + kept[r][2]) + (kept[r][1] + kept[r][3]);
      std::memcpy(scores[r] + c, &chunk, sizeof(chunk));
    }
  }
  for (int r = 0; r < R; ++r) {  // LaneTreeDotsTransposed's scalar tail
    for (int64_t d = lanes_end; d < n; ++d) {
      const float q_d = queries[r][d];
      const float* k_d = keys_transposed + d * T;
#pragma omp simd
      for (int64_t t = 0; t < T; ++t) scores[r][t] = std::fma(q_d, k_d[t], scores[r][t]);
    }
  }
}

template <int R>
void LaneTreeDotsTransposedRows(const float* const* queries, const float* keys_transposed, int64_t n,
                                float* const* scores) {
  int r = 0;
  for (; r + 2 <= R; r += 2) LaneTreeDotsTransposedRowPair<2>(queries + r, keys_transposed, n, scores + r);
  if (r < R) LaneTreeDotsTransposedRowPair<1>(queries + r, keys_transposed, n, scores + r);
}

// AddWeightedRows for R rows at once over the same value rows: each value vector loaded once for all R rows,
// each row's sums the same operations in the same key order as AddWeightedRows (a key of weight 0 skipped per
// row), in blocks of kRowsValueVectors vectors of columns, then AddWeightedRows' own loops per row for the rest.
#if defined(__AVX512F__)
constexpr int kRowsValueVectors = 4;  // R (4) x 4 accumulators + 4 values within 32 registers
#else
constexpr int kRowsValueVectors = 2;  // within 16 registers
#endif
template <int R>
void AddWeightedRowsRows(float* const* accumulators, const float* const* rows, int64_t offset,
                         const float* const* weights, int64_t count, int64_t n) {
  constexpr int64_t kBlock = kRowsValueVectors * kLanes;
  // Keys whose weight is nonzero in every row (all but a causal tail's and underflows, in a verify or prefill
  // block), found once for all blocks of columns: their rows add without a branch each (session 43: a branch per
  // row and key was a third of this loop's time). The same adds in the same order either way.
  bool every_row[kKeysPerTile];
  const int64_t flagged = std::min(count, kKeysPerTile);
  for (int64_t t = 0; t < flagged; ++t) {
    bool all = true;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) all = all && weights[r][t] != 0.0f;
    every_row[t] = all;
  }
  int64_t d = 0;
  for (; d + kBlock <= n; d += kBlock) {
    Lanes sums[R][kRowsValueVectors];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < kRowsValueVectors; ++v) sums[r][v] = LoadLanes(accumulators[r] + d + v * kLanes);
    for (int64_t t = 0; t < count; ++t) {
      const float* value = rows[t] + offset + d;
      Lanes values[kRowsValueVectors];
#pragma GCC unroll 4
      for (int v = 0; v < kRowsValueVectors; ++v) values[v] = LoadLanes(value + v * kLanes);
      if (t < flagged && every_row[t]) {
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const float weight = weights[r][t];
#pragma GCC unroll 4
          for (int v = 0; v < kRowsValueVectors; ++v) sums[r][v] += weight * values[v];
        }
        continue;
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const float weight = weights[r][t];
        if (weight == 0.0f) continue;
#pragma GCC unroll 4
        for (int v = 0; v < kRowsValueVectors; ++v) sums[r][v] += weight * values[v];
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < kRowsValueVectors; ++v) std::memcpy(accumulators[r] + d + v * kLanes, &sums[r][v], sizeof(Lanes));
  }
  if (d == n) return;
  for (int r = 0; r < R; ++r) AddWeightedRows(accumulators[r] + d, rows, offset + d, weights[r], count, n - d);
}

// f(row) for a block's rows of query heads [head_begin, head_end) (row = b * H + h): the rows of the kv heads an
// item attends.
template <typename F>
inline void ForHeadRows(int64_t query_block, int64_t num_heads, int64_t head_begin, int64_t head_end, F&& f) {
  for (int64_t b = 0; b < query_block; ++b)
    for (int64_t h = head_begin; h < head_end; ++h) f(b * num_heads + h);
}

// The outputs of a block's rows of query heads [head_begin, head_end) from their folded softmax states (a row
// that saw no key stays zero: a sink adds no value).
template <typename T, typename PageT>
void WriteOutputRows(const Problem<T, PageT>& p, T* out, int64_t head_begin, int64_t head_end, const float* max,
                     const float* denominator, const float* accumulator) {
  const int64_t D = p.head_dim;
  ForHeadRows(p.query_block, p.num_heads, head_begin, head_end, [&](int64_t row) {
    if (denominator[row] <= 0.0f) return;
    float rescale;
    const float* sink = p.sinks == nullptr ? nullptr : p.sinks + row % p.num_heads;
    const float inverse = OutputScale(max[row], denominator[row], sink, rescale);
    for (int64_t d = 0; d < D; ++d) out[row * D + d] = FromFloat<T>(accumulator[row * D + d] * inverse);
  });
}

// Rows of a block are (token b, query head h): row = b * H + h, its kv head is h / (H / K).
// Keys [key_begin, key_end) of the block (whole ranges: RangeStart) for the rows of kv heads
// [kv_begin, kv_end): their outputs when `partial` is null, else their softmax state there (key_end - key_begin
// is then one range). Other rows' outputs and states are not touched: items of other kv heads write them.
//
// Each row's arithmetic depends on its own query, position and keys only, never on the other rows of its
// block or on how the block's work was split: tiles are kKeysPerTile keys from key 0, every tile loop runs over
// the whole tile (keys past the row's last are -inf, weight 0), each range (RangeStart) has its own
// online softmax, folded in key order (FoldState), and both ways of scoring give the same bits. A verify row
// (speculation: k + 1 query tokens of a sequence in one block) then computes what a decode row (one) does.
template <typename T, typename PageT>
void AttendRange(const Problem<T, PageT>& p, int64_t block, int64_t kv_begin, int64_t kv_end, int64_t key_begin,
                 int64_t key_end, Scratch& s, const PartialState* partial) {
  const int64_t B = p.query_block, H = p.num_heads, D = p.head_dim, K = p.num_kv_heads;
  const int64_t groups = H / K, rows = B * H, first_token = block * B, row_width = K * D;
  const int64_t head_begin = kv_begin * groups, head_end = kv_end * groups;
  // `width` values per row from `data` set to `value` for this item's rows (one run of heads per token)
  auto fill_rows = [&](auto* data, int64_t width, auto value) {
    for (int64_t b = 0; b < B; ++b) std::fill_n(data + (b * H + head_begin) * width, (head_end - head_begin) * width, value);
  };
  const int32_t* positions = p.positions + first_token;
  const int32_t* pages = p.page_table + int64_t(p.token_seq_ids[first_token]) * p.pages_per_seq;
  int32_t max_position = -1, min_position = std::numeric_limits<int32_t>::max();
  for (int64_t b = 0; b < B; ++b) {
    if (positions[b] < 0) continue;
    max_position = std::max(max_position, positions[b]);
    min_position = std::min(min_position, positions[b]);
  }
  T* out = p.out + first_token * H * D;
  if (partial == nullptr) fill_rows(out, D, FromFloat<T>(0.0f));
  if (partial != nullptr) {
    fill_rows(partial->max, 1, kNegativeInfinity);
    fill_rows(partial->denominator, 1, 0.0f);
    fill_rows(partial->accumulator, D, 0.0f);
  }
  if (max_position < 0) return;  // a block of padding

  // Sized for all of the block's rows, set (and read) for this item's only.
  for (auto* buffer : {&s.queries, &s.accumulator, &s.folded_accumulator}) buffer->resize(rows * D);
  for (auto* buffer : {&s.running_max, &s.denominator, &s.folded_max, &s.folded_denominator}) buffer->resize(rows);
  s.scores.resize(rows * kKeysPerTile);
  fill_rows(s.accumulator.data(), D, 0.0f);
  fill_rows(s.running_max.data(), 1, kNegativeInfinity);
  fill_rows(s.denominator.data(), 1, 0.0f);
  fill_rows(s.folded_max.data(), 1, kNegativeInfinity);
  fill_rows(s.folded_denominator.data(), 1, 0.0f);
  fill_rows(s.folded_accumulator.data(), D, 0.0f);
  // Many query rows per kv head (prefill, verify): transpose the tile's keys once so each row's scores are
  // axpys across keys instead of one horizontal sum per key. The same bits either way (LaneTreeDotsTransposed).
  // Below 12 rows a kv head the rows' dot products with the keys in place are faster (one thread, 30 layers, 444
  // and 1000 keys, session 30): 1 token of 3 / 4 / 7 query heads a kv head 0.70-0.85x the time, 2 tokens of 3-4
  // 0.8-0.85x; 4 tokens of 3 1.03x, of 4 0.95-1.07x, of 7 1.12-1.16x; 8 tokens of 3 1.16-1.2x.
  const bool transpose_keys = B * groups >= 12;
  if (transpose_keys) s.keys_transposed.assign(D * kKeysPerTile, 0.0f);
  s.key_tile.resize(kKeysPerTile * row_width);
  s.value_tile.resize(kKeysPerTile * row_width);
  // the item's query rows as float32 (at their rows' offsets)
  const T* block_q = p.q + first_token * H * D;
  const float* block_queries = nullptr;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t begin = (b * H + head_begin) * D;
    block_queries = AsFloat(block_q + begin, (head_end - head_begin) * D, s.queries.data() + begin) - begin;
  }

  // The range state so far joins the ranges before it, and the next range starts afresh.
  auto fold_range = [&]() {
    ForHeadRows(B, H, head_begin, head_end, [&](int64_t row) {
      FoldState(s.folded_max[row], s.folded_denominator[row], s.folded_accumulator.data() + row * D,
                s.running_max[row], s.denominator[row], s.accumulator.data() + row * D, D);
    });
    fill_rows(s.running_max.data(), 1, kNegativeInfinity);
    fill_rows(s.denominator.data(), 1, 0.0f);
    fill_rows(s.accumulator.data(), D, 0.0f);
  };

  int64_t first_key = 0;
  if (p.sliding_window > 0) first_key = std::max<int64_t>(0, min_position - p.sliding_window + 1);
  first_key -= first_key % kKeysPerTile;
  first_key = std::max(first_key, key_begin);
  const int64_t last_key = std::min<int64_t>(max_position, key_end - 1);
  const float* key_rows[kKeysPerTile];
  const float* value_rows[kKeysPerTile];
  for (int64_t tile_start = first_key; tile_start <= last_key; tile_start += kKeysPerTile) {
    if (tile_start > first_key && RangeStart(RangeOf(tile_start)) == tile_start) fold_range();
    const int64_t num_keys = std::min<int64_t>(kKeysPerTile, last_key + 1 - tile_start);
    for (int64_t t = 0; t < num_keys; ++t) {
      const int64_t key = tile_start + t;
      const int64_t kv_index = int64_t(pages[key / p.page_size]) * p.page_size + key % p.page_size;
      const float* k_scales = p.k_scales == nullptr ? nullptr : p.k_scales + kv_index * K;
      const float* v_scales = p.v_scales == nullptr ? nullptr : p.v_scales + kv_index * K;
      key_rows[t] = RowAsFloat(p.k_pages + kv_index * row_width, k_scales, kv_begin, kv_end, D,
                               s.key_tile.data() + t * row_width);
      value_rows[t] = RowAsFloat(p.v_pages + kv_index * row_width, v_scales, kv_begin, kv_end, D,
                                 s.value_tile.data() + t * row_width);
    }
    // float32 pages: the next tile's rows (this item's heads of them) asked into L2 while this tile is attended.
    // Session 30, 30 layers chained in one jit, two threads: 8 sequences at 444 / 1000 keys 0.80-0.82x the time,
    // 32 at 444 0.82x, one at 2000 0.75x, one at 1000 (a range a thread) 1.1x. Not for 16-bit or quantized pages
    // (widened into the tile's scratch first): bfloat16 took 1.05-1.3x the time with it.
    // The item's first tile too, all its rows asked for at once before its first dot product: at short contexts
    // every tile is the first of its range, and a step's projections have evicted the pages since the last
    // step (bench/cpu_attention_decode.cc COLD=1 TWO_THREADS=1, 30 layers: 64 keys 425 -> 299 us, 160 keys
    // 860-940 -> 700-750, 512 keys 2120 -> 1820, 1000 keys 3800 -> 3540; with the pages in cache, 1.06x the time).
    if constexpr (std::is_same_v<PageT, float>) {
      if (tile_start == first_key) {
        const int64_t row_bytes = (kv_end - kv_begin) * D * int64_t(sizeof(PageT));
        for (int64_t t = 0; t < num_keys; ++t) {
          const char* k_row = reinterpret_cast<const char*>(key_rows[t] + kv_begin * D);
          const char* v_row = reinterpret_cast<const char*>(value_rows[t] + kv_begin * D);
          for (int64_t b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch(k_row + b, 0, 2);
            __builtin_prefetch(v_row + b, 0, 2);
          }
        }
      }
      if (tile_start + kKeysPerTile <= last_key) {
        const int64_t next_keys = std::min<int64_t>(kKeysPerTile, last_key + 1 - tile_start - kKeysPerTile);
        const int64_t row_bytes = (kv_end - kv_begin) * D * int64_t(sizeof(PageT));
        for (int64_t t = 0; t < next_keys; ++t) {
          const int64_t key = tile_start + kKeysPerTile + t;
          const int64_t kv_index = int64_t(pages[key / p.page_size]) * p.page_size + key % p.page_size;
          const char* k_row = reinterpret_cast<const char*>(p.k_pages + kv_index * row_width + kv_begin * D);
          const char* v_row = reinterpret_cast<const char*>(p.v_pages + kv_index * row_width + kv_begin * D);
          for (int64_t b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch(k_row + b, 0, 2);
            __builtin_prefetch(v_row + b, 0, 2);
          }
        }
      }
    }
    // A row's softmax over the tile from its scores (row_scores, overwritten with the keys' weights): false when
    // no key of the tile is visible to it (nothing to add).
    auto weigh_tile = [&](int64_t row, int64_t position, int64_t lowest_visible, float* row_scores) {
      // the whole tile: keys past the block's last, or the row's, are masked
      const int64_t visible_begin = std::max<int64_t>(0, lowest_visible - tile_start);
      const int64_t visible_end = std::min<int64_t>(num_keys, position - tile_start + 1);
      float tile_max = kNegativeInfinity;
      if (p.soft_cap > 0.0f) {
        for (int64_t t = 0; t < kKeysPerTile; ++t) {
          const bool visible = t >= visible_begin && t < visible_end;
          const float score = visible ? p.soft_cap * std::tanh(row_scores[t] * p.scale / p.soft_cap) : 0.0f;
          row_scores[t] = visible ? score : kNegativeInfinity;
          tile_max = std::max(tile_max, row_scores[t]);
        }
      } else {  // in vectors: a scalar loop here, and in the weights below, was half of a prefill's attention
        LaneInts key_index;
        for (int64_t l = 0; l < kLanes; ++l) key_index[l] = int32_t(l);
        Lanes maxima = Lanes{} + kNegativeInfinity;
        for (int64_t t = 0; t < kKeysPerTile; t += kLanes, key_index += int32_t(kLanes)) {
          const Lanes scaled = LoadLanes(row_scores + t) * p.scale;
          const Lanes masked = key_index >= int32_t(visible_begin) && key_index < int32_t(visible_end)
                                   ? scaled
                                   : Lanes{} + kNegativeInfinity;
          std::memcpy(row_scores + t, &masked, sizeof(masked));
          maxima = LanesMax(maxima, masked);
        }
        for (int64_t l = 0; l < kLanes; ++l) tile_max = std::max(tile_max, maxima[l]);
      }
      if (tile_max == kNegativeInfinity) return false;
      const float new_max = std::max(s.running_max[row], tile_max);
      const float rescale = ExpNonpositive(s.running_max[row] - new_max);  // 0 on the first tile
      float* accumulator = s.accumulator.data() + row * D;
      if (rescale != 1.0f) {
        s.denominator[row] *= rescale;
        for (int64_t d = 0; d < D; ++d) accumulator[d] *= rescale;
      }
      // The keys' weights (masked keys: 0) and their sum, in lanes added in a tree (SumLanes).
      Lanes sums = {};
      for (int64_t t = 0; t < kKeysPerTile; t += kLanes) {
        const Lanes weights = ExpNonpositiveLanes(LoadLanes(row_scores + t) - new_max);
        std::memcpy(row_scores + t, &weights, sizeof(weights));
        sums += weights;
      }
      const float tile_sum = SumLanes(sums);
      s.denominator[row] += tile_sum;
      s.running_max[row] = new_max;
      return true;
    };
    for (int64_t kv_head = kv_begin; kv_head < kv_end; ++kv_head) {
      const int64_t kv_offset = kv_head * D;
      if (!transpose_keys) {
        for (int64_t b = 0; b < B; ++b) {
          const int64_t position = positions[b];
          if (position < tile_start) continue;  // padding, or every key of the tile is in its future
          const int64_t lowest_visible = p.sliding_window > 0 ? position - p.sliding_window + 1 : 0;
          // the token's query heads of this kv head, kRowGroup at a time: each key and value vector loaded once
          // for them (LaneTreeDotRows, AddWeightedRowsRows: each row the same bits as alone)
          for (int64_t h0 = kv_head * groups; h0 < (kv_head + 1) * groups; h0 += kRowGroup) {
            const int64_t count = std::min<int64_t>(kRowGroup, (kv_head + 1) * groups - h0);
            const float* queries[kRowGroup];
            float* scores[kRowGroup];
            for (int64_t r = 0; r < count; ++r) {
              queries[r] = block_queries + (b * H + h0 + r) * D;
              scores[r] = s.scores.data() + (b * H + h0 + r) * kKeysPerTile;
            }
            WithRows(count, [&](auto rows) {
              for (int64_t t = 0; t < num_keys; ++t) {
                LaneTreeDotRows<decltype(rows)::value>(queries, key_rows[t] + kv_offset, D, scores, t);
              }
            });
            float* accumulators[kRowGroup];
            const float* weights[kRowGroup];
            int64_t kept = 0;
            for (int64_t r = 0; r < count; ++r) {
              const int64_t row = b * H + h0 + r;
              if (!weigh_tile(row, position, lowest_visible, scores[r])) continue;
              accumulators[kept] = s.accumulator.data() + row * D;
              weights[kept++] = scores[r];
            }
            WithRows(kept, [&](auto rows) {
              AddWeightedRowsRows<decltype(rows)::value>(accumulators, value_rows, kv_offset, weights, num_keys, D);
            });
          }
        }
        continue;
      }
      for (int64_t t = 0; t < num_keys; ++t)
        for (int64_t d = 0; d < D; ++d) s.keys_transposed[d * kKeysPerTile + t] = key_rows[t][kv_offset + d];
      // The kv head's rows that see a key of the tile, kRowGroup at a time through the many-row scores and sums.
      int64_t group_rows[kRowGroup], group_positions[kRowGroup], filled = 0;
      auto run_group = [&]() {
        const float* queries[kRowGroup];
        float* scores[kRowGroup];
        for (int64_t r = 0; r < filled; ++r) {
          queries[r] = block_queries + group_rows[r] * D;
          scores[r] = s.scores.data() + group_rows[r] * kKeysPerTile;
        }
        WithRows(filled, [&](auto rows) { LaneTreeDotsTransposedRows<decltype(rows)::value>(queries, s.keys_transposed.data(), D, scores); });
        float* accumulators[kRowGroup];
        const float* weights[kRowGroup];
        int64_t kept = 0;
        for (int64_t r = 0; r < filled; ++r) {
          const int64_t position = group_positions[r];
          const int64_t lowest_visible = p.sliding_window > 0 ? position - p.sliding_window + 1 : 0;
          if (!weigh_tile(group_rows[r], position, lowest_visible, scores[r])) continue;
          accumulators[kept] = s.accumulator.data() + group_rows[r] * D;
          weights[kept++] = scores[r];
        }
        WithRows(kept, [&](auto rows) { AddWeightedRowsRows<decltype(rows)::value>(accumulators, value_rows, kv_offset, weights, num_keys, D); });
        filled = 0;
      };
      for (int64_t b = 0; b < B; ++b) {
        const int64_t position = positions[b];
        if (position < tile_start) continue;  // padding, or every key of the tile is in its future
        for (int64_t h = kv_head * groups; h < (kv_head + 1) * groups; ++h) {
          group_rows[filled] = b * H + h;
          group_positions[filled++] = position;
          if (filled == kRowGroup) run_group();
        }
      }
      if (filled > 0) run_group();
    }
  }
  fold_range();
  if (partial != nullptr) {
    ForHeadRows(B, H, head_begin, head_end, [&](int64_t row) {
      partial->max[row] = s.folded_max[row];
      partial->denominator[row] = s.folded_denominator[row];
      std::copy_n(s.folded_accumulator.data() + row * D, D, partial->accumulator + row * D);
    });
    return;
  }
  WriteOutputRows(p, out, head_begin, head_end, s.folded_max.data(), s.folded_denominator.data(),
                  s.folded_accumulator.data());
}

// A block's outputs of query heads [head_begin, head_end) from the softmax states of its key ranges, folded in key
// order as one thread folds them.
template <typename T, typename PageT>
void MergeRanges(const Problem<T, PageT>& p, int64_t block, const PartialState* ranges, int64_t num_ranges,
                 int64_t head_begin, int64_t head_end) {
  const int64_t rows = p.query_block * p.num_heads, D = p.head_dim;
  thread_local std::vector<float> max, denominator, accumulator;  // a thread's own, kept from call to call
  max.assign(rows, kNegativeInfinity), denominator.assign(rows, 0.0f), accumulator.resize(rows * D);
  ForHeadRows(p.query_block, p.num_heads, head_begin, head_end, [&](int64_t row) {
    std::fill_n(accumulator.data() + row * D, D, 0.0f);
    for (int64_t r = 0; r < num_ranges; ++r) {
      FoldState(max[row], denominator[row], accumulator.data() + row * D, ranges[r].max[row],
                ranges[r].denominator[row], ranges[r].accumulator + row * D, D);
    }
  });
  T* out = p.out + block * rows * D;
  ForHeadRows(p.query_block, p.num_heads, head_begin, head_end,
              [&](int64_t row) { std::fill_n(out + row * D, D, FromFloat<T>(0.0f)); });
  WriteOutputRows(p, out, head_begin, head_end, max.data(), denominator.data(), accumulator.data());
}

// Ranges 0, 1, ... in order, and ordered by their keys, longest first (ties in key order): the order a split call's
// items are taken in, so that the short ones even out the threads' ends (at 480 keys: 224 keys on one thread,
// 128 + 64 + 64 on the other).
inline std::vector<int64_t> RangesInOrder(int64_t num_ranges) {
  std::vector<int64_t> order(num_ranges);
  for (int64_t r = 0; r < num_ranges; ++r) order[r] = r;
  return order;
}
inline std::vector<int64_t> LongestFirst(const std::vector<int64_t>& range_keys) {
  std::vector<int64_t> order = RangesInOrder(int64_t(range_keys.size()));
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return range_keys[a] > range_keys[b]; });
  return order;
}

// How many groups a split call cuts its kv heads into: each its own item, reading only its heads' part of every key
// row.
inline int64_t KvGroups(int64_t num_ranges, int64_t num_workers, int64_t num_kv_heads) {
  return num_ranges < num_workers ? num_kv_heads : 1;
}

// Work items are (block, key range, group of kv heads). When there are too few blocks to keep the threads busy
// (one sequence decoding, or one long prompt's chunk), a block is cut into its ranges (RangeStart: fixed by the
// key positions) and its kv heads into groups: a range leaves its rows' softmax states, folded into
// the block's output once all items are done (as flash-decoding does on a GPU), and a group of kv heads attends
// only its own rows (a row's arithmetic never depends on other rows), so every split computes the same bits as
// one thread attending the whole block. Before the kv heads were split (session 30) a single stream's decode
// step attended each layer on one thread while the other waited, up to 512 keys.
template <typename T, typename PageT>
void AttendAllBlocks(ffi::ThreadPool& thread_pool, const Problem<T, PageT>& p, int64_t num_blocks, bool own_helpers) {
  const int64_t num_workers = std::max<int64_t>(1, thread_pool.num_threads());
  const int64_t rows = p.query_block * p.num_heads, D = p.head_dim, K = p.num_kv_heads;
  const bool split = num_blocks < 2 * num_workers;
  // Per block: its first range (ranges after it, when it has more than one, hold softmax states), and each
  // range's keys (to the block's last position).
  std::vector<int64_t> first_range(num_blocks + 1, 0), range_keys;
  for (int64_t block = 0; block < num_blocks; ++block) {
    int32_t max_position = -1;
    for (int64_t b = 0; b < p.query_block; ++b) max_position = std::max(max_position, p.positions[block * p.query_block + b]);
    const int64_t ranges = split ? RangeOf(std::max<int64_t>(0, max_position)) + 1 : 1;
    first_range[block + 1] = first_range[block] + ranges;
    for (int64_t r = 0; split && r < ranges; ++r) {
      range_keys.push_back(std::min<int64_t>(RangeStart(r + 1), int64_t(max_position) + 1) - RangeStart(r));
    }
  }
  const int64_t num_ranges = first_range[num_blocks];
  const std::vector<int64_t> order = split ? LongestFirst(range_keys) : RangesInOrder(num_ranges);
  // Fewer ranges than threads (one sequence under 65 keys): each kv head is its own item. Only then: an
  // item reading one head's part of every key row reads memory less well (each core's prefetchers bring the
  // other heads' parts of the rows too), so at 1000-2000 keys ranges split into kv heads took 1.2-1.5x the time
  // of the whole ranges (bench/cpu_attention_decode.cc, session 30), while a lone range of 256-444 keys ran in
  // 0.8x on two threads. Not on a CPU mesh (helpers from XLA's pool, own_helpers false): there every device's
  // program attends its own heads at once, and items handed to the busy pool only wait for it.
  const int64_t kv_groups = split && own_helpers ? KvGroups(num_ranges, num_workers, K) : 1;
  const int64_t num_items = num_ranges * kv_groups;
  std::vector<float> states(split ? num_ranges * rows * (D + 2) : 0);
  std::vector<PartialState> partials(split ? num_ranges : 0);
  for (int64_t i = 0; i < int64_t(partials.size()); ++i) {
    float* base = states.data() + i * rows * (D + 2);
    partials[i] = PartialState{base, base + rows, base + 2 * rows};
  }
  const int64_t* first_range_data = first_range.data();
  const PartialState* partial_data = partials.data();
  const int64_t* order_data = order.data();
  auto item = [&p, num_blocks, split, kv_groups, K, first_range_data, partial_data, order_data](int64_t /*worker*/,
                                                                                                int64_t i) {
    // Each thread's buffers outlive the call: allocated (and zeroed) per call, they cost a decode step's
    // 30 calls more than their keys (issue 29).
    thread_local Scratch scratch;
    const int64_t range = order_data[i / kv_groups], group = i % kv_groups;
    const int64_t kv_begin = K * group / kv_groups, kv_end = K * (group + 1) / kv_groups;
    if (!split) {
      AttendRange(p, range, 0, K, 0, std::numeric_limits<int64_t>::max(), scratch, nullptr);
      return;
    }
    const int64_t block =
        std::upper_bound(first_range_data, first_range_data + num_blocks + 1, range) - first_range_data - 1;
    const int64_t index = range - first_range_data[block];
    const bool one_range = first_range_data[block + 1] - first_range_data[block] == 1;
    // a block of one range writes its rows' outputs itself (the same bits as folding its one state)
    AttendRange(p, block, kv_begin, kv_end, RangeStart(index), RangeStart(index + 1), scratch,
                one_range ? nullptr : partial_data + range);
  };
  // Several device programs share XLA's pool on a CPU mesh: there the helpers come from it.
  std::function<void(std::function<void()>)> schedule = nullptr;
  if (!own_helpers) schedule = [&thread_pool](std::function<void()> work) { thread_pool.Schedule([work] { work(); }); };
  jaxserve_cpu::RunItems(num_workers, num_items, item, schedule);
  if (!split) return;
  // The blocks' states folded, a kv head's query heads an item: over the threads once there are many (a long
  // context's ranges: a verify block of 8 tokens at 4000 keys folds 11 states of 72 rows), else here.
  const int64_t groups = p.num_heads / K;
  auto merge = [&p, groups, K, first_range_data, partial_data](int64_t /*worker*/, int64_t i) {
    const int64_t block = i / K, kv_head = i % K;
    const int64_t ranges = first_range_data[block + 1] - first_range_data[block];
    if (ranges > 1) MergeRanges(p, block, partial_data + first_range_data[block], ranges, kv_head * groups, (kv_head + 1) * groups);
  };
  constexpr int64_t kFoldsOnCaller = 256;  // rows x ranges
  if (num_ranges * rows <= kFoldsOnCaller) {
    for (int64_t i = 0; i < num_blocks * K; ++i) merge(0, i);
  } else {
    jaxserve_cpu::RunItems(num_workers, num_blocks * K, merge, schedule);
  }
}

template <typename T, typename PageT>
void Attend(ffi::ThreadPool& thread_pool, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k_pages,
            const ffi::AnyBuffer& v_pages, const ffi::Buffer<ffi::F32>& k_scales, const ffi::Buffer<ffi::F32>& v_scales,
            const ffi::Buffer<ffi::S32>& page_table,
            const ffi::Buffer<ffi::S32>& token_seq_ids, const ffi::Buffer<ffi::S32>& positions,
            const ffi::Buffer<ffi::F32>& sinks, int64_t query_block, int64_t sliding_window, float soft_cap,
            bool own_helpers, ffi::AnyBuffer& out) {
  const auto q_dims = q.dimensions(), page_dims = k_pages.dimensions();
  const bool quantized = k_scales.element_count() != 0;
  Problem<T, PageT> p{static_cast<const T*>(q.untyped_data()), static_cast<const PageT*>(k_pages.untyped_data()),
               static_cast<const PageT*>(v_pages.untyped_data()), quantized ? k_scales.typed_data() : nullptr,
               quantized ? v_scales.typed_data() : nullptr, page_table.typed_data(), token_seq_ids.typed_data(),
               positions.typed_data(), sinks.element_count() ? sinks.typed_data() : nullptr,
               static_cast<T*>(out.untyped_data()), q_dims[1], page_dims[2], q_dims[2],
               page_dims[1], page_table.dimensions()[1], query_block, sliding_window,
               1.0f / std::sqrt(float(q_dims[2])), soft_cap};
  AttendAllBlocks(thread_pool, p, q_dims[0] / query_block, own_helpers);
}

bool IsServedType(ffi::DataType type) {
  return type == ffi::DataType::F32 || type == ffi::DataType::BF16 || type == ffi::DataType::F16;
}

// The queries' type T and the pages' (T itself, int8 / float8_e4m3fn with scales, or 16-bit beside float32 T).
template <typename T>
void AttendPages(ffi::ThreadPool& thread_pool, ffi::DataType page_type, const ffi::AnyBuffer& q,
                 const ffi::AnyBuffer& k_pages, const ffi::AnyBuffer& v_pages, const ffi::Buffer<ffi::F32>& k_scales,
                 const ffi::Buffer<ffi::F32>& v_scales, const ffi::Buffer<ffi::S32>& page_table,
                 const ffi::Buffer<ffi::S32>& token_seq_ids, const ffi::Buffer<ffi::S32>& positions,
                 const ffi::Buffer<ffi::F32>& sinks, int64_t query_block, int64_t sliding_window, float soft_cap,
                 bool own_helpers, ffi::AnyBuffer& out) {
  if (page_type == ffi::DataType::S8) {
    Attend<T, int8_t>(thread_pool, q, k_pages, v_pages, k_scales, v_scales, page_table, token_seq_ids, positions,
                      sinks, query_block, sliding_window, soft_cap, own_helpers, out);
  } else if (page_type == ffi::DataType::F8E4M3FN) {
    Attend<T, Float8E4M3>(thread_pool, q, k_pages, v_pages, k_scales, v_scales, page_table, token_seq_ids,
                          positions, sinks, query_block, sliding_window, soft_cap, own_helpers, out);
  } else if constexpr (std::is_same_v<T, float>) {
    // a float32 model's cache kept in 16 bits (cache.kv_dtype bfloat16 / float16): widened as read, as a 16-bit
    // model's pages are
    if (page_type == ffi::DataType::BF16) {
      Attend<float, BFloat16>(thread_pool, q, k_pages, v_pages, k_scales, v_scales, page_table, token_seq_ids,
                              positions, sinks, query_block, sliding_window, soft_cap, own_helpers, out);
    } else if (page_type == ffi::DataType::F16) {
      Attend<float, Float16>(thread_pool, q, k_pages, v_pages, k_scales, v_scales, page_table, token_seq_ids,
                             positions, sinks, query_block, sliding_window, soft_cap, own_helpers, out);
    } else {
      Attend<T, T>(thread_pool, q, k_pages, v_pages, k_scales, v_scales, page_table, token_seq_ids, positions, sinks,
                   query_block, sliding_window, soft_cap, own_helpers, out);
    }
  } else {
    Attend<T, T>(thread_pool, q, k_pages, v_pages, k_scales, v_scales, page_table, token_seq_ids, positions, sinks,
                 query_block, sliding_window, soft_cap, own_helpers, out);
  }
}

ffi::Error PagedAttention(ffi::ThreadPool thread_pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                          ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
                          ffi::Buffer<ffi::S32> page_table,
                          ffi::Buffer<ffi::S32> token_seq_ids, ffi::Buffer<ffi::S32> positions,
                          ffi::Buffer<ffi::F32> sinks, int64_t query_block, int64_t sliding_window, float soft_cap, bool own_helpers,
                          ffi::Result<ffi::AnyBuffer> out) {
  const auto q_dims = q.dimensions(), page_dims = k_pages.dimensions(), table_dims = page_table.dimensions();
  if (q_dims.size() != 3 || page_dims.size() != 4 || table_dims.size() != 2) {
    return ffi::Error::InvalidArgument("paged attention: q must be [T, H, D], pages [N, page_size, K, D]");
  }
  if (query_block < 1 || q_dims[0] % query_block || q_dims[1] % page_dims[2] || page_dims[3] != q_dims[2]) {
    return ffi::Error::InvalidArgument("paged attention: inconsistent shapes");
  }
  if (sinks.element_count() != 0 && int64_t(sinks.element_count()) != q_dims[1]) {
    return ffi::Error::InvalidArgument("paged attention: sinks must be [H] (or empty: none)");
  }
  const ffi::DataType type = q.element_type(), page_type = k_pages.element_type();
  const bool quantized = page_type == ffi::DataType::S8 || page_type == ffi::DataType::F8E4M3FN;
  const bool widened = type == ffi::DataType::F32 && IsServedType(page_type);  // 16-bit pages, float32 queries
  if (!IsServedType(type) || (page_type != type && !quantized && !widened) || v_pages.element_type() != page_type ||
      out->element_type() != type) {
    return ffi::Error::InvalidArgument(
        "paged attention: q and output must share a float32/bfloat16/float16 type, the pages that type, int8/float8_e4m3fn, "
        "or 16-bit beside float32 q");
  }
  const size_t scale_count = quantized ? size_t(page_dims[0] * page_dims[1] * page_dims[2]) : 0;
  if (k_scales.element_count() != scale_count || v_scales.element_count() != scale_count) {
    return ffi::Error::InvalidArgument("paged attention: quantized pages need scales [N, page_size, K] (else none)");
  }
  switch (type) {
    case ffi::DataType::BF16:
      AttendPages<BFloat16>(thread_pool, page_type, q, k_pages, v_pages, k_scales, v_scales, page_table, token_seq_ids,
                            positions, sinks, query_block, sliding_window, soft_cap, own_helpers, *out);
      break;
    case ffi::DataType::F16:
      AttendPages<Float16>(thread_pool, page_type, q, k_pages, v_pages, k_scales, v_scales, page_table, token_seq_ids,
                           positions, sinks, query_block, sliding_window, soft_cap, own_helpers, *out);
      break;
    default:
      AttendPages<float>(thread_pool, page_type, q, k_pages, v_pages, k_scales, v_scales, page_table, token_seq_ids,
                         positions, sinks, query_block, sliding_window, soft_cap, own_helpers, *out);
  }
  return ffi::Error::Success();
}

// Token t's row of `rows` into row kv_indices[t] of `target`, the result aliased to `pages`.
void WriteRows(const ffi::AnyBuffer& pages, ffi::AnyBuffer& target, const ffi::AnyBuffer& rows, const int32_t* kv_indices,
               int64_t num_tokens, size_t row_bytes) {
  char* target_data = static_cast<char*>(target.untyped_data());
  if (pages.untyped_data() != target.untyped_data()) {  // XLA could not alias (pages not donated): copy first
    std::memcpy(target_data, pages.untyped_data(), pages.size_bytes());
  }
  const char* row_data = static_cast<const char*>(rows.untyped_data());
  for (int64_t t = 0; t < num_tokens; ++t) std::memcpy(target_data + kv_indices[t] * row_bytes, row_data + t * row_bytes, row_bytes);
}

// Token t's row [K, D] into row kv_indices[t] of each pool; the results alias the pools. Rows of any type
// and shape ([T, ...] into [N, page_size, ...]): quantized pools write their values and then their scales
// ([T, K] into [N, page_size, K]) with it.
ffi::Error WriteKvPages(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::Buffer<ffi::S32> kv_indices, ffi::Result<ffi::AnyBuffer> k_pages_out,
                        ffi::Result<ffi::AnyBuffer> v_pages_out) {
  const auto page_dims = k_pages.dimensions(), token_dims = k.dimensions();
  bool shapes_match = page_dims.size() >= 2 && page_dims.size() == token_dims.size() + 1;
  for (size_t i = 1; shapes_match && i < token_dims.size(); ++i) shapes_match = token_dims[i] == page_dims[i + 1];
  if (!shapes_match || kv_indices.element_count() != size_t(token_dims[0]) ||
      v.element_count() != k.element_count() || v_pages.element_count() != k_pages.element_count()) {
    return ffi::Error::InvalidArgument("write_kv_pages: k/v must be [T, K(, D)] and pages [N, page_size, K(, D)]");
  }
  const ffi::DataType type = k_pages.element_type();
  if (k.element_type() != type || v.element_type() != type || v_pages.element_type() != type) {
    return ffi::Error::InvalidArgument("write_kv_pages: k, v and pages must share a type");
  }
  const int64_t num_rows = page_dims[0] * page_dims[1];
  const size_t row_bytes = k.size_bytes() / std::max<int64_t>(1, token_dims[0]);
  const int32_t* indices = kv_indices.typed_data();
  for (int64_t t = 0; t < token_dims[0]; ++t) {
    if (indices[t] < 0 || indices[t] >= num_rows) return ffi::Error::InvalidArgument("write_kv_pages: KV index out of range");
  }
  WriteRows(k_pages, *k_pages_out, k, indices, token_dims[0], row_bytes);
  WriteRows(v_pages, *v_pages_out, v, indices, token_dims[0], row_bytes);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("query_block")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<bool>("own_helpers")
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveWriteKvPages, WriteKvPages,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
