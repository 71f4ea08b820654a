// One thread's GB/s of the int8-activation quantized kernel's work items (cpu_quantized_int8_dot.cc) over
// SmolLM2-135M's weights in the Q8_0 layout (int8, groups of 32, float16 scales) and the Q4_0 layout (4-bit,
// offset 8), against a plain read stream in the same run (issue #25). Times are thread CPU time, best of 5
// after a 512 MiB read that evicts the caches (on a shared machine wall time mostly measures the other
// processes). Bytes = the stored weights + their scales.
//
//   g++ -O3 -march=native -fopenmp-simd -fno-math-errno -fno-trapping-math -std=c++17 \
//       -I pallas_kernels -I $(.venv/bin/python -c "import jax; print(jax.ffi.include_dir())") \
//       bench/cpu_int8_dot_stream.cc -o /tmp/cpu_int8_dot_stream && /tmp/cpu_int8_dot_stream
//
// HOT=1 reuses the first layer's weights in every layer (3.5 MB for Q8_0: from L2/L3, the instructions'
// bound rather than memory's; the "of_stream" figures then exceed 1). Add -mno-avx512f for the avx2 path. Prints one JSON line per layout, rows and round: "layers" and "head"
// as fractions of the read stream. An argument picks one row count (1, 2, 4, 5, 8).
#include "../pallas_kernels/matmul/cpu_quantized_int8_dot.cc"

#include <sys/mman.h>

#include <cstdio>
#include <ctime>
#include <random>

namespace {

double ThreadSeconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

void* HugePages(size_t bytes) {  // as the engine's weights (jaxserve/device/huge_pages.py)
  bytes = (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(p, bytes, MADV_HUGEPAGE);
  std::memset(p, 0x11, bytes);
  return p;
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

struct StoredWeight {
  const void* values;
  const uint16_t* scales;
  int64_t depth, columns;
};

void Bench(const char* layout, int bits, int64_t rows) {
  constexpr int64_t kLayers = 30, kEmbed = 576, kKv = 192, kMlp = 1536, kVocab = 49152, kGroup = 32;
  const int64_t shapes[7][2] = {{kEmbed, kEmbed}, {kEmbed, kKv}, {kEmbed, kKv}, {kEmbed, kEmbed},
                                {kEmbed, kMlp},   {kEmbed, kMlp}, {kMlp, kEmbed}};
  auto make = [&](int64_t depth, int64_t columns) {
    const int64_t value_bytes = depth * columns * bits / 8;
    auto* values = static_cast<uint8_t*>(HugePages(value_bytes));
    auto* scales = static_cast<uint16_t*>(HugePages(depth / kGroup * columns * 2));
    std::mt19937 rng(int(depth * 7 + columns));
    for (int64_t i = 0; i < value_bytes; ++i) values[i] = uint8_t(rng() % (bits == 8 ? 255 : 256) - (bits == 8 ? 127 : 0));
    for (int64_t i = 0; i < depth / kGroup * columns; ++i) scales[i] = 0x2000 + rng() % 0x800;  // small f16
    return StoredWeight{values, scales, depth, columns};
  };
  std::vector<StoredWeight> layers;
  int64_t layer_bytes = 0;
  for (int64_t l = 0; l < kLayers; ++l) {
    for (size_t i = 0; i < 7; ++i) {
      const auto& s = shapes[i];
      layers.push_back(l > 0 && std::getenv("HOT") != nullptr ? layers[i] : make(s[0], s[1]));
      layer_bytes += s[0] * s[1] * bits / 8 + s[0] / kGroup * s[1] * 2;
    }
  }
  const StoredWeight head = make(kEmbed, kVocab);
  const int64_t head_bytes = kEmbed * kVocab * bits / 8 + kEmbed / kGroup * kVocab * 2;
  const int64_t stream_words = (512 << 20) / 8;
  auto* stream = static_cast<int64_t*>(HugePages(stream_words * 8));
  std::vector<float> x(rows * kMlp);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);
  const Activations x_embed = Quantize(FloatArray{x.data(), ffi::DataType::F32}, rows, kEmbed, kGroup, 1);
  const Activations x_mlp = Quantize(FloatArray{x.data(), ffi::DataType::F32}, rows, kMlp, kGroup, 1);
  std::vector<float> out(rows * kVocab);
  volatile int64_t sink = 0;
  auto best = [&](auto fn) {
    double seconds = 1e9;
    for (int r = 0; r < 5; ++r) {
      sink = ReadStream(stream, stream_words);
      const double start = ThreadSeconds();
      fn();
      seconds = std::min(seconds, ThreadSeconds() - start);
    }
    return seconds;
  };
  // Each weight as the kernel's plan cuts a call of it alone for two workers (PlanCall), its runs one after
  // another.
  auto run = [&](const StoredWeight& w) {
    std::vector<Problem> problems{Problem{w.values, FloatArray{w.scales, ffi::DataType::F16},
                                          FloatArray{nullptr, ffi::DataType::F16}, out.data(),
                                          w.depth == kEmbed ? &x_embed : &x_mlp, w.columns, w.depth, kGroup,
                                          w.depth / kGroup, bits, 0, 0, 0, 0}};
    const CallPlan plan = PlanCall(problems, rows, 2);
    for (size_t r = 0; r + 1 < plan.run_starts.size(); ++r) RunCallPieces(plan, int64_t(r), rows);
    AddPartials(plan, rows);
  };
  for (int round = 0; round < 3; ++round) {
    const double stream_s = best([&] { sink = ReadStream(stream, stream_words); });
    const double layers_s = best([&] {
      for (const StoredWeight& w : layers) run(w);
    });
    const double head_s = best([&] { run(head); });
    const double stream_gb_s = stream_words * 8.0 / stream_s / 1e9;
    const double layers_gb_s = layer_bytes / layers_s / 1e9, head_gb_s = head_bytes / head_s / 1e9;
    std::printf(
        "{\"layout\": \"%s\", \"rows\": %lld, \"round\": %d, \"read_stream_gb_s\": %.1f, \"layers_gb_s\": %.1f, "
        "\"head_gb_s\": %.1f, \"layers_of_stream\": %.2f, \"head_of_stream\": %.2f, \"layers_ms\": %.2f, "
        "\"head_ms\": %.2f}\n",
        layout, static_cast<long long>(rows), round, stream_gb_s, layers_gb_s, head_gb_s, layers_gb_s / stream_gb_s,
        head_gb_s / stream_gb_s, 1e3 * layers_s, 1e3 * head_s);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  for (int64_t rows : {1, 2, 4, 5, 8}) {
    if (argc > 1 && std::atoi(argv[1]) != rows) continue;
    Bench("Q8_0", 8, rows);
    Bench("Q4_0", 4, rows);
  }
}
