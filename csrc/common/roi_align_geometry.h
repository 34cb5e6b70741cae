// RoIAlign sampling geometry, shared by the CPU and CUDA kernels (forward, backward and the
// deterministic backward all place samples and weigh pixels with these functions).
//
// torchvision's rules, computed in the accumulation type T (float for float16 / bfloat16 /
// float32, double for float64):
//   * offset = aligned ? 0.5 : 0; the RoI spans [x1 * scale - offset, x2 * scale - offset]
//     (same for y); without `aligned` its width and height are at least 1;
//   * each of the pooled_height x pooled_width bins holds grid_h x grid_w samples:
//     sampling_ratio when > 0, else ceil(roi_size / pooled_size) per axis;
//   * sample (iy, ix) of bin (ph, pw) lies at
//       y = start_h + ph * bin_h + (iy + 0.5) * bin_h / grid_h   (same for x);
//   * a sample with y < -1, y > H, x < -1 or x > W contributes nothing; otherwise y and x are
//     clamped at 0 from below and read bilinearly, the last row/column repeating at the edge;
//   * a bin's value is the sum of its samples divided by max(grid_h * grid_w, 1).
// Additions, none of which changes a result torchvision defines:
//   * a non-finite sample (NaN RoI coordinates) contributes nothing, and an empty feature map
//     (H or W == 0) has no pixel to read, so nothing is ever read out of bounds;
//   * the adaptive grid of a RoI whose size is not finite is 0 (the bin is 0), and it is capped
//     at kMaxGrid per axis so that the sample count stays within int64.
#pragma once

#include <cmath>
#include <cstdint>

#include "macros.h"

namespace detops {
namespace roi_align {

// Samples per axis of one bin never exceed this (sampling_ratio is checked against it too).
constexpr int64_t kMaxGrid = int64_t{1} << 16;

// Where the samples of one RoI lie.
template <typename T>
struct RoIBins {
  T start_h, start_w;    // top-left corner of the RoI on the feature map
  T bin_h, bin_w;        // size of one bin
  int64_t grid_h, grid_w;  // samples per bin along y and x (>= 0)
  T count;               // the divisor of a bin: max(grid_h * grid_w, 1)
};

template <typename T>
DETOPS_HOST_DEVICE_INLINE int64_t adaptive_grid(T roi_size, int64_t pooled) {
  const T v = ceil(roi_size / static_cast<T>(pooled));
  if (!(v > T(0))) return 0;  // empty, negative or NaN: no samples
  if (!(v < static_cast<T>(kMaxGrid))) return v - v == T(0) ? kMaxGrid : 0;  // inf: none
  return static_cast<int64_t>(v);
}

// roi points at (x1, y1, x2, y2), already in T. sampling_ratio <= 0 means adaptive.
template <typename T>
DETOPS_HOST_DEVICE_INLINE RoIBins<T> roi_bins(
    T x1, T y1, T x2, T y2, T spatial_scale, int64_t pooled_height, int64_t pooled_width,
    int64_t sampling_ratio, bool aligned) {
  const T offset = aligned ? T(0.5) : T(0);
  RoIBins<T> r;
  r.start_w = x1 * spatial_scale - offset;
  r.start_h = y1 * spatial_scale - offset;
  const T end_w = x2 * spatial_scale - offset;
  const T end_h = y2 * spatial_scale - offset;
  T roi_w = end_w - r.start_w;
  T roi_h = end_h - r.start_h;
  if (!aligned) {
    // Legacy mode: malformed RoIs are forced to be at least 1x1 (NaN stays NaN).
    roi_w = roi_w < T(1) ? T(1) : roi_w;
    roi_h = roi_h < T(1) ? T(1) : roi_h;
  }
  r.bin_h = roi_h / static_cast<T>(pooled_height);
  r.bin_w = roi_w / static_cast<T>(pooled_width);
  if (sampling_ratio > 0) {
    r.grid_h = sampling_ratio;
    r.grid_w = sampling_ratio;
  } else {
    r.grid_h = adaptive_grid(roi_h, pooled_height);
    r.grid_w = adaptive_grid(roi_w, pooled_width);
  }
  const int64_t n = r.grid_h * r.grid_w;
  r.count = static_cast<T>(n > 1 ? n : 1);
  return r;
}

// Coordinate of sample i of bin p along one axis.
template <typename T>
DETOPS_HOST_DEVICE_INLINE T sample_coord(T start, T bin, int64_t p, int64_t i, int64_t grid) {
  return start + static_cast<T>(p) * bin +
      static_cast<T>(static_cast<T>(i) + T(0.5)) * bin / static_cast<T>(grid);
}

// The four pixels a sample reads and their weights. Pixel indices are within one H x W plane.
template <typename T>
struct BilinearSample {
  int64_t y_low, y_high, x_low, x_high;
  T w1, w2, w3, w4;  // (y_low, x_low), (y_low, x_high), (y_high, x_low), (y_high, x_high)
};

// One axis of the bilinear rule: clamp below at 0, repeat the last row/column at the edge.
template <typename T>
DETOPS_HOST_DEVICE_INLINE void axis_weights(T v, int64_t size, int64_t& lo, int64_t& hi, T& l) {
  if (v <= T(0)) v = T(0);
  lo = static_cast<int64_t>(v);
  if (lo >= size - 1) {
    lo = hi = size - 1;
    v = static_cast<T>(lo);
  } else {
    hi = lo + 1;
  }
  l = v - static_cast<T>(lo);
}

// Fills s and returns true when the sample at (y, x) reads the H x W map; false when it
// contributes nothing (outside [-1, H] x [-1, W], not finite, or an empty map).
template <typename T>
DETOPS_HOST_DEVICE_INLINE bool bilinear_sample(
    T y, T x, int64_t height, int64_t width, BilinearSample<T>& s) {
  // Written so that NaN fails: only samples inside the closed band are read.
  if (!(y >= T(-1) && y <= static_cast<T>(height) && x >= T(-1) &&
        x <= static_cast<T>(width))) {
    return false;
  }
  if (height <= 0 || width <= 0) return false;
  T ly, lx;
  axis_weights(y, height, s.y_low, s.y_high, ly);
  axis_weights(x, width, s.x_low, s.x_high, lx);
  const T hy = T(1) - ly, hx = T(1) - lx;
  s.w1 = hy * hx;
  s.w2 = hy * lx;
  s.w3 = ly * hx;
  s.w4 = ly * lx;
  return true;
}

// The image a RoI belongs to, or -1 when rois[k, 0] is not an integer in [0, batch_size).
template <typename T>
DETOPS_HOST_DEVICE_INLINE int64_t roi_batch_index(T value, int64_t batch_size) {
  if (!(value >= T(0) && value < static_cast<T>(batch_size))) return -1;
  const int64_t b = static_cast<int64_t>(value);
  return static_cast<T>(b) == value ? b : -1;
}

}  // namespace roi_align
}  // namespace detops
