// RoIAlign forward and backward on the CPU.
//
// The samples of a RoI (which pixels, with which weights) are the same for every channel, so
// they are tabulated once per RoI and applied to a block of channels at a time: the table is
// read once per sample for the whole block, and the channels give independent chains of adds.
//   forward:  parallel over (RoI, channel block) items, outputs disjoint. NCHW input reads
//             kChannelBlock planes per item; channels_last input is read in place, the
//             channels of a pixel being contiguous, so the inner loop is a vector loop over
//             channels.
//   backward: parallel over (image, channel) planes of grad_input; each plane is owned by one
//             task, which adds the RoIs of that image in index order (bins, samples and the
//             four corners in a fixed order), so there are no races and the result does not
//             depend on the number of threads. The planes are cut into chunks of equal work
//             (images with more RoIs count for more), so threads finish together.
// Every output element is the same expression in the same order on every path:
//   sum += w1 * v1 + w2 * v2 + w3 * v3 + w4 * v4 per sample, then sum / count.
// Other layouts are read through a contiguous NCHW copy; outputs are contiguous NCHW.
// float16 / bfloat16 accumulate in float32.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../common/roi_align_checks.h"
#include "../common/roi_align_geometry.h"
#include "plane_chunks.h"

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
// samples[bin_start[i], bin_start[i + 1]). Pixel (y, x) is at offset (y * width + x) * stride
// (stride 1 for an H x W plane, C for a channels_last image). Returns the divisor of a bin.
template <typename T>
T collect_samples(
    const T* roi, T spatial_scale, int64_t pooled_height, int64_t pooled_width,
    int64_t sampling_ratio, bool aligned, int64_t height, int64_t width,
    std::vector<PlaneSample<T>>& samples, std::vector<int64_t>& bin_start, int64_t stride = 1) {
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
              (s.y_low * width + s.x_low) * stride, (s.y_low * width + s.x_high) * stride,
              (s.y_high * width + s.x_low) * stride, (s.y_high * width + s.x_high) * stride,
              s.w1, s.w2, s.w3, s.w4});
        }
      }
      bin_start.push_back(static_cast<int64_t>(samples.size()));
    }
  }
  return r.count;
}

// The backward shares the sample tables of all RoIs between its tasks up to this many bytes
// (an adaptive sampling grid on large RoIs can make the tables larger than the map).
constexpr double kSharedTableBytes = 64.0 * (1 << 20);

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

// Channels per forward item of the NCHW path, and per pass of the backward over one sample.
constexpr int64_t kChannelBlock = 8;
// Channels per forward item of the channels_last path (one vector loop).
constexpr int64_t kChannelsLastBlock = 32;

// Forward of channels [0, nc) of one RoI, NCHW: channel c reads the plane planes[c] and writes
// out_c[c * bins + i]. kFixed > 0 makes nc a compile-time constant (a full block).
template <int64_t kFixed, typename scalar_t, typename acc_t>
inline void forward_planes(
    const scalar_t* const* planes, int64_t nc_runtime, const std::vector<PlaneSample<acc_t>>& samples,
    const std::vector<int64_t>& bin_start, int64_t bins, acc_t count, scalar_t* out_c) {
  const int64_t nc = kFixed > 0 ? kFixed : nc_runtime;
  for (int64_t i = 0; i < bins; ++i) {
    acc_t sum[kChannelBlock];
    for (int64_t c = 0; c < nc; ++c) sum[c] = 0;
    for (int64_t j = bin_start[i]; j < bin_start[i + 1]; ++j) {
      const PlaneSample<acc_t> s = samples[j];
      for (int64_t c = 0; c < nc; ++c) {
        const scalar_t* p = planes[c];
        sum[c] += s.w1 * static_cast<acc_t>(p[s.o1]) + s.w2 * static_cast<acc_t>(p[s.o2]) +
            s.w3 * static_cast<acc_t>(p[s.o3]) + s.w4 * static_cast<acc_t>(p[s.o4]);
      }
    }
    for (int64_t c = 0; c < nc; ++c) out_c[c * bins + i] = static_cast<scalar_t>(sum[c] / count);
  }
}

// Forward of channels [0, nc) of one RoI, channels_last: image points at channel 0 of pixel 0
// of the RoI's image, sample offsets are pixel * C.
template <typename scalar_t, typename acc_t>
inline void forward_channels_last(
    const scalar_t* image, int64_t nc, const std::vector<PlaneSample<acc_t>>& samples,
    const std::vector<int64_t>& bin_start, int64_t bins, acc_t count, scalar_t* out_c) {
  for (int64_t i = 0; i < bins; ++i) {
    acc_t sum[kChannelsLastBlock];
    for (int64_t c = 0; c < nc; ++c) sum[c] = 0;
    for (int64_t j = bin_start[i]; j < bin_start[i + 1]; ++j) {
      const PlaneSample<acc_t> s = samples[j];
      const scalar_t* q1 = image + s.o1;
      const scalar_t* q2 = image + s.o2;
      const scalar_t* q3 = image + s.o3;
      const scalar_t* q4 = image + s.o4;
      for (int64_t c = 0; c < nc; ++c) {
        sum[c] += s.w1 * static_cast<acc_t>(q1[c]) + s.w2 * static_cast<acc_t>(q2[c]) +
            s.w3 * static_cast<acc_t>(q3[c]) + s.w4 * static_cast<acc_t>(q4[c]);
      }
    }
    for (int64_t c = 0; c < nc; ++c) out_c[c * bins + i] = static_cast<scalar_t>(sum[c] / count);
  }
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
  // channels_last is read in place; anything else through a contiguous NCHW view or copy.
  const bool nhwc =
      !input.is_contiguous() && input.is_contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor x = nhwc ? input : input.contiguous();
  const acc_t* roi_ptr = rois.const_data_ptr<acc_t>();
  const scalar_t* in = x.const_data_ptr<scalar_t>();
  scalar_t* out = output.data_ptr<scalar_t>();
  const acc_t scale = static_cast<acc_t>(spatial_scale);
  const int64_t plane = height * width;
  const int64_t block = nhwc ? kChannelsLastBlock : kChannelBlock;
  const int64_t blocks = (channels + block - 1) / block;

  // One item is (RoI k, channel block); items of one RoI are adjacent, so a task that holds
  // several reuses the RoI's sample table.
  at::parallel_for(0, num_rois * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<PlaneSample<acc_t>> samples;
    std::vector<int64_t> bin_start;
    int64_t cached = -1, b = 0;
    acc_t count = 1;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t k = item / blocks;
      const int64_t c0 = (item - k * blocks) * block;
      const int64_t nc = std::min(block, channels - c0);
      if (k != cached) {
        const acc_t* roi = roi_ptr + k * 5;
        b = static_cast<int64_t>(roi[0]);
        count = collect_samples(
            roi, scale, pooled_height, pooled_width, sampling_ratio, aligned, height, width,
            samples, bin_start, nhwc ? channels : 1);
        cached = k;
      }
      scalar_t* out_c = out + (k * channels + c0) * bins;
      if (nhwc) {
        forward_channels_last(
            in + b * plane * channels + c0, nc, samples, bin_start, bins, count, out_c);
        continue;
      }
      const scalar_t* planes[kChannelBlock];
      for (int64_t c = 0; c < nc; ++c) planes[c] = in + (b * channels + c0 + c) * plane;
      if (nc == kChannelBlock) {
        forward_planes<kChannelBlock>(planes, nc, samples, bin_start, bins, count, out_c);
      } else {
        forward_planes<0>(planes, nc, samples, bin_start, bins, count, out_c);
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
  const int64_t plane = height * width;

  // RoIs grouped by image, each group in index order (a counting sort).
  std::vector<int64_t> first(batch + 1, 0), order(num_rois);
  for (int64_t k = 0; k < num_rois; ++k) ++first[static_cast<int64_t>(roi_ptr[k * 5]) + 1];
  for (int64_t b = 0; b < batch; ++b) first[b + 1] += first[b];
  {
    std::vector<int64_t> fill(first.begin(), first.end() - 1);
    for (int64_t k = 0; k < num_rois; ++k) order[fill[static_cast<int64_t>(roi_ptr[k * 5])]++] = k;
  }

  // The sample tables of all RoIs, built once in parallel and shared by every plane of their
  // image, when they fit in kSharedTableBytes; otherwise each task builds the tables it needs.
  struct Table {
    std::vector<PlaneSample<acc_t>> samples;
    std::vector<int64_t> bin_start;
    acc_t count = acc_t(1);
  };
  double table_bytes = 0;
  for (int64_t k = 0; k < num_rois; ++k) {
    const acc_t* roi = roi_ptr + k * 5;
    const roi_align::RoIBins<acc_t> r = roi_align::roi_bins<acc_t>(
        roi[1], roi[2], roi[3], roi[4], scale, pooled_height, pooled_width, sampling_ratio, aligned);
    table_bytes += static_cast<double>(r.grid_h) * r.grid_w * bins * sizeof(PlaneSample<acc_t>);
  }
  const bool shared_tables = table_bytes <= static_cast<double>(kSharedTableBytes);
  std::vector<Table> tables(shared_tables ? num_rois : 0);
  if (shared_tables) {
    at::parallel_for(0, num_rois, 1, [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k) {
        tables[k].count = collect_samples(
            roi_ptr + k * 5, scale, pooled_height, pooled_width, sampling_ratio, aligned, height,
            width, tables[k].samples, tables[k].bin_start);
      }
    });
  }

  // A few chunks of equal work per thread. Which task adds into a plane never changes the
  // order of the additions, so the chunking does not affect the result. Each task zeroes its
  // planes first (grad_input comes uninitialized), while they are about to be written.
  const int64_t planes = batch * channels;
  const int64_t chunks =
      std::max<int64_t>(1, std::min<int64_t>(planes, int64_t{at::get_num_threads()} * 4));
  const std::vector<int64_t> bounds = cpu::balanced_plane_ranges(first, channels, chunks);

  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    Table own;
    const int64_t begin = bounds[chunk_begin], end = bounds[chunk_end];
    std::fill(gi + begin * plane, gi + end * plane, acc_t(0));
    for (int64_t b = begin / channels; b * channels < end; ++b) {
      const int64_t c_begin = std::max(begin, b * channels) - b * channels;
      const int64_t c_end = std::min(end, (b + 1) * channels) - b * channels;
      for (int64_t r = first[b]; r < first[b + 1]; ++r) {
        const int64_t k = order[r];
        const Table* t = &own;
        if (shared_tables) {
          t = &tables[k];
        } else {
          own.count = collect_samples(
              roi_ptr + k * 5, scale, pooled_height, pooled_width, sampling_ratio, aligned, height,
              width, own.samples, own.bin_start);
        }
        const std::vector<PlaneSample<acc_t>>& samples = t->samples;
        const std::vector<int64_t>& bin_start = t->bin_start;
        const acc_t count = t->count;
        for (int64_t c0 = c_begin; c0 < c_end; c0 += kChannelBlock) {
          const int64_t nc = std::min(kChannelBlock, c_end - c0);
          acc_t* dst[kChannelBlock];
          for (int64_t c = 0; c < nc; ++c) dst[c] = gi + (b * channels + c0 + c) * plane;
          const scalar_t* gk = g + (k * channels + c0) * bins;
          for (int64_t i = 0; i < bins; ++i) {
            acc_t gv[kChannelBlock];
            for (int64_t c = 0; c < nc; ++c) gv[c] = static_cast<acc_t>(gk[c * bins + i]) / count;
            for (int64_t j = bin_start[i]; j < bin_start[i + 1]; ++j) {
              const PlaneSample<acc_t> s = samples[j];
              for (int64_t c = 0; c < nc; ++c) {
                acc_t* p = dst[c];
                p[s.o1] += s.w1 * gv[c];
                p[s.o2] += s.w2 * gv[c];
                p[s.o3] += s.w3 * gv[c];
                p[s.o4] += s.w4 * gv[c];
              }
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
  if (batch_size * channels * height * width == 0 || rois.size(0) == 0) {
    return at::zeros({batch_size, channels, height, width}, grad.options());
  }
  // every element is written by the kernel (its task zeroes its planes first)
  at::Tensor grad_input =
      at::empty({batch_size, channels, height, width}, grad.options().dtype(acc_dtype));
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
