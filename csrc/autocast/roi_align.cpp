// Autocast for roi_align: the op runs in float32 whatever the autocast dtype (bilinear sums of
// many samples lose too much in float16 / bfloat16), and the result comes back in the input's
// dtype, as torchvision does. The backward needs no autocast kernel: autograd replays the casts.
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace detops {
namespace ops {
namespace {

template <c10::DispatchKey kAutocastKey, c10::DeviceType kDeviceType>
at::Tensor roi_align_autocast(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale,
    c10::SymInt pooled_height, c10::SymInt pooled_width, int64_t sampling_ratio, bool aligned) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocastKey);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("detops::roi_align", "")
                       .typed<at::Tensor(
                           const at::Tensor&, const at::Tensor&, double, c10::SymInt,
                           c10::SymInt, int64_t, bool)>();
  return op
      .call(
          at::autocast::cached_cast(at::kFloat, input, kDeviceType),
          at::autocast::cached_cast(at::kFloat, rois, kDeviceType), spatial_scale,
          std::move(pooled_height), std::move(pooled_width), sampling_ratio, aligned)
      .to(input.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(detops, AutocastCUDA, m) {
  m.impl(
      "roi_align",
      TORCH_FN((roi_align_autocast<c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA>)));
}

TORCH_LIBRARY_IMPL(detops, AutocastCPU, m) {
  m.impl(
      "roi_align",
      TORCH_FN((roi_align_autocast<c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU>)));
}

}  // namespace ops
}  // namespace detops
