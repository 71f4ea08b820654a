// One thread's GB/s of the K-quant kernel's work items (pallas_kernels/matmul/cpu_kquant_matmul.cc) over
// SmolLM2-135M's Q4_K_M projections (30 layers: q, k, o, gate, up as Q5_0 (K = 576 is no multiple of 256,
// llama.cpp's fallback), down as Q6_K in 14 layers and Q4_K in 16; v and the head are Q8_0, the other
// kernel's), against a plain read stream in the same run (issue #25). Times are thread CPU time, best of 5
// after a 512 MiB read that evicts the caches: on a shared machine wall time mostly measures the other
// processes, thread time far less. Each weight is planned as a call of its own for two workers (PlanCall; more
// than 8 rows: PlanWeight), and its items run one after another on this thread.
//
//   g++ -O3 -march=native -fopenmp-simd -fno-math-errno -fno-trapping-math -std=c++17 \
//       -I pallas_kernels -I $(.venv/bin/python -c "import jax; print(jax.ffi.include_dir())") \
//       bench/cpu_kquant_stream.cc -o /tmp/cpu_kquant_stream && /tmp/cpu_kquant_stream
//
// Add -mno-avx512f -mprefer-vector-width=256 for the avx2 path's code, -march=x86-64 for the portable one.
// Prints one JSON line per rows and round: each kind's and all the layers' GB/s, as fractions of the
// stream. An argument picks the row count (default: 1, 8, 16 and 48).
#include "../pallas_kernels/matmul/cpu_kquant_matmul.cc"

#include <sys/mman.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>

namespace {

double ThreadSeconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

uint8_t* HugePages(size_t bytes) {  // as the engine's weights (jaxserve/device/huge_pages.py)
  bytes = (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20);
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  madvise(p, bytes, MADV_HUGEPAGE);
  std::memset(p, 0, bytes);
  return static_cast<uint8_t*>(p);
}

__attribute__((noinline)) float ReadStream(const float* p, int64_t n) {
  VecF a0{}, a1{}, a2{}, a3{};
  for (int64_t i = 0; i + 4 * kLanes <= n; i += 4 * kLanes) {
    a0 += LoadF(p + i);
    a1 += LoadF(p + i + kLanes);
    a2 += LoadF(p + i + 2 * kLanes);
    a3 += LoadF(p + i + 3 * kLanes);
  }
  VecF a = a0 + a1 + a2 + a3;
  float sum = 0.0f;
  for (int i = 0; i < kLanes; ++i) sum += a[i];
  return sum;
}

// A weight of `kind` [depth, columns] with random planes and float16 scales of 1 (no denormals), laid out
// in one arena as the engine's weights are.
Weight MakeWeight(int kind, int64_t depth, int64_t columns, uint8_t*& arena, int64_t& bytes) {
  Weight w;
  w.kind = kind;
  w.columns = columns;
  w.group = kind == 6 ? 16 : 32;
  w.groups_per_d = kind == kQ5_0 || kind == kQ5_1 ? 1 : kSuperBlock / w.group;
  const int64_t d_rows = depth / w.group / w.groups_per_d;
  auto take = [&](int64_t size) {
    uint8_t* p = arena;
    for (int64_t i = 0; i < size; ++i) p[i] = uint8_t(std::rand());
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

void Bench(int64_t rows) {
  constexpr int64_t kLayers = 30, kEmbed = 576, kKv = 192, kMlp = 1536;
  uint8_t* arena = HugePages(256 << 20);
  std::vector<Weight> weights;
  std::vector<int64_t> depths;
  int64_t bytes_by_kind[3] = {0, 0, 0};  // Q5_0, Q6_K, Q4_K
  for (int64_t l = 0; l < kLayers; ++l) {
    const int64_t q50[4][2] = {{kEmbed, kEmbed}, {kEmbed, kKv}, {kEmbed, kEmbed}, {kEmbed, kMlp}};
    for (const auto& s : q50) {
      for (int copies = s[1] == kMlp ? 2 : 1; copies > 0; --copies) {
        weights.push_back(MakeWeight(kQ5_0, s[0], s[1], arena, bytes_by_kind[0]));
        depths.push_back(s[0]);
      }
    }
    const bool q6 = l < 14;
    weights.push_back(MakeWeight(q6 ? 6 : 4, kMlp, kEmbed, arena, bytes_by_kind[q6 ? 1 : 2]));
    depths.push_back(kMlp);
  }
  const int64_t stream_floats = (512 << 20) / 4;
  auto* stream = reinterpret_cast<float*>(HugePages(stream_floats * 4));
  std::vector<float> x(rows * kMlp), out(rows * kMlp);
  for (auto& v : x) v = float(std::rand() % 1000) / 1000.0f - 0.5f;
  std::vector<float> x_sums(rows * kMlp / 32, 0.25f);
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
  const QuantizedRows x_embed = QuantizeRows(x.data(), rows, kEmbed), x_mlp = QuantizeRows(x.data(), rows, kMlp);
  bool int8 = false;  // whether the items take the int8 tiles
  auto run = [&](int only) {  // only: -1 every weight, else those of one kind
    for (size_t i = 0; i < weights.size(); ++i) {
      Weight w = weights[i];
      const int slot = w.kind == kQ5_0 ? 0 : w.kind == 6 ? 1 : 2;
      if (only >= 0 && only != slot) continue;
      const Rows xs{x.data(), rows, depths[i]};
      w.out = out.data();
      w.x_sums = x_sums.data();
      w.x_int8 = !int8 ? nullptr : depths[i] == kEmbed ? &x_embed : &x_mlp;
      if (rows <= kTileRows) {  // the weight as a call of its own, planned for two workers, run by run here
        const std::vector<Weight> call{w};
        const CallPlan plan = PlanCall(call, depths[i], rows, 2);
        for (size_t r = 0; r + 1 < plan.run_starts.size(); ++r) RunCallPieces(plan, int64_t(r), xs);
        AddPartials(plan, rows);
        continue;
      }
      PlanWeight(w, depths[i], 2);
      const int64_t groups = depths[i] / w.group;
      for (int64_t item = 0; item < w.blocks * w.parts; ++item) {
        const int64_t block = item % w.blocks, part = item / w.blocks;
        const int64_t c0 = block * w.block_columns, width = std::min(w.block_columns, w.columns - c0);
        const Piece piece{&w, c0, width, groups * part / w.parts, groups * (part + 1) / w.parts,
                          Target{out.data(), w.columns, 0}};
        Item(piece, xs, true, nullptr);
      }
    }
  };
  for (int round = 0; round < 6; ++round) {
#if defined(KQUANT_INT8)
    int8 = round % 2 == 1;  // float and int8 activations interleaved
#endif
    const double stream_gb_s = stream_floats * 4.0 / best([&] { sink = ReadStream(stream, stream_floats); }) / 1e9;
    const int64_t total = bytes_by_kind[0] + bytes_by_kind[1] + bytes_by_kind[2];
    const double all_gb_s = total / best([&] { run(-1); }) / 1e9;
    double kind_gb_s[3];
    for (int k = 0; k < 3; ++k) kind_gb_s[k] = bytes_by_kind[k] / best([&] { run(k); }) / 1e9;
    std::printf(
        "{\"activations\": \"%s\", \"rows\": %lld, \"round\": %d, \"lanes\": %d, \"read_stream_gb_s\": %.1f, \"layers_gb_s\": %.2f, "
        "\"layers_of_stream\": %.3f, \"q5_0_of_stream\": %.3f, \"q6_k_of_stream\": %.3f, \"q4_k_of_stream\": %.3f, "
        "\"layers_ms_per_row\": %.3f}\n",
        int8 ? "int8" : "float", static_cast<long long>(rows), round / 2, kLanes, stream_gb_s, all_gb_s, all_gb_s / stream_gb_s,
        kind_gb_s[0] / stream_gb_s, kind_gb_s[1] / stream_gb_s, kind_gb_s[2] / stream_gb_s,
        1e3 * total / all_gb_s / 1e9 / double(rows));
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) {
    Bench(std::atoi(argv[1]));
    return 0;
  }
  for (int64_t rows : {1, 8, 16, 48}) Bench(rows);
}
