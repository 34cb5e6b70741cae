// Deterministic RoIAlign backward on CUDA: a gather over pixel-sorted contribution lists, with
// the gradient of each image's RoIs staged in shared memory one channel group at a time.
//
// The contributions of bilinear sampling (pixel, source bin, weight) do not depend on the
// channel. They are listed once:
//   1. RoIs are ranked within their image (a stable sort by batch index, so ranks follow the
//      RoI order); rank r falls in chunk r / rois_per_chunk at slot r % rois_per_chunk.
//   2. one thread per (RoI, bin) writes the bin's contributions: the key
//      (image, chunk, pixel) and the entry (slot * bins + bin, weight);
//   3. a stable sort by key groups each pixel's contributions per chunk, in list order (RoI
//      index, then bin, then sample), and searchsorted finds each (image, chunk, pixel) segment.
// Then one block per (image, group of G channels), for each chunk of the image's RoIs in turn:
// copies grad[RoIs of the chunk, channels of the group, :, :] into shared memory (coalesced
// runs of a RoI's bins), and each thread, owning pixels p = tid, tid + blockDim, ..., sums its
// pixel's entries in list order for the G channels. Every grad_input element is written once,
// with plain stores of consecutive pixels; no zeroing, no atomics. An image whose RoIs span
// several chunks carries the running sums between chunks in an acc_t buffer, so the additions
// are the same, in the same order, as one pass over the whole list.
// Bit-identical from run to run. Shapes it does not fit (a bin row too wide for shared memory,
// huge key ranges) return false, and the caller runs the general sort-based path.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>

#include "../common/checks.h"
#include "../common/roi_align_geometry.h"
#include "cuda_helpers.h"
#include "roi_align_rois.cuh"

namespace detops {
namespace ops {

namespace {

constexpr const char* kOp = "detops._roi_align_backward";
constexpr int kRankThreads = 256;
constexpr int kGatherThreads = 1024;
// Segment tables longer than this (B * chunks * H * W + 1 entries) are left to the general path.
constexpr int64_t kMaxSegments = int64_t{1} << 28;
// Contribution lists longer than this are left to the general path.
constexpr int64_t kMaxEntries = int64_t{1} << 31;

using roi_align::BilinearSample;
using roi_align::RoIBins;

// One contribution: the slot of its source bin in the staged chunk, and its weight
// (bilinear weight / samples per bin).
template <typename acc_t>
struct alignas(8) DetEntry {
  int32_t src;
  acc_t w;
};

using roi_align_cuda::bins_of;

// The image of each RoI, or `batch` for a RoI whose batch index is not valid.
template <typename acc_t>
__global__ void det_image_kernel(
    int64_t num_rois, const acc_t* __restrict__ rois, int64_t batch, int64_t* __restrict__ image) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < num_rois;
       k += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t b = roi_align::roi_batch_index(rois[k * 5], batch);
    image[k] = b < 0 ? batch : b;
  }
}

// rank[order[i]] = i - starts[sorted_image[i]]: the RoI's position among its image's RoIs.
__global__ void det_rank_kernel(
    int64_t num_rois, const int64_t* __restrict__ order, const int64_t* __restrict__ sorted_image,
    const int64_t* __restrict__ starts, int64_t* __restrict__ rank) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_rois;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    rank[order[i]] = i - starts[sorted_image[i]];
  }
}

// One thread per (RoI, bin): the bin's contributions at first[k] + bin * grid_h * grid_w * 4
// (first == nullptr: at k * per_roi, padded with sentinel keys for samples that read nothing).
template <typename key_t, typename acc_t>
__global__ void det_contribution_kernel(
    int64_t total_bins, const acc_t* __restrict__ rois, int64_t batch, int64_t height,
    int64_t width, int64_t pooled_height, int64_t pooled_width, acc_t scale,
    int64_t sampling_ratio, bool aligned, const int64_t* __restrict__ first, int64_t per_roi,
    const int64_t* __restrict__ rank, int64_t rois_per_chunk, int64_t max_chunks,
    key_t* __restrict__ keys, DetEntry<acc_t>* __restrict__ entries) {
  const int64_t plane = height * width;
  const key_t sentinel = static_cast<key_t>(batch * max_chunks * plane);
  const int64_t bins = pooled_height * pooled_width;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       idx < total_bins; idx += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t bin = idx % bins;
    const int64_t k = idx / bins;
    const acc_t* roi = rois + k * 5;
    const int64_t b = roi_align::roi_batch_index(roi[0], batch);
    const RoIBins<acc_t> r =
        bins_of(roi, scale, pooled_height, pooled_width, sampling_ratio, aligned);
    const int64_t per_bin = r.grid_h * r.grid_w * 4;
    int64_t j = (first != nullptr ? first[k] : k * per_roi) + bin * per_bin;
    if (b < 0) {
      // Adaptive lists hold no entries for such a RoI; fixed-size lists are padded.
      if (first == nullptr) {
        for (int64_t e = 0; e < per_bin; ++e, ++j) {
          keys[j] = sentinel;
          entries[j] = DetEntry<acc_t>{0, acc_t(0)};
        }
      }
      continue;
    }
    const int64_t rk = rank[k];
    const int64_t chunk = rk / rois_per_chunk;
    const int32_t src = static_cast<int32_t>((rk - chunk * rois_per_chunk) * bins + bin);
    const int64_t base = (b * max_chunks + chunk) * plane;
    const int64_t ph = bin / pooled_width, pw = bin % pooled_width;
    BilinearSample<acc_t> s;
    for (int64_t iy = 0; iy < r.grid_h; ++iy) {
      const acc_t y = roi_align::sample_coord(r.start_h, r.bin_h, ph, iy, r.grid_h);
      for (int64_t ix = 0; ix < r.grid_w; ++ix, j += 4) {
        const acc_t x = roi_align::sample_coord(r.start_w, r.bin_w, pw, ix, r.grid_w);
        if (!roi_align::bilinear_sample(y, x, height, width, s)) {
          for (int e = 0; e < 4; ++e) {
            keys[j + e] = sentinel;
            entries[j + e] = DetEntry<acc_t>{0, acc_t(0)};
          }
          continue;
        }
        const int64_t row_lo = base + s.y_low * width, row_hi = base + s.y_high * width;
        keys[j + 0] = static_cast<key_t>(row_lo + s.x_low);
        keys[j + 1] = static_cast<key_t>(row_lo + s.x_high);
        keys[j + 2] = static_cast<key_t>(row_hi + s.x_low);
        keys[j + 3] = static_cast<key_t>(row_hi + s.x_high);
        entries[j + 0] = DetEntry<acc_t>{src, s.w1 / r.count};
        entries[j + 1] = DetEntry<acc_t>{src, s.w2 / r.count};
        entries[j + 2] = DetEntry<acc_t>{src, s.w3 / r.count};
        entries[j + 3] = DetEntry<acc_t>{src, s.w4 / r.count};
      }
    }
  }
}

// entries_out[i] = entries_in[perm[i]]
template <typename acc_t>
__global__ void det_permute_kernel(
    int64_t total, const int64_t* __restrict__ perm, const DetEntry<acc_t>* __restrict__ in,
    DetEntry<acc_t>* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    out[i] = in[perm[i]];
  }
}

// A block per (image, group of G channels); see the top of the file. Shared memory holds
// [G][rois_per_chunk * bins] gradient values in scalar_t (converted to acc_t when read, as the
// other kernels do).
template <typename scalar_t, typename acc_t, int G>
__global__ void __launch_bounds__(kGatherThreads) roi_align_det_gather_kernel(
    const scalar_t* __restrict__ grad, const int64_t* __restrict__ order,
    const int64_t* __restrict__ starts, const int64_t* __restrict__ segment,
    const DetEntry<acc_t>* __restrict__ entries, int64_t channels, int64_t plane, int bins,
    int rois_per_chunk, int64_t max_chunks, int64_t channel_groups, acc_t* __restrict__ partial,
    scalar_t* __restrict__ grad_input) {
  extern __shared__ __align__(16) unsigned char det_smem[];
  scalar_t* stage = reinterpret_cast<scalar_t*>(det_smem);
  const int64_t stride = static_cast<int64_t>(rois_per_chunk) * bins;
  const int64_t b = blockIdx.x / channel_groups;
  const int64_t c0 = (blockIdx.x - b * channel_groups) * G;
  const int nc = static_cast<int>(min(channels - c0, static_cast<int64_t>(G)));
  const int64_t start = starts[b];
  const int64_t n = starts[b + 1] - start;
  const int64_t chunks = (n + rois_per_chunk - 1) / rois_per_chunk;
  scalar_t* out = grad_input + (b * channels + c0) * plane;
  acc_t* part = partial != nullptr ? partial + (b * channels + c0) * plane : nullptr;
  if (chunks == 0) {
    for (int64_t p = threadIdx.x; p < plane; p += blockDim.x) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        if (g < nc) out[g * plane + p] = scalar_t(0);
      }
    }
    return;
  }
  for (int64_t ch = 0; ch < chunks; ++ch) {
    if (ch > 0) __syncthreads();  // the previous chunk's reads of `stage` are done
    const int64_t r0 = ch * rois_per_chunk;
    const int64_t items = min(static_cast<int64_t>(rois_per_chunk), n - r0) * bins;
    for (int g = 0; g < nc; ++g) {
      for (int64_t i = threadIdx.x; i < items; i += blockDim.x) {
        const int64_t r = i / bins;
        const int64_t bin = i - r * bins;
        const int64_t k = order[start + r0 + r];
        stage[g * stride + i] = grad[(k * channels + c0 + g) * bins + bin];
      }
    }
    __syncthreads();
    const bool first_chunk = ch == 0, last_chunk = ch == chunks - 1;
    const int64_t* seg = segment + (b * max_chunks + ch) * plane;
    for (int64_t p = threadIdx.x; p < plane; p += blockDim.x) {
      acc_t sum[G];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        sum[g] = !first_chunk && g < nc ? part[g * plane + p] : acc_t(0);
      }
      const int64_t e_end = seg[p + 1];
      int64_t j = seg[p];
      // two entries per step, loaded before use; the additions stay in list order
      for (; j + 1 < e_end; j += 2) {
        const DetEntry<acc_t> e0 = entries[j];
        const DetEntry<acc_t> e1 = entries[j + 1];
#pragma unroll
        for (int g = 0; g < G; ++g) {
          if (g < nc) sum[g] += e0.w * static_cast<acc_t>(stage[g * stride + e0.src]);
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
          if (g < nc) sum[g] += e1.w * static_cast<acc_t>(stage[g * stride + e1.src]);
        }
      }
      if (j < e_end) {
        const DetEntry<acc_t> e0 = entries[j];
#pragma unroll
        for (int g = 0; g < G; ++g) {
          if (g < nc) sum[g] += e0.w * static_cast<acc_t>(stage[g * stride + e0.src]);
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        if (g >= nc) continue;
        if (last_chunk) {
          out[g * plane + p] = static_cast<scalar_t>(sum[g]);
        } else {
          part[g * plane + p] = sum[g];
        }
      }
    }
  }
}

template <typename scalar_t, int G>
void launch_gather(
    const at::Tensor& g, const at::Tensor& order, const at::Tensor& starts,
    const at::Tensor& segment, const at::Tensor& entries, int64_t batch, int64_t channels,
    int64_t plane, int bins, int rois_per_chunk, int64_t max_chunks, at::Tensor& partial,
    at::Tensor& grad_input, size_t smem_bytes, cudaStream_t stream) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t channel_groups = (channels + G - 1) / G;
  auto kernel = roi_align_det_gather_kernel<scalar_t, acc_t, G>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes)));
  kernel<<<static_cast<unsigned>(batch * channel_groups), kGatherThreads, smem_bytes, stream>>>(
      g.const_data_ptr<scalar_t>(), order.const_data_ptr<int64_t>(),
      starts.const_data_ptr<int64_t>(), segment.const_data_ptr<int64_t>(),
      reinterpret_cast<const DetEntry<acc_t>*>(entries.const_data_ptr()), channels, plane, bins,
      rois_per_chunk, max_chunks, channel_groups,
      partial.defined() ? partial.data_ptr<acc_t>() : nullptr, grad_input.data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename key_t>
void det_backward(
    const at::Tensor& grad, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, bool aligned, int group, int64_t rois_per_chunk,
    int64_t max_chunks, size_t smem_bytes, at::Tensor& grad_input) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t batch = grad_input.size(0), channels = grad_input.size(1);
  const int64_t height = grad_input.size(2), width = grad_input.size(3);
  const int64_t plane = height * width;
  const int64_t num_rois = rois.size(0);
  const int64_t bins = pooled_height * pooled_width;
  const acc_t scale = static_cast<acc_t>(spatial_scale);
  const acc_t* roi_ptr = rois.const_data_ptr<acc_t>();
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto long_opts = grad.options().dtype(at::kLong);

  // 1. RoIs ranked within their image.
  at::Tensor image = at::empty({num_rois}, long_opts);
  det_image_kernel<acc_t><<<cuda::grid_for(num_rois, kRankThreads), kRankThreads, 0, stream>>>(
      num_rois, roi_ptr, batch, image.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const auto by_image = image.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor& sorted_image = std::get<0>(by_image);
  const at::Tensor& order = std::get<1>(by_image);
  // starts[b]: the first sorted position of image b; starts[batch + 1] = num_rois
  const at::Tensor starts = at::searchsorted(
      sorted_image, at::arange(batch + 2, long_opts), /*out_int32=*/false, /*right=*/false);
  at::Tensor rank = at::empty({num_rois}, long_opts);
  det_rank_kernel<<<cuda::grid_for(num_rois, kRankThreads), kRankThreads, 0, stream>>>(
      num_rois, order.const_data_ptr<int64_t>(), sorted_image.const_data_ptr<int64_t>(),
      starts.const_data_ptr<int64_t>(), rank.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // 2. The contribution list.
  at::Tensor first;
  int64_t per_roi = 0, total = 0;
  if (sampling_ratio > 0) {
    per_roi = bins * sampling_ratio * sampling_ratio * 4;
    total = num_rois * per_roi;
  } else {
    at::Tensor counts = at::empty({num_rois}, long_opts);
    roi_align_cuda::contribution_count_kernel<acc_t>
        <<<cuda::grid_for(num_rois, kRankThreads), kRankThreads, 0, stream>>>(
            num_rois, roi_ptr, batch, pooled_height, pooled_width, scale, sampling_ratio, aligned,
            kMaxEntries, counts.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const at::Tensor ends = counts.cumsum(0);
    first = ends - counts;
    total = ends[-1].item<int64_t>();  // the one host sync: it sizes the list
    DETOPS_CHECK(
        total < kMaxEntries, kOp, ": too many samples for the deterministic backward (", total,
        " contributions)");
  }
  const at::ScalarType key_dtype = c10::CppTypeToScalarType<key_t>::value;
  constexpr int64_t kWords = static_cast<int64_t>(sizeof(DetEntry<acc_t>) / sizeof(int64_t));
  static_assert(sizeof(DetEntry<acc_t>) % sizeof(int64_t) == 0, "entries are whole 8-byte words");
  at::Tensor keys = at::empty({total}, grad.options().dtype(key_dtype));
  at::Tensor entries = at::empty({total, kWords}, long_opts);
  if (total > 0) {
    const int64_t total_bins = num_rois * bins;
    det_contribution_kernel<key_t, acc_t>
        <<<cuda::grid_for(total_bins, kRankThreads), kRankThreads, 0, stream>>>(
            total_bins, roi_ptr, batch, height, width, pooled_height, pooled_width, scale,
            sampling_ratio, aligned, first.defined() ? first.const_data_ptr<int64_t>() : nullptr,
            per_roi, rank.const_data_ptr<int64_t>(), rois_per_chunk, max_chunks,
            keys.data_ptr<key_t>(), reinterpret_cast<DetEntry<acc_t>*>(entries.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // 3. Grouped by (image, chunk, pixel); equal keys keep their list order.
  const auto sorted = keys.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor& sorted_keys = std::get<0>(sorted);
  const at::Tensor& perm = std::get<1>(sorted);
  at::Tensor sorted_entries = at::empty_like(entries);
  if (total > 0) {
    det_permute_kernel<acc_t><<<cuda::grid_for(total, kRankThreads), kRankThreads, 0, stream>>>(
        total, perm.const_data_ptr<int64_t>(),
        reinterpret_cast<const DetEntry<acc_t>*>(entries.const_data_ptr()),
        reinterpret_cast<DetEntry<acc_t>*>(sorted_entries.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const at::Tensor segment = at::searchsorted(
      sorted_keys, at::arange(batch * max_chunks * plane + 1, grad.options().dtype(key_dtype)),
      /*out_int32=*/false, /*right=*/false);

  // 4. The gather.
  const at::Tensor g = grad.contiguous();
  at::Tensor partial;
  if (max_chunks > 1) {
    partial = at::empty({batch, channels, height, width}, grad.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
  }
  const int b32 = static_cast<int>(bins), rpc32 = static_cast<int>(rois_per_chunk);
  switch (group) {
    case 4:
      launch_gather<scalar_t, 4>(g, order, starts, segment, sorted_entries, batch, channels, plane, b32, rpc32, max_chunks, partial, grad_input, smem_bytes, stream);
      break;
    case 2:
      launch_gather<scalar_t, 2>(g, order, starts, segment, sorted_entries, batch, channels, plane, b32, rpc32, max_chunks, partial, grad_input, smem_bytes, stream);
      break;
    default:
      launch_gather<scalar_t, 1>(g, order, starts, segment, sorted_entries, batch, channels, plane, b32, rpc32, max_chunks, partial, grad_input, smem_bytes, stream);
      break;
  }
}

}  // namespace

// Deterministic backward through the staged gather. `rois` is contiguous, in the accumulation
// dtype, with batch indices already checked; grad_input is [B, C, H, W] and not empty, and
// there is at least one RoI. Returns false, touching nothing, for shapes the staged gather
// does not take (the caller then runs the general sort-based path).
bool roi_align_backward_deterministic_staged(
    const at::Tensor& grad, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, bool aligned, at::Tensor& grad_input) {
  const int64_t batch = grad_input.size(0), channels = grad_input.size(1);
  const int64_t plane = grad_input.size(2) * grad_input.size(3);
  const int64_t num_rois = rois.size(0);
  const int64_t bins = pooled_height * pooled_width;
  if (batch * channels * plane == 0 || num_rois == 0) return false;
  if (bins > std::numeric_limits<int32_t>::max() || plane > std::numeric_limits<int32_t>::max()) {
    return false;
  }
  if (sampling_ratio > 0) {
    const double n = static_cast<double>(num_rois) * bins * sampling_ratio * sampling_ratio * 4;
    if (n >= static_cast<double>(kMaxEntries)) return false;
  } else if (num_rois >= (int64_t{1} << 22)) {
    return false;
  }
  const int64_t elem = static_cast<int64_t>(grad.element_size());
  const int64_t smem_cap =
      static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin);
  // The largest channel group whose chunk holds an image's share of the RoIs (with a margin),
  // or at least 32 RoIs. Each group reads the whole contribution list once, and each chunk
  // costs a pass over the group's planes of the running sums: reading the list fewer times
  // wins. Measured on an H200 (1024 RoIs, 2x256x200x304, 14x14; BENCHMARKS.md): groups of 4
  // in 7 chunks per image 2.18 ms, of 2 in 4 chunks 3.00 ms, single channels in 2 chunks
  // 5.29 ms.
  const int64_t expected = num_rois / batch + num_rois / (batch * 10) + 8;
  int group = 1;
  for (int gsize : {4, 2}) {
    if (channels >= gsize && smem_cap / (gsize * bins * elem) >= std::min<int64_t>(expected, 32)) {
      group = gsize;
      break;
    }
  }
  int64_t rois_per_chunk = smem_cap / (group * bins * elem);
  if (rois_per_chunk < 1) return false;
  rois_per_chunk = std::min(rois_per_chunk, num_rois);
  // every staged slot index fits int32 (rois_per_chunk * bins * elem <= smem_cap)
  const int64_t max_chunks = (num_rois + rois_per_chunk - 1) / rois_per_chunk;
  const int64_t segments = batch * max_chunks * plane + 1;
  if (segments > kMaxSegments) return false;
  const int64_t channel_groups = (channels + group - 1) / group;
  if (batch * channel_groups > std::numeric_limits<int32_t>::max()) return false;
  const size_t smem_bytes = static_cast<size_t>(group * rois_per_chunk * bins * elem);
  // segments <= kMaxSegments: keys fit int32
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), kOp, [&] {
    det_backward<scalar_t, int32_t>(
        grad, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned, group,
        rois_per_chunk, max_chunks, smem_bytes, grad_input);
  });
  return true;
}

}  // namespace ops
}  // namespace detops
