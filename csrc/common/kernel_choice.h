// Process-wide kernel settings for tests and benchmarks that compare detops' kernels on the same
// inputs, or reach paths that only huge inputs take otherwise. Internal: not part of the
// installed API (csrc/detops.h); Python reaches them through detops._C._set_roi_kernel,
// detops._C._set_cpu_vector (detops/ops/_utils.py wraps both) and
// detops._C._set_deterministic_pass_limits. The settings live in csrc/vision.cpp.
#pragma once

#include <cstdint>

namespace detops {
namespace ops {

// Which CUDA kernels roi_align and roi_pool use. kAuto (the default) stages bands (roi_pool's
// forward: tiles) of each feature plane in shared memory when the RoIs are dense enough that a
// plane would be read several times over, and gathers from global memory otherwise; kBand
// stages whenever the shapes allow it (NCHW input for roi_align's forward); kGather never
// stages. kTiled and kGeneric force one of roi_align's gathers, forward and backward: the tiled
// kernels (a block per RoI and run of channels) where they can take the shapes, the generic
// ones (a thread per element) always; where kTiled cannot take the shapes, and in roi_pool,
// which has neither kernel, the selection makes its kAuto choice. The deterministic backwards
// are chosen by torch.use_deterministic_algorithms alone. The kernels agree to rounding
// (roi_pool exactly). Read by the selection functions of csrc/cuda/roi_align.cu and
// csrc/cuda/roi_pool.cu.
enum class RoIKernel : int { kAuto = 0, kBand = 1, kGather = 2, kTiled = 3, kGeneric = 4 };
RoIKernel roi_kernel();
RoIKernel set_roi_kernel(RoIKernel choice);  // returns the previous choice

// Which instructions the CPU roi_pool forward uses for float32 input. kAuto (the default): the
// best this CPU and build have: AVX2 (with AVX-512VL's masks on Intel CPUs that have them),
// else SSE2 (x86-64), else scalar code; kAvx512: AVX2 with AVX-512VL's masks on any CPU that
// has them; kAvx2: AVX2 without AVX-512; kSse2: SSE2 even where AVX2 is there; kScalar: scalar
// code only. A choice the CPU lacks falls back to the next narrower one. All paths give the
// same bits.
enum class CpuVector : int { kAuto = 0, kSse2 = 1, kScalar = 2, kAvx2 = 3, kAvx512 = 4 };
CpuVector cpu_vector();
CpuVector set_cpu_vector(CpuVector choice);  // returns the previous choice

// Limits of one pass of the deterministic roi_align backward on CUDA
// (csrc/cuda/roi_align_deterministic.cu), lowered by tests so that small inputs take the passes
// over chunks of RoIs and slices of channels, and the int64 keys, that otherwise only inputs of
// many GiB take. 0 / false (the default): the kernels' own limits.
struct DeterministicPassLimits {
  int64_t max_entries = 0;   // contributions one pass lists (at most the kernels' 2^31 - 1)
  int64_t max_channels = 0;  // channels one pass takes (at most the kernels' 65535 * 32)
  bool wide_keys = false;    // int64 keys even where int32 ones hold every (image, pixel)
};
DeterministicPassLimits deterministic_pass_limits();
DeterministicPassLimits set_deterministic_pass_limits(DeterministicPassLimits limits);  // returns the previous

}  // namespace ops
}  // namespace detops
