// One thread's CPU time of a single-stream decode step's attention through the CPU kernel's AttendRange
// (SmolLM2-135M: 9 query heads, 3 kv heads, head_dim 64, 30 layers, pages of 16 tokens), one sequence at
// 128 and 512 keys, cut into items as the engine cuts them for two workers (issue 29): the sum of the items'
// work on one thread. Thread CPU time, best of 30: on a shared machine wall time mostly measures the other
// processes.
//
//   g++ -O3 -march=native -fopenmp-simd -fno-math-errno -fno-trapping-math -std=c++17 \
//       -I pallas_kernels -I $(.venv/bin/python -c "import jax; print(jax.ffi.include_dir())") \
//       bench/cpu_attention_decode.cc -o /tmp/cpu_attention_decode && /tmp/cpu_attention_decode
//
// Add -mno-avx512f for the avx2 path's code. -DONE_LAYER=1 reads the same layer's pages 30 times (they stay in
// cache: the kernel's own work, steady under load); without it each layer has its own pages, as in a step.
// For an A/B against another version, build it from that version's source
// (`git show REV:pallas_kernels/paged_attention/cpu_kernel.cc`, beside the same headers) and run both in turn.
// Prints one JSON line per dtype and context.
#ifndef KERNEL_SOURCE
#define KERNEL_SOURCE "../pallas_kernels/paged_attention/cpu_kernel.cc"
#endif
#ifndef ONE_LAYER
#define ONE_LAYER 0
#endif
#include KERNEL_SOURCE

#include <cstdio>
#include <ctime>
#include <random>

namespace {

#if defined(__AVX512F__)
constexpr const char* kPathName = "avx512";
#elif defined(__AVX2__)
constexpr const char* kPathName = "avx2";
#else
constexpr const char* kPathName = "portable";
#endif

double ThreadSeconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

template <typename T>
void Bench(const char* dtype, int64_t context) {
  constexpr int64_t kHeads = 9, kKvHeads = 3, kHeadDim = 64, kPageSize = 16, kLayers = 30, kWorkers = 2;
  const int64_t pages = context / kPageSize + 2, layer_values = pages * kPageSize * kKvHeads * kHeadDim;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<T> q(kHeads * kHeadDim), k_pages(kLayers * layer_values), v_pages(k_pages.size()), out(q.size());
  for (auto* values : {&q, &k_pages, &v_pages}) {
    for (auto& x : *values) x = FromFloat<T>(normal(rng));
  }
  std::vector<int32_t> page_table(pages);
  for (int64_t i = 0; i < pages; ++i) page_table[i] = int32_t(i);
  const int32_t seq_id = 0, position = int32_t(context - 1);
  // The engine's items (AttendAllBlocks) for one sequence and two workers: ranges of kKeysPerRange keys, and a lone
  // range's kv heads one item each.
  const int64_t ranges = (position + kKeysPerRange) / kKeysPerRange, kv_groups = ranges < kWorkers ? kKvHeads : 1;
  std::vector<float> states(ranges * kHeads * (kHeadDim + 2));
  std::vector<PartialState> partials(ranges);
  for (int64_t r = 0; r < ranges; ++r) {
    float* base = states.data() + r * kHeads * (kHeadDim + 2);
    partials[r] = PartialState{base, base + kHeads, base + 2 * kHeads};
  }
  Scratch scratch;
  double best = 1e9;
  for (int repeat = 0; repeat < 30; ++repeat) {
    const double start = ThreadSeconds();
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      const int64_t offset = ONE_LAYER ? 0 : layer * layer_values;
      Problem<T, T> p{q.data(), k_pages.data() + offset, v_pages.data() + offset, nullptr, nullptr,
                      page_table.data(), &seq_id, &position, nullptr, out.data(), kHeads, kKvHeads, kHeadDim,
                      kPageSize, pages, 1, 0, 0.125f, 0.0f};
      for (int64_t r = 0; r < ranges; ++r) {
        for (int64_t g = 0; g < kv_groups; ++g) {
          AttendRange(p, 0, kKvHeads * g / kv_groups, kKvHeads * (g + 1) / kv_groups, r * kKeysPerRange,
                      (r + 1) * kKeysPerRange, scratch, ranges == 1 ? nullptr : &partials[r]);
        }
      }
      if (ranges > 1) MergeRanges(p, 0, partials.data(), ranges);
    }
    best = std::min(best, ThreadSeconds() - start);
  }
  std::printf("{\"path\": \"%s\", \"dtype\": \"%s\", \"context\": %lld, \"one_layer\": %d, \"step_us\": %.1f, "
              "\"out0\": %.6f}\n",
              kPathName, dtype, static_cast<long long>(context),
              ONE_LAYER, best * 1e6, ToFloat(out[0]));
  std::fflush(stdout);
}

}  // namespace

int main() {
  for (int64_t context : {128, 512}) {
    Bench<float>("float32", context);
    Bench<BFloat16>("bfloat16", context);
  }
}
