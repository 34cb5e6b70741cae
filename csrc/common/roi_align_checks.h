// Argument checks of roi_align and its backward, shared by the CPU and CUDA kernels. The batch
// index of every RoI (rois[:, 0]) is checked by each device: on the CPU with a TORCH_CHECK,
// on CUDA without a host sync (see the CUDA file).
#pragma once

#include <ATen/ATen.h>

#include <cmath>

#include "checks.h"
#include "roi_align_geometry.h"

namespace detops {
namespace checks {

inline void check_roi_align_common(
    const char* op, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio) {
  check_roi_common(op, rois, spatial_scale, pooled_height, pooled_width);
  DETOPS_CHECK(
      sampling_ratio <= roi_align::kMaxGrid, op, ": sampling_ratio must be at most ",
      roi_align::kMaxGrid, " (<= 0 means adaptive), got ", sampling_ratio);
}

// input [B, C, H, W], rois [K, 5] (batch index, x1, y1, x2, y2), same device and float dtype.
inline void check_roi_align_inputs(
    const char* op, const at::Tensor& input, const at::Tensor& rois, double spatial_scale,
    int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio) {
  DETOPS_CHECK(
      input.dim() == 4, op, ": input must be a [B, C, H, W] tensor, got ", shape_str(input));
  check_float_tensor(op, "input", input);
  check_roi_align_common(op, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio);
  check_same_device(op, "input", input, "rois", rois);
  check_same_dtype(op, "input", input, "rois", rois);
  check_size_fits(
      op, "pooled_height and pooled_width", "an output [K, C, PH, PW]",
      {rois.size(0), input.size(1), pooled_height, pooled_width},
      static_cast<int64_t>(input.element_size()));
}

// grad [K, C, PH, PW] for rois [K, 5] and an input of [batch_size, channels, height, width].
inline void check_roi_align_backward_inputs(
    const char* op, const at::Tensor& grad, const at::Tensor& rois, double spatial_scale,
    int64_t pooled_height, int64_t pooled_width, int64_t batch_size, int64_t channels,
    int64_t height, int64_t width, int64_t sampling_ratio) {
  check_float_tensor(op, "grad", grad);
  check_roi_align_common(op, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio);
  check_grad_input_sizes(op, batch_size, channels, height, width, grad.scalar_type());
  DETOPS_CHECK(
      grad.dim() == 4 && grad.size(0) == rois.size(0) && grad.size(1) == channels &&
          grad.size(2) == pooled_height && grad.size(3) == pooled_width,
      op, ": grad must be a [K, C, PH, PW] = [", rois.size(0), ", ", channels, ", ",
      pooled_height, ", ", pooled_width, "] tensor, got ", shape_str(grad));
  check_same_device(op, "grad", grad, "rois", rois);
  check_same_dtype(op, "grad", grad, "rois", rois);
}

}  // namespace checks
}  // namespace detops
