// Input validation shared by the kernels of every device. Each message names the op and the
// argument, what was expected and what came, e.g.
//   detops.nms: boxes must be a [N, 4] tensor, got [7, 5]
#pragma once

#include <ATen/ATen.h>

#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <type_traits>

// TORCH_CHECK with a message built by detops::checks::message (see below).
#define DETOPS_CHECK(cond, ...) TORCH_CHECK((cond), ::detops::checks::message(__VA_ARGS__))

namespace detops {
namespace checks {

// Error messages are assembled here rather than by streaming numbers into an ostream: with some
// pairings of a torch wheel and the system's libstdc++, formatting a number through
// std::ostream inside an extension crashes the process. Numbers go through std::to_string /
// snprintf; strings, dtypes and devices are appended as text.
inline void append(std::string& out, const char* s) { out += s; }
inline void append(std::string& out, const std::string& s) { out += s; }
inline void append(std::string& out, char c) { out += c; }
inline void append(std::string& out, bool b) { out += b ? "true" : "false"; }
inline void append(std::string& out, at::ScalarType t) { out += c10::toString(t); }
inline void append(std::string& out, const c10::Device& d) { out += d.str(); }
inline void append(std::string& out, c10::DeviceType d) { out += c10::DeviceTypeName(d, false); }
template <typename T>
inline std::enable_if_t<std::is_integral<T>::value && !std::is_same<T, bool>::value && !std::is_same<T, char>::value>
append(std::string& out, T v) {
  out += std::to_string(v);
}
template <typename T>
inline std::enable_if_t<std::is_floating_point<T>::value> append(std::string& out, T v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", static_cast<double>(v));
  out += buf;
}

inline void append(std::string& out, at::IntArrayRef sizes) {
  out += "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(sizes[i]);
  }
  out += "]";
}

template <typename... Args>
inline std::string message(const Args&... args) {
  std::string out;
  (append(out, args), ...);
  return out;
}

inline std::string shape_str(const at::Tensor& t) {
  std::string out;
  append(out, t.sizes());
  return out;
}

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

inline void check_float_tensor(const char* op, const char* arg, const at::Tensor& t) {
  DETOPS_CHECK(
      is_supported_float(t.scalar_type()),
      op, ": ", arg, " must be a float32, float64, float16 or bfloat16 tensor, got ",
      t.scalar_type());
}

// _to_channels_last's one argument: any dtype, a [B, C, H, W] shape.
inline void check_to_channels_last_input(const at::Tensor& input) {
  DETOPS_CHECK(
      input.dim() == 4, "detops._to_channels_last: input must be a [B, C, H, W] tensor, got ",
      shape_str(input));
}

inline void check_same_device(
    const char* op, const char* arg_a, const at::Tensor& a, const char* arg_b,
    const at::Tensor& b) {
  DETOPS_CHECK(
      a.device() == b.device(), op, ": ", arg_a, " and ", arg_b,
      " must be on the same device, got ", a.device(), " and ", b.device());
}

inline void check_same_dtype(
    const char* op, const char* arg_a, const at::Tensor& a, const char* arg_b,
    const at::Tensor& b) {
  DETOPS_CHECK(
      a.scalar_type() == b.scalar_type(), op, ": ", arg_a, " and ", arg_b,
      " must have the same dtype, got ", a.scalar_type(), " and ", b.scalar_type());
}

inline void check_device(const char* op, const char* arg, const at::Tensor& t, at::DeviceType d) {
  DETOPS_CHECK(
      t.device().type() == d, op, ": ", arg, " must be a ", c10::DeviceTypeName(d, /*lower_case=*/false),
      " tensor, got one on ", t.device());
}

inline void check_finite(const char* op, const char* arg, double v) {
  DETOPS_CHECK(std::isfinite(v), op, ": ", arg, " must be a finite number, got ", v);
}

// A tensor of `sizes` (each >= 0) with `item_bytes` per element must be one torch can describe:
// its strides and its byte count, the product of max(size, 1) over the dimensions times
// item_bytes, fit in int64. Otherwise the allocation fails with torch's own message, which
// names neither the op nor the argument. `args` names the arguments that set the sizes,
// `what` the tensor, e.g. "output [K, C, PH, PW]".
inline void check_size_fits(
    const char* op, const char* args, const char* what, at::IntArrayRef sizes,
    int64_t item_bytes) {
  uint64_t bytes = static_cast<uint64_t>(item_bytes);
  bool overflow = false;
  for (const int64_t s : sizes) {
    overflow |= c10::mul_overflows(bytes, static_cast<uint64_t>(s > 1 ? s : 1), &bytes);
  }
  DETOPS_CHECK(
      !overflow && bytes <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), op, ": ",
      args, " must give ", what, " of at most 2^63 - 1 bytes, got sizes ", sizes);
}

// What every RoI op asks of its RoI arguments: rois [K, 5] of a float dtype, a positive pooled
// size and a finite, positive spatial scale.
inline void check_roi_common(
    const char* op, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width) {
  DETOPS_CHECK(
      rois.dim() == 2 && rois.size(1) == 5, op, ": rois must be a [K, 5] tensor, got ",
      shape_str(rois));
  check_float_tensor(op, "rois", rois);
  DETOPS_CHECK(
      pooled_height > 0 && pooled_width > 0, op,
      ": pooled_height and pooled_width must be positive, got ", pooled_height, " and ",
      pooled_width);
  DETOPS_CHECK(
      std::isfinite(spatial_scale) && spatial_scale > 0, op,
      ": spatial_scale must be a finite number > 0, got ", spatial_scale);
}

// Sizes a backward op is asked to produce, at 4 bytes per element or more (the roi_align
// backward accumulates 16-bit gradients in float32).
inline void check_grad_input_sizes(
    const char* op, int64_t batch_size, int64_t channels, int64_t height, int64_t width,
    at::ScalarType dtype) {
  DETOPS_CHECK(
      batch_size >= 0 && channels >= 0 && height >= 0 && width >= 0, op,
      ": batch_size, channels, height and width must be >= 0, got ", batch_size, ", ", channels,
      ", ", height, ", ", width);
  check_size_fits(
      op, "batch_size, channels, height and width", "a grad_input [B, C, H, W]",
      {batch_size, channels, height, width},
      std::max<int64_t>(static_cast<int64_t>(c10::elementSize(dtype)), 4));
}

// boxes [N, 4], scores [N] (and idxs [N] of an integer dtype), one device, one float dtype.
inline void check_nms_inputs(
    const char* op, const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor* idxs,
    double iou_threshold) {
  DETOPS_CHECK(
      boxes.dim() == 2 && boxes.size(1) == 4, op, ": boxes must be a [N, 4] tensor, got ",
      shape_str(boxes));
  DETOPS_CHECK(
      scores.dim() == 1, op, ": scores must be a [N] tensor, got ", shape_str(scores));
  DETOPS_CHECK(
      scores.size(0) == boxes.size(0), op,
      ": boxes and scores must have the same number of entries, got boxes ",
      shape_str(boxes), " and scores ", shape_str(scores));
  check_float_tensor(op, "boxes", boxes);
  check_float_tensor(op, "scores", scores);
  check_same_device(op, "boxes", boxes, "scores", scores);
  if (idxs != nullptr) {
    DETOPS_CHECK(idxs->dim() == 1, op, ": idxs must be a [N] tensor, got ", shape_str(*idxs));
    DETOPS_CHECK(
        idxs->size(0) == boxes.size(0), op,
        ": boxes and idxs must have the same number of entries, got boxes ", shape_str(boxes),
        " and idxs ", shape_str(*idxs));
    DETOPS_CHECK(
        at::isIntegralType(idxs->scalar_type(), /*includeBool=*/false), op,
        ": idxs must be an integer tensor, got ", idxs->scalar_type());
    check_same_device(op, "boxes", boxes, "idxs", *idxs);
  }
  check_finite(op, "iou_threshold", iou_threshold);
}

}  // namespace checks
}  // namespace detops
