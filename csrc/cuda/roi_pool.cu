// RoIPool (max) forward and backward on CUDA.
//
// Forward: one thread per output element (RoI, channel, bin), reading the input through its
// strides (any memory layout, no copy). The bin geometry is the one the CPU kernel uses
// (common/roi_pool_geometry.h), so both devices pick the same pixels.
//
// Backward, two variants:
//   * atomic (default): one thread per grad_output element adds it to the argmax pixel of
//     grad_input with gpuAtomicAdd (a float32 accumulator for float16 / bfloat16); the order of
//     the additions, hence the rounding, varies.
//   * deterministic (torch.use_deterministic_algorithms(True)): every grad_output element gets
//     the key (b * C + c) * H * W + argmax of the pixel it feeds (a sentinel past the end for
//     empty bins); a stable sort by key groups the contributions of each pixel in RoI order,
//     and one thread per group (its first element) sums the group and writes the pixel once.
//     Bit-identical from run to run, with the same summation order as the CPU kernel.
//
// Batch indices are checked on the device (at::_assert_async) instead of with a host sync;
// a RoI with an invalid index has only empty bins and receives no gradient, so nothing is
// read or written out of bounds either way.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/Atomic.cuh>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

#include "../common/checks.h"
#include "../common/roi_pool_geometry.h"
#include "cuda_helpers.h"

namespace detops {
namespace ops {
namespace {

using geometry::roi_pool_bin;
using geometry::roi_pool_box;

constexpr int kThreads = 256;

// Sizes and strides of a [K, C, PH, PW] gradient, with the flat-index decomposition.
struct PooledIndex {
  int64_t channels, pooled_height, pooled_width;
  int64_t s_k, s_c, s_h, s_w;

  __device__ void split(int64_t i, int64_t& k, int64_t& c, int64_t& ph, int64_t& pw) const {
    pw = i % pooled_width;
    i /= pooled_width;
    ph = i % pooled_height;
    i /= pooled_height;
    c = i % channels;
    k = i / channels;
  }
  __device__ int64_t offset(int64_t i) const {
    int64_t k, c, ph, pw;
    split(i, k, c, ph, pw);
    return k * s_k + c * s_c + ph * s_h + pw * s_w;
  }
};

template <typename scalar_t>
__global__ void roi_pool_forward_kernel(
    int64_t total, const scalar_t* __restrict__ input, int64_t batch, int64_t channels,
    int64_t height, int64_t width, int64_t s_b, int64_t s_c, int64_t s_h, int64_t s_w,
    const scalar_t* __restrict__ rois, at::opmath_type<scalar_t> scale, int64_t pooled_height,
    int64_t pooled_width, scalar_t* __restrict__ output, int32_t* __restrict__ argmax) {
  using acc_t = at::opmath_type<scalar_t>;
  const PooledIndex index{channels, pooled_height, pooled_width, 0, 0, 0, 0};
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    int64_t k, c, ph, pw;
    index.split(i, k, c, ph, pw);
    const scalar_t* roi = rois + k * 5;
    const auto box = roi_pool_box<acc_t>(
        static_cast<acc_t>(roi[0]), static_cast<acc_t>(roi[1]), static_cast<acc_t>(roi[2]),
        static_cast<acc_t>(roi[3]), static_cast<acc_t>(roi[4]), scale, batch, pooled_height,
        pooled_width);
    int64_t h0, h1, w0, w1;
    if (!roi_pool_bin(box, ph, pw, height, width, h0, h1, w0, w1)) {
      output[i] = scalar_t(0);
      argmax[i] = -1;
      continue;
    }
    const scalar_t* plane = input + box.batch * s_b + c * s_c;
    int64_t best_idx;
    const acc_t best =
        geometry::roi_pool_max<acc_t>(plane, s_h, s_w, width, h0, h1, w0, w1, best_idx);
    output[i] = static_cast<scalar_t>(best);
    argmax[i] = static_cast<int32_t>(best_idx);
  }
}

// Flat grad_input index fed by grad_output element i, or -1 (empty bin, invalid batch index,
// argmax out of range).
template <typename scalar_t>
__device__ __forceinline__ int64_t roi_pool_target(
    int64_t i, const PooledIndex& index, const int32_t* __restrict__ argmax,
    const scalar_t* __restrict__ rois, int64_t batch, int64_t plane_size) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t a = argmax[i];
  if (a < 0 || a >= plane_size) return -1;
  int64_t k, c, ph, pw;
  index.split(i, k, c, ph, pw);
  const int64_t b = geometry::roi_pool_batch_index(static_cast<acc_t>(rois[k * 5]), batch);
  if (b < 0) return -1;
  return (b * index.channels + c) * plane_size + a;
}

// Adds into an accumulator of the op-math type (float32 for float16 / bfloat16 grads), so
// that many contributions to one pixel do not each round to half precision.
template <typename scalar_t>
__global__ void roi_pool_backward_atomic_kernel(
    int64_t total, const scalar_t* __restrict__ grad, PooledIndex index,
    const int32_t* __restrict__ argmax, const scalar_t* __restrict__ rois, int64_t batch,
    int64_t plane_size, at::opmath_type<scalar_t>* __restrict__ grad_input) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t t = roi_pool_target(i, index, argmax, rois, batch, plane_size);
    if (t >= 0) gpuAtomicAdd(grad_input + t, static_cast<acc_t>(grad[index.offset(i)]));
  }
}

template <typename scalar_t, typename key_t>
__global__ void roi_pool_backward_keys_kernel(
    int64_t total, PooledIndex index, const int32_t* __restrict__ argmax,
    const scalar_t* __restrict__ rois, int64_t batch, int64_t plane_size, key_t sentinel,
    key_t* __restrict__ keys) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t t = roi_pool_target(i, index, argmax, rois, batch, plane_size);
    keys[i] = t >= 0 ? static_cast<key_t>(t) : sentinel;
  }
}

// One thread per run of equal keys (at its first position) sums the run in sorted order.
template <typename scalar_t, typename key_t>
__global__ void roi_pool_backward_segments_kernel(
    int64_t total, const key_t* __restrict__ keys, const int64_t* __restrict__ order,
    const scalar_t* __restrict__ grad, PooledIndex index, key_t sentinel,
    scalar_t* __restrict__ grad_input) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < total;
       j += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const key_t key = keys[j];
    if (key == sentinel || (j > 0 && keys[j - 1] == key)) continue;
    acc_t sum = acc_t(0);
    for (int64_t t = j; t < total && keys[t] == key; ++t) {
      sum += static_cast<acc_t>(grad[index.offset(order[t])]);
    }
    grad_input[key] = static_cast<scalar_t>(sum);
  }
}

// Device-side check of the batch indices: no host sync, the error surfaces at the next sync.
void assert_batch_indices(const at::Tensor& rois, int64_t batch, const char* message) {
  const at::Tensor b = rois.select(1, 0);
  at::_assert_async(at::logical_and(at::logical_and(b >= 0, b < batch), b == b.floor()).all(), message);
}

std::tuple<at::Tensor, at::Tensor> roi_pool_forward_cuda(
    const at::Tensor& input, const at::Tensor& rois_in, double spatial_scale,
    int64_t pooled_height, int64_t pooled_width) {
  checks::check_roi_pool_inputs(input, rois_in, spatial_scale, pooled_height, pooled_width);
  checks::check_device("detops.roi_pool", "input", input, at::kCUDA);
  DETOPS_CHECK(
      input.size(2) * input.size(3) <= std::numeric_limits<int32_t>::max(),
      "detops.roi_pool: input must have H * W < 2^31 (argmax is int32), got ",
      checks::shape_str(input));
  c10::cuda::CUDAGuard guard(input.device());
  const int64_t k = rois_in.size(0);
  at::Tensor output = at::empty({k, input.size(1), pooled_height, pooled_width}, input.options());
  at::Tensor argmax = at::empty(output.sizes(), input.options().dtype(at::kInt));
  if (output.numel() == 0) return {output, argmax};
  const at::Tensor rois = rois_in.contiguous();
  assert_batch_indices(
      rois, input.size(0),
      "detops.roi_pool: rois[:, 0] must hold batch indices, integers in [0, B)");
  const int64_t total = output.numel();
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "detops.roi_pool", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        roi_pool_forward_kernel<scalar_t><<<cuda::grid_for(total, kThreads), kThreads, 0, stream>>>(
            total, input.const_data_ptr<scalar_t>(), input.size(0), input.size(1), input.size(2),
            input.size(3), input.stride(0), input.stride(1), input.stride(2), input.stride(3),
            rois.const_data_ptr<scalar_t>(), static_cast<acc_t>(spatial_scale), pooled_height,
            pooled_width, output.data_ptr<scalar_t>(), argmax.data_ptr<int32_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return {output, argmax};
}

template <typename scalar_t, typename key_t>
void backward_deterministic(
    int64_t total, const at::Tensor& grad, const PooledIndex& index, const at::Tensor& argmax,
    const at::Tensor& rois, int64_t batch, int64_t plane_size, at::Tensor& grad_input,
    cudaStream_t stream) {
  const auto key_dtype = c10::CppTypeToScalarType<key_t>::value;
  const key_t sentinel = static_cast<key_t>(grad_input.numel());
  at::Tensor keys = at::empty({total}, grad.options().dtype(key_dtype));
  const unsigned int blocks = cuda::grid_for(total, kThreads);
  roi_pool_backward_keys_kernel<scalar_t, key_t><<<blocks, kThreads, 0, stream>>>(
      total, index, argmax.const_data_ptr<int32_t>(), rois.const_data_ptr<scalar_t>(), batch,
      plane_size, sentinel, keys.data_ptr<key_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const auto sorted = at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor sorted_keys = std::get<0>(sorted).contiguous();
  const at::Tensor order = std::get<1>(sorted).contiguous();
  roi_pool_backward_segments_kernel<scalar_t, key_t><<<blocks, kThreads, 0, stream>>>(
      total, sorted_keys.const_data_ptr<key_t>(), order.const_data_ptr<int64_t>(),
      grad.const_data_ptr<scalar_t>(), index, sentinel, grad_input.data_ptr<scalar_t>());
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
  at::Tensor grad_input = at::zeros({batch_size, channels, height, width}, grad.options());
  const int64_t total = grad.numel();
  if (total == 0 || grad_input.numel() == 0) return grad_input;
  const at::Tensor rois = rois_in.contiguous();
  const at::Tensor argmax = argmax_in.contiguous();
  assert_batch_indices(
      rois, batch_size,
      "detops.roi_pool backward: rois[:, 0] must hold batch indices, integers in [0, B)");
  const PooledIndex index{
      channels, pooled_height, pooled_width, grad.stride(0), grad.stride(1), grad.stride(2),
      grad.stride(3)};
  const int64_t plane_size = height * width;
  auto stream = at::cuda::getCurrentCUDAStream();
  const bool deterministic = at::globalContext().deterministicAlgorithms();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, grad.scalar_type(), "detops.roi_pool_backward", [&] {
        if (deterministic) {
          // int32 keys sort faster; the sentinel (numel) must fit too.
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
        at::Tensor acc = grad_input;
        if (grad_input.scalar_type() != c10::CppTypeToScalarType<acc_t>::value) {
          acc = at::zeros(grad_input.sizes(), grad_input.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
        }
        roi_pool_backward_atomic_kernel<scalar_t>
            <<<cuda::grid_for(total, kThreads), kThreads, 0, stream>>>(
                total, grad.const_data_ptr<scalar_t>(), index, argmax.const_data_ptr<int32_t>(),
                rois.const_data_ptr<scalar_t>(), batch_size, plane_size, acc.data_ptr<acc_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if (!acc.is_same(grad_input)) grad_input.copy_(acc);
      });
  return grad_input;
}

}  // namespace

TORCH_LIBRARY_IMPL(detops, CUDA, m) {
  m.impl("roi_pool", TORCH_FN(roi_pool_forward_cuda));
  m.impl("_roi_pool_backward", TORCH_FN(roi_pool_backward_cuda));
}

}  // namespace ops
}  // namespace detops
