// detops from C++: NMS and RoIAlign on at::Tensors (on the GPU when detops has CUDA kernels and
// one is visible). Prints the results and exits non-zero if they are not the expected ones.
#include <detops/detops.h>

#include <ATen/ATen.h>

#include <cstdio>

int main() {
  const at::Device device = detops::ops::with_cuda() && at::hasCUDA() ? at::Device(at::kCUDA) : at::Device(at::kCPU);
  std::printf("detops example on %s\n", device.str().c_str());

  // NMS: the second box overlaps the first (IoU 0.81) and is suppressed.
  at::Tensor boxes = at::tensor({0.f, 0.f, 10.f, 10.f, 1.f, 1.f, 10.f, 10.f, 20.f, 20.f, 30.f, 30.f})
                         .view({3, 4}).to(device);
  at::Tensor scores = at::tensor({0.9f, 0.8f, 0.7f}).to(device);
  at::Tensor keep = detops::ops::nms(boxes, scores, /*iou_threshold=*/0.5).cpu();
  std::printf("nms keep:");
  for (int64_t i = 0; i < keep.numel(); ++i) std::printf(" %lld", static_cast<long long>(keep[i].item<int64_t>()));
  std::printf("\n");

  // RoIAlign on a feature map whose value is its column index: bins average x = 1, 2 and 3, 4.
  at::Tensor features = at::arange(8, at::kFloat).view({1, 1, 1, 8}).expand({1, 1, 8, 8}).contiguous().to(device);
  at::Tensor rois = at::tensor({0.f, 1.f, 1.f, 5.f, 5.f}).view({1, 5}).to(device);
  at::Tensor pooled = detops::ops::roi_align(features, rois, /*spatial_scale=*/1.0, /*pooled_height=*/2,
                                             /*pooled_width=*/2, /*sampling_ratio=*/2, /*aligned=*/true)
                          .cpu();
  const float* p = pooled.data_ptr<float>();
  std::printf("roi_align: %.2f %.2f / %.2f %.2f\n", p[0], p[1], p[2], p[3]);

  const bool ok = keep.numel() == 2 && keep[0].item<int64_t>() == 0 && keep[1].item<int64_t>() == 2 &&
                  at::allclose(pooled, at::tensor({1.5f, 3.5f, 1.5f, 3.5f}).view({1, 1, 2, 2}));
  std::printf("%s\n", ok ? "OK" : "UNEXPECTED RESULT");
  return ok ? 0 : 1;
}
