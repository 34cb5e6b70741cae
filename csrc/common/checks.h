// Input validation shared by the kernels of every device. Each message names the op and the
// argument, what was expected and what came, e.g.
//   detops.nms: boxes must be a [N, 4] tensor, got [7, 5]
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <sstream>
#include <string>

namespace detops {
namespace checks {

inline std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << "[";
  for (int64_t i = 0; i < t.dim(); ++i) {
    os << (i ? ", " : "") << t.size(i);
  }
  os << "]";
  return os.str();
}

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

inline void check_float_tensor(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK(
      is_supported_float(t.scalar_type()),
      op, ": ", arg, " must be a float32, float64, float16 or bfloat16 tensor, got ",
      t.scalar_type());
}

inline void check_same_device(
    const char* op, const char* arg_a, const at::Tensor& a, const char* arg_b,
    const at::Tensor& b) {
  TORCH_CHECK(
      a.device() == b.device(), op, ": ", arg_a, " and ", arg_b,
      " must be on the same device, got ", a.device(), " and ", b.device());
}

inline void check_same_dtype(
    const char* op, const char* arg_a, const at::Tensor& a, const char* arg_b,
    const at::Tensor& b) {
  TORCH_CHECK(
      a.scalar_type() == b.scalar_type(), op, ": ", arg_a, " and ", arg_b,
      " must have the same dtype, got ", a.scalar_type(), " and ", b.scalar_type());
}

inline void check_device(const char* op, const char* arg, const at::Tensor& t, at::DeviceType d) {
  TORCH_CHECK(
      t.device().type() == d, op, ": ", arg, " must be a ", c10::DeviceTypeName(d, /*lower_case=*/false),
      " tensor, got one on ", t.device());
}

inline void check_finite(const char* op, const char* arg, double v) {
  TORCH_CHECK(std::isfinite(v), op, ": ", arg, " must be a finite number, got ", v);
}

// boxes [N, 4], scores [N] (and idxs [N] of an integer dtype), one device, one float dtype.
inline void check_nms_inputs(
    const char* op, const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor* idxs,
    double iou_threshold) {
  TORCH_CHECK(
      boxes.dim() == 2 && boxes.size(1) == 4, op, ": boxes must be a [N, 4] tensor, got ",
      shape_str(boxes));
  TORCH_CHECK(
      scores.dim() == 1, op, ": scores must be a [N] tensor, got ", shape_str(scores));
  TORCH_CHECK(
      scores.size(0) == boxes.size(0), op,
      ": boxes and scores must have the same number of entries, got boxes ",
      shape_str(boxes), " and scores ", shape_str(scores));
  check_float_tensor(op, "boxes", boxes);
  check_float_tensor(op, "scores", scores);
  check_same_device(op, "boxes", boxes, "scores", scores);
  if (idxs != nullptr) {
    TORCH_CHECK(idxs->dim() == 1, op, ": idxs must be a [N] tensor, got ", shape_str(*idxs));
    TORCH_CHECK(
        idxs->size(0) == boxes.size(0), op,
        ": boxes and idxs must have the same number of entries, got boxes ", shape_str(boxes),
        " and idxs ", shape_str(*idxs));
    TORCH_CHECK(
        at::isIntegralType(idxs->scalar_type(), /*includeBool=*/false), op,
        ": idxs must be an integer tensor, got ", idxs->scalar_type());
    check_same_device(op, "boxes", boxes, "idxs", *idxs);
  }
  check_finite(op, "iou_threshold", iou_threshold);
}

}  // namespace checks
}  // namespace detops
