// The dispatcher entries of roi_pool and _roi_pool_values for one device, over that device's
// forward(input, rois, spatial_scale, pooled_height, pooled_width, with_argmax), which returns
// (output, argmax) with argmax undefined when with_argmax is false.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace detops {
namespace ops {

using RoIPoolForwardFn = std::tuple<at::Tensor, at::Tensor> (*)(
    const at::Tensor&, const at::Tensor&, double, int64_t, int64_t, bool);

template <RoIPoolForwardFn kForward>
struct RoIPoolEntries {
  // roi_pool: (output, argmax)
  static std::tuple<at::Tensor, at::Tensor> with_argmax(
      const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
      int64_t pooled_width) {
    return kForward(input, rois, spatial_scale, pooled_height, pooled_width, true);
  }
  // _roi_pool_values: the output alone, no argmax computed
  static at::Tensor values(
      const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
      int64_t pooled_width) {
    return std::get<0>(kForward(input, rois, spatial_scale, pooled_height, pooled_width, false));
  }
};

}  // namespace ops
}  // namespace detops
