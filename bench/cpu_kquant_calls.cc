// Whole calls of the K-quant kernel (cpu_kquant_matmul.cc: x quantized as KQuantMatmul does it, then Run with
// its thread split) over one SmolLM2-135M decode step's K-quant projections as the engine joins them for its
// Q4_K_M file: per layer q + k (Q5_0: K = 576 is no multiple of 256, llama.cpp's fallback; v is Q8_0, the
// other kernel's), o and gate + up (Q5_0), down (K = 1536: Q6_K in 14 layers, Q4_K in 16); the tied head is
// Q8_0 (the other kernel's): 120 calls, random planes (issue 25; bench/cpu_int8_dot_calls.cc's sibling).
// KIND=4 / KIND=6: every down Q4_K / Q6_K. Default: thread CPU time of the calling thread (one worker: the
// measure that survives a loaded machine) against a one-thread read stream; WALL=1: wall time against a
// two-thread read stream. FLOAT=1: x kept in float (quantized_activations="float"; paths without the VNNI tiles
// always are). Prints step_ms and of_stream per round (best of 5 steps, caches evicted before each).
// Built with -DKQ_PRINT_PLAN against a kernel with PlanCall, prints the step's plans instead.
//
//   g++ -O3 -march=native -fopenmp-simd -fno-math-errno -fno-trapping-math -std=c++17 -pthread \
//       -I pallas_kernels -I $(.venv/bin/python -c "import jax; print(jax.ffi.include_dir())") \
//       bench/cpu_kquant_calls.cc -o /tmp/cpu_kquant_calls && /tmp/cpu_kquant_calls ROWS WORKERS
#include "../pallas_kernels/matmul/cpu_kquant_matmul.cc"

#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <random>
#include <string>
#include <thread>

namespace {

const bool g_cpu = std::getenv("WALL") == nullptr;  // thread CPU time (one worker) unless WALL

double Now() {
  if (g_cpu) {
    timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

uint8_t* HugePages(size_t bytes) {  // as the engine's weights (jaxserve/device/huge_pages.py)
  bytes = (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(p, bytes, MADV_HUGEPAGE);
  std::memset(p, 0, bytes);
  return static_cast<uint8_t*>(p);
}

__attribute__((noinline)) int64_t ReadStream(const int64_t* p, int64_t n) {
  int64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
  for (int64_t i = 0; i < n; i += 4) {
    a0 += p[i];
    a1 += p[i + 1];
    a2 += p[i + 2];
    a3 += p[i + 3];
  }
  return a0 + a1 + a2 + a3;
}

// A weight of `kind` [depth, columns]: random planes and sub-block scales, float16 d and dmin of 1, in one
// arena as the engine's weights are.
Weight MakeWeight(int kind, int64_t depth, int64_t columns, uint8_t*& arena, int64_t& bytes, std::mt19937& rng) {
  Weight w;
  w.kind = kind;
  w.columns = columns;
  w.group = kind == 6 ? 16 : 32;
  w.groups_per_d = kind == kQ5_0 || kind == kQ5_1 ? 1 : kSuperBlock / w.group;
  const int64_t d_rows = depth / w.group / w.groups_per_d;
  auto take = [&](int64_t size) {
    uint8_t* p = arena;
    for (int64_t i = 0; i < size; ++i) p[i] = uint8_t(rng());
    arena += (size + 63) / 64 * 64;
    bytes += size;
    return p;
  };
  auto halves = [&](int64_t count) {
    auto* p = reinterpret_cast<uint16_t*>(take(2 * count));
    for (int64_t i = 0; i < count; ++i) p[i] = 0x3C00;
    return p;
  };
  w.low = take(depth / 2 * columns);
  if (kind != 4) w.high = take(depth * HighBits(kind) / 8 * columns);
  if (kind == 4 || kind == 5 || kind == 6) w.sub_scales = take(depth / w.group * columns);
  if (kind == 4 || kind == 5) w.sub_mins = take(depth / 32 * columns);
  w.d = halves(d_rows * columns);
  if (HasMins(kind)) w.dmin = halves(d_rows * columns);
  return w;
}

std::string KindName(int kind) { return kind == kQ5_0 ? "q5_0" : kind == kQ5_1 ? "q5_1" : "q" + std::to_string(kind) + "_k"; }

}  // namespace

int main(int argc, char** argv) {
  const int64_t rows = argc > 1 ? std::atoi(argv[1]) : 1;
  const int64_t workers = argc > 2 ? std::atoi(argv[2]) : 1;
  const int down_kind = std::getenv("KIND") != nullptr ? std::atoi(std::getenv("KIND")) : 0;  // 0: as the file
  const bool float_x = std::getenv("FLOAT") != nullptr;
  constexpr int64_t kLayers = 30, kEmbed = 576, kKv = 192, kMlp = 1536;
  std::mt19937 rng(1);
  uint8_t* arena = HugePages(256 << 20);
  int64_t bytes = 0;
  std::vector<std::vector<Weight>> calls;
  std::vector<int64_t> depths;
  for (int64_t l = 0; l < kLayers; ++l) {
    calls.push_back({MakeWeight(kQ5_0, kEmbed, kEmbed, arena, bytes, rng), MakeWeight(kQ5_0, kEmbed, kKv, arena, bytes, rng)});
    calls.push_back({MakeWeight(kQ5_0, kEmbed, kEmbed, arena, bytes, rng)});
    calls.push_back({MakeWeight(kQ5_0, kEmbed, kMlp, arena, bytes, rng), MakeWeight(kQ5_0, kEmbed, kMlp, arena, bytes, rng)});
    const int kind = down_kind != 0 ? down_kind : l < 14 ? 6 : 4;
    calls.push_back({MakeWeight(kind, kMlp, kEmbed, arena, bytes, rng)});
    depths.insert(depths.end(), {kEmbed, kEmbed, kEmbed, kMlp});
  }
#if defined(KQ_PRINT_PLAN)
  for (size_t i = 0; i < 4; ++i) {  // the first layer's calls (the others are alike)
    const CallPlan plan = PlanCall(calls[i], depths[i], rows, workers);
    std::printf("call %zu:", i);
    for (size_t run = 0; run + 1 < plan.run_starts.size(); ++run) {
      std::printf(" run%zu [", run);
      for (int64_t p = plan.run_starts[run]; p < plan.run_starts[run + 1]; ++p) {
        const Piece& piece = plan.pieces[p];
        const Weight& w = *piece.w;
        std::printf("%s%s %lldx%lld c%lld+%lld g%lld-%lld/%lld%s", p > plan.run_starts[run] ? ", " : "",
                    KindName(w.kind).c_str(), (long long)depths[i], (long long)w.columns, (long long)piece.c0,
                    (long long)piece.width, (long long)piece.g0, (long long)piece.g1, (long long)(depths[i] / w.group),
                    piece.target.data == w.out ? "" : " partial");
      }
      std::printf("]");
    }
    std::printf("; partial floats %zu\n", plan.partials.size());
  }
  return 0;
#endif
  std::vector<float> x(rows * kMlp);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);
  std::vector<float> out(rows * kMlp * 2);
  const int64_t stream_words = (512 << 20) / 8;
  const auto* stream = reinterpret_cast<const int64_t*>(HugePages(stream_words * 8));
  volatile int64_t sink = 0;
  auto step = [&] {
    for (size_t i = 0; i < calls.size(); ++i) {  // what KQuantMatmul does past reading its buffers
      const int64_t depth = depths[i];
      std::vector<float> x_sums(rows * (depth / 32), 0.0f);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t k = 0; k < depth; ++k) x_sums[r * (depth / 32) + k / 32] += x[r * depth + k];
      }
#if defined(KQUANT_INT8)
      QuantizedRows x_int8;
      if (!float_x) x_int8 = QuantizeRows(x.data(), rows, depth);
#endif
      std::vector<Weight>& weights = calls[i];
      int64_t offset = 0;
      for (Weight& w : weights) {
        w.out = out.data() + offset;
        offset += rows * w.columns;
        w.x_sums = x_sums.data();
#if defined(KQUANT_INT8)
        w.x_int8 = float_x ? nullptr : &x_int8;
#endif
      }
      Run(workers, weights, Rows{x.data(), rows, depth});
    }
  };
  auto two_streams = [&] {
    std::thread helper([&] { sink = ReadStream(stream, stream_words / 2); });
    sink = ReadStream(stream + stream_words / 2, stream_words / 2);
    helper.join();
  };
#if defined(KQUANT_INT8)
  const char* activations = float_x ? "float" : "int8";
#else
  const char* activations = "float";
#endif
  for (int round = 0; round < 4; ++round) {
    double best_step = 1e9, best_stream = 1e9;
    for (int r = 0; r < 5; ++r) {
      double t = Now();
      if (g_cpu) {
        sink = ReadStream(stream, stream_words);
      } else {
        two_streams();
      }
      best_stream = std::min(best_stream, Now() - t);
      sink = ReadStream(stream, stream_words);  // evict
      t = Now();
      step();
      best_step = std::min(best_step, Now() - t);
    }
    const double stream_gb_s = stream_words * 8 / best_stream / 1e9, gb_s = bytes / best_step / 1e9;
    std::printf(
        "{\"down\": \"%s\", \"activations\": \"%s\", \"rows\": %lld, \"workers\": %lld, \"wall\": %d, "
        "\"stream_gb_s\": %.1f, \"step_ms\": %.2f, \"gb_s\": %.1f, \"of_stream\": %.2f}\n",
        down_kind == 0 ? "q6_k+q4_k" : KindName(down_kind).c_str(), activations, (long long)rows, (long long)workers,
        int(!g_cpu), stream_gb_s, best_step * 1e3, gb_s, gb_s / stream_gb_s);
    std::fflush(stdout);
  }
}
