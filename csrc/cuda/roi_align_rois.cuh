// Per-RoI helpers shared by the RoIAlign CUDA kernel files.
#pragma once

#include <cstdint>

#include "../common/roi_align_geometry.h"

namespace detops {
namespace ops {
namespace roi_align_cuda {

// The bins of a [K, 5] RoI row (batch index, x1, y1, x2, y2).
template <typename T>
__device__ __forceinline__ roi_align::RoIBins<T> bins_of(
    const T* roi, T scale, int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio,
    bool aligned) {
  return roi_align::roi_bins<T>(
      roi[1], roi[2], roi[3], roi[4], scale, pooled_height, pooled_width, sampling_ratio,
      aligned);
}

// One sample row (or column) of a RoI: the two pixel rows (columns) it reads and their
// weights; lo < 0 when the sample lies outside the map (it then contributes nothing).
template <typename T>
struct AxisTap {
  int32_t lo, hi;
  T l, h;
};

// The tap of sample coordinate v on an axis of `size` pixels, with the per-axis rules of
// roi_align::bilinear_sample (a sample outside [-1, size], NaN, or on an empty axis reads
// nothing). A sample reads the map when both its row and its column tap are valid.
template <typename T>
__device__ __forceinline__ AxisTap<T> axis_tap(T v, int64_t size) {
  AxisTap<T> tap{-1, -1, T(0), T(0)};
  if (size > 0 && v >= T(-1) && v <= static_cast<T>(size)) {
    int64_t lo, hi;
    T l;
    roi_align::axis_weights(v, size, lo, hi, l);
    tap = AxisTap<T>{static_cast<int32_t>(lo), static_cast<int32_t>(hi), l, T(1) - l};
  }
  return tap;
}

}  // namespace roi_align_cuda
}  // namespace ops
}  // namespace detops
