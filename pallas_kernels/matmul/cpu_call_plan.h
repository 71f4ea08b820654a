// One plan per call of few rows (a decode step's joined projections: q/k/v, o, gate/up, down, the head; a verify
// step's k + 1 rows per sequence), shared by the quantized kernels that read whole weight rows
// (cpu_quantized_int8_dot.cc, cpu_kquant_matmul.cc): the call's weights in whole-row column blocks, the blocks
// in order as one sequence of bytes, cut at group boundaries into one contiguous run per worker. A weight is
// split along K only where a run ends inside it, and that piece's sums go to a [rows, width] partial added
// after the runs, in K's order.
//
// Why per call: planning weight by weight (every weight cut into 2 x workers parts of K, a partial per part)
// paid each part's first chunk and scales a memory latency, a third of a call's time on SmolLM2's narrow
// weights (issue 25, sessions 13-14). The cut depends on the shapes, the weights' kinds and the number of
// workers only, never on timing: each row's sums are added in the same order every time, whoever runs which
// run.
//
// Never on the rows either (session 16, issue 26): a call of M rows is cut where a ONE-row call's runs end
// (CutCall over the one-row layout's blocks), then each piece is split along its columns only
// (SplitColumns: narrower blocks for more rows, the same groups). So row r of an M-row call adds its K sums
// in the order a one-row call of x[r] does, bit for bit: a verify step (k + 1 rows per sequence) computes
// what the decode steps it replaces compute, which greedy identity with speculation on and off rests on
// (with int8 activations a 1e-6 difference flips a rounding, then a near-tie).

#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace jaxserve_cpu {

// The width of a weight's whole-row column blocks: as even as `multiple`-column multiples allow, at most
// `widest` (a block narrower than a row reads short runs N bytes apart that the hardware prefetchers lose).
inline int64_t EvenBlockWidth(int64_t columns, int64_t widest, int64_t multiple) {
  const int64_t count = (columns + widest - 1) / widest;
  return ((columns + count - 1) / count + multiple - 1) / multiple * multiple;
}

// A column block of one of the call's weights, as the cut sees it.
struct CallBlock {
  int64_t weight;       // the weight's index in the call
  int64_t c0, width;    // its columns
  int64_t groups;       // the weight's groups along K (the cut falls between two)
  int64_t group_bytes;  // the bytes one group of these columns reads (weights, scales, mins)
};

// Groups [g0, g1) of a block: what one run computes of it.
struct CallPiece {
  int64_t weight, c0, width, g0, g1;
  int64_t partial;  // offset of its [rows, width] sums in the plan's partials; -1: it adds into the result
};

struct CallCut {
  std::vector<CallPiece> pieces;    // run by run, each run's pieces in the blocks' order
  std::vector<int64_t> run_starts;  // each run's first piece, then pieces.size()
  int64_t partial_floats = 0;       // the partials' size
};

// `blocks` (in the call's order) cut into at most `num_runs` runs of about equal bytes, each run ending at the
// group boundary nearest its share. A piece that starts past its block's first group gets a partial (the one
// that starts there adds into the result, which the caller zeroes).
inline CallCut CutCall(const std::vector<CallBlock>& blocks, int64_t rows, int64_t num_runs) {
  int64_t total = 0;
  for (const CallBlock& b : blocks) total += b.group_bytes * b.groups;
  num_runs = std::max<int64_t>(1, num_runs);
  CallCut cut;
  int64_t run = 0, position = 0;  // position: bytes before the block's first group
  cut.run_starts.push_back(0);
  auto end_run = [&] {
    if (cut.run_starts.back() < int64_t(cut.pieces.size())) cut.run_starts.push_back(cut.pieces.size());
  };
  for (const CallBlock& b : blocks) {
    int64_t g = 0;
    while (g < b.groups) {
      int64_t end = b.groups;
      if (run + 1 < num_runs) {  // where the run's share of the bytes ends, to the nearest group
        const int64_t bound = total * (run + 1) / num_runs;
        const int64_t at = (bound - position + b.group_bytes / 2) / std::max<int64_t>(1, b.group_bytes);
        end = std::clamp<int64_t>(at, g, b.groups);
      }
      if (end > g) {
        cut.pieces.push_back(CallPiece{b.weight, b.c0, b.width, g, end, g > 0 ? cut.partial_floats : -1});
        if (g > 0) cut.partial_floats += rows * b.width;
        g = end;
      }
      if (g < b.groups) {  // the run ends here: the next one starts
        ++run;
        end_run();
      }
    }
    position += b.group_bytes * b.groups;
  }
  end_run();
  return cut;
}

// `cut` (pieces of whole one-row blocks; its partials' offsets ignored) with each piece split along its columns
// into blocks as even as `multiple`-column multiples allow, at most `widest` wide, over the same groups [g0, g1),
// and a [rows, width] partial for each that starts past its block's first group. A column's K order is the
// piece's: where K is cut and the order the parts are added do not change, only how many columns a walk takes.
inline CallCut SplitColumns(const CallCut& cut, int64_t rows, int64_t widest, int64_t multiple) {
  CallCut split;
  split.run_starts.push_back(0);
  for (size_t run = 0; run + 1 < cut.run_starts.size(); ++run) {
    for (int64_t i = cut.run_starts[run]; i < cut.run_starts[run + 1]; ++i) {
      const CallPiece& whole = cut.pieces[i];
      const int64_t width = EvenBlockWidth(whole.width, widest, multiple);
      for (int64_t c = 0; c < whole.width; c += width) {
        const int64_t w = std::min(width, whole.width - c);
        split.pieces.push_back(
            CallPiece{whole.weight, whole.c0 + c, w, whole.g0, whole.g1, whole.g0 > 0 ? split.partial_floats : -1});
        if (whole.g0 > 0) split.partial_floats += rows * w;
      }
    }
    split.run_starts.push_back(split.pieces.size());
  }
  return split;
}

// A piece's partial [rows, width] added into its columns of the result (rows `stride` apart).
inline void AddPartial(const float* from, int64_t rows, int64_t width, float* to, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r) {
    float* __restrict row = to + r * stride;
    const float* __restrict add = from + r * width;
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) row[c] += add[c];
  }
}

}  // namespace jaxserve_cpu
