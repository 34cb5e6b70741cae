// Process-wide kernel settings for tests and benchmarks that compare detops' kernels on the same
// inputs, or reach paths that only huge inputs take otherwise. Internal: not part of the
// installed API (csrc/detops.h); Python reaches them through detops._C._set_roi_kernel,
// detops._C._set_nms_kernel, detops._C._set_cpu_vector (detops/ops/_utils.py wraps these) and
// detops._C._set_deterministic_pass_limits. The settings live in csrc/vision.cpp, except the
// NMS one, which is defined below.
#pragma once

#include <atomic>
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

// Which CUDA kernels nms / batched_nms (csrc/cuda/nms.cu) and nms_padded (csrc/cuda/nms_padded.cu)
// use, so that tests can run every variant on the same input. `rank` is how boxes are ranked by
// score: kCount (count, for each box, the boxes ahead of it), kRadix (cub's radix sort of 32-bit
// score keys; nms and batched_nms only) or kSort (torch's stable sort). `pass` is nms's greedy
// pass: kBlock (one block) or kDataflow (the cooperative kernel); nms_padded has one pass.
// kAuto (the default) is the selection's own choice. A forced choice the input cannot take falls
// back to the selection's own choice: kCount needs scores of the boxes' dtype, not float64, and at
// most nms_rank::kMaxCountRank boxes (batched_nms: fewer where shared memory is short; nms_padded:
// per image); kRadix needs scores that are not float64 (nms_padded has no radix sort: kRadix is
// kAuto there); kBlock needs nms (not batched_nms) and at most kMaxBlockPass boxes (4096) whose
// words fit the block's shared memory. Every variant gives the same indices.
// Python: detops._C._set_nms_kernel(rank, pass_) (detops.ops._utils.nms_kernel wraps it). The
// setting is stored here (inline), not in csrc/vision.cpp.
enum class NmsRankChoice : int { kAuto = 0, kCount = 1, kRadix = 2, kSort = 3 };
enum class NmsPassChoice : int { kAuto = 0, kBlock = 1, kDataflow = 2 };
struct NmsKernel {
  NmsRankChoice rank = NmsRankChoice::kAuto;
  NmsPassChoice pass = NmsPassChoice::kAuto;
};

namespace detail {
// rank in the low byte, pass in the next: one atomic word, so a pair is read and set at once
inline std::atomic<int>& nms_kernel_word() {
  static std::atomic<int> word{0};
  return word;
}
inline NmsKernel nms_kernel_from(int word) {
  return {static_cast<NmsRankChoice>(word & 0xff), static_cast<NmsPassChoice>((word >> 8) & 0xff)};
}
}  // namespace detail

inline NmsKernel nms_kernel() {
  return detail::nms_kernel_from(detail::nms_kernel_word().load(std::memory_order_relaxed));
}

// returns the previous choice
inline NmsKernel set_nms_kernel(NmsKernel choice) {
  const int word = static_cast<int>(choice.rank) | (static_cast<int>(choice.pass) << 8);
  return detail::nms_kernel_from(detail::nms_kernel_word().exchange(word));
}

}  // namespace ops
}  // namespace detops
