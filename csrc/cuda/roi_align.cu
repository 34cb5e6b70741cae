// RoIAlign forward and backward on CUDA.
//
// forward: one thread per output element (RoI, channel, bin) sums the bin's samples.
// backward, two kernels, picked by at::globalContext().deterministicAlgorithms():
//   atomic (default): one thread per grad element scatters its samples into a zeroed
//     grad_input with atomics (float32 / float64 accumulators; float16 and bfloat16 grads
//     accumulate in a float32 buffer). Fast, but the order of the additions varies.
//   deterministic: the contributions of bilinear sampling (pixel, weight, source bin) do not
//     depend on the channel, so
//       1. one thread per (RoI, bin) lists the bin's contributions, keyed by pixel
//          (b * H * W + y * W + x; samples that read nothing get the key B * H * W);
//       2. a stable sort by key groups the contributions of each pixel, in list order;
//       3. searchsorted finds each pixel's segment (no host sync);
//       4. one thread per grad_input element sums its pixel's segment for its channel, in
//          sorted order, and writes the element once.
//     Bit-identical from run to run. The list length is known on the host when
//     sampling_ratio > 0; with an adaptive grid one sync reads it.
// rois[:, 0] must hold integers in [0, B): a RoI whose batch index is not one contributes
// nothing in every kernel, and an asynchronous device assert reports it without a host sync.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/Atomic.cuh>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>
#include <string>

#include "../common/roi_align_checks.h"
#include "../common/roi_align_geometry.h"
#include "cuda_helpers.h"

namespace detops {
namespace ops {
namespace {

constexpr const char* kForwardOp = "detops.roi_align";
constexpr const char* kBackwardOp = "detops._roi_align_backward";
constexpr int kThreads = 256;
// A deterministic backward whose contribution list would pass this many entries is refused.
constexpr int64_t kMaxContributions = int64_t{1} << 40;

using roi_align::BilinearSample;
using roi_align::RoIBins;

template <typename T>
__device__ __forceinline__ RoIBins<T> bins_of(
    const T* roi, T scale, int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio,
    bool aligned) {
  return roi_align::roi_bins<T>(
      roi[1], roi[2], roi[3], roi[4], scale, pooled_height, pooled_width, sampling_ratio,
      aligned);
}

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
    output[idx] = static_cast<scalar_t>(sum / r.count);
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
    acc_t* plane = grad_input + (b * channels + c) * height * width;
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
}

// Deterministic backward, step 0 (adaptive grid only): contributions of each RoI, 4 per
// sample; 0 for a RoI with an invalid batch index.
template <typename acc_t>
__global__ void roi_contribution_count_kernel(
    int64_t num_rois, const acc_t* __restrict__ rois, int64_t batch, int64_t pooled_height,
    int64_t pooled_width, acc_t scale, int64_t sampling_ratio, bool aligned,
    int64_t* __restrict__ counts) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < num_rois;
       k += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const acc_t* roi = rois + k * 5;
    if (roi_align::roi_batch_index(roi[0], batch) < 0) {
      counts[k] = 0;
      continue;
    }
    const RoIBins<acc_t> r =
        bins_of(roi, scale, pooled_height, pooled_width, sampling_ratio, aligned);
    // grid_h, grid_w <= 2^16: the product is exact; the cap keeps the prefix sum in range.
    const int64_t per_bin = r.grid_h * r.grid_w * 4;
    const int64_t bins = pooled_height * pooled_width;
    counts[k] = per_bin > 0 && bins > kMaxContributions / per_bin ? kMaxContributions
                                                                  : per_bin * bins;
  }
}

// Deterministic backward, step 1: one thread per (RoI, bin) writes the bin's contributions at
// first[k] + bin * grid_h * grid_w * 4 (first == nullptr: at k * per_roi).
template <typename key_t, typename acc_t>
__global__ void roi_contribution_kernel(
    int64_t total_bins, const acc_t* __restrict__ rois, int64_t batch, int64_t channels,
    int64_t height, int64_t width, int64_t pooled_height, int64_t pooled_width, acc_t scale,
    int64_t sampling_ratio, bool aligned, const int64_t* __restrict__ first, int64_t per_roi,
    key_t* __restrict__ keys, acc_t* __restrict__ weights, int64_t* __restrict__ sources) {
  const key_t sentinel = static_cast<key_t>(batch * height * width);
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
          weights[j] = acc_t(0);
          sources[j] = 0;
        }
      }
      continue;
    }
    const int64_t ph = bin / pooled_width, pw = bin % pooled_width;
    const int64_t source = k * channels * bins + bin;
    const int64_t image = b * height * width;
    BilinearSample<acc_t> s;
    for (int64_t iy = 0; iy < r.grid_h; ++iy) {
      const acc_t y = roi_align::sample_coord(r.start_h, r.bin_h, ph, iy, r.grid_h);
      for (int64_t ix = 0; ix < r.grid_w; ++ix, j += 4) {
        const acc_t x = roi_align::sample_coord(r.start_w, r.bin_w, pw, ix, r.grid_w);
        if (!roi_align::bilinear_sample(y, x, height, width, s)) {
          for (int e = 0; e < 4; ++e) {
            keys[j + e] = sentinel;
            weights[j + e] = acc_t(0);
            sources[j + e] = 0;
          }
          continue;
        }
        const int64_t row_lo = image + s.y_low * width, row_hi = image + s.y_high * width;
        keys[j + 0] = static_cast<key_t>(row_lo + s.x_low);
        keys[j + 1] = static_cast<key_t>(row_lo + s.x_high);
        keys[j + 2] = static_cast<key_t>(row_hi + s.x_low);
        keys[j + 3] = static_cast<key_t>(row_hi + s.x_high);
        weights[j + 0] = s.w1 / r.count;
        weights[j + 1] = s.w2 / r.count;
        weights[j + 2] = s.w3 / r.count;
        weights[j + 3] = s.w4 / r.count;
        for (int e = 0; e < 4; ++e) sources[j + e] = source;
      }
    }
  }
}

// Deterministic backward, step 4: grad_input[b, c, y, x] = sum over the segment of pixel
// (b, y, x), in sorted order, of weight * grad[source + c * bins].
template <typename scalar_t, typename acc_t>
__global__ void roi_align_gather_kernel(
    int64_t total, int64_t channels, int64_t plane_size, int64_t bins,
    const int64_t* __restrict__ segment, const acc_t* __restrict__ weights,
    const int64_t* __restrict__ sources, const scalar_t* __restrict__ grad,
    scalar_t* __restrict__ grad_input) {
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t p = idx % plane_size;
    const int64_t c = (idx / plane_size) % channels;
    const int64_t b = idx / (plane_size * channels);
    const int64_t key = b * plane_size + p;
    const int64_t channel_offset = c * bins;
    acc_t sum = 0;
    for (int64_t j = segment[key], e = segment[key + 1]; j < e; ++j) {
      sum += weights[j] * static_cast<acc_t>(grad[sources[j] + channel_offset]);
    }
    grad_input[idx] = static_cast<scalar_t>(sum);
  }
}

// Reports a RoI whose batch index is not an integer in [0, batch) through a device assert,
// without waiting for the device. The kernels already ignore such RoIs.
void assert_batch_indices(const char* op, const at::Tensor& rois, int64_t batch) {
  const at::Tensor index = rois.select(1, 0);
  const at::Tensor ok = at::logical_and(
      at::logical_and(index >= 0, index < static_cast<double>(batch)), index == index.trunc());
  const std::string msg = std::string(op) + ": rois[:, 0] (the batch index) must hold integers in [0, " +
      std::to_string(batch) + ")";
  at::_assert_async(ok.all(), msg);
}

at::ScalarType acc_dtype_of(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

at::Tensor roi_align_forward_cuda(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, bool aligned) {
  checks::check_roi_align_inputs(
      kForwardOp, input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio);
  checks::check_device(kForwardOp, "input", input, at::kCUDA);
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor output =
      at::empty({rois.size(0), input.size(1), pooled_height, pooled_width}, input.options());
  if (output.numel() == 0) return output;
  const int64_t batch = input.size(0);
  assert_batch_indices(kForwardOp, rois, batch);
  const at::Tensor x = input.contiguous();
  const at::Tensor r = rois.to(acc_dtype_of(rois.scalar_type())).contiguous();
  const int64_t total = output.numel();
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), kForwardOp, [&] {
    using acc_t = at::opmath_type<scalar_t>;
    roi_align_forward_kernel<scalar_t, acc_t>
        <<<cuda::grid_for(total, kThreads), kThreads, 0, stream>>>(
            total, x.const_data_ptr<scalar_t>(), r.const_data_ptr<acc_t>(), batch, x.size(1),
            x.size(2), x.size(3), pooled_height, pooled_width, static_cast<acc_t>(spatial_scale),
            sampling_ratio, aligned, output.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return output;
}

template <typename scalar_t, typename key_t>
void backward_deterministic(
    const at::Tensor& grad, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, bool aligned, at::Tensor& grad_input) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t batch = grad_input.size(0), channels = grad_input.size(1);
  const int64_t height = grad_input.size(2), width = grad_input.size(3);
  const int64_t num_rois = rois.size(0);
  const int64_t bins = pooled_height * pooled_width;
  const acc_t scale = static_cast<acc_t>(spatial_scale);
  const acc_t* roi_ptr = rois.const_data_ptr<acc_t>();
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto long_opts = grad.options().dtype(at::kLong);

  // Where each RoI's contributions start, and how many there are in all.
  at::Tensor first;
  int64_t per_roi = 0, total = 0;
  if (sampling_ratio > 0) {
    const double n = static_cast<double>(num_rois) * bins * sampling_ratio * sampling_ratio * 4;
    DETOPS_CHECK(
        n <= static_cast<double>(kMaxContributions), kBackwardOp,
        ": too many samples for the deterministic backward (", n, " contributions)");
    per_roi = bins * sampling_ratio * sampling_ratio * 4;
    total = num_rois * per_roi;
  } else {
    DETOPS_CHECK(
        num_rois < (int64_t{1} << 22), kBackwardOp,
        ": the deterministic backward with an adaptive grid takes at most 2^22 RoIs, got ",
        num_rois);
    at::Tensor counts = at::empty({num_rois}, long_opts);
    roi_contribution_count_kernel<acc_t>
        <<<cuda::grid_for(num_rois, kThreads), kThreads, 0, stream>>>(
            num_rois, roi_ptr, batch, pooled_height, pooled_width, scale, sampling_ratio,
            aligned, counts.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const at::Tensor ends = counts.cumsum(0);
    first = ends - counts;
    total = ends[-1].item<int64_t>();  // the one host sync: it sizes the list
    DETOPS_CHECK(
        total < kMaxContributions, kBackwardOp,
        ": too many samples for the deterministic backward (", total, " contributions)");
  }

  const at::ScalarType key_dtype = c10::CppTypeToScalarType<key_t>::value;
  at::Tensor keys = at::empty({total}, grad.options().dtype(key_dtype));
  at::Tensor weights = at::empty({total}, grad.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
  at::Tensor sources = at::empty({total}, long_opts);
  if (total > 0) {
    const int64_t total_bins = num_rois * bins;
    roi_contribution_kernel<key_t, acc_t>
        <<<cuda::grid_for(total_bins, kThreads), kThreads, 0, stream>>>(
            total_bins, roi_ptr, batch, channels, height, width, pooled_height, pooled_width,
            scale, sampling_ratio, aligned,
            first.defined() ? first.const_data_ptr<int64_t>() : nullptr, per_roi,
            keys.data_ptr<key_t>(), weights.data_ptr<acc_t>(), sources.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // Group by pixel; equal keys keep their list order, which fixes the order of the sums.
  const auto sorted = keys.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor& sorted_keys = std::get<0>(sorted);
  const at::Tensor& perm = std::get<1>(sorted);
  const at::Tensor sorted_weights = weights.index_select(0, perm);
  const at::Tensor sorted_sources = sources.index_select(0, perm);
  const int64_t pixels = batch * height * width;
  const at::Tensor segment = at::searchsorted(
      sorted_keys, at::arange(pixels + 1, grad.options().dtype(key_dtype)),
      /*out_int32=*/false, /*right=*/false);

  const at::Tensor g = grad.contiguous();
  const int64_t n = grad_input.numel();
  roi_align_gather_kernel<scalar_t, acc_t><<<cuda::grid_for(n, kThreads), kThreads, 0, stream>>>(
      n, channels, height * width, bins, segment.const_data_ptr<int64_t>(),
      sorted_weights.const_data_ptr<acc_t>(), sorted_sources.const_data_ptr<int64_t>(),
      g.const_data_ptr<scalar_t>(), grad_input.data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  assert_batch_indices(kBackwardOp, rois, batch_size);
  const at::Tensor r = rois.to(acc_dtype_of(dtype)).contiguous();

  if (at::globalContext().deterministicAlgorithms()) {
    at::Tensor grad_input = at::empty({batch_size, channels, height, width}, grad.options());
    const bool small_keys = batch_size * height * width < std::numeric_limits<int32_t>::max();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, kBackwardOp, [&] {
      if (small_keys) {
        backward_deterministic<scalar_t, int32_t>(
            grad, r, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned,
            grad_input);
      } else {
        backward_deterministic<scalar_t, int64_t>(
            grad, r, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned,
            grad_input);
      }
    });
    return grad_input;
  }

  at::Tensor acc = at::zeros(
      {batch_size, channels, height, width}, grad.options().dtype(acc_dtype_of(dtype)));
  const at::Tensor g = grad.contiguous();
  const int64_t total = g.numel();
  if (total > 0) {
    cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, kBackwardOp, [&] {
      using acc_t = at::opmath_type<scalar_t>;
      roi_align_backward_atomic_kernel<scalar_t, acc_t>
          <<<cuda::grid_for(total, kThreads), kThreads, 0, stream>>>(
              total, g.const_data_ptr<scalar_t>(), r.const_data_ptr<acc_t>(), batch_size,
              channels, height, width, pooled_height, pooled_width,
              static_cast<acc_t>(spatial_scale), sampling_ratio, aligned, acc.data_ptr<acc_t>());
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
