// RoIPool (max) forward and backward on CUDA: the selection functions that pick a kernel for
// each call (select_forward, select_backward), and the gather, atomic and deterministic kernels.
//
// Forward (select_forward): dense RoIs (many bins per pixel of the map) go through
// shared-memory tiles with a lane per channel (tile, roi_pool_tile.cu). Otherwise the work is
// ordered channel by channel (all RoIs of channel 0, then channel 1, ...), so the RoIs in
// flight read one or two feature planes that stay in L2; two kernels, both reading the input
// through its strides (no copy) and both giving the CPU kernel's results:
//   * rows (channel-first layouts such as NCHW): a warp per (block of 8 channels, RoI, bin
//     row ph), which computes the RoI and bin geometry once for its channels. Its lanes split
//     into groups of g lanes (a power of two sized to the bin width), one group per bin of the
//     row; the lanes of a group read adjacent columns of the bin, so each load of a row reads a
//     contiguous run of g values. A lane keeps the maximum of each of its columns over the
//     bin's rows (first row on ties), folds its columns together, and the group combines its
//     lanes with shuffles. Candidates combine by (larger value, then smaller row-major index
//     h * W + w), which picks exactly the bin's first maximum in row-major order, as the
//     sequential scan of roi_pool_max does; NaN never becomes a maximum and a bin without a
//     value above roi_pool_lowest keeps index -1.
//   * channels (channels_last): a warp per (group of 32 channels, RoI, bin row ph), a lane
//     per channel; a load of one pixel reads 32 adjacent channels, and each lane runs the
//     shared sequential scan (roi_pool_max) over each bin of the row.
// The bin geometry is the one the CPU kernel uses (common/roi_pool_geometry.h).
// _roi_pool_values (roi_pool's output when no gradient is needed) runs the same kernels without
// argmax: the tile kernel then scans each bin once, tracking no row, and reads it again only
// when its maximum is zero (roi_pool_tile.cu); nothing stores or transposes indices.
//
// Backward (select_backward):
//   * deterministic (torch.use_deterministic_algorithms(True)): every grad_output element gets
//     the key (b * C + c) * H * W + argmax of the pixel it feeds (a sentinel past the end for
//     empty bins); a stable radix sort of the gradient values by key (over the key's bits
//     only) groups the contributions of each pixel in RoI order, and one thread per group (its
//     first element) sums the group's consecutive values and writes the pixel once.
//     Bit-identical from run to run, with the same summation order as the CPU kernel.
//   * band (dense RoIs on the map, roi_pool_band.cu): each block adds the gradients of its
//     band of rows in shared memory and stores the band once.
//   * atomic: one thread per grad_output element adds it to the argmax pixel of grad_input
//     with atomicAdd (into a float32 accumulator for float16 / bfloat16); empty bins (argmax
//     -1) are skipped before anything else is read.
//   The band and atomic backwards add with atomics: the order of the additions, hence the
//   rounding, varies from run to run.
//
// Index arithmetic is 32-bit when every flat index of the launch fits, 64-bit otherwise.
// Batch indices are checked on the device (roi_checks.cuh) instead of with a host sync;
// a RoI with an invalid index has only empty bins and receives no gradient, so nothing is
// read or written out of bounds either way.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/Atomic.cuh>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "../common/checks.h"
#include "../common/kernel_choice.h"
#include "../common/roi_pool_entries.h"
#include "../common/roi_pool_geometry.h"
#include "cuda_helpers.h"
#include "radix_sort.cuh"
#include "roi_checks.cuh"
#include "roi_pool_kernels.cuh"

namespace detops {
namespace ops {

namespace {

using geometry::roi_pool_bin;

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = kThreads / kWarp;
constexpr unsigned int kFullMask = 0xffffffffu;
// Channels per warp item of the rows kernel: the RoI and bin geometry is computed once for
// them; small enough that the planes of the items in flight stay in L2.
constexpr int kRowsChannels = 8;

// Candidate (v, i) replaces (best, best_i) when it is larger, or equal with a smaller row-major
// index. Candidates are either (a value above roi_pool_lowest, its index >= 0) or
// (roi_pool_lowest, -1), so "no candidate" never replaces a real one and the combination of
// any partition of a bin gives the first maximum of its row-major scan.
template <typename acc_t>
__device__ __forceinline__ void take_better(acc_t v, int32_t i, acc_t& best, int32_t& best_i) {
  if (v > best || (v == best && i < best_i)) {
    best = v;
    best_i = i;
  }
}

// Lanes per bin: the power of two g (1..32) with the fewest warp-wide load rounds per bin row,
// passes * ceil(span / g), where a pass handles 32 / g bins of the row and span bounds a bin's
// column count; ties go to the larger g (longer contiguous runs).
__device__ __forceinline__ int lanes_per_bin(int64_t span, int64_t pooled_width) {
  int best_g = kWarp;
  int64_t best_cost = std::numeric_limits<int64_t>::max();
  for (int g = kWarp; g >= 1; g >>= 1) {
    const int64_t per_pass = kWarp / g;
    const int64_t cost = ((pooled_width + per_pass - 1) / per_pass) * ((span + g - 1) / g);
    if (cost < best_cost) {
      best_cost = cost;
      best_g = g;
    }
  }
  return best_g;
}

// Sizes and strides of a [K, C, PH, PW] gradient, with the flat-index decomposition.
template <typename index_t>
struct PooledIndex {
  index_t channels, pooled_height, pooled_width;
  int64_t s_k, s_c, s_h, s_w;

  __device__ void split(index_t i, index_t& k, index_t& c, index_t& ph, index_t& pw) const {
    pw = i % pooled_width;
    i /= pooled_width;
    ph = i % pooled_height;
    i /= pooled_height;
    c = i % channels;
    k = i / channels;
  }
  __device__ int64_t offset(index_t i) const {
    index_t k, c, ph, pw;
    split(i, k, c, ph, pw);
    return k * s_k + c * s_c + ph * s_h + pw * s_w;
  }
};

// Input sizes and strides as the forward kernels see them.
struct InputView {
  int64_t batch, channels, height, width;
  int64_t s_b, s_c, s_h, s_w;
};

// Rows kernel (see the file comment): a warp per item (channel block, k, ph), items ordered
// channel block first; the warp handles the kRowsChannels channels of its block in turn.
template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads) roi_pool_forward_rows_kernel(
    index_t items, const scalar_t* __restrict__ input, InputView in,
    const scalar_t* __restrict__ rois, index_t num_rois, at::opmath_type<scalar_t> scale,
    index_t pooled_height, index_t pooled_width, scalar_t* __restrict__ output,
    int32_t* __restrict__ argmax) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t lowest = geometry::roi_pool_lowest<acc_t>();
  const int lane = threadIdx.x % kWarp;
  const int32_t width = static_cast<int32_t>(in.width);
  for (int64_t it = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
       it < items; it += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const index_t item = static_cast<index_t>(it);
    const index_t ph = item % pooled_height;
    const index_t kc = item / pooled_height;
    const index_t k = kc % num_rois;
    const int64_t c_begin = static_cast<int64_t>(kc / num_rois) * kRowsChannels;
    const int64_t c_end = std::min<int64_t>(c_begin + kRowsChannels, in.channels);
    const auto box = geometry::roi_pool_box_at(rois, k, scale, in.batch, pooled_height, pooled_width);
    // a bin has at most ceil(bin_w) + 1 columns, and never more than the map's width
    const int64_t span = std::min<int64_t>(
        static_cast<int64_t>(geometry::ceil_of(box.bin_w)) + 1, std::max<int64_t>(in.width, 1));
    const int group = lanes_per_bin(span, pooled_width);
    const int sub = lane % group;  // the lane's place in its group
    const int slot = lane / group;  // the group's bin within a pass
    const int bins_per_pass = kWarp / group;
    const scalar_t* image = input + (box.batch >= 0 ? box.batch * in.s_b : 0);
    // every lane runs every pass and channel (the shuffles need the whole warp)
    for (index_t pw0 = 0; pw0 < pooled_width; pw0 += bins_per_pass) {
      const index_t pw = pw0 + slot;
      int64_t h0 = 0, h1 = 0, w0 = 0, w1 = 0;
      const bool live =
          pw < pooled_width && roi_pool_bin(box, ph, pw, in.height, in.width, h0, h1, w0, w1);
      for (int64_t c = c_begin; c < c_end; ++c) {
        const scalar_t* plane = image + (box.batch >= 0 ? c * in.s_c : 0);
        acc_t best = lowest;
        int32_t best_i = -1;
        if (live) {
          const int32_t hb = static_cast<int32_t>(h0), he = static_cast<int32_t>(h1);
          for (int32_t w = static_cast<int32_t>(w0) + sub; w < w1; w += group) {
            // maximum of column w over the bin's rows, first row on ties
            const scalar_t* p = plane + hb * in.s_h + w * in.s_w;
            acc_t col = lowest;
            int32_t col_h = -1;
#pragma unroll 4
            for (int32_t h = hb; h < he; ++h) {
              const acc_t v = static_cast<acc_t>(p[0]);
              p += in.s_h;
              if (v > col) {
                col = v;
                col_h = h;
              }
            }
            if (col_h >= 0) take_better(col, col_h * width + w, best, best_i);
          }
        }
        for (int offset = group / 2; offset > 0; offset /= 2) {
          const acc_t other = __shfl_xor_sync(kFullMask, best, offset);
          const int32_t other_i = __shfl_xor_sync(kFullMask, best_i, offset);
          take_better(other, other_i, best, best_i);
        }
        if (sub == 0 && pw < pooled_width) {
          const int64_t o =
              ((static_cast<int64_t>(k) * in.channels + c) * pooled_height + ph) * pooled_width + pw;
          output[o] = live ? static_cast<scalar_t>(best) : scalar_t(0);
          if (argmax) argmax[o] = live ? best_i : -1;
        }
      }
    }
  }
}

// Channels kernel (see the file comment): a warp per item (channel group, k, ph), items
// ordered channel group first; lane = channel within the group.
template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads) roi_pool_forward_channels_kernel(
    index_t items, const scalar_t* __restrict__ input, InputView in,
    const scalar_t* __restrict__ rois, index_t num_rois, at::opmath_type<scalar_t> scale,
    index_t pooled_height, index_t pooled_width, scalar_t* __restrict__ output,
    int32_t* __restrict__ argmax) {
  using acc_t = at::opmath_type<scalar_t>;
  const int lane = threadIdx.x % kWarp;
  for (int64_t it = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
       it < items; it += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const index_t item = static_cast<index_t>(it);
    const index_t ph = item % pooled_height;
    const index_t kg = item / pooled_height;
    const index_t k = kg % num_rois;
    const int64_t c = static_cast<int64_t>(kg / num_rois) * kWarp + lane;
    if (c >= in.channels) continue;  // no shuffles below: lanes may leave
    const auto box = geometry::roi_pool_box_at(rois, k, scale, in.batch, pooled_height, pooled_width);
    const scalar_t* plane = input + (box.batch >= 0 ? box.batch * in.s_b + c * in.s_c : 0);
    const int64_t out_row = (static_cast<int64_t>(k) * in.channels + c) * pooled_height + ph;
    scalar_t* out = output + out_row * pooled_width;
    int32_t* arg = argmax ? argmax + out_row * pooled_width : nullptr;
    for (index_t pw = 0; pw < pooled_width; ++pw) {
      int64_t h0, h1, w0, w1;
      if (!roi_pool_bin(box, ph, pw, in.height, in.width, h0, h1, w0, w1)) {
        out[pw] = scalar_t(0);
        if (arg) arg[pw] = -1;
        continue;
      }
      int64_t best_i;
      const acc_t best =
          geometry::roi_pool_max<acc_t>(plane, in.s_h, in.s_w, in.width, h0, h1, w0, w1, best_i);
      out[pw] = static_cast<scalar_t>(best);
      if (arg) arg[pw] = static_cast<int32_t>(best_i);
    }
  }
}

// Blocks of kWarpsPerBlock warps for a warp-per-item grid-stride loop.
unsigned int warp_blocks(int64_t items) {
  const int64_t blocks = cuda::ceil_div(items, kWarpsPerBlock);
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>(blocks, 1 << 30)));
}

template <typename scalar_t, typename index_t>
void launch_forward(
    bool channels_kernel, const at::Tensor& input, const at::Tensor& rois, double spatial_scale,
    int64_t pooled_height, int64_t pooled_width, at::Tensor& output, at::Tensor& argmax,
    cudaStream_t stream) {
  using acc_t = at::opmath_type<scalar_t>;
  const InputView in{
      input.size(0),   input.size(1),   input.size(2),   input.size(3),
      input.stride(0), input.stride(1), input.stride(2), input.stride(3)};
  const int64_t k = rois.size(0);
  const int64_t groups = cuda::ceil_div(in.channels, channels_kernel ? kWarp : kRowsChannels);
  const int64_t items = groups * k * pooled_height;
  const auto kernel = channels_kernel ? roi_pool_forward_channels_kernel<scalar_t, index_t>
                                      : roi_pool_forward_rows_kernel<scalar_t, index_t>;
  kernel<<<warp_blocks(items), kThreads, 0, stream>>>(
      static_cast<index_t>(items), input.const_data_ptr<scalar_t>(), in,
      rois.const_data_ptr<scalar_t>(), static_cast<index_t>(k), static_cast<acc_t>(spatial_scale),
      static_cast<index_t>(pooled_height), static_cast<index_t>(pooled_width),
      output.data_ptr<scalar_t>(), argmax.defined() ? argmax.data_ptr<int32_t>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Flat grad_input index fed by grad_output element i, or -1 (empty bin, invalid batch index,
// argmax out of range).
template <typename scalar_t, typename index_t>
__device__ __forceinline__ int64_t roi_pool_target(
    index_t i, const PooledIndex<index_t>& index, const int32_t* __restrict__ argmax,
    const scalar_t* __restrict__ rois, int64_t batch, int64_t plane_size) {
  using acc_t = at::opmath_type<scalar_t>;
  const int32_t a = argmax[i];
  if (a < 0 || a >= plane_size) return -1;
  const index_t kc = i / (index.pooled_height * index.pooled_width);
  const index_t k = kc / index.channels;
  const index_t c = kc - k * index.channels;
  const int64_t b = geometry::roi_pool_batch_index(static_cast<acc_t>(rois[static_cast<int64_t>(k) * 5]), batch);
  if (b < 0) return -1;
  return (b * index.channels + c) * plane_size + a;
}

// Adds into an accumulator of the op-math type (float32 for float16 / bfloat16 grads), so
// that many contributions to one pixel do not each round to half precision.
template <typename scalar_t, typename index_t, bool kContiguousGrad>
__global__ void __launch_bounds__(kThreads) roi_pool_backward_atomic_kernel(
    index_t total, const scalar_t* __restrict__ grad, PooledIndex<index_t> index,
    const int32_t* __restrict__ argmax, const scalar_t* __restrict__ rois, int64_t batch,
    int64_t plane_size, at::opmath_type<scalar_t>* __restrict__ grad_input) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < total;
       j += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const index_t i = static_cast<index_t>(j);
    const int64_t t = roi_pool_target(i, index, argmax, rois, batch, plane_size);
    if (t < 0) continue;
    const scalar_t g = kContiguousGrad ? grad[i] : grad[index.offset(i)];
    gpuAtomicAdd(grad_input + t, static_cast<acc_t>(g));
  }
}

// keys[i]: the pixel grad_output element i feeds (sentinel for an empty bin); values[i]: the
// element itself, so that the sort carries it along.
template <typename scalar_t, typename key_t>
__global__ void roi_pool_backward_keys_kernel(
    int64_t total, PooledIndex<int64_t> index, const int32_t* __restrict__ argmax,
    const scalar_t* __restrict__ rois, int64_t batch, int64_t plane_size, key_t sentinel,
    const scalar_t* __restrict__ grad, key_t* __restrict__ keys, scalar_t* __restrict__ values) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t t = roi_pool_target(i, index, argmax, rois, batch, plane_size);
    keys[i] = t >= 0 ? static_cast<key_t>(t) : sentinel;
    values[i] = grad[index.offset(i)];
  }
}

// One thread per run of equal keys (at its first position) sums the run's values in sorted
// order.
template <typename scalar_t, typename key_t>
__global__ void roi_pool_backward_segments_kernel(
    int64_t total, const key_t* __restrict__ keys, const scalar_t* __restrict__ values, key_t sentinel,
    scalar_t* __restrict__ grad_input) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < total;
       j += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const key_t key = keys[j];
    if (key == sentinel || (j > 0 && keys[j - 1] == key)) continue;
    acc_t sum = acc_t(0);
    for (int64_t t = j; t < total && keys[t] == key; ++t) sum += static_cast<acc_t>(values[t]);
    grad_input[key] = static_cast<scalar_t>(sum);
  }
}

template <typename scalar_t, typename index_t>
void launch_backward_atomic(
    bool contiguous, int64_t total, const at::Tensor& grad, const at::Tensor& argmax,
    const at::Tensor& rois, int64_t channels, int64_t pooled_height, int64_t pooled_width,
    int64_t batch, int64_t plane_size, at::Tensor& acc, cudaStream_t stream) {
  using acc_t = at::opmath_type<scalar_t>;
  const PooledIndex<index_t> index{
      static_cast<index_t>(channels), static_cast<index_t>(pooled_height),
      static_cast<index_t>(pooled_width), grad.stride(0), grad.stride(1), grad.stride(2),
      grad.stride(3)};
  const auto kernel = contiguous
      ? roi_pool_backward_atomic_kernel<scalar_t, index_t, true>
      : roi_pool_backward_atomic_kernel<scalar_t, index_t, false>;
  kernel<<<cuda::grid_for(total, kThreads), kThreads, 0, stream>>>(
      static_cast<index_t>(total), grad.const_data_ptr<scalar_t>(), index,
      argmax.const_data_ptr<int32_t>(), rois.const_data_ptr<scalar_t>(), batch, plane_size,
      acc.data_ptr<acc_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The forward's kernel for these shapes and layout; roi_kernel() (a test and benchmark
// setting) forces the tile kernel on (kBand) or off (kGather) where it can take the shapes.
// kTiled and kGeneric name roi_align's gathers, which roi_pool does not have: they choose as
// kAuto does.
RoIPoolForwardKernel select_forward(const at::Tensor& input, const RoIPoolShape& s) {
  const RoIKernel choice = roi_kernel();
  if (choice != RoIKernel::kGather && roi_pool_tile_takes(s) &&
      (choice == RoIKernel::kBand || roi_pool_tile_pays(s))) {
    return RoIPoolForwardKernel::kTile;
  }
  if (s.channels > 1 && input.stride(1) == 1) return RoIPoolForwardKernel::kChannels;  // channels_last
  return RoIPoolForwardKernel::kRows;
}

// The backward's kernel: the deterministic one under torch.use_deterministic_algorithms(True),
// else by shapes and roi_kernel() as in select_forward.
RoIPoolBackwardKernel select_backward(const RoIPoolShape& s) {
  if (at::globalContext().deterministicAlgorithms()) return RoIPoolBackwardKernel::kDeterministic;
  const RoIKernel choice = roi_kernel();
  if (choice != RoIKernel::kGather && roi_pool_band_takes(s) &&
      (choice == RoIKernel::kBand || roi_pool_band_pays(s))) {
    return RoIPoolBackwardKernel::kBand;
  }
  return RoIPoolBackwardKernel::kAtomic;
}

// The forward; with_argmax false: the values alone, argmax left undefined (nothing computes
// or stores it).
std::tuple<at::Tensor, at::Tensor> roi_pool_forward_cuda(
    const at::Tensor& input, const at::Tensor& rois_in, double spatial_scale,
    int64_t pooled_height, int64_t pooled_width, bool with_argmax) {
  checks::check_roi_pool_inputs(input, rois_in, spatial_scale, pooled_height, pooled_width);
  checks::check_device("detops.roi_pool", "input", input, at::kCUDA);
  DETOPS_CHECK(
      input.size(2) * input.size(3) <= std::numeric_limits<int32_t>::max(),
      "detops.roi_pool: input must have H * W < 2^31 (argmax is int32), got ",
      checks::shape_str(input));
  c10::cuda::CUDAGuard guard(input.device());
  const int64_t k = rois_in.size(0);
  at::Tensor output = at::empty({k, input.size(1), pooled_height, pooled_width}, input.options());
  at::Tensor argmax;
  if (with_argmax) argmax = at::empty(output.sizes(), input.options().dtype(at::kInt));
  if (output.numel() == 0) return {output, argmax};
  const at::Tensor rois = rois_in.contiguous();
  const RoIPoolShape s{input.size(0), input.size(1), input.size(2), input.size(3),
                       k,             pooled_height, pooled_width,  input.scalar_type()};
  const RoIPoolForwardKernel kernel = select_forward(input, s);
  if (kernel == RoIPoolForwardKernel::kTile) {  // checks the batch indices in its setup
    roi_pool_tile_forward(input, rois, spatial_scale, pooled_height, pooled_width, output, argmax);
    return {output, argmax};
  }
  roi_checks::check_batch_indices_async<RoIPoolCheck>(rois, input.size(0));
  const bool channels_kernel = kernel == RoIPoolForwardKernel::kChannels;
  const int64_t groups =
      cuda::ceil_div(input.size(1), channels_kernel ? kWarp : kRowsChannels);
  const bool narrow = groups * k * pooled_height < std::numeric_limits<int32_t>::max();
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "detops.roi_pool", [&] {
        if (narrow) {
          launch_forward<scalar_t, int32_t>(
              channels_kernel, input, rois, spatial_scale, pooled_height, pooled_width, output,
              argmax, stream);
        } else {
          launch_forward<scalar_t, int64_t>(
              channels_kernel, input, rois, spatial_scale, pooled_height, pooled_width, output,
              argmax, stream);
        }
      });
  return {output, argmax};
}

template <typename scalar_t, typename key_t>
void backward_deterministic(
    int64_t total, const at::Tensor& grad, const PooledIndex<int64_t>& index, const at::Tensor& argmax,
    const at::Tensor& rois, int64_t batch, int64_t plane_size, at::Tensor& grad_input,
    cudaStream_t stream) {
  const auto key_dtype = c10::CppTypeToScalarType<key_t>::value;
  const key_t sentinel = static_cast<key_t>(grad_input.numel());
  // keys and values, then their sorted copies: every element written before it is read
  at::Tensor keys = cuda::empty_written({2, total}, grad.options().dtype(key_dtype));
  at::Tensor values = cuda::empty_written({2, total}, grad.options());
  key_t* const keys_in = keys.data_ptr<key_t>();
  key_t* const keys_out = keys_in + total;
  scalar_t* const values_in = values.data_ptr<scalar_t>();
  scalar_t* const values_out = values_in + total;
  const unsigned int blocks = cuda::grid_for(total, kThreads);
  roi_pool_backward_keys_kernel<scalar_t, key_t><<<blocks, kThreads, 0, stream>>>(
      total, index, argmax.const_data_ptr<int32_t>(), rois.const_data_ptr<scalar_t>(), batch,
      plane_size, sentinel, grad.const_data_ptr<scalar_t>(), keys_in, values_in);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // A stable radix sort over the bits keys up to the sentinel use; the values move as raw
  // bits.
  using bits_t = std::conditional_t<
      sizeof(scalar_t) == 2, uint16_t, std::conditional_t<sizeof(scalar_t) == 4, uint32_t, uint64_t>>;
  static_assert(sizeof(bits_t) == sizeof(scalar_t), "values move as raw bits");
  cuda::sort_pairs(
      keys_in, keys_out, reinterpret_cast<const bits_t*>(values_in), reinterpret_cast<bits_t*>(values_out), total,
      static_cast<uint64_t>(sentinel), grad.device(), stream);
  roi_pool_backward_segments_kernel<scalar_t, key_t><<<blocks, kThreads, 0, stream>>>(
      total, keys_out, values_out, sentinel, grad_input.data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor roi_pool_backward_cuda(
    const at::Tensor& grad, const at::Tensor& rois_in, const at::Tensor& argmax_in,
    double spatial_scale, int64_t pooled_height, int64_t pooled_width, int64_t batch_size,
    int64_t channels, int64_t height, int64_t width) {
  checks::check_roi_pool_backward_inputs(
      grad, rois_in, argmax_in, spatial_scale, pooled_height, pooled_width, batch_size, channels,
      height, width);
  checks::check_device("detops.roi_pool backward", "grad", grad, at::kCUDA);
  c10::cuda::CUDAGuard guard(grad.device());
  const int64_t total = grad.numel();
  if (total == 0 || batch_size * channels * height * width == 0) {
    return at::zeros({batch_size, channels, height, width}, grad.options());
  }
  const RoIPoolShape s{batch_size,    channels,     height,           width, rois_in.size(0),
                       pooled_height, pooled_width, grad.scalar_type()};
  const RoIPoolBackwardKernel kernel = select_backward(s);
  const bool deterministic = kernel == RoIPoolBackwardKernel::kDeterministic;
  const at::Tensor rois = rois_in.contiguous();
  const at::Tensor argmax = argmax_in.contiguous();
  if (kernel == RoIPoolBackwardKernel::kBand) {  // checks the batch indices in its setup
    return roi_pool_band_backward(
        grad, rois, argmax, spatial_scale, pooled_height, pooled_width, batch_size, channels, height, width);
  }
  // float16 / bfloat16 atomics add into a float32 buffer, zeroed instead of grad_input
  const bool wide_acc = !deterministic && (grad.scalar_type() == at::kHalf ||
                                           grad.scalar_type() == at::kBFloat16);
  roi_checks::check_batch_indices_async<RoIPoolBackwardCheck>(rois, batch_size);
  at::Tensor grad_input = wide_acc
      ? at::empty({batch_size, channels, height, width}, grad.options())
      : at::zeros({batch_size, channels, height, width}, grad.options());
  const int64_t plane_size = height * width;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, grad.scalar_type(), "detops.roi_pool_backward", [&] {
        if (deterministic) {
          const PooledIndex<int64_t> index{
              channels, pooled_height, pooled_width, grad.stride(0), grad.stride(1),
              grad.stride(2), grad.stride(3)};
          // int32 keys where the sentinel (numel) fits: fewer bits to sort.
          if (grad_input.numel() < std::numeric_limits<int32_t>::max()) {
            backward_deterministic<scalar_t, int32_t>(
                total, grad, index, argmax, rois, batch_size, plane_size, grad_input, stream);
          } else {
            backward_deterministic<scalar_t, int64_t>(
                total, grad, index, argmax, rois, batch_size, plane_size, grad_input, stream);
          }
          return;
        }
        using acc_t = at::opmath_type<scalar_t>;
        at::Tensor acc = wide_acc ? at::zeros(grad_input.sizes(), grad_input.options().dtype(
                                                                   c10::CppTypeToScalarType<acc_t>::value))
                                  : grad_input;
        const bool contiguous = grad.is_contiguous();
        if (total < std::numeric_limits<int32_t>::max()) {
          launch_backward_atomic<scalar_t, int32_t>(
              contiguous, total, grad, argmax, rois, channels, pooled_height, pooled_width,
              batch_size, plane_size, acc, stream);
        } else {
          launch_backward_atomic<scalar_t, int64_t>(
              contiguous, total, grad, argmax, rois, channels, pooled_height, pooled_width,
              batch_size, plane_size, acc, stream);
        }
        if (wide_acc) grad_input.copy_(acc);
      });
  return grad_input;
}

}  // namespace

TORCH_LIBRARY_IMPL(detops, CUDA, m) {
  m.impl("roi_pool", TORCH_FN(RoIPoolEntries<&roi_pool_forward_cuda>::with_argmax));
  m.impl("_roi_pool_values", TORCH_FN(RoIPoolEntries<&roi_pool_forward_cuda>::values));
  m.impl("_roi_pool_backward", TORCH_FN(roi_pool_backward_cuda));
}

}  // namespace ops
}  // namespace detops
