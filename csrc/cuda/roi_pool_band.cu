// RoIPool backward on CUDA through plane bands (plane_band.cuh), for dense RoIs on NCHW maps
// (the forward of dense RoIs is roi_pool_tile.cu).
//
// The atomic backward of roi_pool.cu adds every gradient into grad_input in global memory, so
// the many RoIs of a dense set add to the same pixels through L2 atomics. Here a block per
// (image, band of rows, group of channels) adds the gradients of the bin rows that reach its
// band into the band, held in shared memory, and writes the band out:
//   1. roi_pool_owner_kernel keys each bin row (k, ph) by the first band its pixel rows touch,
//      image * bands + band, and counts the bands they touch (its span); the bin rows of a RoI
//      whose batch index is invalid get the extra key B * bands (they add nothing);
//   2. group_by_owner lists each bin row under every band of its span (in any order), as
//      (k << kRowShift) | ph, so that the blocks find a gradient's place without a division;
//   3. a block adds, for each channel of its group, the gradients of its listed bin rows whose
//      argmax pixel lies in its band, with shared-memory atomics, then stores the band in
//      grad's dtype (accumulated in float32, or float64 for float64). The bands do not
//      overlap and cover the map, so every pixel of grad_input is stored once: no zeroing, no
//      global atomics, no float32 buffer for 16-bit gradients. Band rows are not padded, so an
//      argmax pixel a sits at a - band.first * W in the band.
// The forward's argmax lies in its bin, so in the bin row's bands. The op takes any argmax in
// [-1, H * W), though: a block that meets one outside its bin row's bands (an argmax not made
// by the forward) sets a flag, and roi_pool_band_stray_kernel, which runs after and returns at
// once without it, then adds those gradients with global atomics.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/Atomic.cuh>
#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "../common/roi_pool_geometry.h"
#include "cuda_helpers.h"
#include "plane_band.cuh"
#include "roi_checks.cuh"
#include "roi_pool_kernels.cuh"

namespace detops {
namespace ops {

namespace {

using plane_band::BandPlan;
using plane_band::BandRows;
using plane_band::ListWalk;

constexpr int kPoolBandThreads = 512;
constexpr int64_t kPoolBandBudget = 64 * 1024;  // bytes of a band
// List entries a block holds in shared memory beside its band (a longer list is read from
// global memory): 8192, two blocks an SM; for 16-bit gradients 2048, three blocks an SM, which
// pays for them (their band stores are half the bytes) but not for float32 ones.
template <typename scalar_t>
constexpr int kRowCapacity = sizeof(scalar_t) == 2 ? 2048 : 8192;
template <typename scalar_t>
constexpr int kPoolMinBlocks = sizeof(scalar_t) == 2 ? 3 : 1;  // launch bounds: blocks an SM
// Shared memory the band's plan leaves beside it: the most list entries.
constexpr int64_t kPoolListBytes = kRowCapacity<float> * 4;
constexpr int kMaxBands = 255;  // spans are bytes
constexpr int32_t kRowMask = (1 << plane_band::kRowShift) - 1;
// RoIs a list entry holds: k < 2^24, so that (k << kRowShift) | ph stays below the marks' bits
constexpr int32_t kRoIMask = (1 << (30 - plane_band::kRowShift)) - 1;

struct PoolShape {
  int64_t batch, channels;
  int height, width, pooled_height, pooled_width;
  int channels_per_block;
};

// Bands without overlap for the backward: as many rows of acc_bytes elements as fit the
// budget, the map's rows split evenly over the fewest bands that hold them. Not ok where fewer
// than 16 rows fit (and the map is taller), there would be more than kMaxBands bands, or the
// lists (up to bin_rows * bands entries) would overflow int32.
BandPlan pool_plan(int64_t batch, int64_t height, int64_t width, int64_t acc_bytes, int64_t bin_rows) {
  BandPlan p;
  if (height <= 0 || width <= 0 || height * width >= (int64_t{1} << 31)) return p;
  const int64_t budget = plane_band::band_budget(kPoolBandBudget, kPoolListBytes);
  const int64_t fit = budget / (width * acc_bytes);
  if (fit < std::min<int64_t>(16, height)) return p;
  const int64_t core = cuda::ceil_div(height, cuda::ceil_div(height, std::min(fit, height)));
  p.core = static_cast<int>(core);
  p.overlap = 0;
  p.bands = static_cast<int>(cuda::ceil_div(height, core));
  p.stride = static_cast<int>(width);
  p.smem_bytes = cuda::round_up(core * width * acc_bytes, 16);
  p.ok = p.bands <= kMaxBands && batch * p.bands < (int64_t{1} << 30) &&
      bin_rows * p.bands < std::numeric_limits<int32_t>::max();
  return p;
}

// keys[k * PH + ph]: the first band bin row (k, ph)'s pixel rows touch (image * bands + band);
// spans[k * PH + ph]: how many bands they touch. Clears the stray flag of the backward, and
// checks each RoI's batch index (at its row ph = 0), as roi_checks::check_batch_indices_async
// would in a launch of its own.
template <typename scalar_t>
__global__ void roi_pool_owner_kernel(
    int64_t total, const scalar_t* __restrict__ rois, at::opmath_type<scalar_t> scale,
    PoolShape sh, BandPlan plan, int32_t* __restrict__ keys, uint8_t* __restrict__ spans,
    int32_t* __restrict__ stray) {
  const int32_t invalid_key = static_cast<int32_t>(sh.batch * plan.bands);
  if (blockIdx.x == 0 && threadIdx.x == 0) *stray = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t k = i / sh.pooled_height, ph = i - k * sh.pooled_height;
    if (ph == 0) {
      roi_checks::assert_batch_index<RoIPoolBackwardCheck>(static_cast<double>(rois[k * 5]), sh.batch);
    }
    const auto box = geometry::roi_pool_box_at(rois, k, scale, sh.batch, sh.pooled_height, sh.pooled_width);
    int64_t h0, h1, w0, w1;
    geometry::roi_pool_bin(box, ph, 0, sh.height, sh.width, h0, h1, w0, w1);
    const int64_t first = std::min<int64_t>(h0, sh.height - 1) / plan.core;
    const int64_t last = std::max<int64_t>(first, (std::max<int64_t>(h1, h0 + 1) - 1) / plan.core);
    const bool valid = box.batch >= 0;
    keys[i] = valid ? static_cast<int32_t>(box.batch * plan.bands + first) : invalid_key;
    spans[i] = static_cast<uint8_t>(valid ? std::min<int64_t>(last, plan.bands - 1) - first + 1 : 1);
  }
}

// Flat index into grad / argmax of bin (row = k * PH + ph, pw) of channel c.
__device__ __forceinline__ int64_t pooled_index(int64_t row, int64_t c, int pw, const PoolShape& sh) {
  const int64_t k = row / sh.pooled_height, ph = row - k * sh.pooled_height;
  return ((k * sh.channels + c) * sh.pooled_height + ph) * sh.pooled_width + pw;
}

// The pixels [first, end) of the bands a bin row is listed under: `span` bands from the band
// of its key.
__device__ __forceinline__ void span_pixels(
    int32_t key, int span, const PoolShape& sh, const BandPlan& plan, int32_t& first, int32_t& end) {
  const int band = key % plan.bands;
  first = band * plan.core * sh.width;
  end = min(sh.height, (band + span) * plan.core) * sh.width;
}

// One block per (image, band, group of channels): see the top of the file. kItems items per
// thread and round, their loads issued before any of their atomics. List entries are
// (k << kRowShift) | ph with the marks of group_by_owner's mark_ends.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kPoolBandThreads, kPoolMinBlocks<scalar_t>) roi_pool_band_backward_kernel(
    const scalar_t* __restrict__ grad, const int32_t* __restrict__ argmax,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ rows, PoolShape sh,
    BandPlan plan, scalar_t* __restrict__ grad_input, int32_t* __restrict__ stray) {
  constexpr int kItems = 4;
  extern __shared__ __align__(16) unsigned char smem[];
  acc_t* band = reinterpret_cast<acc_t*>(smem);
  int32_t* row_ids = reinterpret_cast<int32_t*>(smem + plan.smem_bytes);
  const int32_t key = static_cast<int32_t>(blockIdx.x);  // invalid RoIs' key has no block
  const int bi = key % plan.bands;
  const int64_t b = key / plan.bands;
  const int32_t first_row = offsets[key];
  const int n = offsets[key + 1] - first_row;
  const BandRows window = plane_band::band_rows(plan, bi, sh.height);
  const int32_t lo = window.first * sh.width;  // the band's first pixel
  const uint32_t count = static_cast<uint32_t>((window.last - window.first) * sh.width);  // its pixels
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * sh.channels_per_block;
  const int nc = static_cast<int>(min(sh.channels - c0, static_cast<int64_t>(sh.channels_per_block)));
  const int pw_n = sh.pooled_width;
  const int64_t plane_size = static_cast<int64_t>(sh.height) * sh.width;
  const int64_t bins = static_cast<int64_t>(sh.pooled_height) * pw_n;  // a channel's bins
  const int64_t roi_bins = sh.channels * bins;                        // a RoI's
  const bool ids_in_smem = n <= kRowCapacity<scalar_t>;
  if (ids_in_smem) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) row_ids[i] = rows[first_row + i];
  }
  uint4* const band16 = reinterpret_cast<uint4*>(smem);
  const int band_vectors = static_cast<int>(plan.smem_bytes / 16);
  for (int i = threadIdx.x; i < band_vectors; i += blockDim.x) band16[i] = make_uint4(0, 0, 0, 0);
  for (int ci = 0; ci < nc; ++ci) {
    const int64_t c = c0 + ci;
    __syncthreads();  // the ids are written, the band is zero
    const scalar_t* grad_c = grad + c * bins;
    const int32_t* argmax_c = argmax + c * bins;
    // the list from shared memory where it fits (one walk each way, so that the first reads
    // shared memory, not through generic addresses)
    auto add_items = [&](const int32_t* __restrict__ ids) {
      for (ListWalk w(pw_n); w.e < n;) {
        int32_t a[kItems], entry[kItems];
        acc_t g[kItems];
#pragma unroll
        for (int u = 0; u < kItems; ++u) {
          a[u] = -1;
          g[u] = acc_t(0);
          entry[u] = 0;
          if (w.e < n) {
            entry[u] = ids[w.e];
            const int64_t k = (entry[u] >> plane_band::kRowShift) & kRoIMask;
            const int64_t o = k * roi_bins + (entry[u] & kRowMask) * pw_n + w.pw;
            a[u] = argmax_c[o];
            g[u] = static_cast<acc_t>(grad_c[o]);
          }
          w.next(pw_n);
        }
#pragma unroll
        for (int u = 0; u < kItems; ++u) {
          if (g[u] == acc_t(0)) continue;
          const uint32_t at = static_cast<uint32_t>(a[u] - lo);
          if (at < count) {
            atomicAdd(band + at, g[u]);
          } else if (a[u] >= 0 && a[u] < plane_size &&
                     (entry[u] & (a[u] < lo ? plane_band::kListedBefore : plane_band::kListedAfter)) == 0) {
            *stray = 1;  // no band of the bin row holds the pixel: left to the stray kernel
          }
        }
      }
    };
    if (ids_in_smem) {
      add_items(row_ids);
    } else {
      add_items(rows + first_row);
    }
    __syncthreads();
    // the band out in grad's dtype, zeroed again for the next channel
    scalar_t* out = grad_input + (b * sh.channels + c) * plane_size + lo;
    bool stored = false;
    if constexpr (sizeof(acc_t) == 4) {
      if (count % 4 == 0 && reinterpret_cast<uintptr_t>(out) % (4 * sizeof(scalar_t)) == 0) {
        struct alignas(4 * sizeof(scalar_t)) Pack {
          scalar_t v[4];
        };
        float4* src = reinterpret_cast<float4*>(band);
        Pack* dst = reinterpret_cast<Pack*>(out);
        for (uint32_t i = threadIdx.x; i < count / 4; i += blockDim.x) {
          const float4 v = src[i];
          src[i] = make_float4(0.f, 0.f, 0.f, 0.f);
          dst[i] = Pack{{static_cast<scalar_t>(v.x), static_cast<scalar_t>(v.y), static_cast<scalar_t>(v.z),
                         static_cast<scalar_t>(v.w)}};
        }
        stored = true;
      }
    }
    if (!stored) {
      for (uint32_t i = threadIdx.x; i < count; i += blockDim.x) {
        out[i] = static_cast<scalar_t>(band[i]);
        band[i] = acc_t(0);
      }
    }
  }
}

// After the band kernel, only where it set *stray: the gradients whose argmax pixel lies
// outside the bands of their bin row, with global atomics. One thread per (bin row, channel).
template <typename scalar_t>
__global__ void roi_pool_band_stray_kernel(
    const scalar_t* __restrict__ grad, const int32_t* __restrict__ argmax,
    const int32_t* __restrict__ keys, const uint8_t* __restrict__ spans,
    const int32_t* __restrict__ stray, int64_t num_rows, PoolShape sh, BandPlan plan,
    scalar_t* __restrict__ grad_input) {
  if (*stray == 0) return;
  const int64_t plane_size = static_cast<int64_t>(sh.height) * sh.width;
  const int32_t invalid_key = static_cast<int32_t>(sh.batch * plan.bands);
  const int64_t total = num_rows * sh.channels;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t j = i / sh.channels, c = i - j * sh.channels;
    const int32_t key = keys[j];
    if (key == invalid_key) continue;
    int32_t first, end;
    span_pixels(key, spans[j], sh, plan, first, end);
    scalar_t* plane = grad_input + (key / plan.bands * sh.channels + c) * plane_size;
    for (int pw = 0; pw < sh.pooled_width; ++pw) {
      const int64_t o = pooled_index(j, c, pw, sh);
      const int32_t a = argmax[o];
      if (a < 0 || a >= plane_size || (a >= first && a < end)) continue;  // none, or a band's
      const scalar_t g = grad[o];
      if (g != scalar_t(0)) gpuAtomicAdd(plane + a, g);
    }
  }
}

// Bin rows keyed and listed by band, and the launch shape.
struct PoolSetup {
  BandPlan plan;
  PoolShape shape;
  at::Tensor index;  // keys, rows, offsets, counts, stray (int32), spans (bytes)
  int64_t rows_total = 0, listed_cap = 0, num_keys = 0;
  int64_t groups = 1;
  size_t smem = 0;
  int32_t* keys() const { return index.data_ptr<int32_t>(); }
  int32_t* rows() const { return keys() + rows_total; }
  int32_t* offsets() const { return rows() + listed_cap; }
  int32_t* counts() const { return offsets() + num_keys + 1; }
  int32_t* stray() const { return counts() + num_keys + 1; }
  uint8_t* spans() const { return reinterpret_cast<uint8_t*>(stray() + 1); }
};

template <typename scalar_t>
PoolSetup setup_pool_bands(
    const at::Tensor& rois, int64_t batch, int64_t channels, int64_t height, int64_t width,
    int64_t pooled_height, int64_t pooled_width, double spatial_scale, int64_t acc_bytes,
    cudaStream_t stream) {
  using acc_t = at::opmath_type<scalar_t>;
  PoolSetup s;
  s.rows_total = rois.size(0) * pooled_height;
  s.plan = pool_plan(batch, height, width, acc_bytes, s.rows_total);
  s.listed_cap = s.rows_total * s.plan.bands;
  s.num_keys = batch * s.plan.bands + 1;  // the last: RoIs with an invalid batch index
  const int64_t ints = s.rows_total + s.listed_cap + 2 * (s.num_keys + 1) + 1;
  s.index = at::empty({ints + cuda::ceil_div(s.rows_total, 4)}, rois.options().dtype(at::kInt));
  s.smem = static_cast<size_t>(s.plan.smem_bytes + 4 * kRowCapacity<scalar_t>);
  // Channel groups: about four blocks per block slot of the GPU, so that a slow block (a band
  // with many bin rows) does not leave the GPU idle at the end.
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int64_t per_sm = std::max<int64_t>(
      1, static_cast<int64_t>(props->sharedMemPerMultiprocessor) / static_cast<int64_t>(s.smem + 1024));
  const int64_t slots = per_sm * props->multiProcessorCount;
  s.groups = std::max<int64_t>(
      1, std::min<int64_t>({channels, cuda::ceil_div(4 * slots, batch * s.plan.bands), 65535}));
  const int64_t per_block = cuda::ceil_div(channels, s.groups);
  s.groups = cuda::ceil_div(channels, per_block);
  s.shape = PoolShape{batch, channels, static_cast<int>(height), static_cast<int>(width),
                      static_cast<int>(pooled_height), static_cast<int>(pooled_width),
                      static_cast<int>(per_block)};
  roi_pool_owner_kernel<scalar_t><<<cuda::grid_for(s.rows_total, 256), 256, 0, stream>>>(
      s.rows_total, rois.const_data_ptr<scalar_t>(), static_cast<acc_t>(spatial_scale), s.shape,
      s.plan, s.keys(), s.spans(), s.stray());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  plane_band::group_by_owner<int32_t>(
      s.keys(), s.rows_total, s.num_keys, s.counts(), s.offsets(), s.rows(),
      static_cast<int>(pooled_height), /*in_order=*/false, stream, s.spans(), /*mark_ends=*/true);
  return s;
}

}  // namespace

bool roi_pool_band_takes(const RoIPoolShape& s) {
  if (s.num_rois <= 0 || s.channels <= 0 || s.height <= 0 || s.width <= 0) return false;
  // list entries (k << kRowShift) | ph
  if (s.pooled_height > kRowMask + 1 || s.num_rois > kRoIMask) return false;
  const int64_t acc_bytes = s.dtype == at::kDouble ? 8 : 4;
  return pool_plan(s.batch, s.height, s.width, acc_bytes, s.num_rois * s.pooled_height).ok;
}

// The band backward beats the atomic one when the bins are dense on the map: at least one bin
// per 8 pixels.
bool roi_pool_band_pays(const RoIPoolShape& s) {
  const double bins = static_cast<double>(s.num_rois) * s.pooled_height * s.pooled_width;
  const double pixels = static_cast<double>(s.batch) * s.height * s.width;
  return 8.0 * bins >= pixels;
}

at::Tensor roi_pool_band_backward(
    const at::Tensor& grad, const at::Tensor& rois, const at::Tensor& argmax, double spatial_scale,
    int64_t pooled_height, int64_t pooled_width, int64_t batch, int64_t channels, int64_t height,
    int64_t width) {
  at::Tensor grad_input = at::empty({batch, channels, height, width}, grad.options());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor g = grad.contiguous();
  const at::Tensor am = argmax.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "detops.roi_pool backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const PoolSetup s = setup_pool_bands<scalar_t>(
        rois, batch, channels, height, width, pooled_height, pooled_width, spatial_scale,
        sizeof(acc_t), stream);
    const dim3 grid(static_cast<unsigned>(s.num_keys - 1), static_cast<unsigned>(s.groups));
    auto kernel = roi_pool_band_backward_kernel<scalar_t, acc_t>;
    plane_band::allow_smem(kernel, static_cast<int64_t>(s.smem));
    kernel<<<grid, kPoolBandThreads, s.smem, stream>>>(
        g.const_data_ptr<scalar_t>(), am.const_data_ptr<int32_t>(), s.offsets(), s.rows(), s.shape,
        s.plan, grad_input.data_ptr<scalar_t>(), s.stray());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t stray_items = s.rows_total * channels;
    const int64_t stray_blocks = std::min<int64_t>(
        cuda::ceil_div(stray_items, 256), at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
    roi_pool_band_stray_kernel<scalar_t><<<static_cast<unsigned>(stray_blocks), 256, 0, stream>>>(
        g.const_data_ptr<scalar_t>(), am.const_data_ptr<int32_t>(), s.keys(), s.spans(), s.stray(),
        s.rows_total, s.shape, s.plan, grad_input.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_input;
}

}  // namespace ops
}  // namespace detops
