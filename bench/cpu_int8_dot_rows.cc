// Two trees' int8-activation quantized kernels (cpu_quantized_int8_dot.cc) in ONE process, alternating, on
// tiled weights of SmolLM2-135M's layer shapes (random bytes, float16 scales, [mins]), cache-hot, one thread:
// the best thread-CPU time of each over the rounds as GMAC/s, their ratio, and whether their outputs are the
// same bits. Why one process: this machine's single-thread rate moves 2x between runs of one binary (the host's
// other tenants), so only alternation inside one process compares two walks (session 42, cpu_int8_dot_tiles.h).
//
//   git worktree add /tmp/wt_old <commit>
//   g++ -O3 -march=native -fopenmp-simd -fno-math-errno -fno-trapping-math -std=c++17 -I pallas_kernels \
//       -I $(.venv/bin/python -c "import jax; print(jax.ffi.include_dir())") \
//       -DOLD_FILE='"/tmp/wt_old/pallas_kernels/matmul/cpu_quantized_int8_dot.cc"' \
//       -DNEW_FILE='"'$PWD'/pallas_kernels/matmul/cpu_quantized_int8_dot.cc"' bench/cpu_int8_dot_rows.cc \
//       -o /tmp/cpu_int8_dot_rows -lpthread
//   /tmp/cpu_int8_dot_rows BITS ROWS [ROUNDS=15] [MINS=0] [TILED=1]   # BITS 4, 5 or 8; TILED 0: [K, N]
//
// The shared headers (workers, call plan, weight basics) are included once, up front; each tree's kernel file
// in a namespace of its own (its handler symbol left out).
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <map>
#include <random>
#include <vector>
#include "xla/ffi/api/ffi.h"
#include "matmul/cpu_weight_basics.h"
#include "cpu_workers.h"
#include "matmul/cpu_call_plan.h"
#include "matmul/cpu_rms_norm.h"
#undef XLA_FFI_DEFINE_HANDLER_SYMBOL
#define XLA_FFI_DEFINE_HANDLER_SYMBOL(...)
namespace ffi = xla::ffi;
namespace old_k {
#include OLD_FILE
}
namespace new_k {
#include NEW_FILE
}
double Cpu() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char** argv) {
  const int bits = std::atoi(argv[1]);
  const int64_t rows = std::atoi(argv[2]);
  const int rounds = argc > 3 ? std::atoi(argv[3]) : 15;
  const bool mins = argc > 4 && std::atoi(argv[4]);
  const bool tiled = !(argc > 5 && std::atoi(argv[5]) == 0);  // 0: the [K, N] layout
  const int64_t shapes[7][2] = {{576, 576}, {576, 192}, {576, 192}, {576, 576}, {576, 1536}, {576, 1536}, {1536, 576}};
  std::mt19937 rng(1);
  std::vector<std::vector<uint8_t>> vals; std::vector<std::vector<uint16_t>> scs, mns;
  for (auto& s : shapes) {
    vals.emplace_back(s[0] * s[1] * bits / 8); for (auto& v : vals.back()) v = rng();
    scs.emplace_back(s[0] / 32 * s[1]); for (auto& v : scs.back()) v = 0x2000 + rng() % 0x800;
    mns.emplace_back(s[0] / 32 * s[1]); for (auto& v : mns.back()) v = 0xA000 + rng() % 0x800;
  }
  std::vector<float> x(rows * 1536); std::normal_distribution<float> nd; for (auto& v : x) v = nd(rng);
  double macs = 0; for (auto& s : shapes) macs += double(s[0]) * s[1] * rows;
  std::vector<std::vector<float>> oa(7), ob(7); for (int i = 0; i < 7; ++i) { oa[i].resize(rows * shapes[i][1]); ob[i].resize(rows * shapes[i][1]); }
#define RUNNER(NS, outs)                                                                                              \
  [&] {                                                                                                               \
    static const NS::Activations xe = NS::Quantize(NS::FloatArray{x.data(), ffi::DataType::F32}, rows, 576, 32, 1);  \
    static const NS::Activations xm = NS::Quantize(NS::FloatArray{x.data(), ffi::DataType::F32}, rows, 1536, 32, 1); \
    for (int i = 0; i < 7; ++i) {                                                                                     \
      std::vector<NS::Problem> ps{NS::Problem{vals[i].data(), NS::FloatArray{scs[i].data(), ffi::DataType::F16},      \
                                              NS::FloatArray{mins ? mns[i].data() : nullptr, ffi::DataType::F16},     \
                                              outs[i].data(), shapes[i][0] == 576 ? &xe : &xm, shapes[i][1],          \
                                              shapes[i][0], 32, shapes[i][0] / 32, bits, 0, 0, 0, 0, tiled}};          \
      NS::Run(1, ps, rows);                                                                                           \
    }                                                                                                                 \
  }
  auto a = RUNNER(old_k, oa);
  auto b = RUNNER(new_k, ob);
  a(); b();
  double ta = 1e9, tb = 1e9;
  for (int r = 0; r < rounds; ++r) {
    double c = Cpu(); a(); ta = std::min(ta, Cpu() - c);
    c = Cpu(); b(); tb = std::min(tb, Cpu() - c);
  }
  bool same = true; for (int i = 0; i < 7; ++i) same &= std::memcmp(oa[i].data(), ob[i].data(), oa[i].size() * 4) == 0;
  std::printf("{\"bits\": %d, \"rows\": %lld, \"mins\": %d, \"tiled\": %d, \"old_gmac_s\": %.1f, \"new_gmac_s\": %.1f, \"new_over_old\": %.2f, \"bit_identical\": %s}\n", bits, (long long)rows, int(mins), int(tiled),
              macs / ta / 1e9, macs / tb / 1e9, ta / tb, same ? "true" : "false");
}
