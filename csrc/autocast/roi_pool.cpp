// Autocast for roi_pool and _roi_pool_values: the max is taken in float32 and the output
// returned in the input's dtype (argmax stays int32). Max pooling is exact, so this only fixes
// the dtype mix that autocast produces (e.g. bfloat16 features with float32 RoIs), which the
// kernels reject.
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <tuple>

#include "../detops.h"

namespace detops {
namespace ops {
namespace {

template <c10::DispatchKey kKey, c10::DeviceType kDevice>
std::tuple<at::Tensor, at::Tensor> roi_pool_autocast(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(kKey);
  auto result = roi_pool(
      at::autocast::cached_cast(at::kFloat, input, kDevice),
      at::autocast::cached_cast(at::kFloat, rois, kDevice), spatial_scale, pooled_height,
      pooled_width);
  return {std::get<0>(result).to(input.scalar_type()), std::get<1>(result)};
}

template <c10::DispatchKey kKey, c10::DeviceType kDevice>
at::Tensor roi_pool_values_autocast(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(kKey);
  return roi_pool_values(
             at::autocast::cached_cast(at::kFloat, input, kDevice),
             at::autocast::cached_cast(at::kFloat, rois, kDevice), spatial_scale, pooled_height,
             pooled_width)
      .to(input.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(detops, AutocastCUDA, m) {
  m.impl(
      "roi_pool",
      TORCH_FN((roi_pool_autocast<c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA>)));
  m.impl(
      "_roi_pool_values",
      TORCH_FN((roi_pool_values_autocast<c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA>)));
}

TORCH_LIBRARY_IMPL(detops, AutocastCPU, m) {
  m.impl(
      "roi_pool",
      TORCH_FN((roi_pool_autocast<c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU>)));
  m.impl(
      "_roi_pool_values",
      TORCH_FN((roi_pool_values_autocast<c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU>)));
}

}  // namespace ops
}  // namespace detops
