// Whole calls of the int8-activation quantized kernel (cpu_quantized_int8_dot.cc: Quantize, Plan, Run with its
// thread split) over one SmolLM2-135M decode step's projections as the engine joins them (q/k/v, o, gate/up,
// down per layer, the tied head: 121 calls), random Q8_0 / Q4_0 weights (issue 25, session 13). What the
// step's kernel time is without XLA and Python: the calls' fixed costs and the worker split included.
// Default: thread CPU time of the calling thread (one worker: meaningful on a loaded machine) against a
// one-thread read stream; WALL=1: wall time against a two-thread read stream (idle machines only).
// TILED=1: the weights in tiles (cpu_int8_dot_tiles.h; random bytes either way). TINY=1: every weight 64 columns wide (a call's fixed and latency cost). Prints step_ms and of_stream.
//
//   g++ -O3 -march=native -fopenmp-simd -fno-math-errno -fno-trapping-math -std=c++17 -pthread \
//       -I pallas_kernels -I $(.venv/bin/python -c "import jax; print(jax.ffi.include_dir())") \
//       bench/cpu_int8_dot_calls.cc -o /tmp/cpu_int8_dot_calls && /tmp/cpu_int8_dot_calls BITS ROWS WORKERS
#include "../pallas_kernels/matmul/cpu_quantized_int8_dot.cc"
#include <sys/mman.h>
#include <chrono>
#include <cstdio>
#include <random>
#include <thread>
namespace {
bool g_cpu = getenv("WALL") == nullptr;  // thread CPU time (one worker) unless WALL
bool g_tiled = getenv("TILED") != nullptr;  // the weights as tiles (quantized_tiles.py: what a one-device engine reads)
double Now() {
  if (g_cpu) { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
void* HugePages(size_t bytes) {
  bytes = (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(p, bytes, MADV_HUGEPAGE); std::memset(p, 0x11, bytes); return p;
}
__attribute__((noinline)) int64_t ReadStream(const int64_t* p, int64_t n) {
  int64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
  for (int64_t i = 0; i < n; i += 4) { a0 += p[i]; a1 += p[i + 1]; a2 += p[i + 2]; a3 += p[i + 3]; }
  return a0 + a1 + a2 + a3;
}
struct W { const void* values; const uint16_t* scales; int64_t depth, columns; };
}
int main(int argc, char** argv) {
  const int bits = argc > 1 ? atoi(argv[1]) : 4; const int64_t rows = argc > 2 ? atoi(argv[2]) : 1;
  const int workers = argc > 3 ? atoi(argv[3]) : 2;
  constexpr int64_t kL = 30, E = 576, KV = 192, MLP = 1536, V = 49152, G = 32;
  std::mt19937 rng(1);
  int64_t bytes = 0;
  const bool tiny = getenv("TINY") != nullptr;
  auto make = [&](int64_t d, int64_t c) {
    if (tiny) c = 64;
    const int64_t vb = d * c * bits / 8; auto* v = (uint8_t*)HugePages(vb); auto* s = (uint16_t*)HugePages(d / G * c * 2);
    for (int64_t i = 0; i < vb; ++i) v[i] = uint8_t(rng() % 255 - (bits == 8 ? 127 : 0));
    for (int64_t i = 0; i < d / G * c; ++i) s[i] = 0x2000 + rng() % 0x800;
    bytes += vb + d / G * c * 2; return W{v, s, d, c};
  };
  std::vector<std::vector<W>> calls;
  for (int l = 0; l < kL; ++l) {
    calls.push_back({make(E, E), make(E, KV), make(E, KV)}); calls.push_back({make(E, E)});
    calls.push_back({make(E, MLP), make(E, MLP)}); calls.push_back({make(MLP, E)});
  }
  calls.push_back({make(E, V)});
  std::vector<float> x(rows * MLP); std::normal_distribution<float> nd; for (float& v : x) v = nd(rng);
  std::vector<float> out(rows * V * 2);
  const int64_t sw = (512 << 20) / 8; auto* stream = (int64_t*)HugePages(sw * 8);
  volatile int64_t sink = 0;
  auto step = [&] {
    for (auto& c : calls) {
      std::vector<Problem> ps; int64_t off = 0;
      for (auto& w : c) {
        ps.push_back(Problem{w.values, FloatArray{w.scales, ffi::DataType::F16}, FloatArray{nullptr, ffi::DataType::F16},
                             out.data() + off, nullptr, w.columns, w.depth, G, w.depth / G, bits, 0, 0, 0, 0});
        ps.back().tiled = g_tiled;
        off += rows * w.columns;
      }
      Activations a = Quantize(FloatArray{x.data(), ffi::DataType::F32}, rows, c[0].depth, G, workers);
      for (auto& p : ps) p.x = &a;
      Run(workers, ps, rows);
    }
  };
  auto two = [&] {
    std::thread t([&] { sink = ReadStream(stream, sw / 2); }); sink = ReadStream(stream + sw / 2, sw / 2); t.join();
  };
  for (int round = 0; round < 4; ++round) {
    double bs = 1e9, bt = 1e9;
    for (int r = 0; r < 5; ++r) {
      double t = Now(); if (g_cpu) sink = ReadStream(stream, sw); else two(); bt = std::min(bt, Now() - t);
      sink = ReadStream(stream, sw);  // evict
      t = Now(); step(); bs = std::min(bs, Now() - t);
    }
    const double sgb = sw * 8 / bt / 1e9, kgb = bytes / bs / 1e9;
    printf("{\"bits\": %d, \"rows\": %lld, \"workers\": %d, \"stream_gb_s\": %.1f, \"step_ms\": %.2f, \"gb_s\": %.1f, \"of_stream\": %.2f}\n",
           bits, (long long)rows, workers, sgb, bs * 1e3, kgb, kgb / sgb);
    fflush(stdout);
  }
}
