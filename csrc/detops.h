// detops public C++ API: the detection ops on at::Tensor, CPU or CUDA by the tensors' device.
// Usable from LibTorch programs without Python; each function calls the dispatcher op
// `detops::<name>`, so it runs the same kernels as the Python API.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <tuple>

namespace detops {
namespace ops {

// Indices of the boxes kept by greedy NMS, by decreasing score. boxes [N, 4] (x1, y1, x2, y2),
// scores [N]; a box is dropped when its IoU with a kept, higher-scored box is > iou_threshold.
at::Tensor nms(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold);

// NMS applied independently within each category of idxs [N] (integers); indices by
// decreasing score.
at::Tensor batched_nms(
    const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs,
    double iou_threshold);

// Fixed-shape batched NMS, free of host syncs on CUDA (CUDA-graph capturable). boxes [B, N, 4],
// scores [B, N]. Per image, the boxes with score > score_threshold (NaN scores never pass) go
// through greedy NMS as in `nms`; the first max_output kept are returned. Returns
// (indices [B, max_output] int64: positions into N by decreasing score, padded with -1;
//  counts [B] int64: the number of valid entries of each row).
std::tuple<at::Tensor, at::Tensor> nms_padded(
    const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
    double score_threshold = -std::numeric_limits<double>::infinity(), int64_t max_output = 100);

// RoIAlign. input [B, C, H, W], rois [K, 5] (batch index, x1, y1, x2, y2) -> [K, C, PH, PW].
at::Tensor roi_align(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, bool aligned);

// Gradient of roi_align with respect to its input, [batch_size, channels, height, width].
at::Tensor roi_align_backward(
    const at::Tensor& grad, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t batch_size, int64_t channels, int64_t height, int64_t width,
    int64_t sampling_ratio, bool aligned);

// RoIPool (max). Returns (output [K, C, PH, PW], argmax [K, C, PH, PW] int32, -1 for empty bins).
std::tuple<at::Tensor, at::Tensor> roi_pool(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width);

// roi_pool's output alone: the same values, without computing or storing argmax when no
// gradient is needed (grad mode off, or input not requiring grad); otherwise roi_pool's output,
// differentiable as roi_pool's.
at::Tensor roi_pool_values(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width);

// Gradient of roi_pool with respect to its input, [batch_size, channels, height, width].
at::Tensor roi_pool_backward(
    const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax,
    double spatial_scale, int64_t pooled_height, int64_t pooled_width, int64_t batch_size,
    int64_t channels, int64_t height, int64_t width);

// Whether this build of detops holds CUDA kernels.
bool with_cuda();

}  // namespace ops
}  // namespace detops
