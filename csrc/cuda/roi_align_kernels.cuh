// The RoIAlign CUDA kernels as roi_align.cu chooses among them: the shapes its selection
// functions read, the kernels they pick, and the entry points of the files that hold them
// (roi_align_band.cu, roi_align_deterministic.cu; roi_align.cu holds the rest).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace detops {
namespace ops {

// One roi_align call, or one call of its backward: the feature map (the forward's input, the
// backward's grad_input), the RoIs and their bins, and the dtype of input (of grad).
struct RoIAlignShape {
  int64_t batch, channels, height, width;
  int64_t num_rois, pooled_height, pooled_width, sampling_ratio;
  at::ScalarType dtype;
};

// The forward's kernels (select_forward in roi_align.cu).
enum class RoIAlignForwardKernel {
  kBandSwizzled,  // roi_align_band.cu: bands of 32-byte pixels of 8 or 16 channels, swizzled
  kBand,          // roi_align_band.cu: bands of 1, 2 or 4 interleaved channel planes
  kNhwc,          // roi_align.cu: the map channels_last (converted if need be), 16-byte vectors
  kTiled,         // roi_align.cu: a block per (RoI, channels), sample taps in shared memory
  kGeneric,       // roi_align.cu: a thread per output element
};

// The backward's kernels (select_backward in roi_align.cu). All but kDeterministic add with
// atomics, so the order of their additions varies from run to run.
enum class RoIAlignBackwardKernel {
  kDeterministic,  // roi_align_deterministic.cu: pixel-sorted contribution lists, bit-identical
  kBandSliced,     // roi_align_band.cu: swizzled bands without overlap, stored in grad's dtype
  kBandSwizzled,   // roi_align_band.cu: swizzled overlapping bands through a float32 buffer
  kBand,           // roi_align_band.cu: overlapping bands, a channel at a time
  kTiled,          // roi_align.cu: a block per (RoI, channels), global atomics
  kGeneric,        // roi_align.cu: a thread per gradient element, global atomics
};

// roi_align_band.cu. Whether the band kernels can take the shapes, staged_bytes being the size
// of a staged value (input's element for the forward, the accumulation type's for the
// backward); whether they pay under RoIKernel::kAuto (the RoIs read each pixel of the maps
// often enough); and which band kernel takes the shapes.
bool roi_align_band_takes(const RoIAlignShape& s, int64_t staged_bytes);
bool roi_align_band_forward_pays(const RoIAlignShape& s);
bool roi_align_band_backward_pays(const RoIAlignShape& s);
bool roi_align_band_forward_swizzled_takes(const RoIAlignShape& s);
bool roi_align_band_backward_sliced_takes(const RoIAlignShape& s);
bool roi_align_band_backward_swizzled_takes(const RoIAlignShape& s);

// Launch the band kernel `kernel` picked for these shapes: input contiguous NCHW, rois
// contiguous in input's (grad's) dtype. Both check the RoIs' batch indices in their setup (the
// device assertion of roi_checks::check_batch_indices_async). The backward returns the
// gradient [batch, channels, height, width] in grad's dtype.
void roi_align_band_forward(
    RoIAlignForwardKernel kernel, const at::Tensor& input, const at::Tensor& rois, double spatial_scale,
    int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio, bool aligned, at::Tensor& output);
at::Tensor roi_align_band_backward(
    RoIAlignBackwardKernel kernel, const at::Tensor& grad, const at::Tensor& rois, double spatial_scale,
    int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio, bool aligned, int64_t batch,
    int64_t channels, int64_t height, int64_t width);

// roi_align_deterministic.cu: the deterministic backward, for every shape (those beyond its
// limits are refused with an error). rois contiguous in the accumulation dtype, batch indices
// already checked; grad_input [B, C, H, W], not empty, and at least one RoI: every element is
// written.
void roi_align_backward_deterministic(
    const at::Tensor& grad, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, bool aligned, at::Tensor& grad_input);

// The ops' device-side batch-index assertions (roi_checks.cuh): what each prints.
struct RoIAlignCheck {
  static constexpr const char* kMessage =
      "detops.roi_align: rois[:, 0] (the batch index) must hold integers in [0, B)";
};
struct RoIAlignBackwardCheck {
  static constexpr const char* kMessage =
      "detops._roi_align_backward: rois[:, 0] (the batch index) must hold integers in [0, B)";
};

}  // namespace ops
}  // namespace detops
