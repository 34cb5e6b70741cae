// Device-side check of RoI batch indices, in one launch and without a host sync: a RoI whose
// rois[k, 0] is not an integer in [0, B) fails a device assertion that names the op. The RoI
// kernels ignore such RoIs (empty bins, no gradient), so nothing is read or written out of
// bounds before the error surfaces at the next synchronization. Kernels that read every RoI
// anyway (the roi_align band setup, the roi_pool tile keys and band owner kernels) make the same
// check themselves (assert_batch_index).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/macros/Macros.h>

#include <cstdint>

#include "cuda_helpers.h"

namespace detops {
namespace ops {
namespace roi_checks {

// Check: a type that names the op, whose `static constexpr const char* kMessage` is the text of
// its assertion. The text is a constant, so the device code holds a copy of it (a device
// assertion can print only a string in device memory). Each op declares its own next to its
// kernels, e.g.
//   struct RoIPoolForward {
//     static constexpr const char* kMessage =
//         "detops.roi_pool: rois[:, 0] must hold batch indices, integers in [0, B)";
//   };

// Fails Check's device assertion unless v (rois[k, 0]) is an integer in [0, batch).
template <typename Check>
__device__ __forceinline__ void assert_batch_index(double v, int64_t batch) {
  const bool ok = v >= 0.0 && v < static_cast<double>(batch) && floor(v) == v;
  CUDA_KERNEL_ASSERT_MSG(ok, Check::kMessage);
}

template <typename Check, typename T>
__global__ void batch_index_kernel(int64_t num_rois, const T* __restrict__ rois, int64_t row_stride,
                                   int64_t batch) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < num_rois;
       k += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    assert_batch_index<Check>(static_cast<double>(rois[k * row_stride]), batch);
  }
}

// rois: [K, 5] floating tensor on the current CUDA device (any row stride).
template <typename Check>
void check_batch_indices_async(const at::Tensor& rois, int64_t batch) {
  const int64_t k = rois.size(0);
  if (k == 0) return;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, rois.scalar_type(), "detops.check_batch_indices", [&] {
    batch_index_kernel<Check, scalar_t><<<cuda::grid_for(k, 256), 256, 0, stream>>>(
        k, rois.const_data_ptr<scalar_t>(), rois.stride(0), batch);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace roi_checks
}  // namespace ops
}  // namespace detops
