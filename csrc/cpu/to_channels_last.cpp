// _to_channels_last on the CPU: a [B, C, H, W] tensor's values copied into a new channels_last
// tensor. The RoI ops' backwards write their gradient plane by plane (NCHW); for an input stored
// channels_last, the autograd returns the gradient in the input's layout through this op.
//
// torch would make the same copy (AccumulateGrad copies a gradient into its leaf's layout), into
// fresh 4 KiB pages, whose page faults cost more than the strided copy itself on a large map.
// Here the output asks for huge pages as the kernels' outputs do (cpu::empty_output), and torch's
// own copy fills it.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "output_alloc.h"

namespace detops {
namespace ops {
namespace {

at::Tensor to_channels_last_cpu(const at::Tensor& input) {
  checks::check_to_channels_last_input(input);
  checks::check_device("detops._to_channels_last", "input", input, at::kCPU);
  // torch's copy gives each thread ranges of the output of its own
  at::Tensor out = cpu::empty_output(
      input.sizes(), input.options().memory_format(at::MemoryFormat::ChannelsLast),
      cpu::FirstWrites::kOwnRanges);
  if (out.numel() > 0) out.copy_(input);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(detops, CPU, m) {
  m.impl("_to_channels_last", TORCH_FN(to_channels_last_cpu));
}

}  // namespace ops
}  // namespace detops
