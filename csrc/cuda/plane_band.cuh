// Bands of rows of one H x W feature plane staged in shared memory, for RoI kernels in which
// many RoIs read the same plane (dense RoIs on one feature map, as in the FPN levels of a
// detector). Gathering each RoI's pixels from global memory fetches a whole 32-byte sector per
// pixel and fetches the same sectors again for every overlapping RoI; staging a band of the
// plane once and serving every RoI of the image from it reads each pixel from L2 about once.
//
// A plane is cut into bands of `core` rows. Band i owns the RoI rows (bin rows) whose first
// pixel row lies in [i * core, (i + 1) * core), and stages rows [i * core, i * core + core +
// overlap) clamped to H, so that a bin row starting near the end of its band still finds its
// pixels in shared memory. A bin row reaching past the staged window reads those pixels from
// global memory instead (same values, same arithmetic), so results never depend on the plan.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cuda_helpers.h"

namespace detops {
namespace ops {
namespace plane_band {

// How one plane is staged. rows = core + overlap rows of `stride` elements each.
struct BandPlan {
  int core = 0;     // rows a band owns
  int overlap = 0;  // rows staged past the owned ones
  int bands = 0;    // ceil(H / core)
  int stride = 0;   // shared-memory elements per staged row (W, padded to an odd count)
  int64_t smem_bytes = 0;
  bool ok = false;  // false: the plane is too wide to stage useful bands
};

// A row stride with an odd element count spreads the rows of a column over the 32 banks.
inline int padded_stride(int64_t width) {
  return static_cast<int>(width % 2 == 0 ? width + 1 : width);
}

// Bands of `budget_bytes` of elem_bytes-sized elements for an H x W plane. The overlap is a
// quarter of the staged rows; at least `min_rows` rows must fit for the plan to be worth it.
inline BandPlan plan_bands(
    int64_t height, int64_t width, int64_t elem_bytes, int64_t budget_bytes, int min_rows = 16) {
  BandPlan p;
  if (height <= 0 || width <= 0 || width > (1 << 20)) return p;
  p.stride = padded_stride(width);
  const int64_t fit = budget_bytes / (static_cast<int64_t>(p.stride) * elem_bytes);
  if (fit < min_rows) return p;
  int64_t rows = std::min<int64_t>(fit, height);
  int64_t overlap = rows >= height ? 0 : rows / 4;
  int64_t core = rows - overlap;
  p.core = static_cast<int>(core);
  p.overlap = static_cast<int>(overlap);
  p.bands = static_cast<int>(cuda::ceil_div(height, core));
  p.smem_bytes = rows * p.stride * elem_bytes;
  p.ok = true;
  return p;
}

// The rows a band stages: [first, last).
struct BandRows {
  int first, last;
};

__device__ __forceinline__ BandRows band_rows(const BandPlan& p, int band, int height) {
  const int first = band * p.core;
  return BandRows{first, min(height, first + p.core + p.overlap)};
}

// Copies rows [rows.first, rows.last) of a row-major plane with `width` columns into `smem`
// (row stride p.stride). All threads of the block take part; the caller synchronizes.
template <typename T>
__device__ __forceinline__ void stage_rows(
    const T* __restrict__ plane, int width, const BandPlan& p, BandRows rows, T* smem) {
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int r = rows.first + static_cast<int>(threadIdx.x / 32); r < rows.last; r += warps) {
    const T* src = plane + static_cast<int64_t>(r) * width;
    T* dst = smem + (r - rows.first) * p.stride;
    for (int c = lane; c < width; c += 32) dst[c] = src[c];
  }
}

}  // namespace plane_band
}  // namespace ops
}  // namespace detops
