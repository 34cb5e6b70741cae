// detops::ops on at::Tensors against hand-computed values (CPU; CUDA too when built with it and
// a GPU is visible).
#include <detops/detops.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vector>

namespace {

std::vector<at::Device> devices() {
  std::vector<at::Device> out{at::kCPU};
  if (detops::ops::with_cuda() && at::hasCUDA()) out.emplace_back(at::kCUDA);
  return out;
}

at::Tensor rois_of(std::vector<float> values, at::Device device) {
  return at::tensor(values, at::kFloat).view({-1, 5}).to(device);
}

TEST(Nms, KeepsTheKnownBoxes) {
  for (const auto& device : devices()) {
    // Box 1 overlaps box 0 with IoU 81/100 > 0.5; box 2 overlaps nothing.
    auto boxes = at::tensor({0.f, 0.f, 10.f, 10.f, 1.f, 1.f, 10.f, 10.f, 20.f, 20.f, 30.f, 30.f}).view({3, 4}).to(device);
    auto scores = at::tensor({0.9f, 0.8f, 0.7f}).to(device);
    auto keep = detops::ops::nms(boxes, scores, 0.5).cpu();
    ASSERT_EQ(keep.scalar_type(), at::kLong);
    ASSERT_EQ(keep.numel(), 2);
    EXPECT_EQ(keep[0].item<int64_t>(), 0);
    EXPECT_EQ(keep[1].item<int64_t>(), 2);
    // With a threshold above 0.81 all three stay, by decreasing score.
    auto all = detops::ops::nms(boxes, scores, 0.9).cpu();
    ASSERT_EQ(all.numel(), 3);
    EXPECT_EQ(all[1].item<int64_t>(), 1);
  }
}

TEST(Nms, BatchedKeepsOverlapsOfOtherCategories) {
  auto boxes = at::tensor({0.f, 0.f, 10.f, 10.f, 1.f, 1.f, 10.f, 10.f, 20.f, 20.f, 30.f, 30.f}).view({3, 4});
  auto scores = at::tensor({0.9f, 0.8f, 0.7f});
  auto idxs = at::tensor({int64_t{0}, int64_t{1}, int64_t{0}});
  auto keep = detops::ops::batched_nms(boxes, scores, idxs, 0.5);
  ASSERT_EQ(keep.numel(), 3);
  EXPECT_TRUE(keep.equal(at::tensor({int64_t{0}, int64_t{1}, int64_t{2}})));
}

TEST(Nms, EmptyInputGivesEmptyOutput) {
  auto keep = detops::ops::nms(at::zeros({0, 4}), at::zeros({0}), 0.5);
  EXPECT_EQ(keep.numel(), 0);
}

TEST(RoIAlign, ConstantMapGivesTheConstant) {
  for (const auto& device : devices()) {
    auto input = at::full({1, 2, 8, 8}, 3.0f, at::TensorOptions().device(device));
    auto rois = rois_of({0, 1, 1, 5, 5, 0, 2.5f, 0.5f, 6, 7}, device);
    auto out = detops::ops::roi_align(input, rois, 1.0, 3, 3, 2, true).cpu();
    ASSERT_EQ(out.sizes(), (at::IntArrayRef{2, 2, 3, 3}));
    EXPECT_TRUE(at::allclose(out, at::full_like(out, 3.0f)));
  }
}

TEST(RoIAlign, LinearRampGivesBinCentres) {
  for (const auto& device : devices()) {
    // value = column index; aligned box x in [0.5, 4.5], 2 bins of width 2, samples at
    // x = 1, 2 (bin 0) and 3, 4 (bin 1): means 1.5 and 3.5 in every row.
    auto input = at::arange(8, at::kFloat).view({1, 1, 1, 8}).expand({1, 1, 8, 8}).contiguous().to(device);
    auto rois = rois_of({0, 1, 1, 5, 5}, device);
    auto out = detops::ops::roi_align(input, rois, 1.0, 2, 2, 2, true).cpu();
    auto want = at::tensor({1.5f, 3.5f, 1.5f, 3.5f}).view({1, 1, 2, 2});
    EXPECT_TRUE(at::allclose(out, want, 1e-5, 1e-6)) << out;
    // Scaled coordinates: the same box at twice the size with spatial_scale 0.5.
    auto scaled = detops::ops::roi_align(input, rois_of({0, 2, 2, 10, 10}, device), 0.5, 2, 2, 2, true).cpu();
    EXPECT_TRUE(at::allclose(scaled, want, 1e-5, 1e-6));
  }
}

TEST(RoIAlign, BackwardSpreadsEachBinOverItsSamples) {
  // A bin is the mean of its samples, so a unit gradient per bin puts total weight PH * PW
  // (for a box inside the map) into the input gradient.
  auto rois = rois_of({0, 1, 1, 5, 5}, at::kCPU);
  auto grad = at::ones({1, 1, 2, 2});
  auto g = detops::ops::roi_align_backward(grad, rois, 1.0, 2, 2, 1, 1, 8, 8, 2, true);
  ASSERT_EQ(g.sizes(), (at::IntArrayRef{1, 1, 8, 8}));
  EXPECT_NEAR(g.sum().item<float>(), 4.0f, 1e-5);
  EXPECT_EQ(g[0][0][7][7].item<float>(), 0.0f);  // outside the box
}

TEST(Autograd, RoIOpsAreDifferentiableFromCpp) {
  // The ops carry their own autograd (csrc/autograd): a gradient through detops::ops::roi_align
  // is the backward op's on the same RoIs; through roi_pool it goes to each bin's maximum.
  auto input = at::arange(64, at::kFloat).view({1, 1, 8, 8}).requires_grad_();
  auto rois = rois_of({0, 1, 1, 5, 5}, at::kCPU);
  detops::ops::roi_align(input, rois, 1.0, 2, 2, 2, true).sum().backward();
  auto want = detops::ops::roi_align_backward(at::ones({1, 1, 2, 2}), rois, 1.0, 2, 2, 1, 1, 8, 8, 2, true);
  EXPECT_TRUE(at::equal(input.grad(), want)) << input.grad();
  EXPECT_NEAR(input.grad().sum().item<float>(), 4.0f, 1e-5);

  auto x = at::arange(16, at::kFloat).view({1, 1, 4, 4}).requires_grad_();
  auto [out, argmax] = detops::ops::roi_pool(x, rois_of({0, 0, 0, 3, 3}, at::kCPU), 1.0, 2, 2);
  EXPECT_FALSE(argmax.requires_grad());
  out.sum().backward();
  auto g = x.grad().flatten();
  for (int64_t i = 0; i < 16; ++i) {
    EXPECT_EQ(g[i].item<float>(), (i == 5 || i == 7 || i == 13 || i == 15) ? 1.0f : 0.0f) << i;
  }
  // roi_pool_values (the output alone) takes roi_pool's autograd when its input needs a gradient
  auto xv = at::arange(16, at::kFloat).view({1, 1, 4, 4}).requires_grad_();
  auto values = detops::ops::roi_pool_values(xv, rois_of({0, 0, 0, 3, 3}, at::kCPU), 1.0, 2, 2);
  ASSERT_TRUE(values.requires_grad());
  values.sum().backward();
  EXPECT_TRUE(at::equal(xv.grad(), x.grad()));
}

TEST(RoIPool, MaxOfAKnownGrid) {
  for (const auto& device : devices()) {
    // 4x4 map 0..15, box (0, 0, 3, 3): 2x2 bins of 2x2 pixels, maxima 5, 7, 13, 15.
    auto input = at::arange(16, at::kFloat).view({1, 1, 4, 4}).to(device);
    auto rois = rois_of({0, 0, 0, 3, 3}, device);
    auto [out, argmax] = detops::ops::roi_pool(input, rois, 1.0, 2, 2);
    auto want = at::tensor({5.f, 7.f, 13.f, 15.f}).view({1, 1, 2, 2});
    EXPECT_TRUE(at::equal(out.cpu(), want)) << out;
    EXPECT_TRUE(at::equal(argmax.cpu(), want.to(at::kInt)));
    EXPECT_TRUE(at::equal(detops::ops::roi_pool_values(input, rois, 1.0, 2, 2).cpu(), want));
  }
}

TEST(Errors, BadInputsThrowC10Errors) {
  EXPECT_THROW(detops::ops::nms(at::zeros({7, 5}), at::zeros({7}), 0.5), c10::Error);
  EXPECT_THROW(detops::ops::nms(at::zeros({7, 4}), at::zeros({6}), 0.5), c10::Error);
  auto input = at::zeros({1, 1, 4, 4});
  EXPECT_THROW(detops::ops::roi_align(input, at::zeros({2, 4}), 1.0, 2, 2, 2, true), c10::Error);
  EXPECT_THROW(detops::ops::roi_pool(input, at::zeros({2, 5}, at::kDouble), 1.0, 2, 2), c10::Error);
  try {
    detops::ops::nms(at::zeros({7, 5}), at::zeros({7}), 0.5);
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("detops.nms: boxes must be a [N, 4] tensor, got [7, 5]"),
              std::string::npos);
  }
}

}  // namespace
