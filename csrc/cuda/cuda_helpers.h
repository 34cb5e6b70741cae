// Small helpers shared by the CUDA kernel files.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cstdint>

namespace detops {
namespace cuda {

constexpr int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// a rounded up to a multiple of m (an offset aligned for vector loads).
constexpr int64_t round_up(int64_t a, int64_t m) {
  return ceil_div(a, m) * m;
}

// Blocks for a grid-stride loop over n items, capped so that huge n still launches.
inline unsigned int grid_for(int64_t n, int threads) {
  const int64_t blocks = ceil_div(n, threads);
  const int64_t cap = static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min(blocks, cap)));
}

// An uninitialized CUDA tensor for a buffer whose every element a kernel writes before
// anything reads it. Under torch.use_deterministic_algorithms(True), at::empty fills new memory
// with NaN (torch.utils.deterministic.fill_uninitialized_memory), one more kernel and one more
// pass over the buffer, which such a buffer does not need; the deterministic backwards, which
// run in that mode, allocate several.
inline at::Tensor empty_written(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::Tensor(at::detail::empty_cuda(sizes, options));
}

}  // namespace cuda
}  // namespace detops
