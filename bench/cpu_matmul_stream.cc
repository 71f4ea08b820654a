// One thread's GB/s of the CPU small matmul's work items over SmolLM2-135M's weights (30 layers: q, k, v,
// o, gate, up, down, and the tied head read transposed), against a plain read stream in the same run
// (issue #29). Times are thread CPU time, best of 5 after a 512 MiB read that evicts the caches: on a
// shared machine wall time mostly measures the other processes, thread time far less.
//
//   g++ -O3 -march=native -fopenmp-simd -fno-math-errno -fno-trapping-math -std=c++17 \
//       -I pallas_kernels -I $(.venv/bin/python -c "import jax; print(jax.ffi.include_dir())") \
//       bench/cpu_matmul_stream.cc -o /tmp/cpu_matmul_stream && /tmp/cpu_matmul_stream
//
// Add -DJAXSERVE_ONE_ROW_SWEEP=1 for what AMD CPUs build (the float32 one-row sweep, cpu_matmul_few_rows.h),
// -mno-avx512f for the avx2 path's code (what JAXSERVE_CPU_KERNEL_PATH=avx2 builds), or
// -DJAXSERVE_NO_BF16_PAIRS for bfloat16 at 3+ rows widened rather than in vdpbf16ps pairs (on AMX CPUs, widened
// is the default and -DJAXSERVE_BF16_PAIRS_WITH_AMX builds the pairs). Prints one JSON
// line per dtype, rows and round: "layers" and "head" as fractions of the read stream. An argument picks
// one row count (1, 2, 4, 5, 8, 16, 64; 5 is a speculative verify step of k = 4).
//
// A second argument, `2`, is the two-thread mode: a decode step's calls as the engine makes them (per layer
// q/k/v joined, o, gate/up joined, down; then the head), each through Run on the caller and one helper
// thread (cpu_workers.h), in wall time, against two threads reading halves of a stream at once (on a
// machine where one thread cannot read at the memory's bandwidth, the single-stream roofline is the
// two-thread one), and against the same calls on one worker. Wall time: run it on a quiet machine.
//
// A third argument `nk` (two-thread mode) stores the layers' weights [N, K] as the tied head is (the same shapes,
// read by the transposed walks, NkStreams / NkItem): what a transposed layer layout would read (session 24:
// docs/notes/cpu-kernels.md); `panels` stores them in column panels as the engine does where the kernel serves
// the dtype at every row count (cpu_matmul_panels.h, session 32; SmolLM2's widths are whole panels).
//
// A second argument `hot` runs the walks over weights that stay in L2 instead (BenchHot): the instructions'
// cost per byte, which a machine with more bandwidth per core would expose, per path and dtype.
#include "../pallas_kernels/matmul/cpu_matmul.cc"

#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <string>

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
  std::memset(p, 0, bytes);
  return p;
}

__attribute__((noinline)) float ReadStream(const float* p, int64_t n) {
  VecF a0{}, a1{}, a2{}, a3{};
  for (int64_t i = 0; i + 4 * kLanes <= n; i += 4 * kLanes) {
    a0 += LoadF(p + i);
    a1 += LoadF(p + i + kLanes);
    a2 += LoadF(p + i + 2 * kLanes);
    a3 += LoadF(p + i + 3 * kLanes);
  }
  return HorizontalSum(a0 + a1 + a2 + a3);
}

// One [K, N] weight as the engine's plan cuts it for two workers (MakePlan), its items run one after another.
template <typename T>
void RunWeightItems(Problem& p, float* out) {
  const Plan plan = MakePlan<T>(p, false, 2);
  for (int64_t i = 0; i < plan.num_items; ++i) {
    const int64_t block = i % plan.blocks, part = i / plan.blocks, c0 = block * plan.block_columns;
    int64_t k0, k1;
    PartRows(plan, part, k0, k1);
    KnItem<T>(p, k0, k1, c0, std::min(plan.block_columns, p.columns - c0), plan.chunk, out);
  }
}

template <typename T>
void Bench(const char* dtype, int64_t rows) {
  using S = typename T::Stored;
  constexpr int64_t kLayers = 30, kEmbed = 576, kKv = 192, kMlp = 1536, kVocab = 49152;
  const int64_t shapes[7][2] = {{kEmbed, kEmbed}, {kEmbed, kKv}, {kEmbed, kKv}, {kEmbed, kEmbed},
                                {kEmbed, kMlp},   {kEmbed, kMlp}, {kMlp, kEmbed}};
  int64_t layer_elements = 0;
  for (const auto& s : shapes) layer_elements += s[0] * s[1];
  auto* layers = static_cast<S*>(HugePages(kLayers * layer_elements * sizeof(S)));
  auto* head = static_cast<S*>(HugePages(kVocab * kEmbed * sizeof(S)));
  const int64_t stream_floats = (512 << 20) / 4;
  auto* stream = static_cast<float*>(HugePages(stream_floats * 4));
  std::vector<float> x(rows * kMlp, 0.01f), out(rows * kVocab);
  std::vector<uint16_t> x16(rows * kMlp, 0x3c24);  // 0.01 in bfloat16: x's pairs for vdpbf16ps (kMlp is even)
  volatile float sink = 0;
  auto best = [&](auto fn) {
    double seconds = 1e9;
    for (int r = 0; r < 5; ++r) {
      sink = ReadStream(stream, stream_floats);
      const double start = ThreadSeconds();
      fn();
      seconds = std::min(seconds, ThreadSeconds() - start);
    }
    return seconds;
  };
  for (int round = 0; round < 3; ++round) {
    const double stream_s = best([&] { sink = ReadStream(stream, stream_floats); });
    const double layers_s = best([&] {
      const S* w = layers;
      for (int64_t l = 0; l < kLayers; ++l) {
        for (const auto& s : shapes) {
          Problem p{w, x.data(), out.data(), rows, s[0], s[1], x16.data(), kMlp};
          RunWeightItems<T>(p, out.data());
          w += s[0] * s[1];
        }
      }
    });
    const double head_s = best([&] {
      Problem p{head, x.data(), out.data(), rows, kEmbed, kVocab, x16.data(), kMlp};
      const Plan plan = MakePlan<T>(p, true, 2);
      for (int64_t n0 = 0; n0 < kVocab; n0 += plan.outputs_per_item) {
        NkItem<T>(p, n0, std::min(plan.outputs_per_item, kVocab - n0));
      }
    });
    const double stream_gb_s = stream_floats * 4.0 / stream_s / 1e9;
    const double layers_gb_s = kLayers * layer_elements * sizeof(S) / layers_s / 1e9;
    const double head_gb_s = kVocab * kEmbed * sizeof(S) / head_s / 1e9;
    std::printf(
        "{\"path\": \"%s\", \"dtype\": \"%s\", \"rows\": %lld, \"round\": %d, \"read_stream_gb_s\": %.1f, "
        "\"layers_gb_s\": %.1f, \"head_gb_s\": %.1f, \"layers_of_stream\": %.2f, \"head_of_stream\": %.2f}\n",
        kPath, dtype, static_cast<long long>(rows), round, stream_gb_s, layers_gb_s, head_gb_s,
        layers_gb_s / stream_gb_s, head_gb_s / stream_gb_s);
    std::fflush(stdout);
  }
}

// Hot caches: the same walks over weights that stay in L2 (one thread), repeated: what the walk's
// instructions cost per byte once memory is out of the way (a machine with more bandwidth per core than
// this one exposes it). "layers": a [576, 576] weight (SmolLM2's q) and a [1536, 576] slice of down's rows
// cut to 288 (K 288, N 576), as the engine's plan cuts them for two workers; "head": 384 rows of the tied
// head read transposed. Bytes of weights per thread-CPU second, best of 5 runs of 200 repeats, beside a
// plain read of the layer weights' bytes from L2 (hot_read_gb_s).
template <typename T>
void BenchHot(const char* dtype, int64_t rows) {
  using S = typename T::Stored;
  constexpr int64_t kEmbed = 576, kHeadRows = 384, kRepeats = 200;
  const int64_t shapes[2][2] = {{kEmbed, kEmbed}, {288, kEmbed}};
  std::vector<S> layer(kEmbed * kEmbed + 288 * kEmbed), head(kHeadRows * kEmbed);
  for (size_t i = 0; i < layer.size(); ++i) layer[i] = T::Round(0.001f * float(int(i % 17) - 8));
  for (size_t i = 0; i < head.size(); ++i) head[i] = T::Round(0.001f * float(int(i % 13) - 6));
  std::vector<float> x(rows * kEmbed, 0.01f), out(rows * kEmbed * 2);
  std::vector<uint16_t> x16(rows * kEmbed, 0x3c24);
  auto best = [&](auto fn) {
    double seconds = 1e9;
    for (int r = 0; r < 5; ++r) {
      fn();  // warm
      const double start = ThreadSeconds();
      for (int i = 0; i < kRepeats; ++i) fn();
      seconds = std::min(seconds, (ThreadSeconds() - start) / kRepeats);
    }
    return seconds;
  };
  volatile float sink = 0;
  const int64_t layer_floats = int64_t(layer.size() * sizeof(S) / sizeof(float));
  for (int round = 0; round < 3; ++round) {
    const double read_s = best([&] { sink = ReadStream(reinterpret_cast<const float*>(layer.data()), layer_floats); });
    const double layers_s = best([&] {
      const S* w = layer.data();
      for (const auto& s : shapes) {
        Problem p{w, x.data(), out.data(), rows, s[0], s[1], x16.data(), kEmbed};
        RunWeightItems<T>(p, out.data());
        w += s[0] * s[1];
      }
    });
    const double head_s = best([&] {
      Problem p{head.data(), x.data(), out.data(), rows, kEmbed, kHeadRows, x16.data(), kEmbed};
      const Plan plan = MakePlan<T>(p, true, 2);
      for (int64_t n0 = 0; n0 < kHeadRows; n0 += plan.outputs_per_item) {
        NkItem<T>(p, n0, std::min(plan.outputs_per_item, kHeadRows - n0));
      }
    });
    std::printf(
        "{\"path\": \"%s\", \"dtype\": \"%s\", \"rows\": %lld, \"round\": %d, \"hot_read_gb_s\": %.1f, "
        "\"hot_layers_gb_s\": %.1f, \"hot_head_gb_s\": %.1f, \"hot_layers_gflop_s\": %.1f, \"hot_head_gflop_s\": %.1f}\n",
        kPath, dtype, static_cast<long long>(rows), round, layer_floats * 4.0 / read_s / 1e9,
        layer.size() * sizeof(S) / layers_s / 1e9,
        head.size() * sizeof(S) / head_s / 1e9, 2.0 * rows * layer.size() / layers_s / 1e9,
        2.0 * rows * head.size() / head_s / 1e9);
    std::fflush(stdout);
  }
}

double WallSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Two threads reading the two halves of the stream at once: what a step's two workers can read.
float TwoThreadStream(const float* p, int64_t n) {
  volatile float other = 0;
  std::thread helper([&] { other = ReadStream(p + n / 2, n - n / 2); });
  const float mine = ReadStream(p, n / 2);
  helper.join();
  return mine + other;
}

template <typename T>
void BenchTwoThreads(const char* dtype, int64_t rows, bool layers_transposed, bool layers_in_panels) {
  using S = typename T::Stored;
  constexpr int64_t kLayers = 30, kEmbed = 576, kKv = 192, kMlp = 1536, kVocab = 49152;
  // A layer's weights in the engine's calls: {q, k, v}, {o}, {gate, up}, {down}.
  const int64_t shapes[7][2] = {{kEmbed, kEmbed}, {kEmbed, kKv}, {kEmbed, kKv}, {kEmbed, kEmbed},
                                {kEmbed, kMlp},   {kEmbed, kMlp}, {kMlp, kEmbed}};
  const int calls[4][2] = {{0, 3}, {3, 4}, {4, 6}, {6, 7}};  // [first, end) of shapes
  int64_t layer_elements = 0;
  for (const auto& s : shapes) layer_elements += s[0] * s[1];
  auto* layers = static_cast<S*>(HugePages(kLayers * layer_elements * sizeof(S)));
  auto* head = static_cast<S*>(HugePages(kVocab * kEmbed * sizeof(S)));
  const int64_t stream_floats = (512 << 20) / 4;
  auto* stream = static_cast<float*>(HugePages(stream_floats * 4));
  std::vector<float> x(rows * kMlp, 0.01f), out(rows * (kVocab + 4 * kMlp));
  std::vector<uint16_t> x16(rows * kMlp, 0x3c24);
  volatile float sink = 0;
  auto step = [&](int64_t workers) {
    const S* w = layers;
    for (int64_t l = 0; l < kLayers; ++l) {
      for (const auto& call : calls) {
        std::vector<Problem> problems;
        float* o = out.data();
        for (int i = call[0]; i < call[1]; ++i) {
          problems.push_back(Problem{w, x.data(), o, rows, shapes[i][0], shapes[i][1], x16.data(), kMlp});
          problems.back().panels = layers_in_panels;
          o += rows * shapes[i][1];
          w += shapes[i][0] * shapes[i][1];
        }
        Run<T>(std::move(problems), layers_transposed, workers);
      }
    }
    Run<T>({Problem{head, x.data(), out.data(), rows, kEmbed, kVocab, x16.data(), kMlp}}, true, workers);
  };
  auto best = [&](auto fn) {
    double seconds = 1e9;
    for (int r = 0; r < 5; ++r) {
      sink = TwoThreadStream(stream, stream_floats);
      const double start = WallSeconds();
      fn();
      seconds = std::min(seconds, WallSeconds() - start);
    }
    return seconds;
  };
  const double bytes = double(kLayers * layer_elements + kVocab * kEmbed) * sizeof(S);
  for (int round = 0; round < 3; ++round) {
    const double one_stream_s = best([&] { sink = ReadStream(stream, stream_floats); });
    const double two_stream_s = best([&] { sink = TwoThreadStream(stream, stream_floats); });
    const double two_s = best([&] { step(2); });
    const double one_s = best([&] { step(1); });
    const double two_stream_gb_s = stream_floats * 4.0 / two_stream_s / 1e9;
    std::printf(
        "{\"path\": \"%s\", \"dtype\": \"%s\", \"rows\": %lld, \"layers\": \"%s\", \"round\": %d, \"one_thread_stream_gb_s\": %.1f, "
        "\"two_thread_stream_gb_s\": %.1f, \"step_ms_two_workers\": %.2f, \"step_ms_one_worker\": %.2f, "
        "\"two_workers_of_two_thread_stream\": %.2f, \"one_worker_of_two_thread_stream\": %.2f}\n",
        kPath, dtype, static_cast<long long>(rows), layers_transposed ? "[N, K]" : layers_in_panels ? "panels" : "[K, N]", round,
        stream_floats * 4.0 / one_stream_s / 1e9, two_stream_gb_s,
        1e3 * two_s, 1e3 * one_s, bytes / two_s / 1e9 / two_stream_gb_s, bytes / one_s / 1e9 / two_stream_gb_s);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool two_threads = argc > 2 && std::atoi(argv[2]) == 2;
  const bool hot = argc > 2 && std::string(argv[2]) == "hot";
  const bool layers_transposed = argc > 3 && std::string(argv[3]) == "nk";
  const bool layers_in_panels = argc > 3 && std::string(argv[3]) == "panels";
  for (int64_t rows : {1, 2, 4, 5, 7, 8, 16, 64}) {
    if (argc > 1 && std::atoi(argv[1]) != rows) continue;
    if (hot) {
      BenchHot<F32>("float32", rows);
      BenchHot<BF16>("bfloat16", rows);
    } else if (two_threads) {
      BenchTwoThreads<F32>("float32", rows, layers_transposed, layers_in_panels);
      BenchTwoThreads<BF16>("bfloat16", rows, layers_transposed, layers_in_panels);
    } else {
      Bench<F32>("float32", rows);
      Bench<BF16>("bfloat16", rows);
    }
  }
}
