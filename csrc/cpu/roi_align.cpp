// RoIAlign forward and backward on the CPU.
//
// The samples of a RoI (which pixels, with which weights) are the same for every channel, so
// they are tabulated once per RoI and applied to a block of channels at a time: the table is
// read once per sample for the whole block, and the channels give independent chains of adds.
//   forward:  parallel over (RoI, channel block) items, outputs disjoint. NCHW input reads
//             kChannelBlock planes per item; channels_last input is read in place, the
//             channels of a pixel being contiguous, so the inner loop is a vector loop over
//             channels. The RoIs' tables are built once, by the threads of the kernel's own
//             parallel region before they start on their items, and shared by every task.
//             The items run RoI fastest within an image and channel block, so a task reads
//             one or a few blocks' channels of the map: for NCHW input their planes, which
//             stay in its core's cache; for channels_last input their slice of every pixel,
//             larger than the cache, so there an image's RoIs run in bands of the rows of
//             their centres, and consecutive items read nearby pixels.
//   backward: parallel over (image, channel) planes of grad_input; each plane (or each band
//             of its rows, where whole planes would give a thread fewer than four tasks) is
//             owned by one task, which adds the RoIs of that image in index order (bins,
//             samples and the four corners in a fixed order), so there are no races and the
//             result does not depend on the number of threads. The planes are cut into chunks
//             of equal work (images with more RoIs count for more), so threads finish together.
// Every output element is the same expression in the same order on every path:
//   sum += w1 * v1 + w2 * v2 + w3 * v3 + w4 * v4 per sample, then sum / count.
// Other layouts are read through a contiguous NCHW copy; outputs are contiguous NCHW.
// float16 / bfloat16 accumulate in float32.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "../common/roi_align_checks.h"
#include "../common/roi_align_geometry.h"
#include "output_alloc.h"
#include "plane_chunks.h"
#include "work_shares.h"

namespace detops {
namespace ops {
namespace {

constexpr const char* kForwardOp = "detops.roi_align";
constexpr const char* kBackwardOp = "detops._roi_align_backward";

// One coordinate of a sample along one axis, when it reads the map: the offsets of the two
// pixel rows (or columns) it reads, and their weights.
template <typename T>
struct AxisSample {
  int64_t lo, hi;  // row (column) index times the axis' stride
  T h, l;          // weights of lo and hi: l is the fraction past lo, h = 1 - l
};

// The samples of one RoI. Sample (iy, ix) of bin (ph, pw) lies at the row coordinate of
// (ph, iy) and the column coordinate of (pw, ix), and it reads the map when both lie in their
// band (bilinear_sample's rule is one test per axis), so a table per axis holds them all: the
// rows of bin row ph that read the map are rows[row_start[ph], row_start[ph + 1]), likewise
// the columns. A bin's samples are the product, rows outer, each with the four pixels and
// weights bilinear_sample gives it. Pixel (y, x) is at offset (y * width + x) * stride (1 for
// an H x W plane, C for a channels_last image).
template <typename T>
struct TableRef {
  const AxisSample<T>* rows;
  const AxisSample<T>* cols;
  const int64_t* row_start;  // pooled_height + 1 entries
  const int64_t* col_start;  // pooled_width + 1 entries
  T count;                   // the divisor of a bin

  // Calls f(o1, o2, o3, o4, w1, w2, w3, w4) for each sample of bin (ph, pw) that reads the
  // map, in bilinear_sample's order of pixels: (lo, lo), (lo, hi), (hi, lo), (hi, hi).
  template <typename F>
  void for_each_sample(int64_t ph, int64_t pw, F&& f) const {
    const AxisSample<T>* const y_end = rows + row_start[ph + 1];
    const AxisSample<T>* const x_begin = cols + col_start[pw];
    const AxisSample<T>* const x_end = cols + col_start[pw + 1];
    for (const AxisSample<T>* y = rows + row_start[ph]; y < y_end; ++y) {
      const int64_t ylo = y->lo, yhi = y->hi;
      const T yh = y->h, yl = y->l;
      for (const AxisSample<T>* x = x_begin; x < x_end; ++x) {
        const int64_t xlo = x->lo, xhi = x->hi;
        const T xh = x->h, xl = x->l;
        f(ylo + xlo, ylo + xhi, yhi + xlo, yhi + xhi, yh * xh, yh * xl, yl * xh, yl * xl);
      }
    }
  }
};

// Where a RoI's table is built and what it reads.
template <typename T>
struct TableGeometry {
  const T* rois;  // [K, 5]
  T spatial_scale;
  int64_t pooled_height, pooled_width, sampling_ratio;
  bool aligned;
  int64_t height, width, stride;

  roi_align::RoIBins<T> bins(int64_t k) const {
    const T* roi = rois + k * 5;
    return roi_align::roi_bins<T>(
        roi[1], roi[2], roi[3], roi[4], spatial_scale, pooled_height, pooled_width,
        sampling_ratio, aligned);
  }
  // Sample rows and columns a RoI with these bins has room for.
  int64_t capacity(const roi_align::RoIBins<T>& r) const {
    return pooled_height * r.grid_h + pooled_width * r.grid_w;
  }
  // Writes RoI k's table, for bins r, into samples (room for capacity(r)) and starts
  // (pooled_height + pooled_width + 2 entries); returns its divisor.
  T build(const roi_align::RoIBins<T>& r, AxisSample<T>* samples, int64_t* starts) const {
    const int64_t rows = axis(r.start_h, r.bin_h, pooled_height, r.grid_h, height, width * stride, samples, starts);
    axis(r.start_w, r.bin_w, pooled_width, r.grid_w, width, stride, samples + rows,
         starts + pooled_height + 1);
    return r.count;
  }
  TableRef<T> ref(const AxisSample<T>* samples, const int64_t* starts, T count) const {
    return TableRef<T>{samples, samples + starts[pooled_height], starts, starts + pooled_height + 1, count};
  }

 private:
  // The samples along one axis that read the map; out_start[p] is where bin p's begin.
  // Returns how many there are.
  static int64_t axis(
      T start, T bin, int64_t pooled, int64_t grid, int64_t size, int64_t stride,
      AxisSample<T>* out, int64_t* out_start) {
    int64_t n = 0;
    out_start[0] = 0;
    for (int64_t p = 0; p < pooled; ++p) {
      for (int64_t i = 0; i < grid; ++i) {
        const T v = roi_align::sample_coord(start, bin, p, i, grid);
        // bilinear_sample's test for this axis, NaN failing it; an empty axis reads nothing
        if (!(v >= T(-1) && v <= static_cast<T>(size)) || size <= 0) continue;
        int64_t lo, hi;
        T l;
        roi_align::axis_weights(v, size, lo, hi, l);
        out[n++] = AxisSample<T>{lo * stride, hi * stride, T(1) - l, l};
      }
      out_start[p + 1] = n;
    }
    return n;
  }
};

// One RoI's table built by the task that reads it, in storage the task reuses.
template <typename T>
struct OwnTable {
  std::unique_ptr<AxisSample<T>[]> samples;  // room for `room` (uninitialized)
  int64_t room = 0;
  std::vector<int64_t> starts;
  int64_t cached = -1;  // the RoI built last
  T count = T(1);       // its divisor

  TableRef<T> get(const TableGeometry<T>& g, int64_t k) {
    if (k != cached) {
      const roi_align::RoIBins<T> r = g.bins(k);
      const int64_t capacity = g.capacity(r);
      if (capacity > room) {
        samples.reset(new AxisSample<T>[capacity]);
        room = capacity;
      }
      starts.resize(static_cast<size_t>(g.pooled_height + g.pooled_width + 2));
      count = g.build(r, samples.get(), starts.data());
      cached = k;
    }
    return g.ref(samples.get(), starts.data(), count);
  }
};

// The tables of all RoIs in one allocation, shared by every task, up to this many bytes (an
// adaptive sampling grid on RoIs far larger than the map can make them large).
constexpr double kSharedTableBytes = 64.0 * (1 << 20);

// The tables of all RoIs, built inside the kernel's own parallel region: each thread first
// builds a strided share of them (build_share), then runs its items, which take their RoIs'
// tables with get(). A table is built once, by whichever thread claims it first; a thread
// that needs a table another thread is still building builds its own copy rather than wait.
// Building them here, in one allocation, saves a parallel loop of their own and the per-RoI
// allocations that the calling thread would free, a sizeable part of a short threaded call.
template <typename T>
class SharedTables {
 public:
  // No tables (empty()) where together they would exceed kSharedTableBytes.
  SharedTables(const TableGeometry<T>& g, int64_t num_rois) : g_(g), num_rois_(num_rois) {
    per_starts_ = g.pooled_height + g.pooled_width + 2;
    offsets_.resize(num_rois + 1);
    offsets_[0] = 0;
    if (g.sampling_ratio > 0) {  // every RoI has the same grid
      const int64_t cap = (g.pooled_height + g.pooled_width) * g.sampling_ratio;
      for (int64_t k = 0; k < num_rois; ++k) offsets_[k + 1] = offsets_[k] + cap;
    } else {
      for (int64_t k = 0; k < num_rois; ++k) offsets_[k + 1] = offsets_[k] + g.capacity(g.bins(k));
    }
    const double bytes = static_cast<double>(offsets_[num_rois]) * sizeof(AxisSample<T>) +
        static_cast<double>(num_rois) * per_starts_ * sizeof(int64_t);
    if (bytes > kSharedTableBytes) return;
    samples_.reset(new AxisSample<T>[std::max<int64_t>(offsets_[num_rois], 1)]);
    starts_.reset(new int64_t[num_rois * per_starts_]);
    slots_.reset(new Slot[num_rois]);
  }

  bool empty() const { return slots_ == nullptr; }

  // Builds the tables of RoIs share, share + shares, ... that no thread has claimed yet.
  void build_share(int64_t share, int64_t shares) {
    if (empty()) return;
    for (int64_t k = share; k < num_rois_; k += shares) claim_and_build(k);
  }

  // RoI k's table: the shared one (built now if no thread has claimed it), or, while another
  // thread is building that, a copy in own. Without shared tables, always own.
  TableRef<T> get(int64_t k, OwnTable<T>& own) {
    if (!empty()) {
      if (slots_[k].state.load(std::memory_order_acquire) == kReady || claim_and_build(k)) {
        return g_.ref(samples_.get() + offsets_[k], starts_.get() + k * per_starts_, slots_[k].count);
      }
    }
    return own.get(g_, k);
  }

 private:
  static constexpr uint8_t kFree = 0, kBuilding = 1, kReady = 2;
  // A RoI's state and divisor, in a cache line of their own: the threads claim and publish
  // neighbouring RoIs at the same time.
  struct alignas(64) Slot {
    std::atomic<uint8_t> state{kFree};
    T count = T(1);
  };

  // Builds RoI k's shared table if no thread has claimed it; true when it is built here.
  bool claim_and_build(int64_t k) {
    Slot& slot = slots_[k];
    uint8_t expected = kFree;
    if (slot.state.load(std::memory_order_relaxed) != kFree ||
        !slot.state.compare_exchange_strong(expected, kBuilding, std::memory_order_relaxed)) {
      return false;
    }
    slot.count = g_.build(g_.bins(k), samples_.get() + offsets_[k], starts_.get() + k * per_starts_);
    slot.state.store(kReady, std::memory_order_release);
    return true;
  }

  TableGeometry<T> g_;
  int64_t num_rois_, per_starts_;
  std::vector<int64_t> offsets_;  // RoI k's samples start at offsets_[k]
  std::unique_ptr<AxisSample<T>[]> samples_;
  std::unique_ptr<int64_t[]> starts_;
  std::unique_ptr<Slot[]> slots_;
};

// RoI k's image (rois is [K, 5], batch indices checked).
template <typename T>
struct ImageOf {
  const T* rois;
  int64_t operator()(int64_t k) const { return static_cast<int64_t>(rois[k * 5]); }
};

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

// Every batch index checked, where the output is empty and no kernel reads the RoIs.
void check_batch_indices(const char* op, const at::Tensor& rois, int64_t batch_size) {
  if (rois.size(0) == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, rois.scalar_type(), "detops.check_batch_indices",
      [&] { checked_rois<at::opmath_type<scalar_t>>(op, rois, batch_size); });
}

// Channels per forward item of the NCHW path, and per pass of the backward over one sample.
constexpr int64_t kChannelBlock = 8;
// Channels per forward item of the channels_last path (one vector loop).
constexpr int64_t kChannelsLastBlock = 32;
// The fewest rows of a backward task's band, where the backward cuts its chunks into bands.
constexpr int64_t kBackwardBandRows = 8;
// The backward's chunks of planes per thread, where there are planes enough.
constexpr int64_t kBackwardChunksPerThread = 4;
// Bands of the last chunk of each thread's share, where the chunks are not cut otherwise.
constexpr int64_t kBackwardTailBands = 4;

// Forward of channels [0, nc) of one RoI, NCHW: channel c reads the plane planes[c] and writes
// out_c[c * bins + i]. kFixed > 0 makes nc a compile-time constant (a full block).
template <int64_t kFixed, typename scalar_t, typename acc_t>
inline void forward_planes(
    const scalar_t* const* planes, int64_t nc_runtime, const TableRef<acc_t>& t,
    int64_t pooled_height, int64_t pooled_width, scalar_t* out_c) {
  const int64_t nc = kFixed > 0 ? kFixed : nc_runtime;
  const int64_t bins = pooled_height * pooled_width;
  for (int64_t ph = 0, i = 0; ph < pooled_height; ++ph) {
    for (int64_t pw = 0; pw < pooled_width; ++pw, ++i) {
      acc_t sum[kChannelBlock];
      for (int64_t c = 0; c < nc; ++c) sum[c] = 0;
      t.for_each_sample(ph, pw, [&](int64_t o1, int64_t o2, int64_t o3, int64_t o4, acc_t w1,
                                    acc_t w2, acc_t w3, acc_t w4) {
        for (int64_t c = 0; c < nc; ++c) {
          const scalar_t* p = planes[c];
          sum[c] += w1 * static_cast<acc_t>(p[o1]) + w2 * static_cast<acc_t>(p[o2]) +
              w3 * static_cast<acc_t>(p[o3]) + w4 * static_cast<acc_t>(p[o4]);
        }
      });
      for (int64_t c = 0; c < nc; ++c) {
        out_c[c * bins + i] = static_cast<scalar_t>(sum[c] / t.count);
      }
    }
  }
}

// Forward of channels [0, nc) of one RoI, channels_last: image points at channel 0 of pixel 0
// of the RoI's image, sample offsets are pixel * C.
template <typename scalar_t, typename acc_t>
inline void forward_channels_last(
    const scalar_t* image, int64_t nc, const TableRef<acc_t>& t, int64_t pooled_height,
    int64_t pooled_width, scalar_t* out_c) {
  const int64_t bins = pooled_height * pooled_width;
  for (int64_t ph = 0, i = 0; ph < pooled_height; ++ph) {
    for (int64_t pw = 0; pw < pooled_width; ++pw, ++i) {
      acc_t sum[kChannelsLastBlock];
      for (int64_t c = 0; c < nc; ++c) sum[c] = 0;
      const auto add = [&sum, image, nc](int64_t o1, int64_t o2, int64_t o3, int64_t o4,
                                         acc_t w1, acc_t w2, acc_t w3, acc_t w4) {
        const scalar_t* q1 = image + o1;
        const scalar_t* q2 = image + o2;
        const scalar_t* q3 = image + o3;
        const scalar_t* q4 = image + o4;
        for (int64_t c = 0; c < nc; ++c) {
          sum[c] += w1 * static_cast<acc_t>(q1[c]) + w2 * static_cast<acc_t>(q2[c]) +
              w3 * static_cast<acc_t>(q3[c]) + w4 * static_cast<acc_t>(q4[c]);
        }
      };
      t.for_each_sample(ph, pw, add);
      for (int64_t c = 0; c < nc; ++c) {
        out_c[c * bins + i] = static_cast<scalar_t>(sum[c] / t.count);
      }
    }
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

  const int64_t stride = nhwc ? channels : 1;
  SharedTables<acc_t> tables(
      TableGeometry<acc_t>{roi_ptr, scale, pooled_height, pooled_width, sampling_ratio, aligned,
                           height, width, stride},
      num_rois);
  // With shared tables, the items of image b are (channel block, RoI of b), RoI fastest, so a
  // task's range of items reads one or a few channel blocks of the map: with NCHW input their
  // planes, which stay in its core's cache; with channels_last input their slice of each
  // pixel, the image's RoIs ordered by the band of rows that holds their centres, so that
  // consecutive items read nearby pixels. Otherwise an item is (RoI, channel block), channel
  // block fastest: a task that builds its own tables builds each once.
  const bool by_block = !tables.empty();
  std::vector<int64_t> first, order;
  if (by_block && nhwc) {
    const int64_t bands = cpu::centre_bands(height);
    const auto key = [&](int64_t k) {
      const acc_t* r = roi_ptr + k * 5;
      return cpu::centre_band_key(r[0], r[2], r[4], scale, batch, bands);
    };
    cpu::group_rois(num_rois, batch * bands, key, first, order);
    for (int64_t b = 0; b <= batch; ++b) first[b] = first[b * bands];  // the images' groups
    first.resize(batch + 1);
  } else if (by_block) {
    cpu::group_rois_by_image(num_rois, batch, ImageOf<acc_t>{roi_ptr}, first, order);
  }

  // Equal shares of the items, in order, a chunk at a time; threads done early help the others.
  // Each thread first builds its share of the tables.
  const int64_t items = num_rois * blocks;
  cpu::parallel_shares(
      items, cpu::share_chunk(items, 32),
      [&](int64_t begin, int64_t end) {
        OwnTable<acc_t> own;
        int64_t b = 0;  // the image of the current item, by_block
        for (int64_t item = begin; item < end; ++item) {
          int64_t k, block_index;
          if (by_block) {
            while (item >= first[b + 1] * blocks) ++b;
            const int64_t n = first[b + 1] - first[b];  // > 0: the item lies in image b
            const int64_t j = item - first[b] * blocks;
            block_index = j / n;
            k = order[first[b] + j % n];
          } else {
            k = item / blocks;
            block_index = item - k * blocks;
          }
          const TableRef<acc_t> t = tables.get(k, own);
          const int64_t c0 = block_index * block;
          const int64_t nc = std::min(block, channels - c0);
          const int64_t image = static_cast<int64_t>(roi_ptr[k * 5]);
          scalar_t* out_c = out + (k * channels + c0) * bins;
          if (nhwc) {
            forward_channels_last(
                in + image * plane * channels + c0, nc, t, pooled_height, pooled_width, out_c);
            continue;
          }
          const scalar_t* planes[kChannelBlock];
          for (int64_t c = 0; c < nc; ++c) planes[c] = in + (image * channels + c0 + c) * plane;
          if (nc == kChannelBlock) {
            forward_planes<kChannelBlock>(planes, nc, t, pooled_height, pooled_width, out_c);
          } else {
            forward_planes<0>(planes, nc, t, pooled_height, pooled_width, out_c);
          }
        }
      },
      [&](int64_t share, int64_t shares) { tables.build_share(share, shares); });
}

at::Tensor roi_align_forward_cpu(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio, bool aligned) {
  checks::check_roi_align_inputs(
      kForwardOp, input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio);
  checks::check_device(kForwardOp, "input", input, at::kCPU);
  at::Tensor output = cpu::empty_output(
      {rois.size(0), input.size(1), pooled_height, pooled_width}, input.options());
  if (output.numel() == 0) {
    check_batch_indices(kForwardOp, rois, input.size(0));  // as for any output
    return output;
  }
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

  std::vector<int64_t> first, order;
  cpu::group_rois_by_image(num_rois, batch, ImageOf<acc_t>{roi_ptr}, first, order);
  // Shared by every plane of their image when they fit in kSharedTableBytes; otherwise each
  // task builds the tables it needs.
  SharedTables<acc_t> tables(
      TableGeometry<acc_t>{roi_ptr, scale, pooled_height, pooled_width, sampling_ratio, aligned,
                           height, width, int64_t{1}},
      num_rois);

  // Chunks of equal work, up to four per thread, of a block of channels or more where there
  // are planes enough for every thread (a task adds each RoI to a block of channels at once),
  // taken in order from equal shares; threads done early help the others. Where that leaves
  // a thread fewer than four chunks, each chunk is cut into bands of rows (at least
  // kBackwardBandRows each), a task adding only what lands in its band's rows: otherwise a
  // call whose chunks are one per thread lasts as long as its slowest core, which on a shared
  // machine runs up to twice as slow as the others.
  // Where each thread has four chunks, only the last chunk of each share is cut, into
  // kBackwardTailBands bands: the tasks that end the shares, and so the call, are a quarter of
  // a chunk, while three quarters of the work runs without the bands' cost (a RoI's bin rows
  // that cross a band's edge are walked once per band). Which task adds into a pixel never
  // changes the order of its additions, so neither the chunking nor the bands affect the
  // result. Each task zeroes its rows of its planes first (grad_input comes uninitialized),
  // while they are about to be written. Each thread first builds its share of the tables.
  const int64_t planes = batch * channels;
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = std::max<int64_t>(
      1, std::min(planes, std::max(threads, std::min(planes / kChannelBlock,
                                                     threads * kBackwardChunksPerThread))));
  const std::vector<int64_t> bounds = cpu::balanced_plane_ranges(first, channels, chunks);
  const int64_t most_bands = std::max<int64_t>(1, height / kBackwardBandRows);
  const int64_t bands = std::clamp<int64_t>(
      (threads * kBackwardChunksPerThread + chunks - 1) / chunks, 1, most_bands);
  // The bands of each share's last chunk where only those chunks are cut, else 1; then the
  // tasks of a share.
  const int64_t tail_bands =
      bands == 1 && threads > 1 && chunks == threads * kBackwardChunksPerThread
      ? std::min(kBackwardTailBands, most_bands)
      : 1;
  const int64_t share_tasks = kBackwardChunksPerThread - 1 + tail_bands;
  const int64_t tasks = tail_bands > 1 ? threads * share_tasks : chunks * bands;
  // Task `task`'s chunk, its band and the bands of that chunk.
  const auto task_rows = [&](int64_t task, int64_t& chunk, int64_t& band, int64_t& of) {
    if (tail_bands == 1) {
      chunk = task / bands, band = task % bands, of = bands;
      return;
    }
    const int64_t share = task / share_tasks, j = task % share_tasks;
    const int64_t whole = kBackwardChunksPerThread - 1;
    chunk = share * kBackwardChunksPerThread + std::min(j, whole);
    band = j < whole ? 0 : j - whole;
    of = j < whole ? 1 : tail_bands;
  };

  cpu::parallel_shares(
      tasks, 1,
      [&](int64_t task_begin, int64_t task_end) {
        OwnTable<acc_t> own;
        // Adds the gradients of image b's RoIs, in RoI order, to rows [y0, y1) of its channels
        // [c_begin, c_end). kBanded: rows are a band of the planes, and each sample adds only
        // its corners in those rows; otherwise they are all the rows.
        const auto add_rois = [&](auto banded, int64_t b, int64_t c_begin, int64_t c_end,
                                  int64_t y0, int64_t y1) {
          constexpr bool kBanded = decltype(banded)::value;
          const int64_t lo_off = y0 * width, hi_off = y1 * width;  // the band's offsets
          const auto in_band = [&](int64_t o) { return o >= lo_off && o < hi_off; };
          for (int64_t r = first[b]; r < first[b + 1]; ++r) {
            const int64_t k = order[r];
            const TableRef<acc_t> t = tables.get(k, own);
            const acc_t count = t.count;
            for (int64_t c0 = c_begin; c0 < c_end; c0 += kChannelBlock) {
              const int64_t nc = std::min(kChannelBlock, c_end - c0);
              acc_t* dst[kChannelBlock];
              for (int64_t c = 0; c < nc; ++c) dst[c] = gi + (b * channels + c0 + c) * plane;
              const scalar_t* gk = g + (k * channels + c0) * bins;
              for (int64_t ph = 0; ph < pooled_height; ++ph) {
                const AxisSample<acc_t>* const y_begin = t.rows + t.row_start[ph];
                const AxisSample<acc_t>* const y_end = t.rows + t.row_start[ph + 1];
                // whole: every corner row of bin row ph is in the band, so its samples are
                // added as without bands; a bin row with none in the band is skipped
                bool whole = true;
                if constexpr (kBanded) {
                  bool any = false;
                  for (const AxisSample<acc_t>* y = y_begin; y < y_end; ++y) {
                    const bool lo = in_band(y->lo), hi = in_band(y->hi);
                    any = any || lo || hi;
                    whole = whole && lo && hi;
                  }
                  if (!any) continue;
                }
                for (int64_t pw = 0; pw < pooled_width; ++pw) {
                  const int64_t i = ph * pooled_width + pw;
                  acc_t gv[kChannelBlock];
                  for (int64_t c = 0; c < nc; ++c) gv[c] = static_cast<acc_t>(gk[c * bins + i]) / count;
                  if (!kBanded || whole) {
                    t.for_each_sample(ph, pw, [&](int64_t o1, int64_t o2, int64_t o3, int64_t o4,
                                                  acc_t w1, acc_t w2, acc_t w3, acc_t w4) {
                      for (int64_t c = 0; c < nc; ++c) {
                        acc_t* p = dst[c];
                        p[o1] += w1 * gv[c];
                        p[o2] += w2 * gv[c];
                        p[o3] += w3 * gv[c];
                        p[o4] += w4 * gv[c];
                      }
                    });
                    continue;
                  }
                  // for_each_sample's order, each corner added only where its row is in the
                  // band: every pixel of the band gets the same additions in the same order
                  const AxisSample<acc_t>* const x_begin = t.cols + t.col_start[pw];
                  const AxisSample<acc_t>* const x_end = t.cols + t.col_start[pw + 1];
                  for (const AxisSample<acc_t>* y = y_begin; y < y_end; ++y) {
                    const bool lo = in_band(y->lo), hi = in_band(y->hi);
                    if (!lo && !hi) continue;
                    const int64_t ylo = y->lo, yhi = y->hi;
                    const acc_t yh = y->h, yl = y->l;
                    for (const AxisSample<acc_t>* x = x_begin; x < x_end; ++x) {
                      const int64_t o1 = ylo + x->lo, o2 = ylo + x->hi;
                      const int64_t o3 = yhi + x->lo, o4 = yhi + x->hi;
                      const acc_t w1 = yh * x->h, w2 = yh * x->l, w3 = yl * x->h, w4 = yl * x->l;
                      for (int64_t c = 0; c < nc; ++c) {
                        acc_t* p = dst[c];
                        if (lo) {
                          p[o1] += w1 * gv[c];
                          p[o2] += w2 * gv[c];
                        }
                        if (hi) {
                          p[o3] += w3 * gv[c];
                          p[o4] += w4 * gv[c];
                        }
                      }
                    }
                  }
                }
              }
            }
          }
        };
        for (int64_t task = task_begin; task < task_end; ++task) {
          int64_t chunk, band, of;
          task_rows(task, chunk, band, of);
          const int64_t y0 = height * band / of, y1 = height * (band + 1) / of;
          const int64_t begin = bounds[chunk], end = bounds[chunk + 1];
          for (int64_t p = begin; p < end; ++p) {
            std::fill(gi + p * plane + y0 * width, gi + p * plane + y1 * width, acc_t(0));
          }
          const auto add = [&](int64_t b, int64_t c_begin, int64_t c_end) {
            if (of > 1) {
              add_rois(std::true_type{}, b, c_begin, c_end, y0, y1);
            } else {
              add_rois(std::false_type{}, b, c_begin, c_end, 0, height);
            }
          };
          for (int64_t b = begin / channels; b * channels < end; ++b) {
            const int64_t c_begin = std::max(begin, b * channels) - b * channels;
            const int64_t c_end = std::min(end, (b + 1) * channels) - b * channels;
            if (tables.empty()) {  // each RoI's table built once, for all the channels
              add(b, c_begin, c_end);
              continue;
            }
            // one block of channels at a time, so that the planes being added to stay in cache
            for (int64_t c0 = c_begin; c0 < c_end; c0 += kChannelBlock) {
              add(b, c0, std::min(c0 + kChannelBlock, c_end));
            }
          }
        }
      },
      [&](int64_t share, int64_t shares) { tables.build_share(share, shares); });
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
    check_batch_indices(kBackwardOp, rois, batch_size);  // as for any gradient
    return at::zeros({batch_size, channels, height, width}, grad.options());
  }
  // every element is written by the kernel (its task zeroes its planes first)
  at::Tensor grad_input = cpu::empty_output(
      {batch_size, channels, height, width}, grad.options().dtype(acc_dtype),
      cpu::FirstWrites::kOwnRanges);
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
