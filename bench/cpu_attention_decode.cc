// A single-stream decode step's attention through the CPU kernel's AttendRange (SmolLM2-135M: 9 query heads, 3 kv
// heads, head_dim 64, 30 layers, pages of 16 tokens), one sequence at 128 and 512 keys (or the context given as the
// argument), cut into items as the engine cuts them for two workers (AttendAllBlocks' ranges, LongestFirst and KvGroups;
// issue 29). By default the sum of the items' work on one thread, in thread CPU time, best of 30: on a shared
// machine wall time mostly measures the other processes.
//
//   g++ -O3 -march=native -mprefer-vector-width=512 -fopenmp-simd -fno-math-errno -fno-trapping-math -std=c++17 \
//       -I pallas_kernels -I $(.venv/bin/python -c "import jax; print(jax.ffi.include_dir())") \
//       bench/cpu_attention_decode.cc -o /tmp/cpu_attention_decode && /tmp/cpu_attention_decode
//
// (-mprefer-vector-width=512 as cpu_library.py builds the avx512 path: without it GCC widens in 256-bit vectors.)
// -mno-avx512f -mprefer-vector-width=256 for the avx2 path's code. Options:
//   -DONE_LAYER=1   the same layer's pages 30 times (they stay in cache: the kernel's own work, steady under load);
//                   without it each layer has its own pages, as in a step.
//   -DCOLD=1        32 MB of other memory read before each layer (untimed), as a step's projections stream their
//                   weights between two layers' attention: the pages come from L3 or memory, as in a step (where
//                   they took twice the time of pages in cache, session 37). COLD=2 reads the kernel's scratch back.
//   -DHUGE=1        the page pools in transparent huge pages (the engine's are in 4 KiB pages).
//   -DTWO_THREADS=1 the items over the caller and one helper (cpu_workers.h's RunItems, as the engine runs them;
//                   with COLD, both threads read the other memory, so the helper is awake as in a step), in wall
//                   time: the figure to compare with the engine's per-call time (bench/step_trace.py).
//   -DWHOLE_ROWS=1  never cut a lone run's kv heads into items of their own.
//   -DQUERY_BLOCK=8 the sequence's last 8 tokens as one query block (a speculative verify step of k = 7; session
//                   43: 4.5 ms for 30 layers on one thread at 168 keys, against 0.9 ms for one token).
// "bits" hashes every layer's output: two builds of the kernel compute the same bits when it matches.
// For an A/B against another version, build it from that version's source
// (`-DKERNEL_SOURCE='"/path/to/cpu_kernel.cc"'` from `git show REV:pallas_kernels/paged_attention/cpu_kernel.cc`,
// with -I pallas_kernels/paged_attention for its headers) and run both in turn.
// Prints one JSON line per dtype and context.
#ifndef KERNEL_SOURCE
#define KERNEL_SOURCE "../pallas_kernels/paged_attention/cpu_kernel.cc"
#endif
#ifndef ONE_LAYER
#define ONE_LAYER 0
#endif
#ifndef COLD
#define COLD 0
#endif
#ifndef QUERY_BLOCK
#define QUERY_BLOCK 1
#endif
#ifndef WHOLE_ROWS
#define WHOLE_ROWS 0
#endif
#ifndef HUGE
#define HUGE 0
#endif
#ifndef TWO_THREADS
#define TWO_THREADS 0
#endif
#include KERNEL_SOURCE

#include <sys/mman.h>

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

double WallSeconds() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

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
  constexpr int64_t B = QUERY_BLOCK;  // query tokens of the block
  std::vector<T> q(B * kHeads * kHeadDim), out(q.size());
  // the pools in 4 KiB pages as malloc gives them, or in huge pages (HUGE)
  const size_t pool_bytes = (kLayers * layer_values * sizeof(T) + (2 << 20) - 1) / (2 << 20) * (2 << 20);
  T* k_pages = static_cast<T*>(mmap(nullptr, pool_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  T* v_pages = static_cast<T*>(mmap(nullptr, pool_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (HUGE) madvise(k_pages, pool_bytes, MADV_HUGEPAGE), madvise(v_pages, pool_bytes, MADV_HUGEPAGE);
  for (auto& x : q) x = FromFloat<T>(normal(rng));
  for (T* pool : {k_pages, v_pages}) {
    for (int64_t i = 0; i < kLayers * layer_values; ++i) pool[i] = FromFloat<T>(normal(rng));
  }
  std::vector<int32_t> page_table(pages);
  for (int64_t i = 0; i < pages; ++i) page_table[i] = int32_t(i);
  const int32_t position = int32_t(context - 1);  // the block's last token
  std::vector<int32_t> seq_ids(B, 0), positions(B);
  for (int64_t b = 0; b < B; ++b) positions[b] = int32_t(context - B + b);
  // The engine's items (AttendAllBlocks) for one sequence and two workers: its ranges (RangeStart), longest first,
  // and a lone range's kv heads one item each.
  const int64_t ranges = RangeOf(position) + 1;
  std::vector<int64_t> range_keys;
  for (int64_t r = 0; r < ranges; ++r) range_keys.push_back(std::min<int64_t>(RangeStart(r + 1), position + 1) - RangeStart(r));
  const std::vector<int64_t> order = LongestFirst(range_keys);
  const int64_t kv_groups = WHOLE_ROWS ? 1 : KvGroups(ranges, kWorkers, kKvHeads);
  std::vector<float> states(ranges * B * kHeads * (kHeadDim + 2));
  std::vector<PartialState> partials(ranges);
  for (int64_t r = 0; r < ranges; ++r) {
    float* base = states.data() + r * B * kHeads * (kHeadDim + 2);
    partials[r] = PartialState{base, base + B * kHeads, base + 2 * B * kHeads};
  }
  Scratch scratch;
  // a projection's stream of weights between two layers' attention (COLD): the layer's pages leave the caches
  std::vector<float> weights(COLD ? (8 << 20) : 0, 1.0f);
  float evicted = 0.0f;
  uint64_t bits = 1469598103934665603ull;  // FNV-1a over every layer's output: the same bits as another build?
  double best = 1e9;
  for (int repeat = 0; repeat < 30; ++repeat) {
    double took = 0.0;
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      // both threads read, as both stream a projection's weights in a step (the helper stays awake)
      std::atomic<int64_t> read_sum{0};
      jaxserve_cpu::RunItems(TWO_THREADS ? kWorkers : 1, kWorkers, [&](int64_t, int64_t half) {
        float sum = 0.0f;
        const size_t begin = weights.size() / kWorkers * half, end = weights.size() / kWorkers * (half + 1);
        for (size_t i = begin; i < end; i += 16) sum += weights[i];
        read_sum += int64_t(sum);
      });
      evicted += float(read_sum.load());
      if (COLD == 2) {  // the kernel's scratch back in cache: only the pages cold
        for (auto* v : {&scratch.queries, &scratch.accumulator, &scratch.scores, &scratch.running_max,
                        &scratch.denominator, &scratch.keys_transposed, &scratch.key_tile, &scratch.value_tile,
                        &scratch.folded_max, &scratch.folded_denominator, &scratch.folded_accumulator}) {
          for (float& x : *v) evicted += x;
        }
      }
      const double start = TWO_THREADS ? WallSeconds() : ThreadSeconds();
      const int64_t offset = ONE_LAYER ? 0 : layer * layer_values;
      Problem<T, T> p{q.data(), k_pages + offset, v_pages + offset, nullptr, nullptr,
                      page_table.data(), seq_ids.data(), positions.data(), nullptr, out.data(), kHeads, kKvHeads, kHeadDim,
                      kPageSize, pages, B, 0, 0.125f, 0.0f};
      auto item = [&](int64_t, int64_t i) {
        thread_local Scratch own;  // as the engine's items
        const int64_t r = order[i / kv_groups], g = i % kv_groups;
        AttendRange(p, 0, kKvHeads * g / kv_groups, kKvHeads * (g + 1) / kv_groups, RangeStart(r), RangeStart(r + 1),
                    TWO_THREADS ? own : scratch, ranges == 1 ? nullptr : &partials[r]);
      };
      if (TWO_THREADS) {
        jaxserve_cpu::RunItems(kWorkers, ranges * kv_groups, item);
      } else {
        for (int64_t i = 0; i < ranges * kv_groups; ++i) item(0, i);
      }
      if (ranges > 1) MergeRanges(p, 0, partials.data(), ranges, 0, kHeads);
      took += (TWO_THREADS ? WallSeconds() : ThreadSeconds()) - start;
      if (repeat == 0) {
        for (size_t i = 0; i < out.size() * sizeof(T); ++i) {
          bits = (bits ^ reinterpret_cast<const unsigned char*>(out.data())[i]) * 1099511628211ull;
        }
      }
    }
    best = std::min(best, took);
  }
  munmap(k_pages, pool_bytes), munmap(v_pages, pool_bytes);
  std::printf("{\"path\": \"%s\", \"dtype\": \"%s\", \"query_block\": %lld, \"context\": %lld, \"one_layer\": %d, \"cold\": %d, \"huge\": %d, \"two_threads\": %d, "
              "\"step_us\": %.1f, \"out0\": %.6f, \"bits\": \"%016llx\"}\n",
              kPathName, dtype, static_cast<long long>(B), static_cast<long long>(context), ONE_LAYER, COLD, HUGE, TWO_THREADS, best * 1e6, ToFloat(out[0]) + 0.0f * evicted,
              static_cast<unsigned long long>(bits));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> contexts = {128, 512};
  if (argc > 1) contexts.assign(1, std::atoll(argv[1]));
  for (int64_t context : contexts) {
    Bench<float>("float32", context);
    Bench<BFloat16>("bfloat16", context);
  }
}
