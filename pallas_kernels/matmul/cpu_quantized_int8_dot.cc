// Rows times quantized weights with integer dot products (llama.cpp's arithmetic), as an XLA FFI
// custom call: out_i [M, N_i] float32 = x [M, K] @ w_i, w [K, N] = q * scales[k / G] (+ mins[k / G])
// (pallas_kernels/matmul/quantized.py's layout: q int8 [K, N], or 4-bit packed two rows to a byte [K / 2, N],
// low nibble row 2i, offset 8 where there are no mins). Same interface as cpu_quantized_matmul.cc (the
// float-widening kernel it replaces by default; the engine option quantized_activations=float picks that one).
//
// Why: widening every weight to float32 and doing an FMA runs at the float instruction rate, so int8 could
// never beat llama.cpp, which quantizes each row of x to int8 per 32-block of K (ggml's quantize_row_q8_0:
// d = max|x| / 127, q = round(x / d), ties away from zero) and does integer dot products, four int8 pairs
// per 32-bit lane and instruction, then one float multiply per block by (weight scale * d). Here too:
//  - x is quantized once per call, per "chunk": 32 consecutive k within a weight group (a group of 16, or
//    a per-channel group's last k, gives a shorter chunk). d and d * sum(q) are used rounded to float16,
//    as ggml's q8_0 / q8_1 blocks hold them (x itself is quantized with the float32 d, as there).
//  - each chunk's integer sums are exact int32; a chunk adds float(sum) * d * scale (+ d * sum(q_x) * min)
//    to the result, so the only other float rounding is that of these per-chunk products and their sum.
//  - AVX-512 VNNI: vpdpbusd takes u8 x s8. int8 weights are made unsigned (w ^ 0x80 = w + 128) and the
//    128 * sum(q_x) this adds is taken out through the accumulator's start; 4-bit nibbles are unsigned
//    already (the offset 8 is taken out the same way). Without VNNI (AVX2, or AVX-512BW alone):
//    vpmaddubsw + vpmaddwd, int8 through the sign trick (|w| x sign(x, w): |w| <= 128, no saturation).
//    Portable: plain int32 loops the compiler vectorizes.
//  - the layout is [K, N] (columns contiguous), the dot wants four k of one column in a 32-bit lane: four
//    weight rows of a tile of columns are interleaved in registers (two rounds of unpacks, within 128-bit
//    lanes), which leaves the tile's columns in a fixed order; scales are widened in that order and the
//    item's results put back in column order at its end. Or the weight is TILED (3-d arrays, built at load
//    by quantized_tiles.py): the four k already side by side, no interleave (cpu_int8_dot_tiles.h), the same
//    bits; a call may join weights of both layouts.
// The walk over the weights is cpu_quantized_matmul.cc's: per work item a block of columns and a range of
// groups; within a chunk, weight rows eight at a time in address order (the int32 sums of up to 8 rows of
// x, [8, width], in L1), software prefetch ahead along the walk; the same thread split (column blocks, then
// parts of K summed in part order: deterministic). One or two rows take a whole chunk per tile with the sums
// in registers (ChunkInRegisters). Up to 64 rows (decode and verify steps) the call is planned as a whole
// (PlanCall): its weights' bytes cut into one contiguous run per worker, K split only where a run ends inside
// a weight, at the same groups whatever the rows (a verify row sums as a decode row does, bit for bit). More
// rows (Plan): a prefill chunk's in blocks of 64
// (items of one column block and one row block, row blocks adjacent so that a thread's column block of
// weights stays in L2 while its row blocks pass), x quantized once for all of them; each row's result is
// what a call with its block's rows alone computes, up to the order in which K's parts are added.
// Files: cpu_int8_dot_vectors.h (the vector basics), cpu_int8_dot_activations.h (the inputs: float widths,
// x quantized), cpu_int8_dot_chunks.h (the walk over one chunk for up to 8 rows), cpu_int8_dot_tiles.h (the
// walk over a tiled weight); here the items and the thread split.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <vector>

#include "cpu_int8_dot_vectors.h"
#include "cpu_int8_dot_activations.h"
#include "cpu_int8_dot_chunks.h"
#include "cpu_int8_dot_tiles.h"
#include "matmul/cpu_call_plan.h"
#include "matmul/cpu_rms_norm.h"
#include "cpu_workers.h"
#include "xla/ffi/api/ffi.h"

namespace {

constexpr int64_t kBlockColumns = 4096;   // an item's columns at most
constexpr int64_t kSumsBytes = 16 * 1024;  // an item's int32 sums [rows, width], in L1
constexpr int64_t kMinBlockColumns = 64;   // narrower blocks where a weight has too few columns for the threads
constexpr int64_t kRowBlock = 64;          // an item's rows at most (a prefill chunk: several row blocks)

// Block columns for `rows` rows of x: the int32 sums of up to 8 rows, [8, width], stay in L1.
inline int64_t BlockColumns(int64_t rows) {
  const int64_t fits = kSumsBytes / int64_t(sizeof(int32_t) * std::min<int64_t>(rows, kRowGroup));
  return std::min<int64_t>(kBlockColumns, fits / kMinBlockColumns * kMinBlockColumns);  // whole tiles
}

// A work item's share of one weight: its columns [c0, c0 + width) over groups [g0, g1), added into `out` (row
// r, column c0 + j at out[r * out_stride + j]; a [K, N] piece's in tile order while it runs, column order at its end): the
// result itself, or the partial sums of a part of K that starts past group 0.
struct Piece {
  const Problem* problem = nullptr;
  int64_t c0 = 0, width = 0, g0 = 0, g1 = 0;
  float* out = nullptr;
  int64_t out_stride = 0;
};

// The lines of p's chunk that starts at k, columns [c0, c0 + width), as a prefetch spread over `tiles` tiles.
inline AheadLines ChunkLines(const Problem& p, int64_t k, int64_t c0, int64_t width, int64_t tiles) {
  if (k >= p.depth) return AheadLines();
  const int64_t per_byte_row = p.bits == 8 ? 1 : 2;  // k per stored row
  const int64_t k_end = std::min(k + kChunk, (k / p.group + 1) * p.group);
  const auto* base = static_cast<const uint8_t*>(p.values);
  return AheadLines(base + k / per_byte_row * p.columns + c0, width, p.columns, (k_end - k) / per_byte_row, tiles);
}

// Group g's scales (and mins) of columns [c0, c0 + width) into L2, in address order.
inline void PrefetchScales(const Problem& p, int64_t g, int64_t c0, int64_t width) {
  const int64_t scale_bytes = p.scales.type == ffi::DataType::F32 ? 4 : 2;
  AheadLines(static_cast<const uint8_t*>(p.scales.data) + (g * p.columns + c0) * scale_bytes, width * scale_bytes,
             0, 1, 1)
      .IssueAll();
  if (p.mins.data != nullptr) {
    AheadLines(static_cast<const uint8_t*>(p.mins.data) + (g * p.columns + c0) * scale_bytes, width * scale_bytes,
               0, 1, 1)
        .IssueAll();
  }
}

// Rows [r_begin, r_end) of x (at most kRowBlock) times `piece`. One or two rows prefetch along the walk: the
// piece's first chunk at its start where `first` (the thread's first piece of the call: nothing earlier
// fetched it), each next chunk and group's scales while the one before runs, and while the last runs the
// first chunk and scales of `after`, the piece the same thread runs next (null: none), so that the memory
// latency of a piece's start (a third of a call's time on SmolLM2's narrow weights, issue 25) overlaps work.
template <int Bits>
void Item(const Piece& piece, int64_t r_begin, int64_t r_end, bool first, const Piece* after) {
  const Problem& p = *piece.problem;
  const int64_t g0 = piece.g0, g1 = piece.g1, c0 = piece.c0, width = piece.width;
  const int64_t rows = r_end - r_begin;
  alignas(64) float scale[kBlockColumns];
  alignas(64) float minimum[kBlockColumns];
  alignas(64) float natural[kBlockColumns];
  alignas(64) int32_t sums[kSumsBytes / sizeof(int32_t)];
  const int64_t vectors = width / kTile * kTile;
  // each position's column: tiles in their sums' order, the last columns in column order
  int64_t column_at[kTile];
  for (int pos = 0; pos < kTile; ++pos) column_at[pos] = ColumnInTile(pos);
  if (p.mins.data == nullptr) std::fill(minimum, minimum + width, 0.0f);
  const Activations& x = *p.x;
  const int64_t tiles = vectors / kTile;
  // the chunk starting at k as lines to prefetch: within the piece, then the first of `after`'s
  auto chunk_lines = [&](int64_t k) {
    if (k < g1 * p.group) return ChunkLines(p, k, c0, width, tiles);
    if (after == nullptr) return AheadLines();
    return ChunkLines(*after->problem, after->g0 * after->problem->group, after->c0, after->width, tiles);
  };
  if (JAXSERVE_QDOT_AHEAD && rows <= 2 && first) {  // (ChunkInRegisters prefetches the chunks after the first)
    AheadLines lines = chunk_lines(g0 * p.group);
    lines.IssueAll();
  }
  for (int64_t g = g0; g < g1; ++g) {
#if JAXSERVE_QDOT_AHEAD
    if (rows <= 2) {  // the next group's scales (and mins)
      if (g + 1 < g1) {
        PrefetchScales(p, g + 1, c0, width);
      } else if (after != nullptr) {
        PrefetchScales(*after->problem, after->g0, after->c0, after->width);
      }
    }
#endif
    WidenInTileOrder(p.scales, g * p.columns + c0, width, vectors, natural, scale);
    if (p.mins.data != nullptr) WidenInTileOrder(p.mins, g * p.columns + c0, width, vectors, natural, minimum);
    for (int64_t i = 0; i < x.chunks_per_group; ++i) {
      const int64_t chunk = g * x.chunks_per_group + i;
      const int64_t k0 = g * p.group + i * kChunk, k1 = std::min(k0 + kChunk, (g + 1) * p.group);
      AheadLines next = chunk_lines(k1);
      float* out = piece.out;
      const int64_t stride = piece.out_stride;
      int64_t r0 = r_begin;
      for (; r0 + kRowGroup <= r_end; r0 += kRowGroup) {
        ChunkRows<kRowGroup, Bits>(p, r0, chunk, k0, k1, c0, width, scale, minimum, sums, out, stride, &next);
      }
      switch (r_end - r0) {
        case 7: ChunkRows<7, Bits>(p, r0, chunk, k0, k1, c0, width, scale, minimum, sums, out, stride, &next); break;
        case 6: ChunkRows<6, Bits>(p, r0, chunk, k0, k1, c0, width, scale, minimum, sums, out, stride, &next); break;
        case 5: ChunkRows<5, Bits>(p, r0, chunk, k0, k1, c0, width, scale, minimum, sums, out, stride, &next); break;
        case 4: ChunkRows<4, Bits>(p, r0, chunk, k0, k1, c0, width, scale, minimum, sums, out, stride, &next); break;
        case 3: ChunkRows<3, Bits>(p, r0, chunk, k0, k1, c0, width, scale, minimum, sums, out, stride, &next); break;
        case 2: ChunkRows<2, Bits>(p, r0, chunk, k0, k1, c0, width, scale, minimum, sums, out, stride, &next); break;
        case 1: ChunkRows<1, Bits>(p, r0, chunk, k0, k1, c0, width, scale, minimum, sums, out, stride, &next); break;
        default: break;
      }
    }
  }
  // the item's results back in column order
  alignas(64) float tile[kTile];
  for (int64_t r = r_begin; r < r_end; ++r) {
    float* out = piece.out + r * piece.out_stride;
    for (int64_t t = 0; t < vectors; t += kTile) {
#if defined(QDOT_X86)
      FromTileOrder(out + t, tile);
      (void)column_at;
#else
      for (int pos = 0; pos < kTile; ++pos) tile[column_at[pos]] = out[t + pos];
#endif
      std::memcpy(out + t, tile, sizeof(tile));
    }
  }
}

inline void RunPiece(const Piece& piece, int64_t r_begin, int64_t r_end, bool first, const Piece* after) {
  const Problem& p = *piece.problem;
  if (p.tiled) {  // (a tile's run is sequential: the hardware's prefetch and a few lines ahead start it)
    if (p.bits == 8) {
      TiledItem<8>(p, piece.c0, piece.width, piece.g0, piece.g1, piece.out, piece.out_stride, r_begin, r_end);
    } else if (p.bits == 5) {
      TiledItem<5>(p, piece.c0, piece.width, piece.g0, piece.g1, piece.out, piece.out_stride, r_begin, r_end);
    } else if (p.bits == 6) {
      TiledItem<6>(p, piece.c0, piece.width, piece.g0, piece.g1, piece.out, piece.out_stride, r_begin, r_end);
    } else {
      TiledItem<4>(p, piece.c0, piece.width, piece.g0, piece.g1, piece.out, piece.out_stride, r_begin, r_end);
    }
    return;
  }
  if (piece.problem->bits == 8) {
    Item<8>(piece, r_begin, r_end, first, after);
  } else {
    Item<4>(piece, r_begin, r_end, first, after);
  }
}

// A call of up to kRowBlock rows (a decode step, or a verify step of k + 1 tokens per sequence), planned as a
// whole (cpu_call_plan.h, shared with the K-quant kernel): each weight in whole-row column blocks (as even as
// whole tiles allow, at most BlockColumns(1) wide), the call's blocks in order as one sequence of bytes
// (weights and scales), cut at group boundaries into one contiguous run per worker. So a weight is split
// along K only where a run ends inside it (a call of two workers: at most one part sum), and each worker
// starts the call once. Planning per weight instead (every weight cut into parts of K, two items per worker)
// cost each part's first chunk and scales a memory latency: 0.63-0.66 of a two-thread stream on Q4_0 (issue
// 25). The cut is a one-row call's whatever the rows (session 16): more rows only split each piece along its
// columns into blocks at most BlockColumns(rows) wide (the sums of up to 8 rows in L1), the same groups. So a
// row's sums are added in the same order in a call of 1 row as of 8 or 64, and every time: the cut depends on
// the shapes and the number of workers only.
struct CallPlan {
  std::vector<Piece> pieces;        // run by run, each run's pieces in the sequence's order
  std::vector<int64_t> run_starts;  // each run's first piece, then pieces.size()
  std::vector<float> partials;      // [rows, width] per piece that starts past its block's group 0
};

CallPlan PlanCall(std::vector<Problem>& problems, int64_t rows, int64_t num_workers) {
  std::vector<jaxserve_cpu::CallBlock> blocks;  // a one-row call's
  for (size_t i = 0; i < problems.size(); ++i) {
    const Problem& p = problems[i];
    const int64_t width = jaxserve_cpu::EvenBlockWidth(p.columns, BlockColumns(1), kMinBlockColumns);
    const int64_t scale_bytes = (p.scales.type == ffi::DataType::F32 ? 4 : 2) * (p.mins.data != nullptr ? 2 : 1);
    for (int64_t c0 = 0; c0 < p.columns; c0 += width) {
      const int64_t w = std::min(width, p.columns - c0);
      blocks.push_back({int64_t(i), c0, w, p.num_groups, w * (p.group * p.bits / 8 + scale_bytes)});
    }
  }
  const jaxserve_cpu::CallCut cut = jaxserve_cpu::SplitColumns(jaxserve_cpu::CutCall(blocks, 1, num_workers), rows,
                                                               BlockColumns(rows), kMinBlockColumns);
  CallPlan plan;
  plan.run_starts = cut.run_starts;
  plan.partials.assign(cut.partial_floats, 0.0f);
  for (const jaxserve_cpu::CallPiece& c : cut.pieces) {
    const Problem& p = problems[c.weight];
    Piece piece{&p, c.c0, c.width, c.g0, c.g1, p.out + c.c0, p.columns};
    if (c.partial >= 0) {
      piece.out = plan.partials.data() + c.partial;
      piece.out_stride = c.width;
    }
    plan.pieces.push_back(piece);
  }
  return plan;
}

// Whether a piece's walk prefetches the piece after it (ChunkInRegisters: whole chunks of whole tiles).
inline bool PrefetchesAfter(const Piece& piece) {
  return !piece.problem->tiled && piece.problem->group % kChunk == 0 && piece.width >= kTile;
}

// Run `run` of the plan: its pieces in order, each prefetching the next one's start ([K, N] pieces only: a tiled
// piece's run starts with its own prefetch, and a [K, N] walk's addresses are not its lines).
void RunCallPieces(const CallPlan& plan, int64_t run, int64_t rows) {
  const int64_t begin = plan.run_starts[run], end = plan.run_starts[run + 1];
  for (int64_t i = begin; i < end; ++i) {
    const bool first = i == begin || !PrefetchesAfter(plan.pieces[i - 1]);
    const Piece* after = i + 1 < end && !plan.pieces[i + 1].problem->tiled ? &plan.pieces[i + 1] : nullptr;
    RunPiece(plan.pieces[i], 0, rows, first, after);
  }
}

// The parts of K beyond a block's first added into the result, in K's order (pieces of one block are in
// K's order in the plan).
void AddPartials(const CallPlan& plan, int64_t rows) {
  for (const Piece& piece : plan.pieces) {
    const Problem& p = *piece.problem;
    if (piece.out == p.out + piece.c0) continue;
    jaxserve_cpu::AddPartial(piece.out, rows, piece.width, p.out + piece.c0, p.columns);
  }
}

// More rows than kRowBlock (a prefill chunk): per weight, blocks of kRowBlock rows, column blocks (narrower
// where there are too few items for the threads), then parts of K. The parts are not PlanCall's: a prefill
// row's sums may be added in another order than a decode row's (they agree to float rounding, not bits).
void Plan(Problem& p, int64_t rows, int64_t num_workers) {
  const int64_t wanted = 2 * num_workers;  // two items per thread at least, so that a late helper gets its share
  p.row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t widest = BlockColumns(rows);
  int64_t width = widest;
  if ((p.columns + width - 1) / width * p.row_blocks < wanted) {
    const int64_t blocks_wanted = (wanted + p.row_blocks - 1) / p.row_blocks;
    const int64_t even = (p.columns + blocks_wanted - 1) / blocks_wanted;
    width = std::min(widest, std::max(kMinBlockColumns, (even + kMinBlockColumns - 1) / kMinBlockColumns * kMinBlockColumns));
  }
  p.block_columns = width;
  p.blocks = (p.columns + width - 1) / width;
  p.parts = 1;
  const int64_t items = p.blocks * p.row_blocks;
  if (items < wanted) p.parts = std::min((wanted + items - 1) / items, p.num_groups);
}

void RunRowBlocks(int64_t num_workers, std::vector<Problem>& problems, int64_t rows) {
  std::vector<int64_t> first_item;  // each problem's first work item
  std::vector<std::vector<float>> partials(problems.size());  // parts beyond the first, where K is split
  int64_t num_items = 0;
  for (size_t i = 0; i < problems.size(); ++i) {
    Problem& p = problems[i];
    Plan(p, rows, num_workers);
    first_item.push_back(num_items);
    num_items += p.row_blocks * p.blocks * p.parts;
    if (p.parts > 1) partials[i].assign((p.parts - 1) * rows * p.columns, 0.0f);
  }
  jaxserve_cpu::RunItems(num_workers, num_items, [&](int64_t, int64_t item) {
    const size_t i = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
    const Problem& p = problems[i];
    // row blocks fastest: a thread's run of consecutive items passes its rows over one column block, whose
    // weights stay in L2 (K x width bytes: 0.3-0.8 MiB on SmolLM2-135M), so that memory sends a weight byte
    // about once per call rather than once per row block
    const int64_t local = item - first_item[i];
    const int64_t row_block = local % p.row_blocks, block = local / p.row_blocks % p.blocks;
    const int64_t part = local / p.row_blocks / p.blocks;
    const int64_t r_begin = row_block * kRowBlock, r_end = std::min(rows, r_begin + kRowBlock);
    const int64_t c0 = block * p.block_columns, width = std::min(p.block_columns, p.columns - c0);
    const int64_t g0 = p.num_groups * part / p.parts, g1 = p.num_groups * (part + 1) / p.parts;
    float* partial = part == 0 ? p.out : partials[i].data() + (part - 1) * rows * p.columns;
    const Piece piece{&p, c0, width, g0, g1, partial + c0, p.columns};
    // (a thread's next item is likely the next part of K: its first chunk and scales follow in memory)
    const Piece after{&p, c0, width, g1, p.num_groups, nullptr, 0};
    RunPiece(piece, r_begin, r_end, true, g1 < p.num_groups ? &after : nullptr);
  });
  for (size_t i = 0; i < problems.size(); ++i) {
    const Problem& p = problems[i];
    const int64_t size = rows * p.columns;
    for (int64_t part = 1; part < p.parts; ++part) {
      const float* from = partials[i].data() + (part - 1) * size;
#pragma omp simd
      for (int64_t j = 0; j < size; ++j) p.out[j] += from[j];
    }
  }
}

void Run(int64_t num_workers, std::vector<Problem>& problems, int64_t rows) {
  for (Problem& p : problems) std::fill(p.out, p.out + rows * p.columns, 0.0f);
  if (rows > kRowBlock) {  // prefill chunks: per-weight items (no decode or verify step is this large)
    RunRowBlocks(num_workers, problems, rows);
    return;
  }
  const CallPlan plan = PlanCall(problems, rows, num_workers);
  const int64_t num_runs = int64_t(plan.run_starts.size()) - 1;
  jaxserve_cpu::RunItems(num_workers, num_runs, [&](int64_t, int64_t run) { RunCallPieces(plan, run, rows); });
  AddPartials(plan, rows);
}

// x [M, K] times each weight of `arrays` (values, scales, mins, super scales and super mins per result), validated
// into `problems` (one per weight, its result's buffer).
ffi::Error MakeProblems(const ffi::AnyBuffer& x, ffi::RemainingArgs& arrays, ffi::RemainingRets& outs,
                        ffi::Span<const int64_t> bits, ffi::Span<const int64_t> has_mins, std::vector<Problem>& problems) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return ffi::Error::InvalidArgument("quantized_int8_dot: x must be 2-d");
  const int64_t rows = x_dims[0], depth = x_dims[1];
  const size_t count = outs.size();
  if (count == 0 || arrays.size() != 5 * count || bits.size() != count || has_mins.size() != count) {
    return ffi::Error::InvalidArgument(
        "quantized_int8_dot: values, scales, mins, super scales and super mins, bits and has_mins per result");
  }
  for (size_t i = 0; i < count; ++i) {
    auto values = arrays.get<ffi::AnyBuffer>(5 * i);
    auto scales = arrays.get<ffi::AnyBuffer>(5 * i + 1);
    auto mins = arrays.get<ffi::AnyBuffer>(5 * i + 2);
    auto super_scales = arrays.get<ffi::AnyBuffer>(5 * i + 3);
    auto super_mins = arrays.get<ffi::AnyBuffer>(5 * i + 4);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!values.has_value() || !scales.has_value() || !mins.has_value() || !super_scales.has_value() ||
        !super_mins.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument("quantized_int8_dot: bad weight or result");
    }
    const auto v_dims = values->dimensions(), s_dims = scales->dimensions(), m_dims = mins->dimensions();
    // [K, N] (2-d), or tiled (3-d): values [N / 64, K / 32, chunk bytes], scales [N / 64, G, 64]
    const bool tiled = v_dims.size() == 3;
    if (bits[i] != 8 && bits[i] != 4 && !((bits[i] == 5 || bits[i] == 6) && tiled)) {
      return ffi::Error::InvalidArgument("quantized_int8_dot: bits must be 8 or 4 (or 5 or 6, tiled)");
    }
    // Q6_K tiles: two int8 scale rows a chunk ([N / 64, 2 (K / 32), 64]); the problem's groups are the chunks
    const int64_t scale_rows = bits[i] == 6 ? 2 : 1;
    const ffi::DataType value_type = bits[i] == 8 ? ffi::DataType::S8 : ffi::DataType::U8;
    if (v_dims.size() != s_dims.size() || (v_dims.size() != 2 && !tiled) ||
        (tiled && (s_dims[2] != kTiledColumns || s_dims[0] != v_dims[0]))) {
      return ffi::Error::InvalidArgument("quantized_int8_dot: values and scales must be 2-d, or tiled 3-d");
    }
    const int64_t columns = tiled ? v_dims[0] * kTiledColumns : v_dims[1];
    const int64_t num_groups = (tiled ? s_dims[1] : s_dims[0]) / scale_rows;
    const bool depth_fits = tiled ? v_dims[1] * kChunk == depth && v_dims[2] == TiledChunkBytes(int(bits[i]))
                                  : v_dims[0] * (8 / bits[i]) == depth && s_dims[1] == columns;
    if (values->element_type() != value_type || !depth_fits || num_groups < 1 || depth % num_groups ||
        (bits[i] == 4 && (depth / num_groups) % 2) || (tiled && (depth / num_groups) % kChunk) ||
        (*out)->element_count() != size_t(rows * columns)) {
      return ffi::Error::InvalidArgument("quantized_int8_dot: inconsistent shapes or types");
    }
    const ffi::DataType scale_type = scales->element_type();
    // two-level (Q4_K / Q5_K tiles): uint8 sc and m per chunk, float16 d and dmin [N / 64, G / 8, 64]; Q6_K
    // tiles: int8 sc per 16 k, float16 d, no mins
    const bool two_level = scale_type == ffi::DataType::U8 || scale_type == ffi::DataType::S8;
    if (two_level) {
      const auto d_dims = super_scales->dimensions(), dmin_dims = super_mins->dimensions();
      const bool q6_k = scale_type == ffi::DataType::S8;
      const bool kind_fits = q6_k ? bits[i] == 6 && !has_mins[i] : (bits[i] == 4 || bits[i] == 5) && has_mins[i];
      const bool mins_fit = q6_k || (std::equal(d_dims.begin(), d_dims.end(), dmin_dims.begin(), dmin_dims.end()) &&
                                     super_mins->element_type() == ffi::DataType::F16);
      const bool fits = tiled && kind_fits && mins_fit && num_groups % 8 == 0 && depth / num_groups == kChunk &&
                        d_dims.size() == 3 && d_dims[0] == s_dims[0] && d_dims[1] * 8 == num_groups &&
                        d_dims[2] == kTiledColumns && super_scales->element_type() == ffi::DataType::F16;
      if (!fits) {
        return ffi::Error::InvalidArgument(
            "quantized_int8_dot: two-level scales are tiled 4- or 5-bit with mins (uint8) or 6-bit without (int8), "
            "float16 d (and dmin) per 8 chunks");
      }
    } else if (bits[i] == 6) {
      return ffi::Error::InvalidArgument("quantized_int8_dot: 6-bit tiles take int8 sub-block scales");
    } else if (scale_type != ffi::DataType::F32 && scale_type != ffi::DataType::F16 &&
               scale_type != ffi::DataType::BF16) {
      return ffi::Error::InvalidArgument("quantized_int8_dot: scales must be float32, float16 or bfloat16");
    }
    if (has_mins[i] && (m_dims.size() != s_dims.size() || !std::equal(m_dims.begin(), m_dims.end(), s_dims.begin()) ||
                        mins->element_type() != scales->element_type())) {
      return ffi::Error::InvalidArgument("quantized_int8_dot: mins must be shaped and typed as scales");
    }
    problems.push_back(Problem{values->untyped_data(),
                               FloatArray{scales->untyped_data(), scales->element_type()},
                               FloatArray{has_mins[i] ? mins->untyped_data() : nullptr, mins->element_type()},
                               (*out)->typed_data(),
                               nullptr,
                               columns,
                               depth,
                               depth / num_groups,
                               num_groups,
                               int(bits[i]),
                               0,
                               0,
                               0,
                               0,
                               tiled});
    if (two_level) {
      problems.back().super_scales = FloatArray{super_scales->untyped_data(), ffi::DataType::F16};
      if (has_mins[i]) problems.back().super_mins = FloatArray{super_mins->untyped_data(), ffi::DataType::F16};
    }
  }
  return ffi::Error::Success();
}

// x [rows, depth] (any of the three float widths) quantized once per group size, times every problem's weight
void QuantizeAndRun(int64_t num_workers, const FloatArray& x, int64_t rows, int64_t depth,
                    std::vector<Problem>& problems) {
  std::map<int64_t, Activations> by_group;  // x quantized once per chunking (weights of one group size share)
  for (Problem& p : problems) {
    auto found = by_group.find(p.group);
    if (found == by_group.end()) found = by_group.emplace(p.group, Quantize(x, rows, depth, p.group, num_workers)).first;
    p.x = &found->second;
  }
  Run(num_workers, problems, rows);
}

ffi::Error QuantizedInt8Dot(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs arrays, ffi::RemainingRets outs,
                            ffi::Span<const int64_t> bits, ffi::Span<const int64_t> has_mins) {
  std::vector<Problem> problems;
  if (ffi::Error error = MakeProblems(x, arrays, outs, bits, has_mins, problems); error.failure()) return error;
  const int64_t num_workers = std::max<int64_t>(1, pool.num_threads());
  const auto x_dims = x.dimensions();
  QuantizeAndRun(num_workers, FloatArray{x.untyped_data(), x.element_type()}, x_dims[0], x_dims[1], problems);
  return ffi::Error::Success();
}

template <typename T>
void NormQuantizeAndRun(int64_t num_workers, const ffi::AnyBuffer& x, const ffi::AnyBuffer& scale, float eps,
                        std::vector<Problem>& problems) {
  const int64_t rows = x.dimensions()[0], depth = x.dimensions()[1];
  const auto normed = jaxserve_cpu::NormedRows<T>(static_cast<const typename T::Stored*>(x.untyped_data()),
                                                  static_cast<const typename T::Stored*>(scale.untyped_data()), rows,
                                                  depth, eps, num_workers);
  QuantizeAndRun(num_workers, FloatArray{normed.data(), x.element_type()}, rows, depth, problems);
}

// RMSNorm(x; scale, eps) [M, K] (cpu_rms_norm.h: the float kernel's norm, the model's RMSNorm) quantized to int8
// and times each weight, as QuantizedInt8Dot: in a decode step the norm's XLA thunks between two kernel calls go.
ffi::Error QuantizedInt8DotNormed(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::RemainingArgs arrays,
                                  ffi::RemainingRets outs, ffi::Span<const int64_t> bits,
                                  ffi::Span<const int64_t> has_mins, float eps) {
  std::vector<Problem> problems;
  if (ffi::Error error = MakeProblems(x, arrays, outs, bits, has_mins, problems); error.failure()) return error;
  if (!jaxserve_cpu::NormScaleFits(x, scale)) {
    return ffi::Error::InvalidArgument("quantized_int8_dot_normed: the norm's scale must be [K] in x's dtype");
  }
  const int64_t num_workers = std::max<int64_t>(1, pool.num_threads());
  switch (x.element_type()) {
    case ffi::DataType::BF16: NormQuantizeAndRun<jaxserve_cpu::BFloat16Scalar>(num_workers, x, scale, eps, problems); break;
    case ffi::DataType::F16: NormQuantizeAndRun<jaxserve_cpu::Float16Scalar>(num_workers, x, scale, eps, problems); break;
    case ffi::DataType::F32: NormQuantizeAndRun<jaxserve_cpu::Float32Scalar>(num_workers, x, scale, eps, problems); break;
    default: return ffi::Error::InvalidArgument("quantized_int8_dot_normed: x must be float32, bfloat16 or float16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantizedInt8Dot, QuantizedInt8Dot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("bits")
                                  .Attr<ffi::Span<const int64_t>>("has_mins"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantizedInt8DotNormed, QuantizedInt8DotNormed,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("bits")
                                  .Attr<ffi::Span<const int64_t>>("has_mins")
                                  .Attr<float>("eps"));
