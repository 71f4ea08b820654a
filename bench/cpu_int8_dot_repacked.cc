// Session 39: the layout below is now the kernel's own (cpu_int8_dot_tiles.h, "tiled_ms": TiledItem on the same
// repacked weights, bit_identical checked too); the prototype's "repacked" walk is kept as the reference it was.
// A one-row prototype for the int8-activation quantized kernel (issue 25, session 13): SmolLM2-135M's layer
// weights (Q8_0 / Q4_0 layouts, random) at one row through the present walk (cpu_quantized_int8_dot.cc's Item,
// whole K, one part) and through a REPACKED layout built once up front: per 64-column tile and 32-k chunk one
// contiguous block, 16 columns x 4 k per 64 bytes (8-bit: [quad 8][vector 4][16 columns][4 k]; 4-bit: [pair 4]
// [vector 4][16 columns][4 bytes], byte b of a lane holding k 8p + b in its low nibble and 8p + 4 + b in its
// high one), so that vpdpbusd (or the AVX2 dot) takes the load with no unpacks and the tile's columns stay in
// column order (scales repacked [N / 64, G, 64]). The same integer sums and the same float expression in the
// same chunk order: "bit_identical" checks the repacked results against Item's. One thread, thread CPU time,
// best of 5 after a 512 MiB read that evicts the caches, against a one-thread read stream in the same run.
//
//   g++ -O3 -march=native -fopenmp-simd -fno-math-errno -fno-trapping-math -std=c++17 -I pallas_kernels \
//       -I $(.venv/bin/python -c "import jax; print(jax.ffi.include_dir())") bench/cpu_int8_dot_repacked.cc \
//       -o /tmp/cpu_int8_dot_repacked && /tmp/cpu_int8_dot_repacked 4 && /tmp/cpu_int8_dot_repacked 8
//
// Add -mno-avx512f for the avx2 path. HOT=1: the first layer's weights in every layer (cache-resident: the
// instruction bound); NARROW=1: every weight 64 columns wide (what a call's fixed / latency cost is).
// -DPF=0 / 1 / 2 (-DPFD=bytes): the repacked walk's software prefetch: none / two lines a chunk 4 KiB ahead /
// every line of the chunk PFD ahead.
#include "../pallas_kernels/matmul/cpu_quantized_int8_dot.cc"
#include <sys/mman.h>
#include <cstdio>
#include <ctime>
#include <random>
#ifndef PF
#define PF 1
#endif
#ifndef PFD
#define PFD 4096
#endif
namespace {
double Cpu() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
void* Huge(size_t b) { b = (b + (2 << 20) - 1) / (2 << 20) * (2 << 20);
  void* p = mmap(nullptr, b, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0); madvise(p, b, MADV_HUGEPAGE); memset(p, 0x11, b); return p; }
__attribute__((noinline)) int64_t ReadStream(const int64_t* p, int64_t n) {
  int64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
  for (int64_t i = 0; i < n; i += 4) { a0 += p[i]; a1 += p[i + 1]; a2 += p[i + 2]; a3 += p[i + 3]; }
  return a0 + a1 + a2 + a3; }
struct Wt { uint8_t* values; uint16_t* scales; uint8_t* packed; uint16_t* pscales; int64_t K, N; };
constexpr int64_t G = 32;
// repacked: tile t (64 columns), chunk g: 8-bit: [quad 8][vector 4][16 cols][4 k]; 4-bit: [pair 4][vector 4][16 cols][4 bytes],
// byte b of a lane: k 8p + b (low nibble), 8p + 4 + b (high)
void Repack(Wt& w, int bits) {
  const int64_t tiles = w.N / 64, chunk_bytes = bits == 8 ? 2048 : 1024;
  for (int64_t t = 0; t < tiles; ++t) for (int64_t g = 0; g < w.K / G; ++g) {
    uint8_t* o = w.packed + (t * (w.K / G) + g) * chunk_bytes;
    for (int64_t col = 0; col < 64; ++col) {
      const int64_t n = t * 64 + col, j = col / 16, i = col % 16;
      w.pscales[(t * (w.K / G) + g) * 64 + col] = w.scales[g * w.N + n];
      for (int64_t kk = 0; kk < 32; ++kk) {
        const int64_t k = g * 32 + kk;
        if (bits == 8) { o[((kk / 4) * 4 + j) * 64 + i * 4 + kk % 4] = w.values[k * w.N + n]; continue; }
        const uint8_t nib = (w.values[(k / 2) * w.N + n] >> (k % 2 * 4)) & 15;
        const int64_t p = kk / 8, b = kk % 4, hi = (kk % 8) / 4;
        uint8_t& byte = o[(p * 4 + j) * 64 + i * 4 + b];
        byte = hi ? (byte & 0x0F) | (nib << 4) : (byte & 0xF0) | nib;
      }
    }
  }
}
#if defined(__AVX512F__)
template <int Bits>
void Packed(const Wt& w, const Activations& x, float* out) {
  const int64_t groups = w.K / G, chunk_bytes = Bits == 8 ? 2048 : 1024;
  for (int64_t t = 0; t < w.N / 64; ++t) {
    const uint8_t* base = w.packed + t * groups * chunk_bytes;
    const uint16_t* sc = w.pscales + t * groups * 64;
    __m512 o[4];
    for (int j = 0; j < 4; ++j) o[j] = _mm512_loadu_ps(out + t * 64 + 16 * j);
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* c = base + g * chunk_bytes;
#if PF == 1
      _mm_prefetch((const char*)c + 4096, _MM_HINT_T1); _mm_prefetch((const char*)c + 4096 + 64 * 8, _MM_HINT_T1);
#elif PF == 2
      for (int64_t l = 0; l < chunk_bytes; l += 64) _mm_prefetch((const char*)c + PFD + l, _MM_HINT_T1);
#endif
      const int8_t* xq = x.q.data() + g * 32;
      int32_t start = 0; for (int k = 0; k < 32; ++k) start -= (Bits == 8 ? 128 : 8) * xq[k];
      __m512i acc[4];
      for (int j = 0; j < 4; ++j) acc[j] = _mm512_set1_epi32(start);
      for (int q = 0; q < 8; q += (Bits == 8 ? 1 : 2)) {
        int32_t f0, f1; memcpy(&f0, xq + 4 * q, 4); memcpy(&f1, xq + 4 * q + 4, 4);
        const __m512i x0 = _mm512_set1_epi32(f0), x1 = _mm512_set1_epi32(f1);
        for (int j = 0; j < 4; ++j) {
          if (Bits == 8) {
            const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(c + (q * 4 + j) * 64), _mm512_set1_epi8(-128));
            acc[j] = _mm512_dpbusd_epi32(acc[j], v, x0);
          } else {
            const __m512i v = _mm512_loadu_si512(c + ((q / 2) * 4 + j) * 64), m = _mm512_set1_epi8(15);
            acc[j] = _mm512_dpbusd_epi32(acc[j], _mm512_and_si512(v, m), x0);
            acc[j] = _mm512_dpbusd_epi32(acc[j], _mm512_and_si512(_mm512_srli_epi16(v, 4), m), x1);
          }
        }
      }
      const __m512 d = _mm512_set1_ps(x.scale[g]);
      for (int j = 0; j < 4; ++j) {
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + g * 64 + 16 * j)));
        o[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[j]), _mm512_mul_ps(d, s), o[j]);
      }
    }
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + t * 64 + 16 * j, o[j]);
  }
}
#else
template <int Bits>
void Packed(const Wt& w, const Activations& x, float* out) {  // AVX2 (+ AVX-VNNI where the flags have it)
  const int64_t groups = w.K / G, chunk_bytes = Bits == 8 ? 2048 : 1024;
  for (int64_t t = 0; t < w.N / 64; ++t) {
    const uint8_t* base = w.packed + t * groups * chunk_bytes;
    const uint16_t* sc = w.pscales + t * groups * 64;
    __m256 o[8];
    for (int j = 0; j < 8; ++j) o[j] = _mm256_loadu_ps(out + t * 64 + 8 * j);
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* c = base + g * chunk_bytes;
#if PF == 1
      _mm_prefetch((const char*)c + 4096, _MM_HINT_T1); _mm_prefetch((const char*)c + 4096 + 64 * 8, _MM_HINT_T1);
#elif PF == 2
      for (int64_t l = 0; l < chunk_bytes; l += 64) _mm_prefetch((const char*)c + PFD + l, _MM_HINT_T1);
#endif
      const int8_t* xq = x.q.data() + g * 32;
      int32_t start = 0; for (int k = 0; k < 32; ++k) start -= (Bits == 8 ? kInt8Offset : 8) * xq[k];
      __m256i acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_set1_epi32(start);
      for (int q = 0; q < 8; q += (Bits == 8 ? 1 : 2)) {
        int32_t f0, f1; memcpy(&f0, xq + 4 * q, 4); memcpy(&f1, xq + 4 * q + 4, 4);
        const __m256i x0 = _mm256_set1_epi32(f0), x1 = _mm256_set1_epi32(f1);
        for (int j = 0; j < 8; ++j) {
          if (Bits == 8) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(c + q * 256 + j * 32));
            acc[j] = DotInt8(acc[j], PrepareInt8(v), x0);
          } else {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(c + (q / 2) * 256 + j * 32)), m = _mm256_set1_epi8(15);
            acc[j] = DotUnsigned(acc[j], _mm256_and_si256(v, m), x0);
            acc[j] = DotUnsigned(acc[j], _mm256_and_si256(_mm256_srli_epi16(v, 4), m), x1);
          }
        }
      }
      const __m256 d = _mm256_set1_ps(x.scale[g]);
      for (int j = 0; j < 8; ++j) {
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc + g * 64 + 8 * j)));
        o[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[j]), _mm256_mul_ps(d, s), o[j]);
      }
    }
    for (int j = 0; j < 8; ++j) _mm256_storeu_ps(out + t * 64 + 8 * j, o[j]);
  }
}
#endif
}
int main(int argc, char** argv) {
  const int bits = atoi(argv[1]); const bool hot = getenv("HOT");
  constexpr int64_t L = 30, E = 576, KV = 192, MLP = 1536;
  const int64_t shapes[7][2] = {{E, E}, {E, KV}, {E, KV}, {E, E}, {E, MLP}, {E, MLP}, {MLP, E}};
  std::mt19937 rng(1); std::vector<Wt> ws; int64_t bytes = 0;
  for (int l = 0; l < L; ++l) for (auto& s : shapes) {
    if (hot && l > 0) { ws.push_back(ws[ws.size() - 7]); bytes += ws.back().K * ws.back().N * bits / 8 + ws.back().K / G * ws.back().N * 2; continue; }
    Wt w; w.K = s[0]; w.N = getenv("NARROW") ? 64 : s[1]; const int64_t vb = w.K * w.N * bits / 8, sb = w.K / G * w.N;
    w.values = (uint8_t*)Huge(vb); w.scales = (uint16_t*)Huge(sb * 2); w.packed = (uint8_t*)Huge(vb); w.pscales = (uint16_t*)Huge(sb * 2);
    for (int64_t i = 0; i < vb; ++i) w.values[i] = uint8_t(rng() % 255 - (bits == 8 ? 127 : 0));
    for (int64_t i = 0; i < sb; ++i) w.scales[i] = 0x2000 + rng() % 0x800;
    Repack(w, bits); ws.push_back(w); bytes += vb + sb * 2;
  }
  std::vector<float> xf(MLP); std::normal_distribution<float> nd; for (float& v : xf) v = nd(rng);
  const Activations xe = Quantize(FloatArray{xf.data(), ffi::DataType::F32}, 1, E, G, 1);
  const Activations xm = Quantize(FloatArray{xf.data(), ffi::DataType::F32}, 1, MLP, G, 1);
  std::vector<float> out_a(MLP), out_b(MLP);
  const int64_t sw = (512 << 20) / 8; auto* stream = (int64_t*)Huge(sw * 8); volatile int64_t sink = 0;
  auto present = [&](const Wt& w, float* out) {
    Problem p{w.values, FloatArray{w.scales, ffi::DataType::F16}, FloatArray{nullptr, ffi::DataType::F16}, out,
              w.K == E ? &xe : &xm, w.N, w.K, G, w.K / G, bits, 0, 0, 0, 0};
    std::fill(out, out + w.N, 0.f);
    RunPiece(Piece{&p, 0, w.N, 0, w.K / G, out, w.N}, 0, 1, true, nullptr);
  };
  auto packed = [&](const Wt& w, float* out) {
    std::fill(out, out + w.N, 0.f);
    if (bits == 8) Packed<8>(w, w.K == E ? xe : xm, out); else Packed<4>(w, w.K == E ? xe : xm, out);
  };
  auto tiled = [&](const Wt& w, float* out) {  // the kernel's own tiled walk (cpu_int8_dot_tiles.h)
    Problem p{w.packed, FloatArray{w.pscales, ffi::DataType::F16}, FloatArray{nullptr, ffi::DataType::F16}, out,
              w.K == E ? &xe : &xm, w.N, w.K, G, w.K / G, bits, 0, 0, 0, 0, true};
    std::fill(out, out + w.N, 0.f);
    RunPiece(Piece{&p, 0, w.N, 0, w.K / G, out, w.N}, 0, 1, true, nullptr);
  };
  int64_t mismatches = 0;
  for (auto& w : ws) { present(w, out_a.data()); packed(w, out_b.data()); mismatches += memcmp(out_a.data(), out_b.data(), w.N * 4) != 0; }
  for (auto& w : ws) { present(w, out_a.data()); tiled(w, out_b.data()); mismatches += memcmp(out_a.data(), out_b.data(), w.N * 4) != 0; }
  auto best = [&](auto fn) { double b = 1e9; for (int r = 0; r < 5; ++r) { sink = ReadStream(stream, sw); double t = Cpu(); fn(); b = std::min(b, Cpu() - t); } return b; };
  for (int round = 0; round < 3; ++round) {
    const double s = best([&] { sink = ReadStream(stream, sw); });
    const double a = best([&] { for (auto& w : ws) present(w, out_a.data()); });
    const double b = best([&] { for (auto& w : ws) packed(w, out_b.data()); });
    const double c = best([&] { for (auto& w : ws) tiled(w, out_b.data()); });
    const double sg = sw * 8 / s / 1e9;
    printf("{\"bits\": %d, \"hot\": %d, \"stream_gb_s\": %.1f, \"present_ms\": %.2f, \"repacked_ms\": %.2f, \"tiled_ms\": %.2f, \"present_of_stream\": %.2f, \"repacked_of_stream\": %.2f, \"tiled_of_stream\": %.2f, \"bit_identical\": %s}\n",
           bits, int(hot), sg, a * 1e3, b * 1e3, c * 1e3, bytes / a / 1e9 / sg, bytes / b / 1e9 / sg, bytes / c / 1e9 / sg, mismatches ? "false" : "true");
    fflush(stdout);
  }
}
