// RoIPool backward on CUDA through plane bands (plane_band.cuh), for dense RoIs on NCHW maps
// (the forward of dense RoIs is roi_pool_tile.cu).
//
// The atomic backward of roi_pool.cu adds every gradient into grad_input in global memory, so
// the many RoIs of a dense set add to the same pixels through L2 atomics. Here a block per
// (image, band of rows, group of channels) accumulates the bin rows its band owns in shared
// memory:
//   1. roi_pool_owner_kernel keys each bin row (k, ph) by the band holding its first pixel row,
//      image * bands + band; the bin rows of a RoI whose batch index is invalid get the extra
//      key B * bands (they add nothing);
//   2. group_by_owner lists the bin rows of each key (in any order);
//   3. a block adds the gradients of its bin rows at their argmax pixels into a shared-memory
//      band (shared-memory atomics) and writes the band out: rows only it stages are stored,
//      rows two bands stage are added to (zeroed beforehand), so grad_input needs no zeroing.
//      roi_pool_band_tail_kernel then adds, with global atomics, the gradients whose argmax
//      lies outside their block's window (those of bin rows taller than the window reaches).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/Atomic.cuh>
#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "../common/roi_pool_geometry.h"
#include "../detops.h"
#include "cuda_helpers.h"
#include "plane_band.cuh"

namespace detops {
namespace ops {

namespace {

using plane_band::BandPlan;
using plane_band::BandRows;

constexpr int kPoolBandThreads = 512;
constexpr int64_t kPoolBandBudget = 64 * 1024;  // bytes of a staged band: two blocks fit an SM
constexpr int kRowCapacity = 8192;  // bin-row ids a block holds in shared memory
// Shared memory a block holds beside the band: the row ids, plus alignment.
constexpr int64_t kPoolListBytes = kRowCapacity * 4 + 16;

struct PoolShape {
  int64_t batch, channels;
  int height, width, pooled_height, pooled_width;
  int channels_per_block;
};

// keys[k * PH + ph]: the owner of bin row (k, ph), the band of its first pixel row;
// tall[k * PH + ph]: 1 when the bin row reaches past its owner's staged window. Clears the
// stray flag of the backward.
template <typename scalar_t>
__global__ void roi_pool_owner_kernel(
    int64_t total, const scalar_t* __restrict__ rois, at::opmath_type<scalar_t> scale,
    PoolShape sh, BandPlan plan, int32_t* __restrict__ keys, int32_t* __restrict__ tall,
    int32_t* __restrict__ stray) {
  const int32_t invalid_key = static_cast<int32_t>(sh.batch * plan.bands);
  if (blockIdx.x == 0 && threadIdx.x == 0) *stray = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t k = i / sh.pooled_height, ph = i - k * sh.pooled_height;
    const auto box = geometry::roi_pool_box_at(rois, k, scale, sh.batch, sh.pooled_height, sh.pooled_width);
    int64_t h0, h1, w0, w1;
    geometry::roi_pool_bin(box, ph, 0, sh.height, sh.width, h0, h1, w0, w1);
    const int64_t band = std::min<int64_t>(h0, sh.height - 1) / plan.core;
    const int64_t last = std::min<int64_t>(sh.height, band * plan.core + plan.core + plan.overlap);
    keys[i] = box.batch < 0 ? invalid_key : static_cast<int32_t>(box.batch * plan.bands + band);
    tall[i] = box.batch >= 0 && h1 > last ? 1 : 0;
  }
}

// Flat index into grad / argmax of bin (row = k * PH + ph, pw) of channel c.
__device__ __forceinline__ int64_t pooled_index(int32_t row, int64_t c, int pw, const PoolShape& sh) {
  const int64_t k = row / sh.pooled_height, ph = row - k * sh.pooled_height;
  return ((k * sh.channels + c) * sh.pooled_height + ph) * sh.pooled_width + pw;
}

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kPoolBandThreads) roi_pool_band_backward_kernel(
    const scalar_t* __restrict__ grad, const int32_t* __restrict__ argmax,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ rows,
    const int32_t* __restrict__ tall, int32_t* __restrict__ stray, PoolShape sh, BandPlan plan,
    int64_t list_offset, acc_t* __restrict__ grad_input) {
  extern __shared__ __align__(16) unsigned char smem[];
  acc_t* band = reinterpret_cast<acc_t*>(smem);
  int32_t* row_ids = reinterpret_cast<int32_t*>(smem + list_offset);
  const int64_t key = blockIdx.x;  // the key of invalid RoIs has no block: they add nothing
  const int bi = static_cast<int>(key % plan.bands);
  const int64_t b = key / plan.bands;
  const int32_t first_row = offsets[key];
  const int n = offsets[key + 1] - first_row;
  const BandRows window = plane_band::band_rows(plan, bi, sh.height);
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * sh.channels_per_block;
  const int nc = static_cast<int>(min(sh.channels - c0, static_cast<int64_t>(sh.channels_per_block)));
  const int pw_n = sh.pooled_width, width = sh.width;
  const int64_t plane_size = static_cast<int64_t>(sh.height) * width;
  const int staged = (window.last - window.first) * plan.stride;
  const bool ids_in_smem = n <= kRowCapacity;
  if (ids_in_smem) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) row_ids[i] = rows[first_row + i];
  }
  const int32_t* ids = ids_in_smem ? row_ids : rows + first_row;
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int ci = 0; ci < nc; ++ci) {
    const int64_t c = c0 + ci;
    __syncthreads();  // the ids are written; the previous channel's band is written out
    for (int i = threadIdx.x; i < staged; i += blockDim.x) band[i] = acc_t(0);
    __syncthreads();
    // kItems items per thread and round, their loads issued before any of their atomics
    constexpr int kItems = 4;
    const int items = n * pw_n;
    for (int base = threadIdx.x; base < items; base += kItems * blockDim.x) {
      int32_t a[kItems], row[kItems];
      acc_t g[kItems];
#pragma unroll
      for (int u = 0; u < kItems; ++u) {
        const int i = base + u * blockDim.x;
        a[u] = -1;
        g[u] = acc_t(0);
        if (i < items) {
          const int e = i / pw_n, pw = i - e * pw_n;
          row[u] = ids[e];
          const int64_t o = pooled_index(row[u], c, pw, sh);
          a[u] = argmax[o];
          g[u] = static_cast<acc_t>(grad[o]);
        }
      }
#pragma unroll
      for (int u = 0; u < kItems; ++u) {
        if (a[u] < 0 || a[u] >= plane_size || g[u] == acc_t(0)) continue;
        const int32_t y = a[u] / width;
        if (y < window.first || y >= window.last) {
          // left to the tail kernel, which visits tall bin rows, or every row once flagged
          if (!tall[row[u]]) *stray = 1;
          continue;
        }
        atomicAdd(band + (y - window.first) * plan.stride + (a[u] - y * width), g[u]);
      }
    }
    __syncthreads();
    acc_t* out = grad_input + (b * sh.channels + c) * plane_size;
    for (int r = window.first + static_cast<int>(threadIdx.x / 32); r < window.last; r += warps) {
      const acc_t* src = band + (r - window.first) * plan.stride;
      acc_t* dst = out + static_cast<int64_t>(r) * width;
      if (plane_band::shared_row(plan, bi, r)) {
        for (int x = lane; x < width; x += 32) {
          if (src[x] != acc_t(0)) gpuAtomicAdd(dst + x, src[x]);
        }
      } else {
        for (int x = lane; x < width; x += 32) dst[x] = src[x];
      }
    }
  }
}

// After the band kernel: the gradients whose argmax pixel lies outside the window of their bin
// row's owner, with global atomics. One thread per (bin row, channel); only tall bin rows can
// hold such pixels (their argmax lies in the bin), unless the band kernel met an argmax outside
// its bin row's window (an argmax not made by the forward), which sets *stray.
template <typename scalar_t, typename acc_t>
__global__ void roi_pool_band_tail_kernel(
    const scalar_t* __restrict__ grad, const int32_t* __restrict__ argmax,
    const int32_t* __restrict__ keys, const int32_t* __restrict__ tall,
    const int32_t* __restrict__ stray, int64_t num_rows, PoolShape sh, BandPlan plan,
    acc_t* __restrict__ grad_input) {
  const int64_t plane_size = static_cast<int64_t>(sh.height) * sh.width;
  const int64_t invalid_key = sh.batch * plan.bands;
  const int64_t total = num_rows * sh.channels;
  const bool all_rows = *stray != 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t j = i / sh.channels, c = i - j * sh.channels;
    if (!all_rows && !tall[j]) continue;
    const int32_t key = keys[j];
    if (key == invalid_key) continue;
    const BandRows window = plane_band::band_rows(plan, key % plan.bands, sh.height);
    const int64_t b = key / plan.bands;
    acc_t* plane = grad_input + (b * sh.channels + c) * plane_size;
    for (int pw = 0; pw < sh.pooled_width; ++pw) {
      const int64_t o = pooled_index(static_cast<int32_t>(j), c, pw, sh);
      const int32_t a = argmax[o];
      if (a < 0 || a >= plane_size) continue;
      const int32_t y = a / sh.width;
      if (y >= window.first && y < window.last) continue;  // added by the band kernel
      const acc_t g = static_cast<acc_t>(grad[o]);
      if (g != acc_t(0)) gpuAtomicAdd(plane + a, g);
    }
  }
}

// Whether the band kernels take these shapes (on top of roi_kernel()). Under kAuto they run
// when the bins are dense on the map (see BENCHMARKS.md for the measurements behind the
// thresholds).
bool pool_band_applies(
    int64_t batch, int64_t channels, int64_t height, int64_t width,
    int64_t num_rois, int64_t pooled_height, int64_t pooled_width, int64_t elem_bytes,
    bool input_nchw) {
  const RoIKernel choice = roi_kernel();
  if (choice == RoIKernel::kGather || !input_nchw) return false;
  if (num_rois <= 0 || channels <= 0 || height <= 0 || width <= 0) return false;
  if (height * width >= (int64_t{1} << 31) || num_rois * pooled_height >= (int64_t{1} << 30)) return false;
  const BandPlan plan = plane_band::plan_bands(height, width, elem_bytes, plane_band::band_budget(kPoolBandBudget, kPoolListBytes));
  if (!plan.ok || batch * plan.bands >= (int64_t{1} << 30)) return false;
  if (choice == RoIKernel::kBand) return true;
  const double bins = static_cast<double>(num_rois) * pooled_height * pooled_width;
  const double pixels = static_cast<double>(batch) * height * width;
  return 8.0 * bins >= pixels;
}

// Bin rows keyed and grouped by owner, and the launch shape.
struct PoolSetup {
  BandPlan plan;
  PoolShape shape;
  at::Tensor index;  // keys, rows, offsets, counts, tall, stray (int32)
  int64_t rows_total = 0, num_keys = 0;
  int64_t groups = 1;
  int32_t* keys() const { return index.data_ptr<int32_t>(); }
  int32_t* rows() const { return keys() + rows_total; }
  int32_t* offsets() const { return rows() + rows_total; }
  int32_t* counts() const { return offsets() + num_keys + 1; }
  int32_t* tall() const { return counts() + num_keys + 1; }
  int32_t* stray() const { return tall() + rows_total; }
};

template <typename scalar_t>
PoolSetup setup_pool_bands(
    const at::Tensor& rois, int64_t batch, int64_t channels, int64_t height, int64_t width,
    int64_t pooled_height, int64_t pooled_width, double spatial_scale, int64_t elem_bytes,
    cudaStream_t stream) {
  using acc_t = at::opmath_type<scalar_t>;
  PoolSetup s;
  s.plan = plane_band::plan_bands(height, width, elem_bytes, plane_band::band_budget(kPoolBandBudget, kPoolListBytes));
  s.rows_total = rois.size(0) * pooled_height;
  s.num_keys = batch * s.plan.bands + 1;  // the last: RoIs with an invalid batch index
  s.index = at::empty({3 * s.rows_total + 2 * (s.num_keys + 1) + 1}, rois.options().dtype(at::kInt));
  // Channel groups: about four blocks per block slot of the GPU, so that a slow block (a band
  // with many bin rows) does not leave the GPU idle at the end.
  const int64_t slots = 2 * static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  s.groups = std::max<int64_t>(
      1, std::min<int64_t>({channels, cuda::ceil_div(4 * slots, batch * s.plan.bands), 65535}));
  const int64_t per_block = cuda::ceil_div(channels, s.groups);
  s.groups = cuda::ceil_div(channels, per_block);
  s.shape = PoolShape{batch, channels, static_cast<int>(height), static_cast<int>(width),
                      static_cast<int>(pooled_height), static_cast<int>(pooled_width),
                      static_cast<int>(per_block)};
  roi_pool_owner_kernel<scalar_t><<<cuda::grid_for(s.rows_total, 256), 256, 0, stream>>>(
      s.rows_total, rois.const_data_ptr<scalar_t>(), static_cast<acc_t>(spatial_scale), s.shape,
      s.plan, s.keys(), s.tall(), s.stray());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  plane_band::group_by_owner<int32_t>(
      s.keys(), s.rows_total, s.num_keys, s.counts(), s.offsets(), s.rows(), 0, /*in_order=*/false, stream);
  return s;
}

}  // namespace

at::Tensor roi_pool_backward_band(
    const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax,
    double spatial_scale, int64_t pooled_height, int64_t pooled_width, int64_t batch,
    int64_t channels, int64_t height, int64_t width) {
  const auto acc_type = grad.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (!pool_band_applies(batch, channels, height, width, rois.size(0), pooled_height,
                         pooled_width, c10::elementSize(acc_type), true)) {
    return at::Tensor();
  }
  at::Tensor grad_input = at::empty({batch, channels, height, width}, grad.options().dtype(acc_type));
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor g = grad.contiguous();
  const at::Tensor am = argmax.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "detops.roi_pool backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    TORCH_INTERNAL_ASSERT(grad_input.scalar_type() == c10::CppTypeToScalarType<acc_t>::value);
    const PoolSetup s = setup_pool_bands<scalar_t>(
        rois, batch, channels, height, width, pooled_height, pooled_width, spatial_scale,
        sizeof(acc_t), stream);
    plane_band::zero_shared_rows(grad_input.data_ptr<acc_t>(), batch * channels, height, width, s.plan, stream);
    const int64_t list_offset = cuda::round_up(s.plan.smem_bytes, 16);
    const int64_t smem = list_offset + kRowCapacity * static_cast<int64_t>(sizeof(int32_t));
    auto kernel = roi_pool_band_backward_kernel<scalar_t, acc_t>;
    plane_band::allow_smem(kernel, smem);
    const dim3 grid(static_cast<unsigned>(s.num_keys - 1), static_cast<unsigned>(s.groups));
    kernel<<<grid, kPoolBandThreads, static_cast<size_t>(smem), stream>>>(
        g.const_data_ptr<scalar_t>(), am.const_data_ptr<int32_t>(), s.offsets(), s.rows(), s.tall(),
        s.stray(), s.shape, s.plan, list_offset, grad_input.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t tail_items = s.rows_total * channels;
    roi_pool_band_tail_kernel<scalar_t, acc_t><<<cuda::grid_for(tail_items, 256), 256, 0, stream>>>(
        g.const_data_ptr<scalar_t>(), am.const_data_ptr<int32_t>(), s.keys(), s.tall(), s.stray(),
        s.rows_total, s.shape, s.plan, grad_input.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_input;
}

}  // namespace ops
}  // namespace detops
