// Paged latent attention for the CPU (DeepSeek's MLA), as an XLA FFI custom call: the contract of
// latent_reference.ragged_paged_latent_attention, for float32, bfloat16 and float16 pools.
//
// The cache holds one entry of 2C lanes per token, its first C lanes in the first pool and its last C
// in the second ([num_pages, page_size, 1, C] each). Every query head scores the whole entry and reads
// the whole entry back as its value: single-head attention of width 2C with keys == values. So a tile
// of keys is gathered (and widened) once, as one [keys, 2C] float32 tile that serves as keys and values
// for every head, where cpu_kernel.cc reads separate K and V rows per KV head.
//
// As cpu_kernel.cc: each query block (one sequence's tokens) walks its sequence's pages in tiles of
// kKeysPerTile keys through the page table, with an online softmax in float32, masked causally by
// absolute position; padding tokens (position -1) come out as zeros. Work items are (block, range of
// heads): a decode step of one sequence has a single block, so its heads are spread over the threads
// (each range re-reads the block's entries: they are shared, so the extra reads mostly hit the cache).
//
// Compiled at first use by pallas_kernels/cpu_library.py into the CPU kernels' one library.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "cpu_workers.h"
#include "paged_attention/cpu_attention_basics.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxserve_cpu_attention::BFloat16;
using jaxserve_cpu_attention::ExpNonpositive;
using jaxserve_cpu_attention::Float16;
using jaxserve_cpu_attention::FromFloat;
using jaxserve_cpu_attention::kNegativeInfinity;
using jaxserve_cpu_attention::Widen;

constexpr int64_t kKeysPerTile = 64;
constexpr int64_t kLanes = 32;  // lanes of AttendTile's weighted sums held in registers per row
constexpr int64_t kRowsPerGroup = 4;  // AttendTile's rows at once (its loops are written for 4)

template <typename T>
struct LatentProblem {
  const T* q;                    // [T, H, W], W = 2C
  const T* first_pages;          // [num_pages, page_size, 1, C]
  const T* second_pages;         // [num_pages, page_size, 1, C]
  const int32_t* page_table;     // [S, P]
  const int32_t* token_seq_ids;  // [T]
  const int32_t* positions;      // [T]
  T* out;                        // [T, H, W]
  int64_t num_heads, half, page_size, pages_per_seq, query_block;
  float scale;
};

// A worker's buffers, kept across the items it takes.
struct LatentScratch {
  std::vector<float> queries, accumulator, scores, running_max, denominator, entries, spare;
};

// Rows [group, group + n) (n <= kRowsPerGroup; row = token b * heads + head) against the tile's entries:
// each entry is loaded once for the group's rows, for their scores and again for their weighted sums,
// so a tile read from L2 serves several rows per pass (as a small matmul would).
inline void AttendTile(LatentScratch& s, int64_t group, int64_t n, int64_t heads, int64_t W,
                       const int32_t* positions, int64_t tile_start, int64_t num_keys) {
  const float* entries = s.entries.data();
  const float* query[kRowsPerGroup];
  float* scores[kRowsPerGroup];
  float* accumulator[kRowsPerGroup];
  int64_t visible[kRowsPerGroup];
  for (int64_t r = 0; r < kRowsPerGroup; ++r) {
    const int64_t row = group + std::min(r, n - 1);  // a short group repeats its last row (results unused)
    query[r] = s.queries.data() + row * W;
    scores[r] = s.scores.data() + r * kKeysPerTile;
    accumulator[r] = s.accumulator.data() + row * W;
    // keys of the tile the row sees: 0 for padding, or when every key is in its future
    visible[r] = r < n ? std::clamp<int64_t>(positions[row / heads] - tile_start + 1, 0, num_keys) : 0;
  }
  if (*std::max_element(visible, visible + kRowsPerGroup) == 0) return;
  for (int64_t t = 0; t < num_keys; ++t) {
    const float* entry = entries + t * W;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t w = 0; w < W; ++w) {
      s0 += query[0][w] * entry[w];
      s1 += query[1][w] * entry[w];
      s2 += query[2][w] * entry[w];
      s3 += query[3][w] * entry[w];
    }
    scores[0][t] = s0, scores[1][t] = s1, scores[2][t] = s2, scores[3][t] = s3;
  }
  for (int64_t r = 0; r < kRowsPerGroup; ++r) {
    if (visible[r] == 0) {  // weighs nothing (a missing row of a short group too)
      std::fill(scores[r], scores[r] + num_keys, 0.0f);
      continue;
    }
    const int64_t row = group + r;
    float tile_max = kNegativeInfinity;
    for (int64_t t = 0; t < visible[r]; ++t) tile_max = std::max(tile_max, scores[r][t]);
    const float new_max = std::max(s.running_max[row], tile_max);
    const float rescale = ExpNonpositive(s.running_max[row] - new_max);  // 0 on the first tile
    if (rescale != 1.0f) {
      s.denominator[row] *= rescale;
      for (int64_t w = 0; w < W; ++w) accumulator[r][w] *= rescale;
    }
    float tile_sum = 0.0f;
#pragma omp simd reduction(+ : tile_sum)
    for (int64_t t = 0; t < visible[r]; ++t) {
      scores[r][t] = ExpNonpositive(scores[r][t] - new_max);
      tile_sum += scores[r][t];
    }
    std::fill(scores[r] + visible[r], scores[r] + num_keys, 0.0f);  // keys in the row's future
    s.denominator[row] += tile_sum;
    s.running_max[row] = new_max;
  }
  // The weighted sums, kLanes lanes of the 4 rows at a time held in registers across the tile's keys (a
  // short group's missing rows add zeros into a spare accumulator rather than alias a real row's).
  for (int64_t r = n; r < kRowsPerGroup; ++r) accumulator[r] = s.spare.data() + r * W;
  const float* weights0 = scores[0];
  const float* weights1 = scores[1];
  const float* weights2 = scores[2];
  const float* weights3 = scores[3];
  int64_t w0 = 0;
  for (; w0 + kLanes <= W; w0 += kLanes) {
    float a0[kLanes], a1[kLanes], a2[kLanes], a3[kLanes];
    std::copy(accumulator[0] + w0, accumulator[0] + w0 + kLanes, a0);
    std::copy(accumulator[1] + w0, accumulator[1] + w0 + kLanes, a1);
    std::copy(accumulator[2] + w0, accumulator[2] + w0 + kLanes, a2);
    std::copy(accumulator[3] + w0, accumulator[3] + w0 + kLanes, a3);
    for (int64_t t = 0; t < num_keys; ++t) {
      const float* entry = entries + t * W + w0;
      const float c0 = weights0[t], c1 = weights1[t], c2 = weights2[t], c3 = weights3[t];
#pragma omp simd
      for (int64_t j = 0; j < kLanes; ++j) {
        const float e = entry[j];
        a0[j] += c0 * e;
        a1[j] += c1 * e;
        a2[j] += c2 * e;
        a3[j] += c3 * e;
      }
    }
    std::copy(a0, a0 + kLanes, accumulator[0] + w0);
    std::copy(a1, a1 + kLanes, accumulator[1] + w0);
    std::copy(a2, a2 + kLanes, accumulator[2] + w0);
    std::copy(a3, a3 + kLanes, accumulator[3] + w0);
  }
  for (int64_t t = 0; t < num_keys && w0 < W; ++t) {  // the last W % kLanes lanes
    const float* entry = entries + t * W;
    for (int64_t r = 0; r < n; ++r) {
      const float weight = scores[r][t];
      for (int64_t w = w0; w < W; ++w) accumulator[r][w] += weight * entry[w];
    }
  }
}

// Heads [head_begin, head_end) of every token of `block`. Rows are (token b, head h in the range).
template <typename T>
void AttendHeads(const LatentProblem<T>& p, int64_t block, int64_t head_begin, int64_t head_end, LatentScratch& s) {
  const int64_t B = p.query_block, H = p.num_heads, C = p.half, W = 2 * p.half;
  const int64_t heads = head_end - head_begin, rows = B * heads, first_token = block * B;
  const int32_t* positions = p.positions + first_token;
  const int32_t* pages = p.page_table + int64_t(p.token_seq_ids[first_token]) * p.pages_per_seq;
  int32_t max_position = -1;
  for (int64_t b = 0; b < B; ++b) max_position = std::max(max_position, positions[b]);
  for (int64_t b = 0; b < B; ++b) {
    T* out = p.out + ((first_token + b) * H + head_begin) * W;
    std::fill(out, out + heads * W, FromFloat<T>(0.0f));
  }
  if (max_position < 0) return;  // a block of padding

  s.queries.resize(rows * W);
  s.accumulator.assign(rows * W, 0.0f);
  s.scores.resize(kRowsPerGroup * kKeysPerTile);
  s.running_max.assign(rows, kNegativeInfinity);
  s.denominator.assign(rows, 0.0f);
  s.entries.resize(kKeysPerTile * W);
  s.spare.resize(kRowsPerGroup * W);
  for (int64_t b = 0; b < B; ++b) {  // the queries scaled in float32 first, as the reference does
    float* queries = s.queries.data() + b * heads * W;
    Widen(p.q + ((first_token + b) * H + head_begin) * W, heads * W, queries);
    for (int64_t i = 0; i < heads * W; ++i) queries[i] *= p.scale;
  }
  // Keys past the page table's last page are never reached (the reference's spans stop there too).
  const int64_t last_key = std::min<int64_t>(max_position, p.pages_per_seq * p.page_size - 1);
  for (int64_t tile_start = 0; tile_start <= last_key; tile_start += kKeysPerTile) {
    const int64_t num_keys = std::min<int64_t>(kKeysPerTile, last_key + 1 - tile_start);
    for (int64_t t = 0; t < num_keys; ++t) {
      const int64_t key = tile_start + t;
      const int64_t kv_index = int64_t(pages[key / p.page_size]) * p.page_size + key % p.page_size;
      float* entry = s.entries.data() + t * W;
      Widen(p.first_pages + kv_index * C, C, entry);
      Widen(p.second_pages + kv_index * C, C, entry + C);
    }
    for (int64_t group = 0; group < rows; group += kRowsPerGroup) {
      AttendTile(s, group, std::min(kRowsPerGroup, rows - group), heads, W, positions, tile_start, num_keys);
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    T* out = p.out + ((first_token + b) * H + head_begin) * W;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t row = b * heads + h;
      if (s.denominator[row] <= 0.0f) continue;  // saw no key: stays zero
      const float inverse = 1.0f / s.denominator[row];
      const float* accumulator = s.accumulator.data() + row * W;
      for (int64_t w = 0; w < W; ++w) out[h * W + w] = FromFloat<T>(accumulator[w] * inverse);
    }
  }
}

template <typename T>
void AttendLatent(ffi::ThreadPool& thread_pool, const ffi::AnyBuffer& q, const ffi::AnyBuffer& first_pages,
                  const ffi::AnyBuffer& second_pages, const ffi::Buffer<ffi::S32>& page_table,
                  const ffi::Buffer<ffi::S32>& token_seq_ids, const ffi::Buffer<ffi::S32>& positions,
                  int64_t query_block, float scale, bool own_helpers, ffi::AnyBuffer& out) {
  const auto q_dims = q.dimensions(), page_dims = first_pages.dimensions();
  const LatentProblem<T> p{static_cast<const T*>(q.untyped_data()),
                           static_cast<const T*>(first_pages.untyped_data()),
                           static_cast<const T*>(second_pages.untyped_data()),
                           page_table.typed_data(),
                           token_seq_ids.typed_data(),
                           positions.typed_data(),
                           static_cast<T*>(out.untyped_data()),
                           q_dims[1],
                           page_dims[3],
                           page_dims[1],
                           page_table.dimensions()[1],
                           query_block,
                           scale};
  const int64_t num_blocks = q_dims[0] / query_block, H = p.num_heads;
  const int64_t num_workers = std::max<int64_t>(1, thread_pool.num_threads());
  // Enough items to keep the threads busy: heads split into ranges only when blocks are few (decode).
  const int64_t wanted_items = 2 * num_workers;
  const int64_t head_ranges = std::min<int64_t>(H, std::max<int64_t>(1, (wanted_items + num_blocks - 1) / num_blocks));
  const int64_t heads_per_range = (H + head_ranges - 1) / head_ranges;
  const int64_t ranges = (H + heads_per_range - 1) / heads_per_range;
  std::vector<LatentScratch> scratch(num_workers);
  LatentScratch* scratch_data = scratch.data();
  auto item = [&p, ranges, heads_per_range, H, scratch_data](int64_t worker, int64_t i) {
    const int64_t block = i / ranges, head_begin = (i % ranges) * heads_per_range;
    AttendHeads(p, block, head_begin, std::min(H, head_begin + heads_per_range), scratch_data[worker]);
  };
  // Several device programs share XLA's pool on a CPU mesh: there the helpers come from it.
  std::function<void(std::function<void()>)> schedule = nullptr;
  if (!own_helpers) schedule = [&thread_pool](std::function<void()> work) { thread_pool.Schedule([work] { work(); }); };
  jaxserve_cpu::RunItems(num_workers, num_blocks * ranges, item, schedule);
}

ffi::Error PagedLatentAttention(ffi::ThreadPool thread_pool, ffi::AnyBuffer q, ffi::AnyBuffer first_pages,
                                ffi::AnyBuffer second_pages, ffi::Buffer<ffi::S32> page_table,
                                ffi::Buffer<ffi::S32> token_seq_ids, ffi::Buffer<ffi::S32> positions,
                                int64_t query_block, float scale, bool own_helpers, ffi::Result<ffi::AnyBuffer> out) {
  const auto q_dims = q.dimensions(), page_dims = first_pages.dimensions(), table_dims = page_table.dimensions();
  if (q_dims.size() != 3 || page_dims.size() != 4 || table_dims.size() != 2 || page_dims[2] != 1 ||
      second_pages.dimensions().size() != 4 || second_pages.element_count() != first_pages.element_count() ||
      second_pages.dimensions()[3] != page_dims[3]) {
    return ffi::Error::InvalidArgument(
        "paged latent attention: q must be [T, H, 2C], both pools [N, page_size, 1, C], the page table [S, P]");
  }
  if (query_block < 1 || q_dims[0] % query_block || q_dims[2] != 2 * page_dims[3] ||
      int64_t(token_seq_ids.element_count()) != q_dims[0] || int64_t(positions.element_count()) != q_dims[0]) {
    return ffi::Error::InvalidArgument("paged latent attention: inconsistent shapes");
  }
  const ffi::DataType type = q.element_type();
  if ((type != ffi::DataType::F32 && type != ffi::DataType::BF16 && type != ffi::DataType::F16) ||
      first_pages.element_type() != type || second_pages.element_type() != type || out->element_type() != type) {
    return ffi::Error::InvalidArgument("paged latent attention: q, pools and output share one float32/bfloat16/float16 type");
  }
  switch (type) {
    case ffi::DataType::BF16:
      AttendLatent<BFloat16>(thread_pool, q, first_pages, second_pages, page_table, token_seq_ids, positions,
                             query_block, scale, own_helpers, *out);
      break;
    case ffi::DataType::F16:
      AttendLatent<Float16>(thread_pool, q, first_pages, second_pages, page_table, token_seq_ids, positions,
                            query_block, scale, own_helpers, *out);
      break;
    default:
      AttendLatent<float>(thread_pool, q, first_pages, second_pages, page_table, token_seq_ids, positions,
                          query_block, scale, own_helpers, *out);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedLatentAttention, PagedLatentAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("query_block")
                                  .Attr<float>("scale")
                                  .Attr<bool>("own_helpers")
                                  .Ret<ffi::AnyBuffer>());
