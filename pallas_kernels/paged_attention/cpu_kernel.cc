// Ragged paged attention for the CPU, as an XLA FFI custom call: the same contract as reference.py.
//
// Work is split by query block: each block (one sequence's query tokens) walks its sequence's pages
// in tiles of kKeysPerTile keys, reading K/V in place through the page table, with an online
// softmax in float32. Blocks are spread over XLA's intra-op thread pool. Compiled at first use by
// cpu.py with -march=native.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kKeysPerTile = 64;
constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

struct Problem {
  const float* q;            // [T, H, D]
  const float* k_pages;      // [num_pages, page_size, K, D]
  const float* v_pages;      // [num_pages, page_size, K, D]
  const int32_t* page_table; // [S, P]
  const int32_t* token_seq_ids;  // [T]
  const int32_t* positions;  // [T]
  float* out;                // [T, H, D]
  int64_t num_heads, num_kv_heads, head_dim, page_size, pages_per_seq, query_block, sliding_window;
  float scale;
};

// exp(x) for the x <= 0 of an online softmax, in a form the compiler vectorizes (std::exp is a scalar
// libm call): Cody-Waite range reduction and Cephes' expf polynomial, within a few ulp of expf.
// Anything below expf's underflow, -inf included, is exactly 0, so masked keys get no weight.
inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.0f);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  const float f = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  const float r = p * f * f + f + 1.0f;
  int32_t exponent_bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &exponent_bits, sizeof(scale));
  return x < -87.0f ? 0.0f : r * scale;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Rows of a block are (token b, query head h): row = b * H + h, its kv head is h / (H / K).
void AttendBlock(const Problem& p, int64_t block, std::vector<float>& scratch) {
  const int64_t B = p.query_block, H = p.num_heads, D = p.head_dim, K = p.num_kv_heads;
  const int64_t groups = H / K, rows = B * H, first_token = block * B;
  const int32_t* positions = p.positions + first_token;
  const int32_t* pages = p.page_table + int64_t(p.token_seq_ids[first_token]) * p.pages_per_seq;
  int32_t max_position = -1, min_position = std::numeric_limits<int32_t>::max();
  for (int64_t b = 0; b < B; ++b) {
    if (positions[b] < 0) continue;
    max_position = std::max(max_position, positions[b]);
    min_position = std::min(min_position, positions[b]);
  }
  float* out = p.out + first_token * H * D;
  std::fill(out, out + rows * D, 0.0f);
  if (max_position < 0) return;  // a block of padding

  scratch.resize(rows * (kKeysPerTile + 2));
  float* scores = scratch.data();                     // [rows, tile]
  float* running_max = scores + rows * kKeysPerTile;  // [rows]
  float* denominator = running_max + rows;            // [rows]
  std::fill(running_max, running_max + rows, kNegativeInfinity);
  std::fill(denominator, denominator + rows, 0.0f);

  int64_t first_key = 0;
  if (p.sliding_window > 0) first_key = std::max<int64_t>(0, min_position - p.sliding_window + 1);
  first_key -= first_key % kKeysPerTile;
  std::vector<float> keys_transposed(D * kKeysPerTile, 0.0f);  // [D, tile]
  const float* key_rows[kKeysPerTile];
  const float* value_rows[kKeysPerTile];
  for (int64_t tile_start = first_key; tile_start <= max_position; tile_start += kKeysPerTile) {
    const int64_t num_keys = std::min<int64_t>(kKeysPerTile, max_position + 1 - tile_start);
    for (int64_t t = 0; t < num_keys; ++t) {
      const int64_t key = tile_start + t;
      const int64_t slot = int64_t(pages[key / p.page_size]) * p.page_size + key % p.page_size;
      key_rows[t] = p.k_pages + slot * K * D;
      value_rows[t] = p.v_pages + slot * K * D;
    }
    for (int64_t kv_head = 0; kv_head < K; ++kv_head) {
      const int64_t kv_offset = kv_head * D;
      // Many query rows per kv head (prefill): transpose the tile's keys once so each row's scores
      // are axpys across keys instead of one horizontal dot product per key.
      const bool transpose_keys = B * groups >= 4;
      if (transpose_keys) {
        for (int64_t t = 0; t < num_keys; ++t)
          for (int64_t d = 0; d < D; ++d) keys_transposed[d * kKeysPerTile + t] = key_rows[t][kv_offset + d];
      }
      for (int64_t b = 0; b < B; ++b) {
        const int64_t position = positions[b];
        if (position < tile_start) continue;  // padding, or every key of the tile is in its future
        const int64_t lowest_visible = p.sliding_window > 0 ? position - p.sliding_window + 1 : 0;
        for (int64_t h = kv_head * groups; h < (kv_head + 1) * groups; ++h) {
          const int64_t row = b * H + h;
          const float* query = p.q + ((first_token + b) * H + h) * D;
          float* row_scores = scores + row * kKeysPerTile;
          if (transpose_keys) {
            std::fill(row_scores, row_scores + kKeysPerTile, 0.0f);
            for (int64_t d = 0; d < D; ++d) {
              const float q_d = query[d];
              const float* keys_d = keys_transposed.data() + d * kKeysPerTile;
#pragma omp simd
              for (int64_t t = 0; t < kKeysPerTile; ++t) row_scores[t] += q_d * keys_d[t];
            }
          } else {
            for (int64_t t = 0; t < num_keys; ++t) row_scores[t] = dot(query, key_rows[t] + kv_offset, D);
          }
          float tile_max = kNegativeInfinity;
          for (int64_t t = 0; t < num_keys; ++t) {
            const int64_t key = tile_start + t;
            const bool visible = key <= position && key >= lowest_visible;
            row_scores[t] = visible ? row_scores[t] * p.scale : kNegativeInfinity;
            tile_max = std::max(tile_max, row_scores[t]);
          }
          if (tile_max == kNegativeInfinity) continue;
          const float new_max = std::max(running_max[row], tile_max);
          const float rescale = exp_nonpositive(running_max[row] - new_max);  // 0 on the first tile
          float* accumulator = out + row * D;
          if (rescale != 1.0f) {
            denominator[row] *= rescale;
            for (int64_t d = 0; d < D; ++d) accumulator[d] *= rescale;
          }
          float tile_sum = 0.0f;
#pragma omp simd reduction(+ : tile_sum)
          for (int64_t t = 0; t < num_keys; ++t) {
            row_scores[t] = exp_nonpositive(row_scores[t] - new_max);  // masked keys: 0
            tile_sum += row_scores[t];
          }
          denominator[row] += tile_sum;
          for (int64_t t = 0; t < num_keys; ++t) {
            const float weight = row_scores[t];
            if (weight == 0.0f) continue;
            const float* value = value_rows[t] + kv_offset;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) accumulator[d] += weight * value[d];
          }
          running_max[row] = new_max;
        }
      }
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    if (denominator[row] <= 0.0f) continue;
    const float inverse = 1.0f / denominator[row];
    for (int64_t d = 0; d < D; ++d) out[row * D + d] *= inverse;
  }
}

ffi::Error PagedAttention(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                          ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> page_table,
                          ffi::Buffer<ffi::S32> token_seq_ids, ffi::Buffer<ffi::S32> positions,
                          int64_t query_block, int64_t sliding_window, ffi::ResultBuffer<ffi::F32> out) {
  const auto q_dims = q.dimensions(), page_dims = k_pages.dimensions(), table_dims = page_table.dimensions();
  if (q_dims.size() != 3 || page_dims.size() != 4 || table_dims.size() != 2) {
    return ffi::Error::InvalidArgument("paged attention: q must be [T, H, D], pages [N, page_size, K, D]");
  }
  Problem p{q.typed_data(), k_pages.typed_data(), v_pages.typed_data(), page_table.typed_data(),
            token_seq_ids.typed_data(), positions.typed_data(), out->typed_data(),
            q_dims[1], page_dims[2], q_dims[2], page_dims[1], table_dims[1], query_block, sliding_window,
            1.0f / std::sqrt(float(q_dims[2]))};
  if (query_block < 1 || q_dims[0] % query_block || p.num_heads % p.num_kv_heads || page_dims[3] != p.head_dim) {
    return ffi::Error::InvalidArgument("paged attention: inconsistent shapes");
  }
  // Workers share a block counter; the caller works too and waits only for the blocks, never for
  // the helpers to start: with several devices' programs on one pool (data parallelism on a CPU),
  // a helper may not start until this call has long returned. It then finds no block left, and
  // the state it touches is kept alive by the shared_ptr.
  struct Shared {
    Problem problem;
    int64_t num_blocks;
    std::atomic<int64_t> next_block{0};
    std::atomic<int64_t> blocks_done{0};
  };
  auto shared = std::make_shared<Shared>();
  shared->problem = p;
  shared->num_blocks = q_dims[0] / query_block;
  auto work = [shared]() {
    std::vector<float> scratch;
    for (int64_t block = shared->next_block++; block < shared->num_blocks; block = shared->next_block++) {
      AttendBlock(shared->problem, block, scratch);
      shared->blocks_done++;
    }
  };
  const int64_t num_helpers = std::min<int64_t>(thread_pool.num_threads(), shared->num_blocks) - 1;
  for (int64_t helper = 0; helper < num_helpers; ++helper) thread_pool.Schedule([work] { work(); });
  work();
  while (shared->blocks_done.load() < shared->num_blocks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("query_block")
                                  .Attr<int64_t>("sliding_window")
                                  .Ret<ffi::Buffer<ffi::F32>>());
