// Argument checks of nms_padded, shared by the CPU and CUDA kernels. Every check depends on
// shapes, dtypes, devices and scalar arguments only, never on tensor values, so the CUDA op
// runs them without a host sync.
#pragma once

#include <ATen/ATen.h>

#include <cmath>

#include "checks.h"

namespace detops {
namespace checks {

// boxes [B, N, 4], scores [B, N], one device, float dtypes (boxes and scores may differ);
// a finite iou_threshold, a score_threshold that is not NaN (+-inf allowed), max_output >= 0.
inline void check_nms_padded_inputs(
    const char* op, const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
    double score_threshold, int64_t max_output) {
  DETOPS_CHECK(
      boxes.dim() == 3 && boxes.size(2) == 4, op, ": boxes must be a [B, N, 4] tensor, got ",
      shape_str(boxes));
  DETOPS_CHECK(
      scores.dim() == 2, op, ": scores must be a [B, N] tensor, got ", shape_str(scores));
  DETOPS_CHECK(
      scores.size(0) == boxes.size(0) && scores.size(1) == boxes.size(1), op,
      ": boxes [B, N, 4] and scores [B, N] must agree in B and N, got boxes ", shape_str(boxes),
      " and scores ", shape_str(scores));
  check_float_tensor(op, "boxes", boxes);
  check_float_tensor(op, "scores", scores);
  check_same_device(op, "boxes", boxes, "scores", scores);
  check_finite(op, "iou_threshold", iou_threshold);
  DETOPS_CHECK(
      !std::isnan(score_threshold), op, ": score_threshold must be a number (-inf and inf are "
      "allowed), got nan");
  DETOPS_CHECK(max_output >= 0, op, ": max_output must be >= 0, got ", max_output);
  check_size_fits(op, "max_output", "indices [B, max_output]", {boxes.size(0), max_output}, 8);
}

}  // namespace checks
}  // namespace detops
