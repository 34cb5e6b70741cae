// _to_channels_last on CUDA: a [B, C, H, W] tensor's values in a new channels_last tensor, on the
// current stream. The RoI ops' autograd returns a channels_last input's gradient through it: the
// backwards write NCHW planes, and AccumulateGrad (or the next op's backward, for a map that is
// not a leaf) would otherwise copy them into the input's layout with torch's own copy.
//
// An NCHW-contiguous input is, image by image, a [C, H*W] matrix, and the output its [H*W, C]
// transpose. torch's copy writes the output in order and reads each channel's value from its
// own plane: a warp's 32 loads touch 32 sectors for 4 bytes each. Here each block moves one
// square tile through shared memory: its warps read channels' rows of pixels and write pixels'
// rows of channels, each lane 2 or 4 values at once, so both sides move whole sectors. The
// values are moved as raw bits of their size, so any dtype of 1, 2, 4 or 8 bytes takes the
// kernel; other inputs (another layout, 16-byte complex) take torch's copy.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "../common/checks.h"
#include "cuda_helpers.h"

namespace detops {
namespace ops {
namespace {

constexpr int kLanes = 32;  // threads per block: kLanes x Rows

// K values of one row side by side: one load or store of K * sizeof(Bits) bytes.
template <typename Bits, int K>
struct alignas(sizeof(Bits) * K) Vec {
  Bits v[K];
};

// One tile of image blockIdx.z (and every gridDim.z-th after it): channels [c0, c0 + T) of
// pixels [p0, p0 + T), T = kLanes * K. A warp reads a channel's T pixels and writes a pixel's T
// channels, each lane K values at once (K = 1 takes any shape; K > 1 needs pixels and channels
// divisible by K and an input aligned to K values). The shared row has one spare column: a
// column of the tile falls on at most two lanes a bank.
template <typename Bits, int K, int Rows, int MinBlocks>
__global__ void __launch_bounds__(kLanes * Rows, MinBlocks) nchw_to_nhwc_kernel(
    const Bits* __restrict__ input, Bits* __restrict__ output, int64_t batch, int64_t channels,
    int64_t pixels) {
  constexpr int T = kLanes * K;
  using V = Vec<Bits, K>;
  __shared__ Bits tile[T][T + 1];
  const int64_t p0 = static_cast<int64_t>(blockIdx.x) * T;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * T;
  const int lane = threadIdx.x * K;
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    const Bits* in = input + b * channels * pixels;
    Bits* out = output + b * channels * pixels;
    const int64_t p = p0 + lane;
#pragma unroll
    for (int k = 0; k < T / Rows; ++k) {
      const int r = threadIdx.y + k * Rows;
      const int64_t c = c0 + r;
      if (c < channels && p < pixels) {
        const V v = *reinterpret_cast<const V*>(in + c * pixels + p);
#pragma unroll
        for (int j = 0; j < K; ++j) tile[r][lane + j] = v.v[j];
      }
    }
    __syncthreads();
    const int64_t c = c0 + lane;
#pragma unroll
    for (int k = 0; k < T / Rows; ++k) {
      const int r = threadIdx.y + k * Rows;
      const int64_t q = p0 + r;
      if (q < pixels && c < channels) {
        V v;
#pragma unroll
        for (int j = 0; j < K; ++j) v.v[j] = tile[lane + j][r];
        *reinterpret_cast<V*>(out + q * channels + c) = v;
      }
    }
    __syncthreads();  // the tile is read out before the next image's values overwrite it
  }
}

template <typename Bits, int K, int Rows, int MinBlocks>
void launch_transpose(const at::Tensor& input, at::Tensor& output, int64_t pixels) {
  constexpr int T = kLanes * K;
  const int64_t batch = input.size(0), channels = input.size(1);
  const dim3 grid(
      static_cast<unsigned int>(cuda::ceil_div(pixels, T)), static_cast<unsigned int>(cuda::ceil_div(channels, T)),
      static_cast<unsigned int>(std::min<int64_t>(batch, 65535)));
  nchw_to_nhwc_kernel<Bits, K, Rows, MinBlocks><<<grid, dim3(kLanes, Rows), 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const Bits*>(input.const_data_ptr()), static_cast<Bits*>(output.mutable_data_ptr()), batch,
      channels, pixels);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Values a lane moves at once, K, and the block's rows of 32 threads, the fastest of K = 1, 2, 4
// and 4 to 16 rows: 2-byte values two a lane in blocks of 8 rows, at least four blocks an SM;
// 4 and 8-byte values two a lane in blocks of 4 rows; 1-byte values four a lane. One value a lane in blocks of 8
// rows where the shape or the input's address does not allow K.
template <typename Bits>
void transpose(const at::Tensor& input, at::Tensor& output, int64_t pixels) {
  constexpr int K = sizeof(Bits) == 1 ? 4 : 2;
  const bool vectors = pixels % K == 0 && input.size(1) % K == 0 &&
      reinterpret_cast<uintptr_t>(input.const_data_ptr()) % (sizeof(Bits) * K) == 0;
  if (!vectors) {
    launch_transpose<Bits, 1, 8, 1>(input, output, pixels);
  } else if constexpr (sizeof(Bits) == 2) {
    launch_transpose<Bits, K, 8, 4>(input, output, pixels);
  } else if constexpr (sizeof(Bits) == 1) {
    launch_transpose<Bits, K, 8, 1>(input, output, pixels);
  } else {
    launch_transpose<Bits, K, 4, 1>(input, output, pixels);
  }
}

// Whether the tiled kernel takes the input: NCHW-contiguous, elements of 1, 2, 4 or 8 bytes,
// and a grid that fits (blockIdx.x up to 2^31 - 1 pixel tiles, blockIdx.y up to 65535 channel
// tiles of 32). One channel or one pixel is the same order in both layouts: a plain copy.
bool tiled(const at::Tensor& input, int64_t pixels) {
  const auto size = input.element_size();
  return input.is_contiguous() && input.size(1) > 1 && pixels > 1 &&
      (size == 1 || size == 2 || size == 4 || size == 8) &&
      cuda::ceil_div(pixels, kLanes) <= INT32_MAX && cuda::ceil_div(input.size(1), kLanes) <= 65535;
}

at::Tensor to_channels_last_cuda(const at::Tensor& input) {
  checks::check_to_channels_last_input(input);
  checks::check_device("detops._to_channels_last", "input", input, at::kCUDA);
  const c10::cuda::CUDAGuard guard(input.device());
  // every element is written below: no fill under deterministic mode
  at::Tensor out = cuda::empty_written(
      input.sizes(), input.options().memory_format(at::MemoryFormat::ChannelsLast));
  if (out.numel() == 0) return out;
  const int64_t pixels = input.size(2) * input.size(3);
  if (!tiled(input, pixels)) {
    out.copy_(input);
    return out;
  }
  switch (input.element_size()) {
    case 1: transpose<uint8_t>(input, out, pixels); break;
    case 2: transpose<uint16_t>(input, out, pixels); break;
    case 4: transpose<uint32_t>(input, out, pixels); break;
    default: transpose<uint64_t>(input, out, pixels); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(detops, CUDA, m) {
  m.impl("_to_channels_last", TORCH_FN(to_channels_last_cuda));
}

}  // namespace ops
}  // namespace detops
