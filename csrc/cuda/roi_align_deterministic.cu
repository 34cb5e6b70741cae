// The deterministic RoIAlign backward on CUDA: a gather over pixel-sorted contribution lists,
// reading the gradient through a copy whose rows hold a bin's channels side by side.
//
// The contributions of bilinear sampling (pixel, source bin, weight) do not depend on the
// channel. They are listed once:
//   1. RoIs are ranked within their image (grouped by image in RoI order, a stable counting
//      sort: plane_band::group_by_owner);
//   2. one thread per (RoI, bin) writes the bin's contributions: the key (image, pixel) and
//      the entry (rank * bins + bin, weight);
//   3. a stable radix sort of the entries by key (cub, over the key's bits only) groups each
//      pixel's contributions, in list order (RoI index, then bin, then sample), and a binary
//      search per (image, pixel) finds its segment.
// Then the gradient is copied so that row (RoI in rank order, bin) holds its channels side by
// side, and one block per (image, run of pixels, group of 32 channels) sums, with a warp per
// pixel and a lane per channel, the pixel's entries in list order: each entry is one 128-byte
// row read for 32 channels. The block writes each channel's run of pixels with consecutive
// stores: every grad_input element is written once, with no zeroing and no atomics.
// Bit-identical from run to run.
//
// One pass lists fewer than 2^31 contributions (kMaxEntries) of at most 2^31 - 1 (RoI, bin)
// slots, the int32 rows of the transposed gradient, and its grids hold at most 65535 * 32
// channels. Larger inputs run several passes: over slices of the channels (the sums are those of
// one pass), and over chunks of consecutive RoIs, each chunk's gradient summed in the
// accumulation type and the chunks' sums added in chunk order (bit-identical from run to run,
// rounded as that order gives). Keys are int32 where every (image, pixel) fits, else int64.
// roi_align_backward_deterministic refuses, with an error, the shapes no pass can take.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "../common/checks.h"
#include "../common/kernel_choice.h"
#include "../common/roi_align_geometry.h"
#include "cuda_helpers.h"
#include "plane_band.cuh"
#include "radix_sort.cuh"
#include "roi_align_kernels.cuh"
#include "roi_align_rois.cuh"

namespace detops {
namespace ops {

namespace {

constexpr const char* kOp = "detops._roi_align_backward";
constexpr int kRankThreads = 256;
constexpr int kGatherThreads = 1024;
// A pass's contribution list holds fewer entries than this, and at most kMaxSlots (RoI, bin)
// slots (a contribution's int32 row in the transposed gradient).
constexpr int64_t kMaxEntries = int64_t{1} << 31;
constexpr int64_t kMaxSlots = std::numeric_limits<int32_t>::max();
// Grid limits of the transpose and gather launches: blocks along x, channel groups along y.
constexpr int64_t kMaxGridX = std::numeric_limits<int32_t>::max();
constexpr int64_t kMaxChannelTiles = 65535;

using roi_align::BilinearSample;
using roi_align::RoIBins;

// One contribution: the row of its source bin in the transposed gradient (rank * bins + bin),
// and its weight (bilinear weight / samples per bin).
template <typename acc_t>
struct alignas(8) Contribution {
  int32_t src;
  acc_t w;
};

using roi_align_cuda::bins_of;

// Contributions of each RoI to its grad_input (4 per sample), capped at `cap` so that a prefix
// sum stays in range; 0 for a RoI with an invalid batch index. For the adaptive grid, where
// the count differs per RoI.
template <typename acc_t>
__global__ void contribution_count_kernel(
    int64_t num_rois, const acc_t* __restrict__ rois, int64_t batch, int64_t pooled_height,
    int64_t pooled_width, acc_t scale, int64_t sampling_ratio, bool aligned, int64_t cap,
    int64_t* __restrict__ counts) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < num_rois;
       k += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const acc_t* roi = rois + k * 5;
    if (roi_align::roi_batch_index(roi[0], batch) < 0) {
      counts[k] = 0;
      continue;
    }
    const roi_align::RoIBins<acc_t> r =
        bins_of(roi, scale, pooled_height, pooled_width, sampling_ratio, aligned);
    // grid_h, grid_w <= 2^16: the product is exact.
    const int64_t per_bin = r.grid_h * r.grid_w * 4;
    const int64_t bins = pooled_height * pooled_width;
    counts[k] = per_bin > 0 && bins > cap / per_bin ? cap : per_bin * bins;
  }
}

// The image of each RoI, or `batch` for a RoI whose batch index is not valid.
template <typename acc_t>
__global__ void deterministic_image_kernel(
    int64_t num_rois, const acc_t* __restrict__ rois, int64_t batch, int32_t* __restrict__ image) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < num_rois;
       k += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t b = roi_align::roi_batch_index(rois[k * 5], batch);
    image[k] = static_cast<int32_t>(b < 0 ? batch : b);
  }
}

// rank[order[i]] = i - starts[image[order[i]]]: the RoI's position among its image's RoIs.
__global__ void deterministic_rank_kernel(
    int64_t num_rois, const int32_t* __restrict__ order, const int32_t* __restrict__ image,
    const int32_t* __restrict__ starts, int32_t* __restrict__ rank) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_rois;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int32_t k = order[i];
    rank[k] = static_cast<int32_t>(i) - starts[image[k]];
  }
}

// One thread per (RoI, bin): the bin's contributions at first[k] + bin * grid_h * grid_w * 4
// (first == nullptr: at k * per_roi, padded with sentinel keys for samples that read nothing).
template <typename key_t, typename acc_t>
__global__ void deterministic_contribution_kernel(
    int64_t total_bins, const acc_t* __restrict__ rois, int64_t batch, int64_t height,
    int64_t width, int64_t pooled_height, int64_t pooled_width, acc_t scale,
    int64_t sampling_ratio, bool aligned, const int64_t* __restrict__ first, int64_t per_roi,
    const int32_t* __restrict__ rank, key_t* __restrict__ keys, Contribution<acc_t>* __restrict__ entries) {
  const int64_t plane = height * width;
  const key_t sentinel = static_cast<key_t>(batch * plane);
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
          entries[j] = Contribution<acc_t>{0, acc_t(0)};
        }
      }
      continue;
    }
    const int32_t src = static_cast<int32_t>(static_cast<int64_t>(rank[k]) * bins + bin);
    const int64_t base = b * plane;
    const int64_t ph = bin / pooled_width, pw = bin % pooled_width;
    BilinearSample<acc_t> s;
    for (int64_t iy = 0; iy < r.grid_h; ++iy) {
      const acc_t y = roi_align::sample_coord(r.start_h, r.bin_h, ph, iy, r.grid_h);
      for (int64_t ix = 0; ix < r.grid_w; ++ix, j += 4) {
        const acc_t x = roi_align::sample_coord(r.start_w, r.bin_w, pw, ix, r.grid_w);
        if (!roi_align::bilinear_sample(y, x, height, width, s)) {
          for (int e = 0; e < 4; ++e) {
            keys[j + e] = sentinel;
            entries[j + e] = Contribution<acc_t>{0, acc_t(0)};
          }
          continue;
        }
        const int64_t row_lo = base + s.y_low * width, row_hi = base + s.y_high * width;
        keys[j + 0] = static_cast<key_t>(row_lo + s.x_low);
        keys[j + 1] = static_cast<key_t>(row_lo + s.x_high);
        keys[j + 2] = static_cast<key_t>(row_hi + s.x_low);
        keys[j + 3] = static_cast<key_t>(row_hi + s.x_high);
        entries[j + 0] = Contribution<acc_t>{src, s.w1 / r.count};
        entries[j + 1] = Contribution<acc_t>{src, s.w2 / r.count};
        entries[j + 2] = Contribution<acc_t>{src, s.w3 / r.count};
        entries[j + 3] = Contribution<acc_t>{src, s.w4 / r.count};
      }
    }
  }
}

// segment[j] = the first i with sorted[i] >= j (total where none), for j in [0, segments): the
// start of key j's run in the sorted keys.
template <typename key_t>
__global__ void deterministic_segment_kernel(
    const key_t* __restrict__ sorted, int64_t total, int64_t segments, int64_t* __restrict__ segment) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < segments;
       j += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    int64_t lo = 0, hi = total;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (static_cast<int64_t>(sorted[mid]) < j) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    segment[j] = lo;
  }
}

// The transposed gather (one chunk per image): grad rows of a RoI's bin hold its channels side
// by side, so that a warp reads one contribution's 32 channels as one 128-byte line.
// gt[(i * bins + bin) * channels + c] = grad[(order[i] * channels + c) * bins + bin], i the
// RoI's position in `order`. Blocks of 32 x 8 threads, a 32 x 32 tile of (channel, bin) each.
constexpr int kTile = 32;

template <typename scalar_t>
__global__ void deterministic_transpose_kernel(
    const scalar_t* __restrict__ grad, const int32_t* __restrict__ order, int64_t channels,
    int bins, int64_t bin_tiles, scalar_t* __restrict__ gt) {
  __shared__ scalar_t tile[kTile][kTile + 1];
  const int64_t i = blockIdx.x / bin_tiles;
  const int bin0 = static_cast<int>(blockIdx.x - i * bin_tiles) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t k = order[i];
  for (int cy = threadIdx.y; cy < kTile; cy += blockDim.y) {
    const int64_t c = c0 + cy;
    const int bin = bin0 + static_cast<int>(threadIdx.x);
    if (c < channels && bin < bins) tile[cy][threadIdx.x] = grad[(k * channels + c) * bins + bin];
  }
  __syncthreads();
  for (int by = threadIdx.y; by < kTile; by += blockDim.y) {
    const int bin = bin0 + by;
    const int64_t c = c0 + threadIdx.x;
    if (c < channels && bin < bins) gt[(i * bins + bin) * channels + c] = tile[threadIdx.x][by];
  }
}

// A block per (image, run of kRunPixels pixels, group of 32 channels): each warp sums one
// pixel at a time, lane c its channel, over the pixel's entries in list order, then the block
// writes each channel's run of pixels with consecutive stores.
constexpr int kRunPixels = 128;

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kGatherThreads) roi_align_deterministic_gather_kernel(
    const scalar_t* __restrict__ gt, const int32_t* __restrict__ starts,
    const int64_t* __restrict__ segment, const Contribution<acc_t>* __restrict__ entries,
    int64_t channels, int64_t plane, int bins, int64_t runs, scalar_t* __restrict__ grad_input) {
  __shared__ acc_t sums[kTile][kRunPixels + 1];
  const int64_t b = blockIdx.x / runs;
  const int64_t p0 = (blockIdx.x - b * runs) * kRunPixels;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int warps = static_cast<int>(blockDim.x / 32);
  const int64_t c = c0 + lane;
  const bool live = c < channels;
  const scalar_t* rows = gt + static_cast<int64_t>(starts[b]) * bins * channels + (live ? c : 0);
  const int64_t* seg = segment + b * plane;
  for (int q = warp; q < kRunPixels; q += warps) {
    const int64_t p = p0 + q;
    acc_t sum = acc_t(0);
    if (p < plane) {
      const int64_t e_end = seg[p + 1];
      int64_t j = seg[p];
      // two entries per step, loaded before use; the additions stay in list order
      for (; j + 1 < e_end; j += 2) {
        const Contribution<acc_t> e0 = entries[j];
        const Contribution<acc_t> e1 = entries[j + 1];
        const acc_t v0 = static_cast<acc_t>(rows[static_cast<int64_t>(e0.src) * channels]);
        const acc_t v1 = static_cast<acc_t>(rows[static_cast<int64_t>(e1.src) * channels]);
        sum += e0.w * v0;
        sum += e1.w * v1;
      }
      if (j < e_end) {
        const Contribution<acc_t> e0 = entries[j];
        sum += e0.w * static_cast<acc_t>(rows[static_cast<int64_t>(e0.src) * channels]);
      }
    }
    sums[lane][q] = sum;
  }
  __syncthreads();
  for (int r = warp; r < kTile; r += warps) {
    const int64_t cr = c0 + r;
    if (cr >= channels) break;
    scalar_t* out = grad_input + (b * channels + cr) * plane;
    for (int q = lane; q < kRunPixels; q += 32) {
      if (p0 + q < plane) out[p0 + q] = static_cast<scalar_t>(sums[r][q]);
    }
  }
}

// One pass: the gradient of rois [K, 5] (acc_t, contiguous) from grad [K, C, PH, PW] into
// grad_input [B, C, H, W], every element written. The list: first[k], where RoI k's
// contributions start (the adaptive grid), or, with first undefined, per_roi = PH * PW *
// sampling_ratio^2 * 4 of them for each RoI; total: its length. Within kMaxEntries, kMaxSlots
// and kMaxChannelTiles (the caller's passes).
template <typename scalar_t, typename key_t>
void deterministic_pass(
    const at::Tensor& grad, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, bool aligned, const at::Tensor& first, int64_t total,
    at::Tensor& grad_input) {
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

  // 1. RoIs ranked within their image: grouped by image (RoIs with an invalid batch index as
  // image `batch`) in RoI order, in one block. order: the RoIs, image by image; starts[b]: the
  // first position of image b in order (starts[batch + 1] = num_rois); rank[k]: RoI k's
  // position among its image's. One int32 buffer, every element written before it is read
  // (group_by_owner's scratch counts by itself).
  at::Tensor index = cuda::empty_written({3 * num_rois + 2 * (batch + 2)}, grad.options().dtype(at::kInt));
  int32_t* const image = index.data_ptr<int32_t>();
  int32_t* const order = image + num_rois;
  int32_t* const rank = order + num_rois;
  int32_t* const starts = rank + num_rois;
  int32_t* const group_counts = starts + batch + 2;
  deterministic_image_kernel<acc_t><<<cuda::grid_for(num_rois, kRankThreads), kRankThreads, 0, stream>>>(
      num_rois, roi_ptr, batch, image);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  plane_band::group_by_owner<int32_t>(
      image, num_rois, batch + 1, group_counts, starts, order, /*row_div=*/0, /*in_order=*/true, stream);
  deterministic_rank_kernel<<<cuda::grid_for(num_rois, kRankThreads), kRankThreads, 0, stream>>>(
      num_rois, order, image, starts, rank);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // 2. The contribution list.
  const int64_t per_roi = first.defined() ? 0 : bins * sampling_ratio * sampling_ratio * 4;
  const at::ScalarType key_dtype = c10::CppTypeToScalarType<key_t>::value;
  constexpr int64_t kWords = static_cast<int64_t>(sizeof(Contribution<acc_t>) / sizeof(int64_t));
  static_assert(sizeof(Contribution<acc_t>) % sizeof(int64_t) == 0, "entries are whole 8-byte words");
  at::Tensor keys = cuda::empty_written({total}, grad.options().dtype(key_dtype));
  at::Tensor entries = cuda::empty_written({total, kWords}, long_opts);
  if (total > 0) {
    const int64_t total_bins = num_rois * bins;
    deterministic_contribution_kernel<key_t, acc_t>
        <<<cuda::grid_for(total_bins, kRankThreads), kRankThreads, 0, stream>>>(
            total_bins, roi_ptr, batch, height, width, pooled_height, pooled_width, scale,
            sampling_ratio, aligned, first.defined() ? first.const_data_ptr<int64_t>() : nullptr,
            per_roi, rank,
            keys.data_ptr<key_t>(), reinterpret_cast<Contribution<acc_t>*>(entries.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // 3. Grouped by (image, pixel); equal keys keep their list order. The entries move with
  // their keys, and the sort looks only at the bits keys up to batch * plane (the sentinel)
  // use.
  at::Tensor sorted_keys = cuda::empty_written({total}, keys.options());
  at::Tensor sorted_entries = cuda::empty_written(entries.sizes(), entries.options());
  const int64_t segments = batch * plane + 1;
  cuda::sort_pairs(
      keys.const_data_ptr<key_t>(), sorted_keys.data_ptr<key_t>(),
      reinterpret_cast<const Contribution<acc_t>*>(entries.const_data_ptr()),
      reinterpret_cast<Contribution<acc_t>*>(sorted_entries.data_ptr()), total, static_cast<uint64_t>(segments - 1),
      grad.device(), stream);
  at::Tensor segment = cuda::empty_written({segments}, long_opts);
  deterministic_segment_kernel<key_t><<<cuda::grid_for(segments, kRankThreads), kRankThreads, 0, stream>>>(
      sorted_keys.const_data_ptr<key_t>(), total, segments, segment.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // 4. The gather: grad rows of 32 channels, then a warp per pixel.
  const at::Tensor g = grad.contiguous();
  at::Tensor gt = cuda::empty_written({num_rois * bins * channels}, g.options());
  const int64_t bin_tiles = (bins + kTile - 1) / kTile;
  deterministic_transpose_kernel<scalar_t>
      <<<dim3(static_cast<unsigned>(num_rois * bin_tiles), static_cast<unsigned>((channels + kTile - 1) / kTile)),
         dim3(kTile, 8), 0, stream>>>(
          g.const_data_ptr<scalar_t>(), order, channels, static_cast<int>(bins),
          bin_tiles, gt.data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t runs = (plane + kRunPixels - 1) / kRunPixels;
  roi_align_deterministic_gather_kernel<scalar_t, acc_t>
      <<<dim3(static_cast<unsigned>(batch * runs), static_cast<unsigned>((channels + kTile - 1) / kTile)),
         kGatherThreads, 0, stream>>>(
          gt.const_data_ptr<scalar_t>(), starts, segment.const_data_ptr<int64_t>(),
          reinterpret_cast<const Contribution<acc_t>*>(sorted_entries.const_data_ptr()), channels, plane,
          static_cast<int>(bins), runs, grad_input.data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// A chunk of consecutive RoIs [k0, k1) that one pass takes: its list's length, and where the
// list of all RoIs puts its first entry (adaptive grid; 0 otherwise).
struct RoIChunk {
  int64_t k0, k1, total, first_entry;
};

// The deterministic backward of every RoI through passes over chunks of RoIs (see the top of
// the file) into grad_input [B, C, H, W]: one pass where the list fits one, else the chunks'
// sums in acc_t, added in chunk order.
template <typename scalar_t, typename key_t>
void deterministic_chunks(
    const at::Tensor& grad, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, bool aligned, const at::Tensor& first,
    const std::vector<RoIChunk>& chunks, at::Tensor& grad_input) {
  using acc_t = at::opmath_type<scalar_t>;
  if (chunks.size() == 1) {
    deterministic_pass<scalar_t, key_t>(
        grad, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned, first, chunks[0].total,
        grad_input);
    return;
  }
  const at::ScalarType acc_dtype = c10::CppTypeToScalarType<acc_t>::value;
  const at::Tensor g = grad.contiguous().to(acc_dtype);
  at::Tensor sum = std::is_same_v<scalar_t, acc_t> ? grad_input
                                                  : cuda::empty_written(grad_input.sizes(), grad_input.options().dtype(acc_dtype));
  at::Tensor part;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const RoIChunk& c = chunks[i];
    const int64_t n = c.k1 - c.k0;
    const at::Tensor chunk_first = first.defined() ? first.narrow(0, c.k0, n) - c.first_entry : at::Tensor();
    if (i > 0 && !part.defined()) part = cuda::empty_written(sum.sizes(), sum.options());
    at::Tensor& out = i == 0 ? sum : part;
    deterministic_pass<acc_t, key_t>(
        g.narrow(0, c.k0, n), rois.narrow(0, c.k0, n), spatial_scale, pooled_height, pooled_width, sampling_ratio,
        aligned, chunk_first, c.total, out);
    if (i > 0) sum.add_(part);
  }
  if (!sum.is_same(grad_input)) grad_input.copy_(sum);
}

}  // namespace

void roi_align_backward_deterministic(
    const at::Tensor& grad, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, bool aligned, at::Tensor& grad_input) {
  const int64_t batch = grad_input.size(0), channels = grad_input.size(1);
  const int64_t plane = grad_input.size(2) * grad_input.size(3);
  const int64_t num_rois = rois.size(0);
  const int64_t bins = pooled_height * pooled_width;
  // Limits of every pass. A RoI's bins are rows of the transposed gradient (int32): past 2^31 - 1
  // of them its contribution list alone, four entries per sample of every bin that holds one,
  // would take more than 96 GiB, twice that while sorted.
  DETOPS_CHECK(
      bins <= kMaxSlots, kOp, ": the deterministic backward takes at most 2^31 - 1 bins per RoI "
      "(pooled_height * pooled_width), got ", pooled_height, " * ", pooled_width);
  // Blocks of the gather, (image, run of 128 pixels); the image keys of the ranking are int32. The
  // limit is reached past 2^37 pixels (512 GiB of float32 gradient) where H * W > 128, and past
  // 2^31 - 3 images otherwise.
  const int64_t runs = cuda::ceil_div(plane, kRunPixels);
  DETOPS_CHECK(
      batch <= (kMaxGridX - 2) / runs, kOp, ": the deterministic backward takes at most 2^31 - 3 "
      "blocks of 128 pixels (batch_size * ceil(height * width / 128)), got batch_size ", batch, " and ", plane,
      " pixels per image");
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // The limits of a pass, lower where a test asks (common/kernel_choice.h).
  const DeterministicPassLimits test_limits = deterministic_pass_limits();
  const int64_t max_entries =
      test_limits.max_entries > 0 ? std::min(test_limits.max_entries, kMaxEntries) : kMaxEntries;
  const int64_t max_slice = test_limits.max_channels > 0 ? std::min(test_limits.max_channels, kMaxChannelTiles * kTile)
                                                         : kMaxChannelTiles * kTile;

  // The chunks of RoIs: as many RoIs a chunk as their lists and slots allow.
  std::vector<RoIChunk> chunks;
  at::Tensor first;  // adaptive grid: where each RoI's contributions start in the list of all
  // One RoI's list must fit a pass: 2^31 entries take 24 GiB (int32 keys, 8-byte entries), as
  // much again sorted, and the radix sort's own buffers on top.
  const std::string too_many = std::string(": the deterministic backward takes at most ") +
      (max_entries == kMaxEntries ? std::string("2^31") : std::to_string(max_entries)) +
      " - 1 contributions (4 per sample) per RoI, got ";
  if (sampling_ratio > 0) {
    const double per_roi_d = static_cast<double>(bins) * static_cast<double>(sampling_ratio * sampling_ratio) * 4.0;
    DETOPS_CHECK(
        per_roi_d < static_cast<double>(max_entries), kOp, too_many, "pooled_height * pooled_width * "
        "sampling_ratio^2 * 4 = ", per_roi_d);
    const int64_t per_roi = bins * sampling_ratio * sampling_ratio * 4;
    const int64_t per_chunk = std::min(kMaxSlots / bins, (max_entries - 1) / per_roi);
    for (int64_t k0 = 0; k0 < num_rois; k0 += per_chunk) {
      const int64_t k1 = std::min(num_rois, k0 + per_chunk);
      chunks.push_back(RoIChunk{k0, k1, (k1 - k0) * per_roi, 0});
    }
  } else {
    // Counts capped at kMaxEntries each, so that their sum stays within int64 for fewer than
    // 2^32 RoIs (which alone take 80 GiB as float32).
    DETOPS_CHECK(
        num_rois < (int64_t{1} << 32), kOp, ": the deterministic backward with an adaptive sampling grid "
        "(sampling_ratio <= 0) takes fewer than 2^32 RoIs, got ", num_rois);
    at::Tensor counts = at::empty({num_rois}, rois.options().dtype(at::kLong));
    AT_DISPATCH_FLOATING_TYPES(rois.scalar_type(), kOp, [&] {
      contribution_count_kernel<scalar_t><<<cuda::grid_for(num_rois, kRankThreads), kRankThreads, 0, stream>>>(
          num_rois, rois.const_data_ptr<scalar_t>(), batch, pooled_height, pooled_width,
          static_cast<scalar_t>(spatial_scale), sampling_ratio, aligned, kMaxEntries, counts.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    const at::Tensor ends = counts.cumsum(0);
    first = ends - counts;
    const int64_t total = ends[-1].item<int64_t>();  // the one host sync: it sizes the list
    if (total < max_entries && num_rois <= kMaxSlots / bins) {
      chunks.push_back(RoIChunk{0, num_rois, total, 0});
    } else {
      // a second sync, for inputs that need several passes: the chunks from each RoI's count
      const at::Tensor ends_host = ends.cpu();
      const int64_t* e = ends_host.const_data_ptr<int64_t>();
      int64_t k0 = 0, start = 0;  // the chunk's first RoI and first entry
      for (int64_t k = 0; k < num_rois; ++k) {
        const int64_t begin = k > 0 ? e[k - 1] : 0;
        DETOPS_CHECK(
            e[k] - begin < max_entries, kOp, too_many, e[k] - begin, " for RoI ", k, " (its adaptive sampling grid)");
        if (e[k] - start >= max_entries || k + 1 - k0 > kMaxSlots / bins) {
          chunks.push_back(RoIChunk{k0, k, begin - start, start});
          k0 = k;
          start = begin;
        }
      }
      chunks.push_back(RoIChunk{k0, num_rois, e[num_rois - 1] - start, start});
    }
  }

  // Slices of the channels where the grids cannot hold them all at once.
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), kOp, [&] {
    auto run = [&](auto key) {
      using key_t = decltype(key);
      if (channels <= max_slice) {
        deterministic_chunks<scalar_t, key_t>(
            grad, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned, first, chunks,
            grad_input);
        return;
      }
      for (int64_t c0 = 0; c0 < channels; c0 += max_slice) {
        const int64_t n = std::min(max_slice, channels - c0);
        const at::Tensor g = grad.narrow(1, c0, n).contiguous();
        at::Tensor out = cuda::empty_written(
            {batch, n, grad_input.size(2), grad_input.size(3)}, grad_input.options());
        deterministic_chunks<scalar_t, key_t>(
            g, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned, first, chunks, out);
        grad_input.narrow(1, c0, n).copy_(out);
      }
    };
    // int32 keys where every (image, pixel) and the sentinel past them fit
    if (batch * plane < std::numeric_limits<int32_t>::max() && !test_limits.wide_keys) {
      run(int32_t{});
    } else {
      run(int64_t{});
    }
  });
}

}  // namespace ops
}  // namespace detops
