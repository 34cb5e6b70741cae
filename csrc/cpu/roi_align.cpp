// RoIAlign forward and backward on the CPU.
//
// The samples of a RoI (which pixels, with which weights) are the same for every channel, so
// each task computes them once per RoI and then runs over its channels.
//   forward:  parallel over (RoI, channel) pairs; a task that spans several channels of one RoI
//             reuses that RoI's samples.
//   backward: parallel over (image, channel) planes of grad_input; each task owns its planes and
//             adds the RoIs of that image in index order, so there are no races and the result
//             does not depend on the number of threads.
// Inputs of any layout (contiguous, strided, channels_last) are read through a contiguous
// NCHW copy; outputs are contiguous NCHW. float16 / bfloat16 accumulate in float32.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../common/roi_align_checks.h"
#include "../common/roi_align_geometry.h"

namespace detops {
namespace ops {
namespace {

constexpr const char* kForwardOp = "detops.roi_align";
constexpr const char* kBackwardOp = "detops._roi_align_backward";

// A sample that reads the map: offsets of its four pixels in one H x W plane, and weights.
template <typename T>
struct PlaneSample {
  int64_t o1, o2, o3, o4;
  T w1, w2, w3, w4;
};

// The samples of one RoI that read the map, bin by bin: those of bin i are
// samples[bin_start[i], bin_start[i + 1]). Returns the divisor of a bin.
template <typename T>
T collect_samples(
    const T* roi, T spatial_scale, int64_t pooled_height, int64_t pooled_width,
    int64_t sampling_ratio, bool aligned, int64_t height, int64_t width,
    std::vector<PlaneSample<T>>& samples, std::vector<int64_t>& bin_start) {
  const roi_align::RoIBins<T> r = roi_align::roi_bins<T>(
      roi[1], roi[2], roi[3], roi[4], spatial_scale, pooled_height, pooled_width,
      sampling_ratio, aligned);
  samples.clear();
  bin_start.assign(1, 0);
  roi_align::BilinearSample<T> s;
  for (int64_t ph = 0; ph < pooled_height; ++ph) {
    for (int64_t pw = 0; pw < pooled_width; ++pw) {
      for (int64_t iy = 0; iy < r.grid_h; ++iy) {
        const T y = roi_align::sample_coord(r.start_h, r.bin_h, ph, iy, r.grid_h);
        for (int64_t ix = 0; ix < r.grid_w; ++ix) {
          const T x = roi_align::sample_coord(r.start_w, r.bin_w, pw, ix, r.grid_w);
          if (!roi_align::bilinear_sample(y, x, height, width, s)) continue;
          samples.push_back(PlaneSample<T>{
              s.y_low * width + s.x_low, s.y_low * width + s.x_high,
              s.y_high * width + s.x_low, s.y_high * width + s.x_high, s.w1, s.w2, s.w3, s.w4});
        }
      }
      bin_start.push_back(static_cast<int64_t>(samples.size()));
    }
  }
  return r.count;
}

// rois as a contiguous [K, 5] tensor of the accumulation type, every batch index checked.
template <typename acc_t>
at::Tensor checked_rois(const char* op, const at::Tensor& rois, int64_t batch_size) {
  const at::Tensor r = rois.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
  const acc_t* p = r.const_data_ptr<acc_t>();
  for (int64_t k = 0; k < r.size(0); ++k) {
    DETOPS_CHECK(
        roi_align::roi_batch_index(p[k * 5], batch_size) >= 0, op, ": rois[", k,
        ", 0] (the batch index) must be an integer in [0, ", batch_size, "), got ", p[k * 5]);
  }
  return r;
}

template <typename scalar_t>
void forward_typed(
    const at::Tensor& input, const at::Tensor& rois_in, double spatial_scale,
    int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio, bool aligned,
    at::Tensor& output) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t batch = input.size(0), channels = input.size(1);
  const int64_t height = input.size(2), width = input.size(3);
  const int64_t num_rois = rois_in.size(0);
  const int64_t bins = pooled_height * pooled_width;
  const at::Tensor rois = checked_rois<acc_t>(kForwardOp, rois_in, batch);
  const at::Tensor x = input.contiguous();
  const acc_t* roi_ptr = rois.const_data_ptr<acc_t>();
  const scalar_t* in = x.const_data_ptr<scalar_t>();
  scalar_t* out = output.data_ptr<scalar_t>();
  const acc_t scale = static_cast<acc_t>(spatial_scale);

  const int64_t grain = std::max<int64_t>(1, 4096 / bins);
  at::parallel_for(0, num_rois * channels, grain, [&](int64_t begin, int64_t end) {
    std::vector<PlaneSample<acc_t>> samples;
    std::vector<int64_t> bin_start;
    int64_t cached = -1, b = 0;
    acc_t count = 1;
    for (int64_t kc = begin; kc < end; ++kc) {
      const int64_t k = kc / channels, c = kc % channels;
      if (k != cached) {
        const acc_t* roi = roi_ptr + k * 5;
        b = static_cast<int64_t>(roi[0]);
        count = collect_samples(
            roi, scale, pooled_height, pooled_width, sampling_ratio, aligned, height, width,
            samples, bin_start);
        cached = k;
      }
      const scalar_t* plane = in + (b * channels + c) * height * width;
      scalar_t* o = out + kc * bins;
      for (int64_t i = 0; i < bins; ++i) {
        acc_t sum = 0;
        for (int64_t j = bin_start[i]; j < bin_start[i + 1]; ++j) {
          const PlaneSample<acc_t>& s = samples[j];
          sum += s.w1 * static_cast<acc_t>(plane[s.o1]) + s.w2 * static_cast<acc_t>(plane[s.o2]) +
              s.w3 * static_cast<acc_t>(plane[s.o3]) + s.w4 * static_cast<acc_t>(plane[s.o4]);
        }
        o[i] = static_cast<scalar_t>(sum / count);
      }
    }
  });
}

at::Tensor roi_align_forward_cpu(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, bool aligned) {
  checks::check_roi_align_inputs(
      kForwardOp, input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio);
  checks::check_device(kForwardOp, "input", input, at::kCPU);
  at::Tensor output =
      at::empty({rois.size(0), input.size(1), pooled_height, pooled_width}, input.options());
  if (output.numel() == 0) return output;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), kForwardOp, [&] {
    forward_typed<scalar_t>(
        input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned, output);
  });
  return output;
}

template <typename scalar_t>
void backward_typed(
    const at::Tensor& grad_in, const at::Tensor& rois_in, double spatial_scale,
    int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio, bool aligned,
    at::Tensor& grad_input) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t batch = grad_input.size(0), channels = grad_input.size(1);
  const int64_t height = grad_input.size(2), width = grad_input.size(3);
  const int64_t num_rois = rois_in.size(0);
  const int64_t bins = pooled_height * pooled_width;
  const at::Tensor rois = checked_rois<acc_t>(kBackwardOp, rois_in, batch);
  const at::Tensor grad = grad_in.contiguous();
  const acc_t* roi_ptr = rois.const_data_ptr<acc_t>();
  const scalar_t* g = grad.const_data_ptr<scalar_t>();
  acc_t* gi = grad_input.data_ptr<acc_t>();
  const acc_t scale = static_cast<acc_t>(spatial_scale);

  // RoIs grouped by image, each group in index order (a counting sort).
  std::vector<int64_t> first(batch + 1, 0), order(num_rois);
  for (int64_t k = 0; k < num_rois; ++k) ++first[static_cast<int64_t>(roi_ptr[k * 5]) + 1];
  for (int64_t b = 0; b < batch; ++b) first[b + 1] += first[b];
  {
    std::vector<int64_t> fill(first.begin(), first.end() - 1);
    for (int64_t k = 0; k < num_rois; ++k) order[fill[static_cast<int64_t>(roi_ptr[k * 5])]++] = k;
  }

  at::parallel_for(0, batch * channels, 1, [&](int64_t begin, int64_t end) {
    std::vector<PlaneSample<acc_t>> samples;
    std::vector<int64_t> bin_start;
    for (int64_t b = begin / channels; b * channels < end; ++b) {
      const int64_t c0 = std::max(begin, b * channels) - b * channels;
      const int64_t c1 = std::min(end, (b + 1) * channels) - b * channels;
      for (int64_t r = first[b]; r < first[b + 1]; ++r) {
        const int64_t k = order[r];
        const acc_t count = collect_samples(
            roi_ptr + k * 5, scale, pooled_height, pooled_width, sampling_ratio, aligned, height,
            width, samples, bin_start);
        for (int64_t c = c0; c < c1; ++c) {
          acc_t* plane = gi + (b * channels + c) * height * width;
          const scalar_t* gk = g + (k * channels + c) * bins;
          for (int64_t i = 0; i < bins; ++i) {
            const acc_t gv = static_cast<acc_t>(gk[i]) / count;
            for (int64_t j = bin_start[i]; j < bin_start[i + 1]; ++j) {
              const PlaneSample<acc_t>& s = samples[j];
              plane[s.o1] += s.w1 * gv;
              plane[s.o2] += s.w2 * gv;
              plane[s.o3] += s.w3 * gv;
              plane[s.o4] += s.w4 * gv;
            }
          }
        }
      }
    }
  });
}

at::Tensor roi_align_backward_cpu(
    const at::Tensor& grad, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t batch_size, int64_t channels, int64_t height, int64_t width,
    int64_t sampling_ratio, bool aligned) {
  checks::check_roi_align_backward_inputs(
      kBackwardOp, grad, rois, spatial_scale, pooled_height, pooled_width, batch_size, channels,
      height, width, sampling_ratio);
  checks::check_device(kBackwardOp, "grad", grad, at::kCPU);
  const auto acc_dtype = grad.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor grad_input =
      at::zeros({batch_size, channels, height, width}, grad.options().dtype(acc_dtype));
  if (grad_input.numel() == 0 || rois.size(0) == 0) return grad_input.to(grad.scalar_type());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), kBackwardOp, [&] {
    backward_typed<scalar_t>(
        grad, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned,
        grad_input);
  });
  return grad_input.to(grad.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(detops, CPU, m) {
  m.impl("roi_align", TORCH_FN(roi_align_forward_cpu));
  m.impl("_roi_align_backward", TORCH_FN(roi_align_backward_cpu));
}

}  // namespace ops
}  // namespace detops
