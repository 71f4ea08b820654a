// Row invariance of the CPU small matmul (cpu_matmul.cc) for a build the engine's library may not be on this
// CPU: test_small_matmul_rows.py compiles it with -DJAXSERVE_BF16_PAIRS_WITH_AMX, the AVX-512 BF16 vdpbf16ps tiles
// (the avx512 path on an AVX-512 BF16 CPU without AMX, e.g. AMD Zen 4), on any CPU that has the instruction. For
// bfloat16 [K, N], [N, K] and column-panel weights (cpu_matmul_panels.h) of several widths, rows 0, M / 2 and M - 1
// of calls of M rows against the 1-row call of the same row, bit for bit, through Run on two workers. Prints the mismatches; exit status 1 if any.
// With -DROWS_FLOAT32 the same check for float32 weights: compiled with -DJAXSERVE_ONE_ROW_SWEEP=1 (the one-row walk of
// AMD CPUs, cpu_matmul_few_rows.h) on any CPU.
#include "../../../pallas_kernels/matmul/cpu_matmul.cc"

#include <cstdio>
#include <random>

#if defined(ROWS_FLOAT32)
using Type = F32;
#else
using Type = BF16;
#endif

int main() {
  const int64_t depth = 301, widths[3] = {200, 64, 9000}, row_counts[10] = {2, 3, 5, 8, 9, 16, 40, 64, 100, 256};
  std::mt19937 rng(26);
  std::normal_distribution<float> normal;
  std::vector<Type::Stored> x(256 * depth);
  for (auto& v : x) v = Type::Round(2.0f * normal(rng));
  int mismatches = 0;
  std::printf("pairs: %d, one-row sweep: %d\n", int(kBf16Pairs), int(JAXSERVE_ONE_ROW_SWEEP));
  enum Layout { kKn, kNk, kPanels };
  for (Layout layout : {kKn, kNk, kPanels}) {
    const bool transposed = layout == kNk, panels = layout == kPanels;
    std::vector<std::vector<Type::Stored>> weights;
    for (int64_t n : widths) {
      weights.emplace_back(n * depth);
      for (auto& v : weights.back()) v = Type::Round(0.05f * normal(rng));
      if (panels) {  // [K, N] as [ceil(N / P), K, P], zeros past N
        const int64_t count = (n + kPanelColumns - 1) / kPanelColumns;
        std::vector<Type::Stored> in_panels(count * depth * kPanelColumns, Type::Round(0.0f));
        for (int64_t k = 0; k < depth; ++k) {
          for (int64_t c = 0; c < n; ++c) {
            in_panels[(c / kPanelColumns * depth + k) * kPanelColumns + c % kPanelColumns] = weights.back()[k * n + c];
          }
        }
        weights.back() = std::move(in_panels);
      }
    }
    auto call = [&](int64_t first, int64_t rows) {
      std::vector<std::vector<float>> outs;
      std::vector<Problem> problems;
      for (size_t i = 0; i < weights.size(); ++i) outs.emplace_back(rows * widths[i]);
      for (size_t i = 0; i < weights.size(); ++i) {
        problems.push_back(Problem{weights[i].data(), nullptr, outs[i].data(), rows, depth, widths[i]});
        problems.back().panels = panels;
      }
      WidenAndRun<Type>(2, x.data() + first * depth, std::move(problems), transposed);
      return outs;
    };
    for (int64_t rows : row_counts) {
      const auto together = call(0, rows);
      for (int64_t row : {int64_t(0), rows / 2, rows - 1}) {
        const auto alone = call(row, 1);
        for (size_t i = 0; i < weights.size(); ++i) {
          int64_t differ = 0;
          for (int64_t c = 0; c < widths[i]; ++c) {
            differ += std::memcmp(&together[i][row * widths[i] + c], &alone[i][c], sizeof(float)) != 0;
          }
          if (differ > 0) {
            std::printf("layout %d: row %lld of %lld, N %lld: %lld columns differ\n", int(layout),
                        (long long)row, (long long)rows, (long long)widths[i], (long long)differ);
            ++mismatches;
          }
        }
      }
    }
  }
  std::printf("%d mismatching results\n", mismatches);
  return mismatches > 0;
}
