// RoIAlign "plane" kernels for NCHW input on CUDA (roi_align_plane.cu); the entry points of
// roi_align.cu try them first and keep their own kernels for the shapes these decline.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace detops {
namespace ops {
namespace roi_align_plane {

// Forward on an NCHW input. rois: [K, 5] contiguous, in the accumulation dtype (float32, or
// float64 for float64 input). Writes output [K, C, PH, PW] and returns true when the plane
// kernel ran; returns false (and writes nothing) when it does not fit or does not pay.
bool forward(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, bool aligned, at::Tensor& output);

// Atomic (non-deterministic) backward; rois as for forward. Returns grad_input
// [B, C, H, W] in grad's dtype, or an undefined tensor when the plane kernel declines.
at::Tensor backward(
    const at::Tensor& grad, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t batch_size, int64_t channels, int64_t height, int64_t width,
    int64_t sampling_ratio, bool aligned);

}  // namespace roi_align_plane
}  // namespace ops
}  // namespace detops
