// RoIAlign plane kernels: NCHW input, a thread block per (image, channel, band of rows).
//
// In NCHW the bilinear samples of a large RoI are sparse in a channel plane, so a kernel that
// reads them from global memory pulls a 32-byte sector for every 4- or 8-byte pixel. These
// kernels instead bring the rows of one channel plane into shared memory once and compute
// every output of that channel, for all the RoIs of the image, from there:
//   prep:     one block groups the RoIs by image (order / starts) and computes each RoI's bins
//             (roi_bins) once, for every channel and band to share;
//   forward:  the block copies its band of rows (rows [row0, row0 + band_rows), vectorized)
//             into shared memory, then computes the outputs of the bins it owns: a bin belongs
//             to the band whose core rows [row0, row0 + band_core) hold the bin's anchor row
//             (the row of its first sample row, clamped into the map). Bands overlap by a
//             halo of rows so that a bin's samples usually lie in the band; samples that read
//             rows outside it read global memory (correct for any RoI size);
//   backward: the bands partition the rows; the block accumulates, in shared memory, every
//             contribution that lands in its rows (shared-memory atomics, so the order of the
//             additions varies: non-deterministic like the atomic kernels of roi_align.cu)
//             and writes its rows of grad_input once, converted to the grad's dtype. No zeroing
//             pass and no global atomics.
// Sample positions and weights come from roi_align_geometry.h with the same expressions as the
// tiled kernels of roi_align.cu, term for term, so the forward gives the same bits.
//
// Knobs (read at each call): DETOPS_ROI_ALIGN_PLANE = 0 never uses these kernels, 1 uses them
// whenever they fit, unset or anything else decides by shape; DETOPS_ROI_ALIGN_PLANE_ROWS = N
// caps the rows of a band at N (the tests use it to force many bands).
#include "roi_align_plane.h"

#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

#include "../common/checks.h"
#include "../common/roi_align_geometry.h"
#include "cuda_helpers.h"

namespace detops {
namespace ops {
namespace roi_align_plane {
namespace {

using roi_align::RoIBins;

constexpr const char* kForwardOp = "detops.roi_align";
constexpr const char* kBackwardOp = "detops._roi_align_backward";
constexpr int kPlaneThreads = 512;
constexpr int kPrepThreads = 1024;
constexpr int64_t kMaxBatch = 4095;  // images the prep block groups (two int32 per image)
constexpr int kXCache = 4;           // sample columns of a bin kept in registers
constexpr int64_t kHaloRows = 16;    // rows by which forward bands overlap, at most
constexpr int64_t kMinAutoRows = 16;  // thinner bands are left to the other kernels

// The row that decides which forward band owns bin row ph: the first sample row, clamped
// into [0, height - 1] (a NaN or empty grid gives row 0).
template <typename acc_t>
__device__ __forceinline__ int64_t anchor_row(const RoIBins<acc_t>& r, int64_t ph, int64_t height) {
  if (r.grid_h <= 0) return 0;
  const acc_t y = roi_align::sample_coord(r.start_h, r.bin_h, ph, int64_t{0}, r.grid_h);
  if (!(y > acc_t(0))) return 0;
  if (!(y < static_cast<acc_t>(height - 1))) return height - 1;
  return static_cast<int64_t>(y);
}

// Prep: starts[n]..starts[n + 1] index the RoIs of image n in order (n in [0, batch]; RoIs with
// an invalid batch index form the group n == batch); bins[k] = roi_bins of RoI k;
// anchors[k * pooled_height + ph] = anchor_row of bin row ph of RoI k.
// One block; shared memory holds 2 * (batch + 1) int32.
template <typename acc_t>
__global__ void __launch_bounds__(kPrepThreads) roi_align_plane_prep_kernel(
    const acc_t* __restrict__ rois, int64_t num_rois, int64_t batch, acc_t scale,
    int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio, bool aligned,
    int64_t height, RoIBins<acc_t>* __restrict__ bins, int32_t* __restrict__ anchors,
    int32_t* __restrict__ starts, int32_t* __restrict__ order) {
  extern __shared__ int32_t prep_smem[];
  const int64_t groups = batch + 1;
  int32_t* counts = prep_smem;            // RoIs per group, then the cursor of each group
  int32_t* first = prep_smem + groups;    // exclusive prefix sum of counts
  for (int64_t i = threadIdx.x; i < groups; i += blockDim.x) counts[i] = 0;
  __syncthreads();
  for (int64_t k = threadIdx.x; k < num_rois; k += blockDim.x) {
    const acc_t* roi = rois + k * 5;
    const int64_t b = roi_align::roi_batch_index(roi[0], batch);
    atomicAdd(&counts[b < 0 ? batch : b], 1);
    const RoIBins<acc_t> r = roi_align::roi_bins<acc_t>(
        roi[1], roi[2], roi[3], roi[4], scale, pooled_height, pooled_width, sampling_ratio,
        aligned);
    bins[k] = r;
    for (int64_t ph = 0; ph < pooled_height; ++ph) {
      anchors[k * pooled_height + ph] = static_cast<int32_t>(anchor_row(r, ph, height));
    }
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // one warp scans, 32 groups at a time
    const unsigned lane = threadIdx.x;
    int32_t running = 0;
    for (int64_t base = 0; base < groups; base += 32) {
      const int64_t i = base + lane;
      const int32_t v = i < groups ? counts[i] : 0;
      int32_t inclusive = v;
      for (int d = 1; d < 32; d *= 2) {
        const int32_t t = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (static_cast<int>(lane) >= d) inclusive += t;
      }
      if (i < groups) first[i] = running + inclusive - v;
      running += __shfl_sync(0xffffffffu, inclusive, 31);
    }
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < groups; i += blockDim.x) {
    starts[i] = first[i];
    counts[i] = first[i];
  }
  if (threadIdx.x == 0) starts[groups] = static_cast<int32_t>(num_rois);
  __syncthreads();
  for (int64_t k = threadIdx.x; k < num_rois; k += blockDim.x) {
    const int64_t b = roi_align::roi_batch_index(rois[k * 5], batch);
    order[atomicAdd(&counts[b < 0 ? batch : b], 1)] = static_cast<int32_t>(k);
  }
}

// The per-axis rule of build_taps in roi_align.cu: false when the sample lies outside
// [-1, size] (or is NaN); else the two pixels along the axis and the weight l of the far one.
template <typename acc_t>
__device__ __forceinline__ bool axis_tap(acc_t v, int64_t size, int64_t& lo, int64_t& hi, acc_t& l) {
  if (!(v >= acc_t(-1) && v <= static_cast<acc_t>(size))) return false;
  roi_align::axis_weights(v, size, lo, hi, l);
  return true;
}

// i / bins, in 32 bits when i fits (a 64-bit division costs several times more).
__device__ __forceinline__ int64_t item_roi(int64_t i, int bins, bool narrow) {
  if (narrow) return static_cast<int64_t>(static_cast<uint32_t>(i) / static_cast<uint32_t>(bins));
  return i / bins;
}

// Copies count consecutive elements into shared memory, 16 bytes per load when src allows.
template <typename scalar_t>
__device__ __forceinline__ void load_rows(
    const scalar_t* __restrict__ src, int64_t count, scalar_t* __restrict__ dst) {
  constexpr int64_t kPer = 16 / sizeof(scalar_t);
  int64_t done = 0;
  if (reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    const int64_t vecs = count / kPer;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) d[i] = s[i];
    done = vecs * kPer;
  }
  for (int64_t i = done + threadIdx.x; i < count; i += blockDim.x) dst[i] = src[i];
}

// Forward: a block per (image n in [0, batch], channel, band). Group n == batch (RoIs with an
// invalid batch index) writes zeros from band 0.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kPlaneThreads, 2) roi_align_plane_forward_kernel(
    const scalar_t* __restrict__ input, const RoIBins<acc_t>* __restrict__ roi_bins,
    const int32_t* __restrict__ anchors, const int32_t* __restrict__ starts,
    const int32_t* __restrict__ order, int64_t batch, int64_t channels, int64_t height,
    int64_t width, int pooled_height, int pooled_width, int64_t band_core, int64_t band_rows,
    int64_t num_bands, scalar_t* __restrict__ output) {
  extern __shared__ __align__(16) unsigned char plane_smem[];
  const int64_t block = blockIdx.x;
  const int64_t band = block % num_bands;
  const int64_t c = (block / num_bands) % channels;
  const int64_t n = block / (num_bands * channels);
  const int64_t first = starts[n], last = starts[n + 1];
  if (first == last) return;
  const int bins = pooled_height * pooled_width;
  const int64_t items = (last - first) * bins;
  const bool narrow = items <= INT32_MAX;  // 32-bit division then suffices
  if (n == batch) {
    if (band != 0) return;
    for (int64_t i = threadIdx.x; i < items; i += blockDim.x) {
      const int64_t j = i / bins;
      const int64_t k = order[first + j];
      output[(k * channels + c) * bins + (i - j * bins)] = scalar_t(0);
    }
    return;
  }
  const int64_t row0 = band * band_core;
  const int64_t row_end = min(height, row0 + band_rows);
  const scalar_t* plane = input + (n * channels + c) * height * width;
  scalar_t* tile = reinterpret_cast<scalar_t*>(plane_smem);  // rows [row0, row_end)
  load_rows(plane + row0 * width, (row_end - row0) * width, tile);
  __syncthreads();

  for (int64_t i = threadIdx.x; i < items; i += blockDim.x) {
    const int64_t j = item_roi(i, bins, narrow);
    const int bin = static_cast<int>(i - j * bins);
    const int ph = bin / pooled_width, pw = bin - ph * pooled_width;
    const int64_t k = order[first + j];
    const int64_t anchor = anchors[k * pooled_height + ph];
    if (anchor < row0 || anchor >= row0 + band_core) continue;
    const RoIBins<acc_t> r = roi_bins[k];
    const int64_t gh = r.grid_h, gw = r.grid_w;
    // the bin's sample columns, kept in registers when there are few
    // (x_lo, x_hi) of each sample column as int32 (width < 2^31); x_lo = -1: reads nothing
    int32_t xlo_c[kXCache], xhi_c[kXCache];
    acc_t lx_c[kXCache];
    const bool cached = gw <= kXCache;
    if (cached) {
#pragma unroll
      for (int ix = 0; ix < kXCache; ++ix) {
        int64_t lo = -1, hi = -1;
        acc_t l = acc_t(0);
        if (!(ix < gw &&
              axis_tap(roi_align::sample_coord(r.start_w, r.bin_w, int64_t{pw}, int64_t{ix}, gw),
                       width, lo, hi, l))) {
          lo = hi = -1;
        }
        xlo_c[ix] = static_cast<int32_t>(lo);
        xhi_c[ix] = static_cast<int32_t>(hi);
        lx_c[ix] = l;
      }
    }
    acc_t sum = 0;
    for (int64_t iy = 0; iy < gh; ++iy) {
      int64_t ylo, yhi;
      acc_t ly;
      if (!axis_tap(roi_align::sample_coord(r.start_h, r.bin_h, int64_t{ph}, iy, gh), height, ylo,
                    yhi, ly)) {
        continue;
      }
      const acc_t hy = acc_t(1) - ly;
      const bool in_tile = ylo >= row0 && yhi < row_end;
      // one sample: the expression of the tiled kernel of roi_align.cu, term for term
      auto add = [&](const scalar_t* lo_row, const scalar_t* hi_row, int64_t xlo, int64_t xhi,
                     acc_t lx) {
        const acc_t hx = acc_t(1) - lx;
        sum += (hy * hx) * static_cast<acc_t>(lo_row[xlo]) +
            (hy * lx) * static_cast<acc_t>(lo_row[xhi]) +
            (ly * hx) * static_cast<acc_t>(hi_row[xlo]) +
            (ly * lx) * static_cast<acc_t>(hi_row[xhi]);
      };
      auto row_loop = [&](const scalar_t* lo_row, const scalar_t* hi_row) {
        if (cached) {
#pragma unroll
          for (int ix = 0; ix < kXCache; ++ix) {
            if (xlo_c[ix] >= 0) add(lo_row, hi_row, xlo_c[ix], xhi_c[ix], lx_c[ix]);
          }
        } else {
          for (int64_t ix = 0; ix < gw; ++ix) {
            int64_t xlo, xhi;
            acc_t lx;
            if (!axis_tap(roi_align::sample_coord(r.start_w, r.bin_w, int64_t{pw}, ix, gw), width,
                          xlo, xhi, lx)) {
              continue;
            }
            add(lo_row, hi_row, xlo, xhi, lx);
          }
        }
      };
      if (in_tile) {
        row_loop(tile + (ylo - row0) * width, tile + (yhi - row0) * width);
      } else {
        row_loop(plane + ylo * width, plane + yhi * width);
      }
    }
    output[(k * channels + c) * bins + bin] = static_cast<scalar_t>(sum / r.count);
  }
}

// Backward: a block per (image, channel, band); bands partition the rows. Every row of
// grad_input is written exactly once (zeros for images without RoIs).
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kPlaneThreads, 2) roi_align_plane_backward_kernel(
    const scalar_t* __restrict__ grad, const RoIBins<acc_t>* __restrict__ roi_bins,
    const int32_t* __restrict__ starts, const int32_t* __restrict__ order, int64_t channels,
    int64_t height, int64_t width, int pooled_height, int pooled_width, int64_t band_core,
    int64_t num_bands, scalar_t* __restrict__ grad_input) {
  extern __shared__ __align__(16) unsigned char plane_smem[];
  acc_t* acc = reinterpret_cast<acc_t*>(plane_smem);  // rows [row0, row_end) of the plane
  const int64_t block = blockIdx.x;
  const int64_t band = block % num_bands;
  const int64_t c = (block / num_bands) % channels;
  const int64_t n = block / (num_bands * channels);
  const int64_t row0 = band * band_core;
  const int64_t row_end = min(height, row0 + band_core);
  const int64_t count = (row_end - row0) * width;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) acc[i] = acc_t(0);
  __syncthreads();

  const int64_t first = starts[n], last = starts[n + 1];
  const int bins = pooled_height * pooled_width;
  const int64_t items = (last - first) * bins;
  const bool narrow = items <= INT32_MAX;  // 32-bit division then suffices
  // A sample at y reads rows min(floor(max(y, 0)), H - 1) and the one below it (row 1 when
  // y <= 0, with weight 0), so a bin whose sample rows all lie below skip_below, or at or past
  // skip_from, touches no row of this band (a sample at y == H reads row H - 1, so the last
  // band skips nothing from above).
  const acc_t skip_below = static_cast<acc_t>(row0 <= 1 ? -1 : row0 - 1);
  const acc_t skip_from = row_end < height ? static_cast<acc_t>(row_end)
                                           : std::numeric_limits<acc_t>::infinity();
  for (int64_t i = threadIdx.x; i < items; i += blockDim.x) {
    const int64_t j = item_roi(i, bins, narrow);
    const int bin = static_cast<int>(i - j * bins);
    const int64_t k = order[first + j];
    const acc_t go = static_cast<acc_t>(grad[(k * channels + c) * bins + bin]);
    if (go == acc_t(0)) continue;
    const RoIBins<acc_t> r = roi_bins[k];
    const int64_t gh = r.grid_h, gw = r.grid_w;
    if (gh <= 0 || gw <= 0) continue;
    const int ph = bin / pooled_width, pw = bin - ph * pooled_width;
    {
      // sample rows are monotone in iy: the first and the last bound them
      const acc_t y0 = roi_align::sample_coord(r.start_h, r.bin_h, int64_t{ph}, int64_t{0}, gh);
      const acc_t y1 = roi_align::sample_coord(r.start_h, r.bin_h, int64_t{ph}, gh - 1, gh);
      const acc_t ymin = y0 <= y1 ? y0 : y1, ymax = y0 <= y1 ? y1 : y0;
      if (ymax < skip_below || ymin >= skip_from) continue;
    }
    const acc_t gv = go / r.count;
    // (x_lo, x_hi) of each sample column as int32 (width < 2^31); x_lo = -1: reads nothing
    int32_t xlo_c[kXCache], xhi_c[kXCache];
    acc_t lx_c[kXCache];
    const bool cached = gw <= kXCache;
    if (cached) {
#pragma unroll
      for (int ix = 0; ix < kXCache; ++ix) {
        int64_t lo = -1, hi = -1;
        acc_t l = acc_t(0);
        if (!(ix < gw &&
              axis_tap(roi_align::sample_coord(r.start_w, r.bin_w, int64_t{pw}, int64_t{ix}, gw),
                       width, lo, hi, l))) {
          lo = hi = -1;
        }
        xlo_c[ix] = static_cast<int32_t>(lo);
        xhi_c[ix] = static_cast<int32_t>(hi);
        lx_c[ix] = l;
      }
    }
    for (int64_t iy = 0; iy < gh; ++iy) {
      int64_t ylo, yhi;
      acc_t ly;
      if (!axis_tap(roi_align::sample_coord(r.start_h, r.bin_h, int64_t{ph}, iy, gh), height, ylo,
                    yhi, ly)) {
        continue;
      }
      const bool lo_in = ylo >= row0 && ylo < row_end;
      const bool hi_in = yhi >= row0 && yhi < row_end;
      if (!lo_in && !hi_in) continue;
      const acc_t hy = acc_t(1) - ly;
      acc_t* lo_row = acc + (ylo - row0) * width;
      acc_t* hi_row = acc + (yhi - row0) * width;
      // the weights of the atomic kernels of roi_align.cu
      auto scatter = [&](int64_t xlo, int64_t xhi, acc_t lx) {
        const acc_t hx = acc_t(1) - lx;
        if (lo_in) {
          atomicAdd(lo_row + xlo, (hy * hx) * gv);
          atomicAdd(lo_row + xhi, (hy * lx) * gv);
        }
        if (hi_in) {
          atomicAdd(hi_row + xlo, (ly * hx) * gv);
          atomicAdd(hi_row + xhi, (ly * lx) * gv);
        }
      };
      if (cached) {
#pragma unroll
        for (int ix = 0; ix < kXCache; ++ix) {
          if (xlo_c[ix] >= 0) scatter(xlo_c[ix], xhi_c[ix], lx_c[ix]);
        }
      } else {
        for (int64_t ix = 0; ix < gw; ++ix) {
          int64_t xlo, xhi;
          acc_t lx;
          if (!axis_tap(roi_align::sample_coord(r.start_w, r.bin_w, int64_t{pw}, ix, gw), width,
                        xlo, xhi, lx)) {
            continue;
          }
          scatter(xlo, xhi, lx);
        }
      }
    }
  }
  __syncthreads();
  scalar_t* out = grad_input + ((n * channels + c) * height + row0) * width;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) out[i] = static_cast<scalar_t>(acc[i]);
}

// -1: decide by shape, 0: never, 1: whenever the kernels fit.
int plane_mode() {
  const char* v = std::getenv("DETOPS_ROI_ALIGN_PLANE");
  if (v == nullptr) return -1;
  const std::string s(v);
  if (s == "0") return 0;
  if (s == "1") return 1;
  return -1;
}

// The cap on band rows set by DETOPS_ROI_ALIGN_PLANE_ROWS, or 0.
int64_t rows_cap() {
  const char* v = std::getenv("DETOPS_ROI_ALIGN_PLANE_ROWS");
  if (v == nullptr) return 0;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  return end != v && n > 0 ? static_cast<int64_t>(n) : 0;
}

struct Bands {
  int64_t rows = 0;       // rows of a band held in shared memory
  int64_t core = 0;       // band b owns rows [b * core, (b + 1) * core)
  int64_t count = 0;      // bands per plane
  size_t smem_bytes = 0;  // dynamic shared memory of a block
};

// Rows of `row_bytes` each that a block may hold: half an SM's shared memory (two blocks per
// SM, so that one loads while the other computes), or the opt-in maximum of one block when
// the half would cut the plane into bands thinner than 64 rows.
int64_t band_rows_for(int64_t height, int64_t row_bytes) {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  const int64_t reserved = static_cast<int64_t>(prop->reservedSharedMemPerBlock);
  const int64_t half = static_cast<int64_t>(prop->sharedMemPerMultiprocessor) / 2 - reserved;
  int64_t rows = std::max<int64_t>(0, half) / row_bytes;
  if (rows < height && rows < 64) {
    rows = static_cast<int64_t>(prop->sharedMemPerBlockOptin) / row_bytes;
  }
  const int64_t cap = rows_cap();
  if (cap > 0) rows = std::min(rows, cap);
  return std::min(rows, height);
}

// Overlapping forward bands: core rows plus a halo of up to kHaloRows.
Bands forward_bands(int64_t height, int64_t width, int64_t elem_bytes) {
  Bands b;
  const int64_t rows = band_rows_for(height, width * elem_bytes);
  if (rows < 1) return b;
  if (rows >= height) {
    b.rows = b.core = height;
    b.count = 1;
  } else {
    const int64_t halo = std::min(kHaloRows, rows / 2);
    b.count = cuda::ceil_div(height, rows - halo);
    b.core = cuda::ceil_div(height, b.count);
    b.rows = std::min(rows, b.core + halo);
  }
  b.smem_bytes = static_cast<size_t>(b.rows * width * elem_bytes);
  return b;
}

// Backward bands partition the rows; each holds its rows in the accumulation type.
Bands backward_bands(int64_t height, int64_t width, int64_t acc_bytes) {
  Bands b;
  const int64_t rows = band_rows_for(height, width * acc_bytes);
  if (rows < 1) return b;
  b.count = cuda::ceil_div(height, rows);
  b.core = b.rows = cuda::ceil_div(height, b.count);
  b.smem_bytes = static_cast<size_t>(b.rows * width * acc_bytes);
  return b;
}

// Whether the plane kernels should run for these sizes (bands already planned).
bool wanted(
    int64_t batch, int64_t channels, int64_t height, int64_t width, int64_t num_rois,
    int64_t bins, int64_t sampling_ratio, const Bands& bands, int64_t blocks) {
  const int mode = plane_mode();
  if (mode == 0) return false;
  // what the kernels can index and the prep block can group
  if (bands.count < 1 || batch < 1 || batch > kMaxBatch || height < 1 || width < 1 ||
      channels < 1 || num_rois < 1 || num_rois >= (int64_t{1} << 31) ||
      height * width >= (int64_t{1} << 31) || bins > (int64_t{1} << 20) ||
      blocks >= (int64_t{1} << 31)) {
    return false;
  }
  if (mode == 1) return true;
  if (bands.rows < std::min(height, kMinAutoRows)) return false;
  // Reading a plane once costs about its bytes; reading samples from global memory costs a
  // 32-byte sector per pixel read. Plane pays once the pixel reads reach the element count.
  const int64_t per_bin = sampling_ratio > 0 ? sampling_ratio * sampling_ratio : 4;
  const double pixel_reads = static_cast<double>(num_rois) * channels * bins * per_bin * 4;
  return pixel_reads >= static_cast<double>(batch) * channels * height * width;
}

struct Prep {
  at::Tensor bins, anchors, starts, order;
};

template <typename acc_t>
Prep prepare(
    const at::Tensor& rois, int64_t batch, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, bool aligned, int64_t height,
    cudaStream_t stream) {
  const int64_t num_rois = rois.size(0);
  const auto opts = rois.options();
  Prep p;
  p.bins = at::empty(
      {num_rois * static_cast<int64_t>(sizeof(RoIBins<acc_t>))}, opts.dtype(at::kByte));
  p.anchors = at::empty({num_rois * pooled_height}, opts.dtype(at::kInt));
  p.starts = at::empty({batch + 2}, opts.dtype(at::kInt));
  p.order = at::empty({num_rois}, opts.dtype(at::kInt));
  const size_t smem = static_cast<size_t>(2 * (batch + 1) * sizeof(int32_t));
  roi_align_plane_prep_kernel<acc_t><<<1, kPrepThreads, smem, stream>>>(
      rois.const_data_ptr<acc_t>(), num_rois, batch, static_cast<acc_t>(spatial_scale),
      pooled_height, pooled_width, sampling_ratio, aligned, height,
      reinterpret_cast<RoIBins<acc_t>*>(p.bins.data_ptr()), p.anchors.data_ptr<int32_t>(),
      p.starts.data_ptr<int32_t>(),
      p.order.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return p;
}

template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
}

}  // namespace

bool forward(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, bool aligned, at::Tensor& output) {
  if (input.is_contiguous(at::MemoryFormat::ChannelsLast) && !input.is_contiguous()) return false;
  const int64_t batch = input.size(0), channels = input.size(1);
  const int64_t height = input.size(2), width = input.size(3);
  const int64_t bins = pooled_height * pooled_width;
  const Bands bands = forward_bands(height, width, input.element_size());
  const int64_t blocks = (batch + 1) * channels * bands.count;
  if (!wanted(batch, channels, height, width, rois.size(0), bins, sampling_ratio, bands, blocks)) {
    return false;
  }
  const c10::cuda::CUDAGuard guard(input.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor x = input.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), kForwardOp, [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const Prep p = prepare<acc_t>(
        rois, batch, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned, height,
        stream);
    auto kernel = roi_align_plane_forward_kernel<scalar_t, acc_t>;
    allow_smem(kernel, bands.smem_bytes);
    kernel<<<static_cast<unsigned>(blocks), kPlaneThreads, bands.smem_bytes, stream>>>(
        x.const_data_ptr<scalar_t>(), reinterpret_cast<const RoIBins<acc_t>*>(p.bins.const_data_ptr()),
        p.anchors.const_data_ptr<int32_t>(), p.starts.const_data_ptr<int32_t>(),
        p.order.const_data_ptr<int32_t>(), batch, channels,
        height, width, static_cast<int>(pooled_height), static_cast<int>(pooled_width),
        bands.core, bands.rows, bands.count, output.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return true;
}

at::Tensor backward(
    const at::Tensor& grad, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t batch_size, int64_t channels, int64_t height, int64_t width,
    int64_t sampling_ratio, bool aligned) {
  const int64_t bins = pooled_height * pooled_width;
  const int64_t acc_bytes = grad.scalar_type() == at::kDouble ? 8 : 4;
  const Bands bands = backward_bands(height, width, acc_bytes);
  const int64_t blocks = batch_size * channels * bands.count;
  if (!wanted(batch_size, channels, height, width, rois.size(0), bins, sampling_ratio, bands,
              blocks)) {
    return at::Tensor();
  }
  const c10::cuda::CUDAGuard guard(grad.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor g = grad.contiguous();
  at::Tensor grad_input = at::empty({batch_size, channels, height, width}, grad.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), kBackwardOp, [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const Prep p = prepare<acc_t>(
        rois, batch_size, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned,
        height, stream);
    auto kernel = roi_align_plane_backward_kernel<scalar_t, acc_t>;
    allow_smem(kernel, bands.smem_bytes);
    kernel<<<static_cast<unsigned>(blocks), kPlaneThreads, bands.smem_bytes, stream>>>(
        g.const_data_ptr<scalar_t>(), reinterpret_cast<const RoIBins<acc_t>*>(p.bins.const_data_ptr()),
        p.starts.const_data_ptr<int32_t>(), p.order.const_data_ptr<int32_t>(), channels, height,
        width, static_cast<int>(pooled_height), static_cast<int>(pooled_width), bands.core,
        bands.count, grad_input.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad_input;
}

}  // namespace roi_align_plane
}  // namespace ops
}  // namespace detops
