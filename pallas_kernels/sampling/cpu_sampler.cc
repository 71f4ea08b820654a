// The sampler's draw on the CPU, as an XLA FFI custom call (its reference: jaxserve/device/sampler.py and
// sampling_draws.py, the same rules in jax.numpy, which every other backend runs):
//   tokens [S] int32 = one token a row of logits [S, V] float32, from the row's temperature, top_k, top_p, min_p
//   and its uniform u in [0, 1): the reference's, bit for bit (JAX's threefry over the row's seed folded with
//   the index of the token it samples).
//
// A row with temperature 0 takes its first argmax. Any other row is scaled by its temperature (a float32 division,
// as the reference) and draws from its nucleus with probability proportional to exp(scaled - max):
//   top-k keeps every token at least as likely as the k-th; top-p, over the distribution renormalized to those,
//   keeps a token when the strictly more likely hold less than top_p of the mass; min-p keeps those at least
//   min_p times as likely as the most likely, which stays in any case. Each rule keeps the tokens at or above a
//   logit, so ties are kept or left whole.
// The draw is an inverse CDF over the kept tokens in vocabulary order: the first token whose running mass passes
// u times the total (never one of zero weight: the last positive one where rounding leaves none past it).
//
// Why a kernel: in jax.numpy the sampler is ~100 small XLA kernels (a top-k, prefix sums, halvings, three
// conditionals) that XLA:CPU compiled into every step executable, 0.8 s of each one's compile time, and it ran
// 15-37 ms over 64 rows of a 49152-token vocabulary where this takes a few. Here each row is one thread's: a max,
// an exp pass, the thresholds by radix selection over the logits' float order (an 11-bit digit at a time:
// counts for top-k, masses for top-p, each level only over the tokens the digits so far left), and the draw.
// A row's arithmetic depends on its own logits and parameters alone, so any batch (a decode step, a verify step,
// a mesh's shard) samples it alike.
//
// Built by pallas_kernels/cpu_library.py into the one CPU kernel library.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "cpu_workers.h"
#include "matmul/cpu_float_vectors.h"
#include "paged_attention/cpu_attention_basics.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kInfinity = std::numeric_limits<float>::infinity();
constexpr int kLevels = 3;
constexpr int kShift[kLevels] = {21, 10, 0};  // a key's digits: bits 31-21, 20-10, 9-0
constexpr int kDigitBits[kLevels] = {11, 11, 10};
constexpr int64_t kDrawBlock = 256;  // the draw's first level: sums of blocks of this many tokens

struct RowParams {
  float temperature, top_p, min_p, uniform;
  int32_t top_k;
};

// JAX's threefry2x32 hash of (x0, x1) under key (k0, k1): 20 rounds, a key injection after every 4.
inline void Threefry2x32(uint32_t k0, uint32_t k1, uint32_t& x0, uint32_t& x1) {
  const uint32_t keys[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  static constexpr int kRotations[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  x0 += keys[0];
  x1 += keys[1];
  for (uint32_t group = 0; group < 5; ++group) {
    for (const int r : kRotations[group % 2]) {
      x0 += x1;
      x1 = (x1 << r) | (x1 >> (32 - r));
      x1 ^= x0;
    }
    x0 += keys[(group + 1) % 3];
    x1 += keys[(group + 2) % 3] + group + 1;
  }
}

// The row's uniform as the reference draws it (sampler.row_uniforms): jax.random.fold_in(key(seed), index), then
// jax.random.uniform of that key (one 32-bit draw: the two words of the hash of (0, 0) xor-ed, 23 bits of it as a
// float's mantissa in [1, 2), less one).
inline float RowUniform(uint32_t seed0, uint32_t seed1, uint32_t index) {
  uint32_t key0 = 0, key1 = index;
  Threefry2x32(seed0, seed1, key0, key1);
  uint32_t word0 = 0, word1 = 0;
  Threefry2x32(key0, key1, word0, word1);
  const uint32_t bits = ((word0 ^ word1) >> 9) | 0x3F800000u;
  float one_to_two;
  std::memcpy(&one_to_two, &bits, sizeof(one_to_two));
  return std::max(0.0f, one_to_two - 1.0f);
}

// One thread's buffers, kept between calls (allocated per call they would cost more than a small step's rows).
struct Scratch {
  std::vector<float> scaled, weights;
  std::vector<uint32_t> keys;
  std::vector<int32_t> ids;
  std::vector<double> masses, block_sums;
  std::vector<int64_t> counts;

  void Fit(int64_t n) {
    if (int64_t(scaled.size()) >= n) return;
    scaled.resize(n);
    weights.resize(n);
    keys.resize(n);
    ids.resize(n);
    block_sums.resize((n + kDrawBlock - 1) / kDrawBlock);
  }
};

// float32 -> uint32 in the same order, -0.0 taken as 0.0 (sampling_draws.float_keys).
inline uint32_t FloatKey(float x) {
  x += 0.0f;
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits >> 31) ? ~bits : (bits | 0x80000000u);
}

inline uint32_t Digit(uint32_t key, int level) {
  return (key >> kShift[level]) & ((1u << kDigitBits[level]) - 1);
}

// max(a, b), NaN where either is (jnp.max's rule).
inline float MaxOrNan(float a, float b) { return a != a ? a : (b != b ? b : std::max(a, b)); }

// The largest of kDrawBlock entries, NaN where one is NaN (as jnp.max), in vectors (GCC leaves a float max loop
// scalar: std::max's order of operands matters for NaN). Four accumulators: a chain of one would wait on each max's
// latency. NaN is found by a probe that sums x * 0 (NaN for a NaN or an infinity, one FMA a vector; a check in the
// max itself cost greedy rows 0.5 -> 0.75 ms at 64 x 49152): only then is the block read again, one by one.
inline float BlockMax(const float* x) {
  static_assert(kDrawBlock % (4 * kLanes) == 0);
  VecF m[4], probe = Broadcast(0.0f);
  const VecF zero = Broadcast(0.0f);
  for (int a = 0; a < 4; ++a) m[a] = Broadcast(-kInfinity);
  for (int64_t i = 0; i < kDrawBlock; i += 4 * kLanes) {
    for (int a = 0; a < 4; ++a) {
      const VecF v = LoadF(x + i + a * kLanes);
      m[a] = v > m[a] ? v : m[a];
      probe = Fma(v, zero, probe);
    }
  }
  float best = -kInfinity, probed = 0.0f;
  for (int lane = 0; lane < kLanes; ++lane) probed += probe[lane];
  if (probed != probed) {  // a NaN or an infinity: which, and where, one by one
    for (int64_t i = 0; i < kDrawBlock; ++i) best = MaxOrNan(best, x[i]);
    return best;
  }
  for (int a = 0; a < 4; ++a) {
    for (int lane = 0; lane < kLanes; ++lane) best = std::max(best, m[a][lane]);
  }
  return best;
}

// The first index of the row's largest entry (0 where every entry is -inf; the first NaN where there is one, as
// jnp.argmax): the reference's first_argmax. The maxima of blocks first (vectorized), then the first block holding
// the largest searched for its first.
int32_t FirstArgmax(const float* x, int64_t n) {
  float best = -kInfinity;
  int64_t best_block = 0;
  for (int64_t begin = 0; begin < n; begin += kDrawBlock) {
    float block_max = -kInfinity;
    if (begin + kDrawBlock <= n) {
      block_max = BlockMax(x + begin);
    } else {
      for (int64_t i = begin; i < n; ++i) block_max = MaxOrNan(block_max, x[i]);
    }
    if (block_max != block_max) {
      for (int64_t i = begin;; ++i) {
        if (x[i] != x[i]) return int32_t(i);
      }
    }
    if (block_max > best) {
      best = block_max;
      best_block = begin;
    }
  }
  for (int64_t i = best_block; i < n; ++i) {
    if (x[i] == best) return int32_t(i);
  }
  return 0;
}

// The tokens still in the selection after `level` digits: all of them at level 0, else s.ids[0, count).
template <typename Visit>
inline void ForCandidates(int level, int64_t n, int64_t count, const Scratch& s, Visit visit) {
  if (level == 0) {
    for (int64_t i = 0; i < n; ++i) visit(i);
  } else {
    for (int64_t c = 0; c < count; ++c) visit(int64_t(s.ids[c]));
  }
}

// Keeps (in s.ids) the candidates whose digit at `level` is `digit`; returns how many.
int64_t KeepDigit(int level, uint32_t digit, int64_t n, int64_t count, Scratch& s) {
  const uint32_t* keys = s.keys.data();
  int64_t kept = 0;
  ForCandidates(level, n, count, s, [&](int64_t i) {
    if (Digit(keys[i], level) == digit) s.ids[kept++] = int32_t(i);
  });
  return kept;
}

// The k-th largest key of the row (1 <= k <= n, counting ties): the lowest key with fewer than k above it.
uint32_t KthLargestKey(int64_t n, int64_t k, Scratch& s) {
  const uint32_t* keys = s.keys.data();
  uint32_t prefix = 0;
  int64_t count = n, remaining = k;  // the k-th is the remaining-th largest among the candidates
  for (int level = 0; level < kLevels; ++level) {
    const int64_t bins = int64_t(1) << kDigitBits[level];
    s.counts.assign(bins, 0);
    ForCandidates(level, n, count, s, [&](int64_t i) { ++s.counts[Digit(keys[i], level)]; });
    int64_t digit = bins - 1;
    while (digit > 0 && s.counts[digit] < remaining) remaining -= s.counts[digit--];
    prefix |= uint32_t(digit) << kShift[level];
    if (level + 1 < kLevels) count = KeepDigit(level, uint32_t(digit), n, count, s);
  }
  return prefix;
}

// The top-p threshold: the largest key at which the mass of the tokens at or above it (weights, in order from the
// most likely) reaches `goal`; every token below it has at least `goal` strictly above it, every token at or
// above it less. 0 (keep every token) where the whole mass stays under goal (rounding at top_p near 1).
uint32_t MassThresholdKey(int64_t n, double goal, Scratch& s) {
  const uint32_t* keys = s.keys.data();
  const float* weights = s.weights.data();
  uint32_t prefix = 0;
  int64_t count = n;
  double above = 0.0;  // mass of the tokens above the current selection
  for (int level = 0; level < kLevels; ++level) {
    const int64_t bins = int64_t(1) << kDigitBits[level];
    s.counts.assign(bins, 0);
    s.masses.assign(bins, 0.0);
    ForCandidates(level, n, count, s, [&](int64_t i) {
      const uint32_t digit = Digit(keys[i], level);
      ++s.counts[digit];
      s.masses[digit] += weights[i];
    });
    int64_t digit = bins - 1, lowest = -1;
    for (; digit >= 0; --digit) {
      if (s.counts[digit] == 0) continue;
      lowest = digit;
      if (above + s.masses[digit] >= goal) break;
      above += s.masses[digit];
    }
    if (digit < 0) {
      if (level == 0) return 0;  // the whole row is under goal
      digit = lowest;  // the sums of a finer split rounded under: the selection's lowest tokens
      above -= s.masses[lowest];
    }
    prefix |= uint32_t(digit) << kShift[level];
    if (level + 1 < kLevels) count = KeepDigit(level, uint32_t(digit), n, count, s);
  }
  return prefix;
}

// An index with probability weights[i] / sum(weights) for u in [0, 1), in two levels (block sums, then within the
// chosen block); never one of zero weight. 0 where every weight is 0.
int32_t Draw(const float* weights, int64_t n, float u, Scratch& s) {
  const int64_t num_blocks = (n + kDrawBlock - 1) / kDrawBlock;
  double total = 0.0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t begin = b * kDrawBlock, end = std::min(n, begin + kDrawBlock);
    float sum = 0.0f;  // a block's 256 in float32, the blocks' sums in double
#pragma omp simd reduction(+ : sum)
    for (int64_t i = begin; i < end; ++i) sum += weights[i];
    s.block_sums[b] = sum;
    total += sum;
  }
  const double target = double(u) * total;
  double running = 0.0;
  int64_t chosen = -1, last_block = -1;
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (s.block_sums[b] <= 0.0) continue;
    last_block = b;
    if (running + s.block_sums[b] > target) {
      chosen = b;
      break;
    }
    running += s.block_sums[b];
  }
  if (last_block < 0) return 0;
  const int64_t block = chosen < 0 ? last_block : chosen;  // none passed target: rounding at the row's end
  const int64_t begin = block * kDrawBlock, end = std::min(n, begin + kDrawBlock);
  int64_t last_positive = begin;
  for (int64_t i = begin; i < end; ++i) {
    if (weights[i] <= 0.0f) continue;
    last_positive = i;
    running += double(weights[i]);
    if (chosen >= 0 && running > target) return int32_t(i);
  }
  return int32_t(last_positive);  // the block's sum rounded past target where its entries one by one do not
}

int32_t SampleRow(const float* logits, int64_t n, const RowParams& p, Scratch& s) {
  if (!(p.temperature > 0.0f)) return FirstArgmax(logits, n);
  s.Fit(n);
  float* scaled = s.scaled.data();
  float* weights = s.weights.data();
  // the row divided by its temperature (as the reference: a division, not a product with its inverse), in vectors
  const VecF temperature = Broadcast(p.temperature), zero = Broadcast(0.0f);
  VecF top_lanes = Broadcast(-kInfinity), probe = zero;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const VecF v = LoadF(logits + i) / temperature;
    StoreF(scaled + i, v);
    top_lanes = v > top_lanes ? v : top_lanes;
    probe = Fma(v, zero, probe);  // NaN after a NaN or an infinity (BlockMax)
  }
  float top = -kInfinity, probed = 0.0f;
  for (int lane = 0; lane < kLanes; ++lane) {
    top = std::max(top, top_lanes[lane]);
    probed += probe[lane];
  }
  for (; i < n; ++i) {
    scaled[i] = logits[i] / p.temperature;
    top = MaxOrNan(top, scaled[i]);
  }
  if (probed != probed) {
    for (int64_t j = 0; j < n; ++j) top = MaxOrNan(top, scaled[j]);
  }
  // No distribution to draw from: no finite logit (every token banned: the caller reports the row), a NaN (a
  // broken model: its first, as argmax), or a maximum the division overflowed (a temperature near 0: the row's own
  // argmax, which +inf ties would hide).
  if (!(top > -kInfinity) || !(top < kInfinity)) return FirstArgmax(logits, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) weights[i] = jaxserve_cpu_attention::ExpNonpositive(scaled[i] - top);
  const bool by_k = p.top_k > 0 && p.top_k < n, by_p = p.top_p < 1.0f, by_min = p.min_p > 0.0f;
  if (!(by_k || by_p || by_min)) return Draw(weights, n, p.uniform, s);
  uint32_t* keys = s.keys.data();
  uint32_t lowest_kept = 0;  // the lowest key top-k and top-p keep
  if (by_k || by_p) {
    for (int64_t i = 0; i < n; ++i) keys[i] = FloatKey(scaled[i]);
  }
  if (by_k) {
    lowest_kept = KthLargestKey(n, p.top_k, s);
    for (int64_t i = 0; i < n; ++i) {
      if (keys[i] < lowest_kept) weights[i] = 0.0f;
    }
  }
  if (by_p) {
    double mass = 0.0;
#pragma omp simd reduction(+ : mass)
    for (int64_t i = 0; i < n; ++i) mass += double(weights[i]);
    lowest_kept = std::max(lowest_kept, MassThresholdKey(n, double(p.top_p) * mass, s));
  }
  const float min_weight = by_min ? p.min_p : 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const bool above = !(by_k || by_p) || keys[i] >= lowest_kept;  // keys are set only for top-k and top-p
    if (!((above && weights[i] >= min_weight) || scaled[i] == top)) weights[i] = 0.0f;
  }
  return Draw(weights, n, p.uniform, s);
}

ffi::Error Sample(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> temperature,
                  ffi::Buffer<ffi::S32> top_k, ffi::Buffer<ffi::F32> top_p, ffi::Buffer<ffi::F32> min_p,
                  ffi::Buffer<ffi::U32> seeds, ffi::Buffer<ffi::S32> token_indices, bool own_helpers,
                  ffi::Result<ffi::Buffer<ffi::S32>> tokens) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("cpu_sampler: logits [S, V]");
  const int64_t num_rows = dims[0], vocab = dims[1];
  for (const size_t size : {temperature.element_count(), top_k.element_count(), top_p.element_count(),
                            min_p.element_count(), token_indices.element_count(), tokens->element_count()}) {
    if (size != size_t(num_rows)) return ffi::Error::InvalidArgument("cpu_sampler: one parameter a row");
  }
  if (seeds.element_count() != size_t(2 * num_rows)) return ffi::Error::InvalidArgument("cpu_sampler: seeds [S, 2]");
  if (num_rows == 0) return ffi::Error::Success();
  if (vocab == 0) return ffi::Error::InvalidArgument("cpu_sampler: an empty vocabulary");
  const float* logit_data = logits.typed_data();
  const float *t = temperature.typed_data(), *p = top_p.typed_data(), *m = min_p.typed_data();
  const uint32_t* seed = seeds.typed_data();
  const int32_t *k = top_k.typed_data(), *index = token_indices.typed_data();
  int32_t* out = tokens->typed_data();
  auto item = [=](int64_t /*worker*/, int64_t row) {
    thread_local Scratch scratch;
    const float u = RowUniform(seed[2 * row], seed[2 * row + 1], uint32_t(index[row]));
    out[row] = SampleRow(logit_data + row * vocab, vocab, RowParams{t[row], p[row], m[row], u, k[row]}, scratch);
  };
  // Several device programs share XLA's pool on a CPU mesh: there the helpers come from it (cpu_kernel.cc).
  std::function<void(std::function<void()>)> schedule = nullptr;
  if (!own_helpers) schedule = [&pool](std::function<void()> work) { pool.Schedule([work] { work(); }); };
  jaxserve_cpu::RunItems(std::max<int64_t>(1, pool.num_threads()), num_rows, item, schedule);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveSample, Sample,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits [S, V]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // temperature [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // top_k [S]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // top_p [S]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // min_p [S]
                                  .Arg<ffi::Buffer<ffi::U32>>()  // seeds [S, 2]: threefry key data
                                  .Arg<ffi::Buffer<ffi::S32>>()  // token_indices [S]
                                  .Attr<bool>("own_helpers")
                                  .Ret<ffi::Buffer<ffi::S32>>());  // tokens [S]
