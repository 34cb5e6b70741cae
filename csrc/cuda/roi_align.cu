// RoIAlign forward and backward on CUDA: the selection functions that pick a kernel for each
// call (select_forward, select_backward), and the gather kernels.
//
// forward (select_forward):
//   band (roi_align_band.cu): dense RoIs on contiguous NCHW maps with a fixed sampling grid of
//     1 to 4: bands of each plane staged in shared memory serve every RoI of the image;
//   nhwc: channels_last maps, and NCHW maps whose samples far outnumber their elements
//     (converted first): threads run along channels, reading 16-byte vectors;
//   tiled: a block per (RoI, run of channels) computes the RoI's sample rows and columns once
//     into shared memory, then each thread sums bins from them;
//   generic: one thread per output element recomputing everything, for the shapes the tiled
//     kernel does not fit.
// backward (select_backward):
//   deterministic (at::globalContext().deterministicAlgorithms(), roi_align_deterministic.cu):
//     pixel-sorted contribution lists summed in a fixed order, bit-identical from run to run;
//   otherwise every gradient element adds its samples' weighted values with atomics (float32 /
//   float64 accumulators; float16 and bfloat16 gradients accumulate in a float32 buffer), so
//   the order of the additions varies: band (roi_align_band.cu) in shared-memory bands for dense
//   RoIs, else tiled (the forward's tiling) or generic (a thread per gradient element).
// rois[:, 0] must hold integers in [0, B): a RoI whose batch index is not one contributes
// nothing in every kernel, and an asynchronous device assert reports it without a host sync.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/Atomic.cuh>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../common/kernel_choice.h"
#include "../common/roi_align_checks.h"
#include "../common/roi_align_geometry.h"
#include "cuda_helpers.h"
#include "roi_align_kernels.cuh"
#include "roi_align_rois.cuh"
#include "roi_checks.cuh"

namespace detops {
namespace ops {

namespace {

constexpr const char* kForwardOp = "detops.roi_align";
constexpr const char* kBackwardOp = "detops._roi_align_backward";
constexpr int kThreads = 256;

using roi_align::BilinearSample;
using roi_align::RoIBins;

using roi_align_cuda::bins_of;

// One output element: the mean of the bin's samples, read from one H x W plane.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t roi_align_bin(
    const scalar_t* __restrict__ plane, const RoIBins<acc_t>& r, int64_t ph, int64_t pw,
    int64_t height, int64_t width) {
  acc_t sum = 0;
  BilinearSample<acc_t> s;
  for (int64_t iy = 0; iy < r.grid_h; ++iy) {
    const acc_t y = roi_align::sample_coord(r.start_h, r.bin_h, ph, iy, r.grid_h);
    for (int64_t ix = 0; ix < r.grid_w; ++ix) {
      const acc_t x = roi_align::sample_coord(r.start_w, r.bin_w, pw, ix, r.grid_w);
      if (!roi_align::bilinear_sample(y, x, height, width, s)) continue;
      const int64_t row_lo = s.y_low * width, row_hi = s.y_high * width;
      sum += s.w1 * static_cast<acc_t>(plane[row_lo + s.x_low]) +
          s.w2 * static_cast<acc_t>(plane[row_lo + s.x_high]) +
          s.w3 * static_cast<acc_t>(plane[row_hi + s.x_low]) +
          s.w4 * static_cast<acc_t>(plane[row_hi + s.x_high]);
    }
  }
  return sum / r.count;
}

// Backward of one output element: adds gv times each sample's bilinear weights into one
// H x W plane of the accumulator, with atomics.
template <typename acc_t>
__device__ __forceinline__ void roi_align_scatter_bin(
    acc_t* __restrict__ plane, const RoIBins<acc_t>& r, int64_t ph, int64_t pw, int64_t height,
    int64_t width, acc_t gv) {
  BilinearSample<acc_t> s;
  for (int64_t iy = 0; iy < r.grid_h; ++iy) {
    const acc_t y = roi_align::sample_coord(r.start_h, r.bin_h, ph, iy, r.grid_h);
    for (int64_t ix = 0; ix < r.grid_w; ++ix) {
      const acc_t x = roi_align::sample_coord(r.start_w, r.bin_w, pw, ix, r.grid_w);
      if (!roi_align::bilinear_sample(y, x, height, width, s)) continue;
      const int64_t row_lo = s.y_low * width, row_hi = s.y_high * width;
      gpuAtomicAdd(plane + row_lo + s.x_low, s.w1 * gv);
      gpuAtomicAdd(plane + row_lo + s.x_high, s.w2 * gv);
      gpuAtomicAdd(plane + row_hi + s.x_low, s.w3 * gv);
      gpuAtomicAdd(plane + row_hi + s.x_high, s.w4 * gv);
    }
  }
}

// Generic forward: one thread per output element (RoI, channel, bin).
template <typename scalar_t, typename acc_t>
__global__ void roi_align_forward_kernel(
    int64_t total, const scalar_t* __restrict__ input, const acc_t* __restrict__ rois,
    int64_t batch, int64_t channels, int64_t height, int64_t width, int64_t pooled_height,
    int64_t pooled_width, acc_t scale, int64_t sampling_ratio, bool aligned,
    scalar_t* __restrict__ output) {
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t pw = idx % pooled_width;
    const int64_t ph = (idx / pooled_width) % pooled_height;
    const int64_t c = (idx / (pooled_width * pooled_height)) % channels;
    const int64_t k = idx / (pooled_width * pooled_height * channels);
    const acc_t* roi = rois + k * 5;
    const int64_t b = roi_align::roi_batch_index(roi[0], batch);
    if (b < 0) {
      output[idx] = scalar_t(0);
      continue;
    }
    const RoIBins<acc_t> r =
        bins_of(roi, scale, pooled_height, pooled_width, sampling_ratio, aligned);
    const scalar_t* plane = input + (b * channels + c) * height * width;
    output[idx] = static_cast<scalar_t>(roi_align_bin(plane, r, ph, pw, height, width));
  }
}

using roi_align_cuda::AxisTap;

constexpr int kTapCapacity = 512;  // sample rows (and columns) a tiled block holds
constexpr int kTiledThreads = 256;
constexpr int kTiledOutputs = 2048;  // outputs per tiled block, about

// Fills the block's sample-row and sample-column tables for RoI bins r (ny rows, nx columns),
// with the same per-axis rules as bilinear_sample. The caller synchronizes.
template <typename acc_t>
__device__ __forceinline__ void build_taps(
    const RoIBins<acc_t>& r, int64_t ny, int64_t nx, int64_t height, int64_t width,
    AxisTap<acc_t>* ytaps, AxisTap<acc_t>* xtaps) {
  for (int64_t i = threadIdx.x; i < ny + nx; i += blockDim.x) {
    const bool is_y = i < ny;
    const int64_t j = is_y ? i : i - ny;
    const int64_t grid = is_y ? r.grid_h : r.grid_w;
    const int64_t p = j / grid, q = j - p * grid;
    const acc_t v = is_y ? roi_align::sample_coord(r.start_h, r.bin_h, p, q, grid)
                         : roi_align::sample_coord(r.start_w, r.bin_w, p, q, grid);
    // an empty map reads nothing: both taps of every sample must be valid
    const int64_t size = height > 0 && width > 0 ? (is_y ? height : width) : 0;
    AxisTap<acc_t> tap = roi_align_cuda::axis_tap(v, size);
    if (is_y && tap.lo >= 0) {  // y taps hold plane offsets (row * W)
      tap.lo *= static_cast<int32_t>(width);
      tap.hi *= static_cast<int32_t>(width);
    }
    (is_y ? ytaps[j] : xtaps[j]) = tap;
  }
}

// Tiled forward: a block per (RoI, run of channels). The sample coordinates of a RoI are
// separable (rows depend on (ph, iy) only, columns on (pw, ix)), so the block computes them
// once into shared memory, with the same geometry as the generic kernel, and every output
// then costs four loads and four multiply-adds per sample. A RoI whose adaptive grid
// overflows the tables falls back to the generic per-output computation.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kTiledThreads) roi_align_forward_tiled_kernel(
    const scalar_t* __restrict__ input, const acc_t* __restrict__ rois, int64_t batch,
    int64_t channels, int64_t height, int64_t width, int pooled_height, int pooled_width,
    acc_t scale, int64_t sampling_ratio, bool aligned, int channels_per_block,
    scalar_t* __restrict__ output) {
  __shared__ AxisTap<acc_t> ytaps[kTapCapacity];
  __shared__ AxisTap<acc_t> xtaps[kTapCapacity];
  const int64_t k = blockIdx.x;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * channels_per_block;
  const int bins = pooled_height * pooled_width;
  const int nc = static_cast<int>(min(channels - c0, static_cast<int64_t>(channels_per_block)));
  const int nout = nc * bins;
  scalar_t* out = output + (k * channels + c0) * bins;
  const acc_t* roi = rois + k * 5;
  const int64_t b = roi_align::roi_batch_index(roi[0], batch);
  if (b < 0) {
    for (int o = threadIdx.x; o < nout; o += blockDim.x) out[o] = scalar_t(0);
    return;
  }
  const RoIBins<acc_t> r =
      bins_of(roi, scale, pooled_height, pooled_width, sampling_ratio, aligned);
  const int64_t ny = pooled_height * r.grid_h, nx = pooled_width * r.grid_w;
  const scalar_t* planes = input + (b * channels + c0) * height * width;
  if (ny > kTapCapacity || nx > kTapCapacity) {
    for (int o = threadIdx.x; o < nout; o += blockDim.x) {
      const int c = o / bins, bin = o - c * bins;
      const int ph = bin / pooled_width, pw = bin - ph * pooled_width;
      out[o] = static_cast<scalar_t>(
          roi_align_bin(planes + c * height * width, r, ph, pw, height, width));
    }
    return;
  }
  build_taps(r, ny, nx, height, width, ytaps, xtaps);
  __syncthreads();
  const int gh = static_cast<int>(r.grid_h), gw = static_cast<int>(r.grid_w);
  const int64_t plane_size = height * width;
  for (int o = threadIdx.x; o < nout; o += blockDim.x) {
    const int c = o / bins, bin = o - c * bins;
    const int ph = bin / pooled_width, pw = bin - ph * pooled_width;
    const scalar_t* plane = planes + c * plane_size;
    acc_t sum = 0;
    for (int iy = 0; iy < gh; ++iy) {
      const AxisTap<acc_t> ty = ytaps[ph * gh + iy];
      if (ty.lo < 0) continue;
      for (int ix = 0; ix < gw; ++ix) {
        const AxisTap<acc_t> tx = xtaps[pw * gw + ix];
        if (tx.lo < 0) continue;
        sum += (ty.h * tx.h) * static_cast<acc_t>(plane[ty.lo + tx.lo]) +
            (ty.h * tx.l) * static_cast<acc_t>(plane[ty.lo + tx.hi]) +
            (ty.l * tx.h) * static_cast<acc_t>(plane[ty.hi + tx.lo]) +
            (ty.l * tx.l) * static_cast<acc_t>(plane[ty.hi + tx.hi]);
      }
    }
    out[o] = static_cast<scalar_t>(sum / r.count);
  }
}

// Channels-last forward: a block per (RoI, run of channels). Threads run along channels, so
// each sample's four pixels are read as whole 16-byte vectors of consecutive channels (in NCHW
// every pixel of a channel plane is a separate 32-byte sector). Results gather in a shared
// [channel][bin] tile that is written out as one contiguous run of the NCHW output.
// kVec channels per thread; C and the run length are multiples of kVec and rows are 16-byte
// aligned (checked on the host).
constexpr int kNhwcTileBytes = 32 * 1024;

template <typename scalar_t, int kVec>
struct alignas(16) ChannelVec {
  scalar_t v[kVec];
};

template <typename scalar_t, typename acc_t, int kVec>
__global__ void __launch_bounds__(kTiledThreads) roi_align_forward_nhwc_kernel(
    const scalar_t* __restrict__ input, const acc_t* __restrict__ rois, int64_t batch,
    int64_t channels, int64_t height, int64_t width, int pooled_height, int pooled_width,
    acc_t scale, int64_t sampling_ratio, bool aligned, int channels_per_block, int bins_stride,
    scalar_t* __restrict__ output) {
  __shared__ AxisTap<acc_t> ytaps[kTapCapacity];
  __shared__ AxisTap<acc_t> xtaps[kTapCapacity];
  extern __shared__ unsigned char tile_raw[];
  acc_t* tile = reinterpret_cast<acc_t*>(tile_raw);  // [channels_per_block][bins_stride]
  const int64_t k = blockIdx.x;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * channels_per_block;
  const int bins = pooled_height * pooled_width;
  const int nc = static_cast<int>(min(channels - c0, static_cast<int64_t>(channels_per_block)));
  scalar_t* out = output + (k * channels + c0) * bins;
  const acc_t* roi = rois + k * 5;
  const int64_t b = roi_align::roi_batch_index(roi[0], batch);
  if (b < 0) {
    for (int o = threadIdx.x; o < nc * bins; o += blockDim.x) out[o] = scalar_t(0);
    return;
  }
  const RoIBins<acc_t> r =
      bins_of(roi, scale, pooled_height, pooled_width, sampling_ratio, aligned);
  const int64_t ny = pooled_height * r.grid_h, nx = pooled_width * r.grid_w;
  const bool fits = ny <= kTapCapacity && nx <= kTapCapacity;
  if (fits) {
    // pixel offsets within the image (y * W + x), not plane offsets
    build_taps(r, ny, nx, height, width, ytaps, xtaps);
  }
  __syncthreads();
  const scalar_t* image = input + b * height * width * channels + c0;
  const int vecs = nc / kVec;
  const int gh = static_cast<int>(r.grid_h), gw = static_cast<int>(r.grid_w);
  for (int item = threadIdx.x; item < vecs * bins; item += blockDim.x) {
    const int cv = item % vecs, bin = item / vecs;
    const int ph = bin / pooled_width, pw = bin - ph * pooled_width;
    acc_t sum[kVec];
#pragma unroll
    for (int v = 0; v < kVec; ++v) sum[v] = acc_t(0);
    const scalar_t* base = image + cv * kVec;
    // one sample: the same expression, term for term, as the NCHW kernels
    auto add = [&](int64_t p1, int64_t p2, int64_t p3, int64_t p4, acc_t w1, acc_t w2, acc_t w3,
                   acc_t w4) {
      using V = ChannelVec<scalar_t, kVec>;
      const V q1 = *reinterpret_cast<const V*>(base + p1 * channels);
      const V q2 = *reinterpret_cast<const V*>(base + p2 * channels);
      const V q3 = *reinterpret_cast<const V*>(base + p3 * channels);
      const V q4 = *reinterpret_cast<const V*>(base + p4 * channels);
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        sum[v] += w1 * static_cast<acc_t>(q1.v[v]) + w2 * static_cast<acc_t>(q2.v[v]) +
            w3 * static_cast<acc_t>(q3.v[v]) + w4 * static_cast<acc_t>(q4.v[v]);
      }
    };
    if (fits) {
      for (int iy = 0; iy < gh; ++iy) {
        const AxisTap<acc_t> ty = ytaps[ph * gh + iy];
        if (ty.lo < 0) continue;
        for (int ix = 0; ix < gw; ++ix) {
          const AxisTap<acc_t> tx = xtaps[pw * gw + ix];
          if (tx.lo < 0) continue;
          add(ty.lo + tx.lo, ty.lo + tx.hi, ty.hi + tx.lo, ty.hi + tx.hi, ty.h * tx.h,
              ty.h * tx.l, ty.l * tx.h, ty.l * tx.l);
        }
      }
    } else {
      BilinearSample<acc_t> s;
      for (int64_t iy = 0; iy < r.grid_h; ++iy) {
        const acc_t y = roi_align::sample_coord(r.start_h, r.bin_h, int64_t{ph}, iy, r.grid_h);
        for (int64_t ix = 0; ix < r.grid_w; ++ix) {
          const acc_t x = roi_align::sample_coord(r.start_w, r.bin_w, int64_t{pw}, ix, r.grid_w);
          if (!roi_align::bilinear_sample(y, x, height, width, s)) continue;
          add(s.y_low * width + s.x_low, s.y_low * width + s.x_high, s.y_high * width + s.x_low,
              s.y_high * width + s.x_high, s.w1, s.w2, s.w3, s.w4);
        }
      }
    }
#pragma unroll
    for (int v = 0; v < kVec; ++v) tile[(cv * kVec + v) * bins_stride + bin] = sum[v] / r.count;
  }
  __syncthreads();
  for (int o = threadIdx.x; o < nc * bins; o += blockDim.x) {
    const int c = o / bins, bin = o - c * bins;
    out[o] = static_cast<scalar_t>(tile[c * bins_stride + bin]);
  }
}

// Tiled atomic backward, the forward's tiling: each grad element scatters its samples with
// weights taken from the block's tables. Falls back per RoI like the forward.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kTiledThreads) roi_align_backward_tiled_kernel(
    const scalar_t* __restrict__ grad, const acc_t* __restrict__ rois, int64_t batch,
    int64_t channels, int64_t height, int64_t width, int pooled_height, int pooled_width,
    acc_t scale, int64_t sampling_ratio, bool aligned, int channels_per_block,
    acc_t* __restrict__ grad_input) {
  __shared__ AxisTap<acc_t> ytaps[kTapCapacity];
  __shared__ AxisTap<acc_t> xtaps[kTapCapacity];
  const int64_t k = blockIdx.x;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * channels_per_block;
  const int bins = pooled_height * pooled_width;
  const int nc = static_cast<int>(min(channels - c0, static_cast<int64_t>(channels_per_block)));
  const int nout = nc * bins;
  const acc_t* roi = rois + k * 5;
  const int64_t b = roi_align::roi_batch_index(roi[0], batch);
  if (b < 0) return;
  const RoIBins<acc_t> r =
      bins_of(roi, scale, pooled_height, pooled_width, sampling_ratio, aligned);
  const int64_t ny = pooled_height * r.grid_h, nx = pooled_width * r.grid_w;
  const scalar_t* g = grad + (k * channels + c0) * bins;
  const int64_t plane_size = height * width;
  acc_t* planes = grad_input + (b * channels + c0) * plane_size;
  const bool fits = ny <= kTapCapacity && nx <= kTapCapacity;
  if (fits) build_taps(r, ny, nx, height, width, ytaps, xtaps);
  __syncthreads();
  const int gh = static_cast<int>(r.grid_h), gw = static_cast<int>(r.grid_w);
  for (int o = threadIdx.x; o < nout; o += blockDim.x) {
    const acc_t go = static_cast<acc_t>(g[o]);
    if (go == acc_t(0)) continue;
    const acc_t gv = go / r.count;
    const int c = o / bins, bin = o - c * bins;
    const int ph = bin / pooled_width, pw = bin - ph * pooled_width;
    acc_t* plane = planes + c * plane_size;
    if (!fits) {
      roi_align_scatter_bin(plane, r, int64_t{ph}, int64_t{pw}, height, width, gv);
      continue;
    }
    for (int iy = 0; iy < gh; ++iy) {
      const AxisTap<acc_t> ty = ytaps[ph * gh + iy];
      if (ty.lo < 0) continue;
      for (int ix = 0; ix < gw; ++ix) {
        const AxisTap<acc_t> tx = xtaps[pw * gw + ix];
        if (tx.lo < 0) continue;
        gpuAtomicAdd(plane + ty.lo + tx.lo, (ty.h * tx.h) * gv);
        gpuAtomicAdd(plane + ty.lo + tx.hi, (ty.h * tx.l) * gv);
        gpuAtomicAdd(plane + ty.hi + tx.lo, (ty.l * tx.h) * gv);
        gpuAtomicAdd(plane + ty.hi + tx.hi, (ty.l * tx.l) * gv);
      }
    }
  }
}

template <typename scalar_t, typename acc_t>
__global__ void roi_align_backward_atomic_kernel(
    int64_t total, const scalar_t* __restrict__ grad, const acc_t* __restrict__ rois,
    int64_t batch, int64_t channels, int64_t height, int64_t width, int64_t pooled_height,
    int64_t pooled_width, acc_t scale, int64_t sampling_ratio, bool aligned,
    acc_t* __restrict__ grad_input) {
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t pw = idx % pooled_width;
    const int64_t ph = (idx / pooled_width) % pooled_height;
    const int64_t c = (idx / (pooled_width * pooled_height)) % channels;
    const int64_t k = idx / (pooled_width * pooled_height * channels);
    const acc_t* roi = rois + k * 5;
    const int64_t b = roi_align::roi_batch_index(roi[0], batch);
    if (b < 0) continue;
    const acc_t g = static_cast<acc_t>(grad[idx]);
    if (g == acc_t(0)) continue;  // adds nothing (and saves the atomics of padded RoIs)
    const RoIBins<acc_t> r =
        bins_of(roi, scale, pooled_height, pooled_width, sampling_ratio, aligned);
    const acc_t gv = g / r.count;
    roi_align_scatter_bin(grad_input + (b * channels + c) * height * width, r, ph, pw, height, width, gv);
  }
}

at::ScalarType acc_dtype_of(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// Outputs per block of the tiled kernels (and of the nhwc kernel's grid): the channels of a
// RoI that a block takes.
int64_t tiled_channels_per_block(const RoIAlignShape& s) {
  const int64_t bins = s.pooled_height * s.pooled_width;
  return std::max<int64_t>(1, std::min<int64_t>(s.channels, kTiledOutputs / bins));
}

// The tiled kernels (and the nhwc one) keep pixel offsets in 32 bits and a RoI per grid column.
bool tiled_takes(const RoIAlignShape& s) {
  const int64_t bins = s.pooled_height * s.pooled_width;
  const int64_t channel_blocks = cuda::ceil_div(s.channels, tiled_channels_per_block(s));
  return s.height * s.width < (int64_t{1} << 31) && channel_blocks <= 65535 &&
      s.num_rois < (int64_t{1} << 31) && bins <= kTiledOutputs;
}

// Channels-last input, or NCHW input whose samples far outnumber its elements: the NCHW tiled
// kernel costs about twice as much per sample as the nhwc one (in NCHW every pixel of a channel
// is a separate sector), so converting the map pays once the samples save more than the
// conversion costs, from about 8 samples per input element. C and the tile's runs of channels
// are multiples of a 16-byte vector; a channels_last input is read in place, so it must start
// on 16 bytes (a converted copy is a new allocation, which does).
bool nhwc_takes(const at::Tensor& input, const RoIAlignShape& s) {
  const int64_t vec = 16 / static_cast<int64_t>(input.element_size());
  const int64_t bins = s.pooled_height * s.pooled_width;
  const int64_t sample_estimate = s.num_rois * s.channels * bins * 4 *
      std::max<int64_t>(1, s.sampling_ratio > 0 ? s.sampling_ratio * s.sampling_ratio : 4);
  if (!tiled_takes(s) || s.channels % vec != 0 || bins > 512) return false;
  if (input.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    return reinterpret_cast<uintptr_t>(input.const_data_ptr()) % 16 == 0;
  }
  return s.channels >= 32 && sample_estimate >= 8 * input.numel();
}

// roi_kernel() (a test and benchmark setting), kAuto in place of a forced kTiled that cannot
// take the shapes. kGeneric takes every shape.
RoIKernel forced_choice(const RoIAlignShape& s) {
  const RoIKernel choice = roi_kernel();
  return choice == RoIKernel::kTiled && !tiled_takes(s) ? RoIKernel::kAuto : choice;
}

// The forward's kernel for these shapes, layout and dtype; forced_choice() forces a gather, or
// the band kernels on or off where they can take the shapes.
RoIAlignForwardKernel select_forward(const at::Tensor& input, const RoIAlignShape& s) {
  const RoIKernel choice = forced_choice(s);
  if (choice == RoIKernel::kTiled) return RoIAlignForwardKernel::kTiled;
  if (choice == RoIKernel::kGeneric) return RoIAlignForwardKernel::kGeneric;
  if (choice != RoIKernel::kGather && input.is_contiguous() && roi_align_band_takes(s, input.element_size()) &&
      (choice == RoIKernel::kBand || roi_align_band_forward_pays(s))) {
    return roi_align_band_forward_swizzled_takes(s) ? RoIAlignForwardKernel::kBandSwizzled
                                                    : RoIAlignForwardKernel::kBand;
  }
  if (nhwc_takes(input, s)) return RoIAlignForwardKernel::kNhwc;
  if (tiled_takes(s)) return RoIAlignForwardKernel::kTiled;
  return RoIAlignForwardKernel::kGeneric;
}

// The backward's kernel: the deterministic one under torch.use_deterministic_algorithms(True),
// else by shapes and dtype as in select_forward.
RoIAlignBackwardKernel select_backward(const RoIAlignShape& s) {
  if (at::globalContext().deterministicAlgorithms()) return RoIAlignBackwardKernel::kDeterministic;
  const RoIKernel choice = forced_choice(s);
  if (choice == RoIKernel::kTiled) return RoIAlignBackwardKernel::kTiled;
  if (choice == RoIKernel::kGeneric) return RoIAlignBackwardKernel::kGeneric;
  const int64_t acc_bytes = static_cast<int64_t>(at::elementSize(at::toOpMathType(s.dtype)));
  if (choice != RoIKernel::kGather && roi_align_band_takes(s, acc_bytes) &&
      (choice == RoIKernel::kBand || roi_align_band_backward_pays(s))) {
    if (roi_align_band_backward_sliced_takes(s)) return RoIAlignBackwardKernel::kBandSliced;
    if (roi_align_band_backward_swizzled_takes(s)) return RoIAlignBackwardKernel::kBandSwizzled;
    return RoIAlignBackwardKernel::kBand;
  }
  if (tiled_takes(s)) return RoIAlignBackwardKernel::kTiled;
  return RoIAlignBackwardKernel::kGeneric;
}

// rois in the accumulation type, contiguous, for the kernels of this file, once their batch
// indices are checked (on the device; the band kernels check them in their setup instead).
template <typename Check>
at::Tensor checked_rois(const at::Tensor& rois, int64_t batch, at::ScalarType dtype) {
  roi_checks::check_batch_indices_async<Check>(rois, batch);
  return rois.to(acc_dtype_of(dtype)).contiguous();
}

at::Tensor roi_align_forward_cuda(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, bool aligned) {
  checks::check_roi_align_inputs(
      kForwardOp, input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio);
  checks::check_device(kForwardOp, "input", input, at::kCUDA);
  const c10::cuda::CUDAGuard guard(input.device());
  // every element written by the kernels
  at::Tensor output =
      cuda::empty_written({rois.size(0), input.size(1), pooled_height, pooled_width}, input.options());
  if (output.numel() == 0) return output;
  const RoIAlignShape s{input.size(0), input.size(1),  input.size(2), input.size(3),        rois.size(0),
                        pooled_height, pooled_width,   sampling_ratio, input.scalar_type()};
  const RoIAlignForwardKernel kernel = select_forward(input, s);
  if (kernel == RoIAlignForwardKernel::kBandSwizzled || kernel == RoIAlignForwardKernel::kBand) {
    roi_align_band_forward(
        kernel, input, rois.contiguous(), spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned,
        output);
    return output;
  }
  const at::Tensor r = checked_rois<RoIAlignCheck>(rois, s.batch, input.scalar_type());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t batch = s.batch, channels = s.channels, bins = pooled_height * pooled_width;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), kForwardOp, [&] {
    using acc_t = at::opmath_type<scalar_t>;
    switch (kernel) {
      case RoIAlignForwardKernel::kNhwc: {
        const at::Tensor xl = input.contiguous(at::MemoryFormat::ChannelsLast);
        constexpr int kVec = 16 / sizeof(scalar_t);
        const int bins_stride = static_cast<int>(bins % 2 ? bins : bins + 1);
        // the tile shares the default 48 KiB with the static tap tables
        const int64_t budget = 48 * 1024 - 2 * kTapCapacity * static_cast<int64_t>(sizeof(AxisTap<acc_t>));
        int64_t per_block = std::min<int64_t>(kNhwcTileBytes, budget) /
            (bins_stride * static_cast<int64_t>(sizeof(acc_t)));
        per_block = std::max<int64_t>(kVec, std::min<int64_t>(channels, per_block / kVec * kVec));
        const int64_t blocks_c = (channels + per_block - 1) / per_block;
        const size_t tile_bytes = static_cast<size_t>(per_block * bins_stride * sizeof(acc_t));
        auto nhwc = roi_align_forward_nhwc_kernel<scalar_t, acc_t, kVec>;
        const dim3 grid(static_cast<unsigned>(rois.size(0)), static_cast<unsigned>(blocks_c));
        nhwc<<<grid, kTiledThreads, tile_bytes, stream>>>(
            xl.const_data_ptr<scalar_t>(), r.const_data_ptr<acc_t>(), batch, channels, xl.size(2),
            xl.size(3), static_cast<int>(pooled_height), static_cast<int>(pooled_width),
            static_cast<acc_t>(spatial_scale), sampling_ratio, aligned, static_cast<int>(per_block),
            bins_stride, output.data_ptr<scalar_t>());
        break;
      }
      case RoIAlignForwardKernel::kTiled: {
        const at::Tensor x = input.contiguous();
        const int64_t per_block = tiled_channels_per_block(s);
        const dim3 grid(static_cast<unsigned>(rois.size(0)), static_cast<unsigned>(cuda::ceil_div(channels, per_block)));
        roi_align_forward_tiled_kernel<scalar_t, acc_t><<<grid, kTiledThreads, 0, stream>>>(
            x.const_data_ptr<scalar_t>(), r.const_data_ptr<acc_t>(), batch, channels, x.size(2),
            x.size(3), static_cast<int>(pooled_height), static_cast<int>(pooled_width),
            static_cast<acc_t>(spatial_scale), sampling_ratio, aligned, static_cast<int>(per_block),
            output.data_ptr<scalar_t>());
        break;
      }
      default: {
        const at::Tensor x = input.contiguous();
        const int64_t total = output.numel();
        roi_align_forward_kernel<scalar_t, acc_t>
            <<<cuda::grid_for(total, kThreads), kThreads, 0, stream>>>(
                total, x.const_data_ptr<scalar_t>(), r.const_data_ptr<acc_t>(), batch, channels,
                x.size(2), x.size(3), pooled_height, pooled_width, static_cast<acc_t>(spatial_scale),
                sampling_ratio, aligned, output.data_ptr<scalar_t>());
        break;
      }
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return output;
}

at::Tensor roi_align_backward_cuda(
    const at::Tensor& grad, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t batch_size, int64_t channels, int64_t height, int64_t width,
    int64_t sampling_ratio, bool aligned) {
  checks::check_roi_align_backward_inputs(
      kBackwardOp, grad, rois, spatial_scale, pooled_height, pooled_width, batch_size, channels,
      height, width, sampling_ratio);
  checks::check_device(kBackwardOp, "grad", grad, at::kCUDA);
  const c10::cuda::CUDAGuard guard(grad.device());
  const at::ScalarType dtype = grad.scalar_type();
  if (batch_size * channels * height * width == 0 || rois.size(0) == 0) {
    return at::zeros({batch_size, channels, height, width}, grad.options());
  }
  const RoIAlignShape s{batch_size,    channels,     height,         width, rois.size(0),
                        pooled_height, pooled_width, sampling_ratio, dtype};
  const RoIAlignBackwardKernel kernel = select_backward(s);
  switch (kernel) {
    case RoIAlignBackwardKernel::kDeterministic: {
      const at::Tensor r = checked_rois<RoIAlignBackwardCheck>(rois, batch_size, dtype);
      // every element written by the deterministic backward
      at::Tensor grad_input = cuda::empty_written({batch_size, channels, height, width}, grad.options());
      roi_align_backward_deterministic(
          grad, r, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned, grad_input);
      return grad_input;
    }
    case RoIAlignBackwardKernel::kBandSliced:
    case RoIAlignBackwardKernel::kBandSwizzled:
    case RoIAlignBackwardKernel::kBand:
      return roi_align_band_backward(
          kernel, grad, rois.contiguous(), spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned,
          batch_size, channels, height, width);
    default:
      break;
  }
  at::Tensor acc = at::empty(
      {batch_size, channels, height, width}, grad.options().dtype(acc_dtype_of(dtype)));
  const at::Tensor r = checked_rois<RoIAlignBackwardCheck>(rois, batch_size, dtype);
  acc.zero_();
  const at::Tensor g = grad.contiguous();
  const int64_t total = g.numel();
  if (total > 0) {
    cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, kBackwardOp, [&] {
      using acc_t = at::opmath_type<scalar_t>;
      if (kernel == RoIAlignBackwardKernel::kTiled) {
        const int64_t per_block = tiled_channels_per_block(s);
        const dim3 grid(static_cast<unsigned>(rois.size(0)), static_cast<unsigned>(cuda::ceil_div(channels, per_block)));
        roi_align_backward_tiled_kernel<scalar_t, acc_t><<<grid, kTiledThreads, 0, stream>>>(
            g.const_data_ptr<scalar_t>(), r.const_data_ptr<acc_t>(), batch_size, channels, height,
            width, static_cast<int>(pooled_height), static_cast<int>(pooled_width),
            static_cast<acc_t>(spatial_scale), sampling_ratio, aligned,
            static_cast<int>(per_block), acc.data_ptr<acc_t>());
      } else {
        roi_align_backward_atomic_kernel<scalar_t, acc_t>
            <<<cuda::grid_for(total, kThreads), kThreads, 0, stream>>>(
                total, g.const_data_ptr<scalar_t>(), r.const_data_ptr<acc_t>(), batch_size,
                channels, height, width, pooled_height, pooled_width,
                static_cast<acc_t>(spatial_scale), sampling_ratio, aligned, acc.data_ptr<acc_t>());
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return acc.to(dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(detops, CUDA, m) {
  m.impl("roi_align", TORCH_FN(roi_align_forward_cuda));
  m.impl("_roi_align_backward", TORCH_FN(roi_align_backward_cuda));
}

}  // namespace ops
}  // namespace detops
