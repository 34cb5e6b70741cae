// The C ABI (detops_aot.h) called as a host framework calls it: raw buffers, shapes, dtype names.
#include <detops/detops_aot.h>
#include <gtest/gtest.h>

#include "aot_call.h"

#include <cstdint>
#include <string>
#include <vector>

namespace {

using Call = detops_test::AotCallList;

TEST(Aot, NmsFillsKeepAndCount) {
  float boxes[] = {0, 0, 10, 10, 1, 1, 10, 10, 20, 20, 30, 30};
  float scores[] = {0.9f, 0.8f, 0.7f};
  float thr[] = {0.5f};
  int64_t keep[] = {7, 7, 7};
  int64_t count[] = {7};
  Call call;
  call.add(boxes, {3, 4}, "float32");
  call.add(scores, {3}, "float32");
  call.add(thr, {1}, "float32");
  call.add(keep, {3}, "int64");
  call.add(count, {1}, "int64");
  ASSERT_EQ(call(DetopsNms), DETOPS_AOT_OK) << DetopsAotLastError();
  EXPECT_EQ(count[0], 2);
  EXPECT_EQ(keep[0], 0);
  EXPECT_EQ(keep[1], 2);
  EXPECT_EQ(keep[2], -1);
}

TEST(Aot, BadParameterListsAreRejectedWithoutWriting) {
  float boxes[] = {0, 0, 10, 10};
  float scores[] = {0.9f};
  float thr[] = {0.5f};
  int64_t keep[] = {7};
  int64_t count[] = {7};
  Call call;
  call.add(boxes, {1, 4}, "float32");
  call.add(scores, {1}, "float32");
  call.add(thr, {1}, "float32");
  call.add(keep, {1}, "int64");
  EXPECT_EQ(call(DetopsNms), DETOPS_AOT_BAD_PARAM_COUNT);
  call.add(count, {1}, "int64");
  call.dtypes[0] = "float33";
  EXPECT_EQ(call(DetopsNms), DETOPS_AOT_BAD_DTYPE);
  EXPECT_NE(std::string(DetopsAotLastError()).find("float33"), std::string::npos);
  call.dtypes[0] = "float32";
  call.shape_store[3] = {2};  // keep must have N entries
  EXPECT_EQ(call(DetopsNms), DETOPS_AOT_BAD_SHAPE);
  EXPECT_EQ(keep[0], 7);
  EXPECT_EQ(count[0], 7);
}

TEST(Aot, RoIPoolKnownGrid) {
  float input[16];
  for (int i = 0; i < 16; ++i) input[i] = static_cast<float>(i);
  float rois[] = {0, 0, 0, 3, 3};
  float attrs[] = {1.0f};
  float out[4] = {};
  int32_t argmax[4] = {};
  Call call;
  call.add(input, {1, 1, 4, 4}, "float32");
  call.add(rois, {1, 5}, "float32");
  call.add(attrs, {1}, "float32");
  call.add(out, {1, 1, 2, 2}, "float32");
  call.add(argmax, {1, 1, 2, 2}, "int32");
  ASSERT_EQ(call(DetopsRoIPoolForward), DETOPS_AOT_OK) << DetopsAotLastError();
  EXPECT_EQ(out[0], 5.f);
  EXPECT_EQ(out[3], 15.f);
  EXPECT_EQ(argmax[1], 7);
}

}  // namespace
