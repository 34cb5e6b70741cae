// Pieces of the RoIPool CUDA kernels that split bins among the lanes of a warp: the tie rule
// that combines partial maxima (roi_pool.cu's rows kernel and roi_pool_band.cu's band forward)
// and the rows kernel's lanes-per-bin choice.
#pragma once

#include <cstdint>
#include <limits>

namespace detops {
namespace ops {
namespace roi_pool_cuda {

// Candidate (v, i) replaces (best, best_i) when it is larger, or equal with a smaller row-major
// index. Candidates are either (a value above roi_pool_lowest, its index >= 0) or
// (roi_pool_lowest, -1), so "no candidate" never replaces a real one and the combination of
// any partition of a bin gives the first maximum of its row-major scan.
template <typename acc_t>
__device__ __forceinline__ void take_better(acc_t v, int32_t i, acc_t& best, int32_t& best_i) {
  if (v > best || (v == best && i < best_i)) {
    best = v;
    best_i = i;
  }
}

// Lanes per bin: the power of two g (1..32) with the fewest warp-wide load rounds per bin row,
// passes * ceil(span / g), where a pass handles 32 / g bins of the row and span bounds a bin's
// column count; ties go to the larger g (longer contiguous runs).
__device__ __forceinline__ int lanes_per_bin(int64_t span, int64_t pooled_width) {
  constexpr int kWarp = 32;
  int best_g = kWarp;
  int64_t best_cost = std::numeric_limits<int64_t>::max();
  for (int g = kWarp; g >= 1; g >>= 1) {
    const int64_t per_pass = kWarp / g;
    const int64_t cost = ((pooled_width + per_pass - 1) / per_pass) * ((span + g - 1) / g);
    if (cost < best_cost) {
      best_cost = cost;
      best_g = g;
    }
  }
  return best_g;
}

}  // namespace roi_pool_cuda
}  // namespace ops
}  // namespace detops
