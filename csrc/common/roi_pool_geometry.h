// RoIPool (max) geometry and input checks shared by the CPU and CUDA kernels.
//
// A RoI (batch, x1, y1, x2, y2) is scaled by spatial_scale and rounded half away from zero to
// integer pixel coordinates; its size is (end - start + 1), at least 1. Bin (ph, pw) of a
// PH x PW grid covers rows [floor(ph * bin_h), ceil((ph + 1) * bin_h)) offset by the RoI start
// and clamped to [0, H] (columns likewise), with bin_h = roi_height / PH computed in T. A bin
// with no rows or no columns is empty. These are torchvision's rules; T is the accumulation
// type (float for float16 / bfloat16 / float32 data, double for float64), so float32 and
// float64 results match torchvision exactly.
//
// Hardening on top of those rules (no effect on ordinary inputs):
//   * scaled coordinates are clamped to +-2^30 before the integer conversion, and all integer
//     arithmetic is int64, so huge or infinite coordinates cannot overflow;
//   * a RoI with a NaN coordinate, or whose batch index is not an integer in [0, B), has only
//     empty bins (output 0, argmax -1) and receives no gradient. The CPU kernels reject such
//     batch indices up front; on CUDA they are flagged by a device-side assertion instead of
//     a host sync.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

#include "checks.h"
#include "macros.h"

namespace detops {
namespace geometry {

DETOPS_HOST_DEVICE_INLINE float round_away(float v) {
  return roundf(v);  // halfway cases away from zero
}
DETOPS_HOST_DEVICE_INLINE double round_away(double v) {
  return round(v);
}
DETOPS_HOST_DEVICE_INLINE float floor_of(float v) {
  return floorf(v);
}
DETOPS_HOST_DEVICE_INLINE double floor_of(double v) {
  return floor(v);
}
DETOPS_HOST_DEVICE_INLINE float ceil_of(float v) {
  return ceilf(v);
}
DETOPS_HOST_DEVICE_INLINE double ceil_of(double v) {
  return ceil(v);
}

DETOPS_HOST_DEVICE_INLINE int64_t clamp_i64(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// Rounded, scaled coordinate as an integer; NaN reports failure through ok.
template <typename T>
DETOPS_HOST_DEVICE_INLINE int64_t roi_pool_coord(T v, T scale, bool& ok) {
  constexpr T kLimit = static_cast<T>(1 << 30);
  T s = round_away(v * scale);
  if (s != s) {
    ok = false;
    return 0;
  }
  s = s < -kLimit ? -kLimit : (s > kLimit ? kLimit : s);
  return static_cast<int64_t>(s);
}

// Batch index of a RoI, or -1 when rois[k, 0] is not an integer in [0, batch_size).
template <typename T>
DETOPS_HOST_DEVICE_INLINE int64_t roi_pool_batch_index(T v, int64_t batch_size) {
  if (!(v >= T(0)) || !(v < static_cast<T>(batch_size)) || floor_of(v) != v) return -1;
  return static_cast<int64_t>(v);
}

// One RoI on the feature map: integer start and the (fractional) bin sizes.
template <typename T>
struct RoiPoolBox {
  int64_t batch;  // -1: the RoI has only empty bins
  int64_t start_h, start_w;
  T bin_h, bin_w;
};

// The RoI (b, x1, y1, x2, y2), already converted to T, on a batch of batch_size images.
template <typename T>
DETOPS_HOST_DEVICE_INLINE RoiPoolBox<T> roi_pool_box(
    T b, T x1, T y1, T x2, T y2, T scale, int64_t batch_size, int64_t pooled_height,
    int64_t pooled_width) {
  RoiPoolBox<T> box;
  bool ok = true;
  box.start_w = roi_pool_coord(x1, scale, ok);
  box.start_h = roi_pool_coord(y1, scale, ok);
  const int64_t end_w = roi_pool_coord(x2, scale, ok);
  const int64_t end_h = roi_pool_coord(y2, scale, ok);
  const int64_t width = end_w - box.start_w + 1 > 1 ? end_w - box.start_w + 1 : 1;
  const int64_t height = end_h - box.start_h + 1 > 1 ? end_h - box.start_h + 1 : 1;
  box.bin_h = static_cast<T>(height) / static_cast<T>(pooled_height);
  box.bin_w = static_cast<T>(width) / static_cast<T>(pooled_width);
  box.batch = ok ? roi_pool_batch_index(b, batch_size) : -1;
  return box;
}

// roi_pool_box of row k of a contiguous [K, 5] RoI tensor of any floating type.
template <typename T, typename scalar_t>
DETOPS_HOST_DEVICE_INLINE RoiPoolBox<T> roi_pool_box_at(
    const scalar_t* rois, int64_t k, T scale, int64_t batch_size, int64_t pooled_height,
    int64_t pooled_width) {
  const scalar_t* r = rois + k * 5;
  return roi_pool_box<T>(
      static_cast<T>(r[0]), static_cast<T>(r[1]), static_cast<T>(r[2]), static_cast<T>(r[3]),
      static_cast<T>(r[4]), scale, batch_size, pooled_height, pooled_width);
}

// Pixel range [lo, hi) of bin i along one axis: the RoI starts at `start` and its bins are
// `bin` pixels long; the axis has `size` pixels.
template <typename T>
DETOPS_HOST_DEVICE_INLINE void roi_pool_bin_range(
    int64_t start, T bin, int64_t i, int64_t size, int64_t& lo, int64_t& hi) {
  lo = clamp_i64(static_cast<int64_t>(floor_of(static_cast<T>(i) * bin)) + start, 0, size);
  hi = clamp_i64(static_cast<int64_t>(ceil_of(static_cast<T>(i + 1) * bin)) + start, 0, size);
}

// Pixel window [h0, h1) x [w0, w1) of bin (ph, pw) on an H x W map; false when it is empty.
// Rows depend on ph alone and columns on pw alone (roi_pool_bin_range).
template <typename T>
DETOPS_HOST_DEVICE_INLINE bool roi_pool_bin(
    const RoiPoolBox<T>& box, int64_t ph, int64_t pw, int64_t height, int64_t width,
    int64_t& h0, int64_t& h1, int64_t& w0, int64_t& w1) {
  roi_pool_bin_range(box.start_h, box.bin_h, ph, height, h0, h1);
  roi_pool_bin_range(box.start_w, box.bin_w, pw, width, w0, w1);
  return box.batch >= 0 && h1 > h0 && w1 > w0;
}

// Value a non-empty bin starts its maximum from (torchvision's -FLT_MAX): a bin whose values
// are all NaN or below it keeps argmax -1.
template <typename T>
DETOPS_HOST_DEVICE_INLINE T roi_pool_lowest() {
  return static_cast<T>(-3.402823466e+38f);
}

// Maximum of plane over the window [h0, h1) x [w0, w1) (strides s_h, s_w), in acc_t, and its
// index h * width + w: the first maximum in row-major order wins, and a window whose values
// are all NaN or below roi_pool_lowest keeps index -1. Both devices call this.
template <typename acc_t, typename scalar_t>
DETOPS_HOST_DEVICE_INLINE acc_t roi_pool_max(
    const scalar_t* plane, int64_t s_h, int64_t s_w, int64_t width, int64_t h0, int64_t h1,
    int64_t w0, int64_t w1, int64_t& best_idx) {
  acc_t best = roi_pool_lowest<acc_t>();
  best_idx = -1;
  for (int64_t h = h0; h < h1; ++h) {
    const scalar_t* row = plane + h * s_h;
    for (int64_t w = w0; w < w1; ++w) {
      const acc_t v = static_cast<acc_t>(row[w * s_w]);
      if (v > best) {
        best = v;
        best_idx = h * width + w;
      }
    }
  }
  return best;
}

}  // namespace geometry

namespace checks {

// Shapes, dtypes and devices of roi_pool's arguments (not the batch indices: see above).
inline void check_roi_pool_inputs(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width) {
  const char* op = "detops.roi_pool";
  DETOPS_CHECK(
      input.dim() == 4, op, ": input must be a [B, C, H, W] tensor, got ", shape_str(input));
  check_float_tensor(op, "input", input);
  check_roi_common(op, rois, spatial_scale, pooled_height, pooled_width);
  check_same_device(op, "input", input, "rois", rois);
  check_same_dtype(op, "input", input, "rois", rois);
  // the output, or argmax (int32) where that is larger
  check_size_fits(
      op, "pooled_height and pooled_width", "an output [K, C, PH, PW]",
      {rois.size(0), input.size(1), pooled_height, pooled_width},
      std::max<int64_t>(static_cast<int64_t>(input.element_size()), 4));
}

inline void check_roi_pool_backward_inputs(
    const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax,
    double spatial_scale, int64_t pooled_height, int64_t pooled_width, int64_t batch_size,
    int64_t channels, int64_t height, int64_t width) {
  const char* op = "detops.roi_pool backward";
  check_roi_common(op, rois, spatial_scale, pooled_height, pooled_width);
  check_grad_input_sizes(op, batch_size, channels, height, width, grad.scalar_type());
  const std::vector<int64_t> want{rois.size(0), channels, pooled_height, pooled_width};
  DETOPS_CHECK(
      grad.sizes() == at::IntArrayRef(want), op, ": grad must be a [K, C, PH, PW] = ",
      at::IntArrayRef(want), " tensor, got ", shape_str(grad));
  DETOPS_CHECK(
      argmax.sizes() == at::IntArrayRef(want), op, ": argmax must be a [K, C, PH, PW] = ",
      at::IntArrayRef(want), " tensor, got ", shape_str(argmax));
  DETOPS_CHECK(
      argmax.scalar_type() == at::kInt, op, ": argmax must be an int32 tensor, got ",
      argmax.scalar_type());
  check_float_tensor(op, "grad", grad);
  check_float_tensor(op, "rois", rois);
  check_same_dtype(op, "grad", grad, "rois", rois);
  check_same_device(op, "grad", grad, "rois", rois);
  check_same_device(op, "grad", grad, "argmax", argmax);
}

}  // namespace checks
}  // namespace detops
