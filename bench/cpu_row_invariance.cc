// Row invariance of the quantized CPU kernels at any number of workers (session 16, issue 26): for each worker
// count 1 .. MAX_WORKERS and each call of M rows (2, 3, 5, 8, 9, 16, 40, 64), rows 0 and M / 2 of the M-row call
// against the one-row call of that row, bit for bit, over one call of weights at odd widths plus two head-wide
// ones (8640 and 9000 columns). The pytest checks (tests/kernels/row_invariance.py) run with XLA's pool, as
// many workers as this machine has cores; this driver calls the kernel's Run with any count (a verify step on a
// 16-core host cuts a call into 16 runs). Prints the differing columns per (workers, rows) and a verdict.
// KERNEL: INT8 (cpu_quantized_int8_dot.cc), KQUANT (cpu_kquant_matmul.cc; x in int8 where the path has the
// tiles, and in float), FLOAT (cpu_quantized_matmul.cc).
//
//   for K in INT8 KQUANT FLOAT; do g++ -O3 -march=native -fopenmp-simd -fno-math-errno -fno-trapping-math \
//       -std=c++17 -pthread -DKERNEL_$K -I pallas_kernels -I $(.venv/bin/python -c "import jax; \
//       print(jax.ffi.include_dir())") bench/cpu_row_invariance.cc -o /tmp/rows_$K && /tmp/rows_$K 8; done
#if defined(KERNEL_INT8)
#include "../pallas_kernels/matmul/cpu_quantized_int8_dot.cc"
#elif defined(KERNEL_KQUANT)
#include "../pallas_kernels/matmul/cpu_kquant_matmul.cc"
#else
#include "../pallas_kernels/matmul/cpu_quantized_matmul.cc"
#endif

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

namespace {

constexpr int64_t kDepth = 512;
using Results = std::vector<std::vector<float>>;  // per weight [rows, columns]
using Call = std::function<Results(const float* x, int64_t rows, int64_t workers)>;

std::vector<uint8_t> RandomBytes(int64_t count, std::mt19937& rng) {
  std::vector<uint8_t> bytes(count);
  for (uint8_t& b : bytes) b = uint8_t(rng());
  return bytes;
}

std::vector<uint16_t> RandomHalves(int64_t count, std::mt19937& rng, bool signed_values) {
  std::vector<uint16_t> halves(count);
  for (uint16_t& h : halves) h = uint16_t(0x1C00 + rng() % 0x800 + (signed_values && rng() % 2 ? 0x8000 : 0));
  return halves;
}

#if !defined(KERNEL_KQUANT)
struct Spec {
  int64_t columns;
  int bits, group;
  bool mins;
};
struct Stored {
  Spec spec;
  std::vector<uint8_t> values;
  std::vector<uint16_t> scales, mins;
};

std::vector<Stored> MakeWeights(std::mt19937& rng) {
  const Spec specs[] = {{200, 4, 32, false}, {64, 4, 32, true},  {64, 8, 32, false},   {83, 8, 32, false},
                        {30, 8, 16, true},   {150, 4, 128, false}, {17, 8, 512, false}, {8640, 4, 32, false},
                        {9000, 8, 32, false}};
  std::vector<Stored> weights;
  for (const Spec& s : specs) {
    const int64_t groups = kDepth / s.group;
    weights.push_back(Stored{s, RandomBytes(kDepth * s.bits / 8 * s.columns, rng),
                             RandomHalves(groups * s.columns, rng, false),
                             s.mins ? RandomHalves(groups * s.columns, rng, true) : std::vector<uint16_t>()});
  }
  return weights;
}
#endif

#if defined(KERNEL_INT8)
Call MakeCall(const std::vector<Stored>& weights) {
  return [&weights](const float* x, int64_t rows, int64_t workers) {
    Results out(weights.size());
    std::vector<Problem> problems;
    for (size_t i = 0; i < weights.size(); ++i) {
      const Stored& w = weights[i];
      out[i].assign(rows * w.spec.columns, 0.0f);
      problems.push_back(Problem{w.values.data(), FloatArray{w.scales.data(), ffi::DataType::F16},
                                 FloatArray{w.spec.mins ? w.mins.data() : nullptr, ffi::DataType::F16}, out[i].data(),
                                 nullptr, w.spec.columns, kDepth, w.spec.group, kDepth / w.spec.group, w.spec.bits, 0,
                                 0, 0, 0});
    }
    std::map<int64_t, Activations> by_group;
    for (Problem& p : problems) {
      auto found = by_group.find(p.group);
      if (found == by_group.end()) {
        found = by_group.emplace(p.group, Quantize(FloatArray{x, ffi::DataType::F32}, rows, kDepth, p.group, workers))
                    .first;
      }
      p.x = &found->second;
    }
    Run(workers, problems, rows);
    return out;
  };
}
#elif defined(KERNEL_KQUANT)
struct Stored {
  int kind;
  int64_t columns;
  std::vector<uint8_t> low, high, sub_scales, sub_mins;
  std::vector<uint16_t> d, dmin;
};

std::vector<Stored> MakeWeights(std::mt19937& rng) {
  const std::pair<int, int64_t> specs[] = {{6, 260}, {4, 37}, {kQ5_0, 64}, {5, 83}, {kQ5_1, 19}, {4, 8640}, {6, 9000}};
  std::vector<Stored> weights;
  for (const auto& [kind, columns] : specs) {
    const int64_t group = kind == 6 ? 16 : 32, per_d = kind == kQ5_0 || kind == kQ5_1 ? 1 : kSuperBlock / group;
    const int64_t d_rows = kDepth / group / per_d;
    Stored w{kind, columns, RandomBytes(kDepth / 2 * columns, rng), {}, {}, {}, {}, {}};
    if (kind != 4) w.high = RandomBytes(kDepth * HighBits(kind) / 8 * columns, rng);
    if (kind == 4 || kind == 5 || kind == 6) w.sub_scales = RandomBytes(kDepth / group * columns, rng);
    if (kind == 6) {
      for (uint8_t& s : w.sub_scales) s = uint8_t(int8_t(s % 64) - 32);
    } else {
      for (uint8_t& s : w.sub_scales) s %= 64;
    }
    if (kind == 4 || kind == 5) {
      w.sub_mins = RandomBytes(kDepth / 32 * columns, rng);
      for (uint8_t& m : w.sub_mins) m %= 64;
    }
    w.d = RandomHalves(d_rows * columns, rng, false);
    if (HasMins(kind)) w.dmin = RandomHalves(d_rows * columns, rng, kind == kQ5_1);
    weights.push_back(std::move(w));
  }
  return weights;
}

Call MakeCall(const std::vector<Stored>& weights, bool int8_x) {
  return [&weights, int8_x](const float* x, int64_t rows, int64_t workers) {
    Results out(weights.size());
    std::vector<float> x_sums(rows * (kDepth / 32), 0.0f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < kDepth; ++k) x_sums[r * (kDepth / 32) + k / 32] += x[r * kDepth + k];
#if defined(KQUANT_INT8)
    QuantizedRows x_int8;
    if (int8_x) x_int8 = QuantizeRows(x, rows, kDepth);
#else
    (void)int8_x;
#endif
    std::vector<Weight> ws;
    for (size_t i = 0; i < weights.size(); ++i) {
      const Stored& s = weights[i];
      out[i].assign(rows * s.columns, 0.0f);
      Weight w;
      w.kind = s.kind;
      w.columns = s.columns;
      w.group = s.kind == 6 ? 16 : 32;
      w.groups_per_d = s.kind == kQ5_0 || s.kind == kQ5_1 ? 1 : kSuperBlock / w.group;
      w.low = s.low.data();
      w.high = s.high.empty() ? nullptr : s.high.data();
      w.sub_scales = s.sub_scales.empty() ? nullptr : s.sub_scales.data();
      w.sub_mins = s.sub_mins.empty() ? nullptr : s.sub_mins.data();
      w.d = s.d.data();
      w.dmin = s.dmin.empty() ? nullptr : s.dmin.data();
      w.out = out[i].data();
      w.x_sums = x_sums.data();
#if defined(KQUANT_INT8)
      w.x_int8 = int8_x ? &x_int8 : nullptr;
#endif
      ws.push_back(w);
    }
    Run(workers, ws, Rows{x, rows, kDepth});
    return out;
  };
}
#else
Call MakeCall(const std::vector<Stored>& weights) {
  return [&weights](const float* x, int64_t rows, int64_t workers) {
    Results out(weights.size());
    std::vector<Problem> problems;
    std::vector<std::vector<float>> x_sums(weights.size());
    for (size_t i = 0; i < weights.size(); ++i) {
      const Stored& w = weights[i];
      const int64_t groups = kDepth / w.spec.group;
      out[i].assign(rows * w.spec.columns, 0.0f);
      x_sums[i].assign(rows * groups, 0.0f);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < kDepth; ++k) x_sums[i][r * groups + k / w.spec.group] += x[r * kDepth + k];
      problems.push_back(Problem{w.values.data(), FloatArray{w.scales.data(), ffi::DataType::F16},
                                 FloatArray{w.spec.mins ? w.mins.data() : nullptr, ffi::DataType::F16}, out[i].data(),
                                 x_sums[i].data(), w.spec.columns, w.spec.group, groups, w.spec.bits, 0, 0, 0});
    }
    Run(workers, problems, Rows{x, rows, kDepth});
    return out;
  };
}
#endif

// Differing columns over (rows 0 and M / 2 of M-row calls) vs one-row calls; prints each nonzero count.
int64_t Check(const char* label, const Call& call, const std::vector<float>& x, int64_t max_workers) {
  int64_t total = 0;
  for (int64_t workers = 1; workers <= max_workers; ++workers) {
    for (int64_t rows : {2, 3, 5, 8, 9, 16, 40, 64}) {
      const Results together = call(x.data(), rows, workers);
      int64_t differ = 0;
      for (int64_t row : {int64_t(0), rows / 2}) {
        const Results alone = call(x.data() + row * kDepth, 1, workers);
        for (size_t i = 0; i < alone.size(); ++i) {
          const int64_t columns = int64_t(alone[i].size());
          for (int64_t c = 0; c < columns; ++c) differ += together[i][row * columns + c] != alone[i][c];
        }
      }
      if (differ) std::printf("%s: %lld workers, %lld rows: %lld columns differ\n", label, (long long)workers,
                              (long long)rows, (long long)differ);
      total += differ;
    }
  }
  std::printf("%s: workers 1-%lld: %s\n", label, (long long)max_workers, total ? "ROW-DEPENDENT" : "row-invariant");
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t max_workers = argc > 1 ? std::atoi(argv[1]) : 8;
  std::mt19937 rng(16);
  std::vector<float> x(64 * kDepth);
  std::normal_distribution<float> normal;
  for (float& v : x) v = normal(rng);
  const auto weights = MakeWeights(rng);
  int64_t total = 0;
#if defined(KERNEL_KQUANT)
  total += Check("kquant float x", MakeCall(weights, false), x, max_workers);
#if defined(KQUANT_INT8)
  total += Check("kquant int8 x", MakeCall(weights, true), x, max_workers);
#endif
#elif defined(KERNEL_INT8)
  total += Check("int8 dot", MakeCall(weights), x, max_workers);
#else
  total += Check("float quantized", MakeCall(weights), x, max_workers);
#endif
  return total ? 1 : 0;
}
