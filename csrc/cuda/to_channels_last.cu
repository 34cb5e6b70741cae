// _to_channels_last on CUDA: torch's own copy into a new channels_last tensor, on the current
// stream. The RoI ops' autograd calls the op for CPU inputs only (csrc/cpu/to_channels_last.cpp);
// on CUDA it is here so that the op runs on either device.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../common/checks.h"

namespace detops {
namespace ops {
namespace {

at::Tensor to_channels_last_cuda(const at::Tensor& input) {
  checks::check_to_channels_last_input(input);
  checks::check_device("detops._to_channels_last", "input", input, at::kCUDA);
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out =
      at::empty(input.sizes(), input.options().memory_format(at::MemoryFormat::ChannelsLast));
  if (out.numel() > 0) out.copy_(input);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(detops, CUDA, m) {
  m.impl("_to_channels_last", TORCH_FN(to_channels_last_cuda));
}

}  // namespace ops
}  // namespace detops
