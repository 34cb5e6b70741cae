// The RoIPool CUDA kernels as roi_pool.cu chooses among them: the shapes its selection
// functions read, the kernels they pick, and the entry points of the files that hold them
// (roi_pool_tile.cu, roi_pool_band.cu; roi_pool.cu holds the rest).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace detops {
namespace ops {

// One roi_pool call, or one call of its backward: the feature map (the forward's input, the
// backward's grad_input), the RoIs and their bins, and the dtype of input (of grad).
struct RoIPoolShape {
  int64_t batch, channels, height, width;
  int64_t num_rois, pooled_height, pooled_width;
  at::ScalarType dtype;
};

// The forward's kernels (select_forward in roi_pool.cu). All give the CPU kernel's values and
// argmax.
enum class RoIPoolForwardKernel {
  kTile,      // roi_pool_tile.cu: dense RoIs, tiles of the map in shared memory, a lane per channel
  kChannels,  // roi_pool.cu: channels_last maps, a lane per channel
  kRows,      // roi_pool.cu: other layouts, a warp per bin row, lanes along its columns
};

// The backward's kernels (select_backward in roi_pool.cu).
enum class RoIPoolBackwardKernel {
  kDeterministic,  // roi_pool.cu: gradients sorted by pixel and summed in RoI order, bit-identical
  kBand,           // roi_pool_band.cu: dense RoIs, bands of the map in shared memory, atomics
  kAtomic,         // roi_pool.cu: a thread per gradient element, global atomics
};

// roi_pool_tile.cu: whether the tile forward can take the shapes (any layout: it reads the
// input through its strides), and whether it pays under RoIKernel::kAuto (dense bins, and
// channels enough to keep at least half of a warp's lanes busy).
bool roi_pool_tile_takes(const RoIPoolShape& s);
bool roi_pool_tile_pays(const RoIPoolShape& s);
// rois contiguous in input's dtype; an undefined argmax: the values alone. Checks the RoIs'
// batch indices in its setup (the device assertion of roi_checks::check_batch_indices_async).
void roi_pool_tile_forward(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, at::Tensor& output, at::Tensor& argmax);

// roi_pool_band.cu: whether the band backward can take the shapes (of an NCHW gradient), and
// whether it pays under RoIKernel::kAuto (dense bins).
bool roi_pool_band_takes(const RoIPoolShape& s);
bool roi_pool_band_pays(const RoIPoolShape& s);
// rois and argmax contiguous; returns grad_input in grad's dtype. Checks the RoIs' batch
// indices in its setup, as the tile forward does.
at::Tensor roi_pool_band_backward(
    const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax, double spatial_scale,
    int64_t pooled_height, int64_t pooled_width, int64_t batch, int64_t channels, int64_t height,
    int64_t width);

// The ops' device-side batch-index assertions (roi_checks.cuh): what each prints.
struct RoIPoolCheck {
  static constexpr const char* kMessage =
      "detops.roi_pool: rois[:, 0] must hold batch indices, integers in [0, B)";
};
struct RoIPoolBackwardCheck {
  static constexpr const char* kMessage =
      "detops.roi_pool backward: rois[:, 0] must hold batch indices, integers in [0, B)";
};

}  // namespace ops
}  // namespace detops
