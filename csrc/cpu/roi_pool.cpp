// RoIPool (max) forward and backward on the CPU.
//
// Forward: one work item per (block of 8 channels, RoI); the RoI's bin windows are computed
// once per item. _roi_pool_values runs the same code without storing argmax (and, in the
// vector path, without tracking indices at all: see "two steps" below). The input is
// read through its strides, so contiguous, channels_last and other strided inputs need no
// copy. Every path gives geometry::roi_pool_max's value bits and index (row-major order, the
// first maximum wins, NaN never does):
//   * float32 with contiguous rows (NCHW) or contiguous channels (channels_last) and at least
//     8 channels: the vector path (roi_pool_block.h), AVX2 where the CPU has it (with
//     AVX-512VL's masks for the argmax on Intel CPUs that have them), else SSE2;
//     the block's channels are the vector lanes, and each bin row's column maxima are found
//     once for all the bins of that row (see "two steps" below);
//   * any other input: a scalar scan per channel and bin (window_max).
// Items are taken one at a time, so the threads end within an item of each other.
// Backward: grad_input is cut into ranges of (image, channel) planes of equal work; each plane
// receives the gradients of its image's RoIs in RoI order: race-free, deterministic, and the
// same summation order as a serial loop over RoIs, with the argmax and gradients of the RoIs a
// few places ahead asked for while it adds (they lie C * bins values apart). float32 /
// float64 add into grad_input directly; float16 / bfloat16 through a float32 plane that is
// rounded once at the end.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "../common/checks.h"
#include "../common/roi_pool_entries.h"
#include "../common/roi_pool_geometry.h"
#include "../common/kernel_choice.h"
#include "output_alloc.h"
#include "plane_chunks.h"
#include "work_shares.h"
#include "roi_pool_lanes.h"

namespace detops {
namespace ops {
namespace {

// Rejects a RoI whose batch index is not an integer in [0, batch_size); returns the indices.
template <typename scalar_t>
std::vector<int64_t> batch_indices(const char* op, const at::Tensor& rois, int64_t batch_size) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t k = rois.size(0);
  const scalar_t* r = rois.const_data_ptr<scalar_t>();
  std::vector<int64_t> out(k);
  for (int64_t i = 0; i < k; ++i) {
    const acc_t v = static_cast<acc_t>(r[i * 5]);
    out[i] = geometry::roi_pool_batch_index(v, batch_size);
    DETOPS_CHECK(
        out[i] >= 0, op, ": rois[:, 0] must hold batch indices, integers in [0, ", batch_size,
        "), got ", v, " in row ", i);
  }
  return out;
}

// Channels per work item of the forward.
constexpr int64_t kChannelBlock = 8;

// The vector path finds a bin's maximum in two steps that give geometry::roi_pool_max's
// result (row-major order, the first maximum wins, NaN never does):
//   1. column maxima: for a bin row ph and every column w of the RoI, the largest value of
//      rows [h0, h1) in column w and its index h * W + w. Only a strictly greater value
//      replaces the maximum, so it is the first one from the top, and NaN never is. A column
//      whose values are all NaN or at most roi_pool_lowest keeps roi_pool_lowest and index -1.
//   2. per bin, over its columns [w0, w1) in order: a column replaces the current best when its
//      maximum is greater, or equal (-0 == +0) with a smaller index. The result is the largest
//      value m and, of the elements equal to m, the one with the smallest index: the first in
//      row-major order, the element the serial scan keeps, with its value bits.
// The vector path runs both steps on vectors of 8 channels: a bin row's column maxima are
// computed once for all the bins of that row, and each column on its own. Without argmax it
// tracks no index: step 1 keeps a column's first maximum from the top with one MAXPS per value
// (its first operand where greater, else its second, so equal values and NaN never replace
// the maximum), step 2 takes the largest column maximum, whose bits are the serial scan's
// unless it is zero: the first zero of the bin in row-major order is then read from the map.

// Pixel windows of one RoI's bins: bin (ph, pw) covers rows [rows[2ph], rows[2ph + 1]) and
// columns [cols[2pw], cols[2pw + 1]); it is empty when either range is, or when the RoI has
// only empty bins (box.batch < 0). Non-empty bins cover columns [first_col, last_col).
struct RoiWindows {
  std::vector<int64_t> rows, cols;
  int64_t first_col = 0, last_col = 0;

  RoiWindows(int64_t pooled_height, int64_t pooled_width)
      : rows(2 * pooled_height), cols(2 * pooled_width) {}

  template <typename T>
  void set(const geometry::RoiPoolBox<T>& box, int64_t height, int64_t width) {
    const int64_t ph_n = static_cast<int64_t>(rows.size()) / 2;
    const int64_t pw_n = static_cast<int64_t>(cols.size()) / 2;
    bool any_row = false;
    for (int64_t ph = 0; ph < ph_n; ++ph) {
      int64_t& h0 = rows[2 * ph];
      int64_t& h1 = rows[2 * ph + 1];
      geometry::roi_pool_bin_range(box.start_h, box.bin_h, ph, height, h0, h1);
      any_row = any_row || h1 > h0;
    }
    // A bin is non-empty where its row range and its column range both are (roi_pool_bin).
    first_col = width;
    last_col = 0;
    const bool any_bin = box.batch >= 0 && any_row;
    for (int64_t pw = 0; pw < pw_n; ++pw) {
      int64_t& w0 = cols[2 * pw];
      int64_t& w1 = cols[2 * pw + 1];
      geometry::roi_pool_bin_range(box.start_w, box.bin_w, pw, width, w0, w1);
      if (any_bin && w1 > w0) {
        first_col = std::min(first_col, w0);
        last_col = std::max(last_col, w1);
      }
    }
  }
};

// Items of the forward in one chunk of its parallel loop.
constexpr int64_t kForwardChunk = 1;

// Chunks of the backward's planes per thread, at most (never more chunks than planes).
constexpr int64_t kBackwardChunksPerThread = 16;

// The backward asks for the argmax and gradients of the RoI this many places ahead in its
// image's list while it adds the current one's: a plane's RoIs are a channel's (k, c) entries,
// C * bins values apart, each on other cache lines and mostly another page, which the
// hardware prefetchers do not follow.
constexpr int64_t kBackwardPrefetchRois = 4;

// Asks the CPU to bring [p, p + bytes) into its caches; a hint, never a fault.
inline void prefetch_range(const void* p, int64_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
  __builtin_prefetch(c + bytes - 1);
#else
  (void)p;
  (void)bytes;
#endif
}

// A forward thread's buffers: the vector path's column maxima and results (lanes entries per
// column / bin; index_lanes for their indices, 0 without argmax), and the windows of the RoI
// win_roi (-1: none yet).
struct ForwardScratch {
  std::vector<float> col_max, res;
  std::vector<int32_t> col_idx, res_idx;
  RoiWindows win;
  int64_t win_roi = -1;

  ForwardScratch(
      int64_t width, int64_t bins, int64_t lanes, int64_t index_lanes, int64_t pooled_height,
      int64_t pooled_width)
      : col_max(width * lanes),
        res(bins * lanes),
        col_idx(width * index_lanes),
        res_idx(bins * index_lanes),
        win(pooled_height, pooled_width) {}
};

// ---- Scalar path: any dtype, any strides, one channel and one bin at a time.

// geometry::roi_pool_max of one channel in two passes: the largest value (two independent
// maximum chains; NaN never replaces a maximum), then the first element equal to it in
// row-major order, which is the element the serial scan keeps (a later equal value never
// replaces it, -0 and +0 included). Same value bits and index as the serial scan.
template <typename acc_t, typename scalar_t>
inline acc_t window_max(
    const scalar_t* plane, int64_t s_h, int64_t s_w, int64_t width, int64_t h0, int64_t h1,
    int64_t w0, int64_t w1, int64_t& best_idx) {
  const acc_t lowest = geometry::roi_pool_lowest<acc_t>();
  acc_t m0 = lowest, m1 = lowest;
  for (int64_t h = h0; h < h1; ++h) {
    const scalar_t* row = plane + h * s_h;
    int64_t w = w0;
    for (; w + 1 < w1; w += 2) {
      const acc_t v0 = static_cast<acc_t>(row[w * s_w]);
      const acc_t v1 = static_cast<acc_t>(row[(w + 1) * s_w]);
      m0 = v0 > m0 ? v0 : m0;
      m1 = v1 > m1 ? v1 : m1;
    }
    if (w < w1) {
      const acc_t v0 = static_cast<acc_t>(row[w * s_w]);
      m0 = v0 > m0 ? v0 : m0;
    }
  }
  const acc_t m = m1 > m0 ? m1 : m0;
  best_idx = -1;
  if (!(m > lowest)) return lowest;
  for (int64_t h = h0; h < h1; ++h) {
    const scalar_t* row = plane + h * s_h;
    for (int64_t w = w0; w < w1; ++w) {
      const acc_t v = static_cast<acc_t>(row[w * s_w]);
      if (v == m) {
        best_idx = h * width + w;
        return v;
      }
    }
  }
  return m;  // not reached: m is one of the window's values
}

// Channels [0, nc) of one RoI: channel c's plane is first_plane + c * s_c, its outputs
// o[c * bins + j] and a[c * bins + j].
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void pool_channels_scalar(
    const scalar_t* first_plane, int64_t s_c, int64_t s_h, int64_t s_w, int64_t width,
    int64_t nc, const RoiWindows& win, int64_t pooled_height, int64_t pooled_width,
    scalar_t* o, int32_t* a) {
  const int64_t bins = pooled_height * pooled_width;
  for (int64_t ph = 0; ph < pooled_height; ++ph) {
    const int64_t h0 = win.rows[2 * ph], h1 = win.rows[2 * ph + 1];
    for (int64_t pw = 0; pw < pooled_width; ++pw) {
      const int64_t j = ph * pooled_width + pw;
      const int64_t w0 = win.cols[2 * pw], w1 = win.cols[2 * pw + 1];
      if (h1 <= h0 || w1 <= w0) {
        for (int64_t c = 0; c < nc; ++c) {
          o[c * bins + j] = scalar_t(0);
          if (a) a[c * bins + j] = -1;
        }
        continue;
      }
      for (int64_t c = 0; c < nc; ++c) {
        int64_t best_idx;
        const acc_t best = window_max<acc_t>(
            first_plane + c * s_c, s_h, s_w, width, h0, h1, w0, w1, best_idx);
        o[c * bins + j] = static_cast<scalar_t>(best);
        if (a) a[c * bins + j] = static_cast<int32_t>(best_idx);
      }
    }
  }
}

// ---- Vector path: float32, kChannelBlock channels at a time (roi_pool_block.h), built once
// per instruction set of roi_pool_lanes.h.
#ifdef DETOPS_CPU_SSE2
namespace sse2 {
using Lanes = cpu::Sse2Lanes;
#define DETOPS_LANES_FN
#include "roi_pool_block.h"
#undef DETOPS_LANES_FN
}  // namespace sse2
#endif
#ifdef DETOPS_CPU_AVX2
namespace avx2 {
using Lanes = cpu::Avx2Lanes;
#define DETOPS_LANES_FN DETOPS_AVX2_FN
#include "roi_pool_block.h"
#undef DETOPS_LANES_FN
}  // namespace avx2
namespace avx512 {
using Lanes = cpu::Avx512Lanes;
#define DETOPS_LANES_FN DETOPS_AVX512_FN
#include "roi_pool_block.h"
#undef DETOPS_LANES_FN
}  // namespace avx512
#endif

enum class ForwardPath { kScalar, kSse2, kAvx2, kAvx512 };

// The path of a float32 input that the vector path takes, by cpu_vector(), this CPU and
// whether argmax is computed. Avx512Lanes differ from Avx2Lanes in the index steps alone, so
// they serve the forward with argmax only; with the default choice, on Intel CPUs with
// AVX-512VL, where the masks speed it up (on AMD ones they slow it down).
ForwardPath vector_forward_path(bool with_argmax) {
  const CpuVector choice = cpu_vector();
  if (choice == CpuVector::kScalar) return ForwardPath::kScalar;
#ifdef DETOPS_CPU_AVX2
  const bool masks = with_argmax &&
      (choice == CpuVector::kAvx512 || (choice == CpuVector::kAuto && cpu::cpu_is_intel()));
  if (masks && cpu::cpu_has_avx512vl()) return ForwardPath::kAvx512;
  if (choice != CpuVector::kSse2 && cpu::cpu_has_avx2()) return ForwardPath::kAvx2;
#endif
#ifdef DETOPS_CPU_SSE2
  return ForwardPath::kSse2;
#else
  return ForwardPath::kScalar;
#endif
}

// Channel blocks an item of the vector path's argmax reads in one pass with channels inner:
// Lanes::kIndexBlocks of the path's lanes.
int64_t index_blocks(ForwardPath path) {
#ifdef DETOPS_CPU_AVX2
  if (path == ForwardPath::kAvx512) return avx512::Lanes::kIndexBlocks;
  if (path == ForwardPath::kAvx2) return avx2::Lanes::kIndexBlocks;
#endif
#ifdef DETOPS_CPU_SSE2
  if (path == ForwardPath::kSse2) return sse2::Lanes::kIndexBlocks;
#endif
  return 1;
}

template <typename scalar_t>
void roi_pool_forward_typed(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, at::Tensor& output, at::Tensor& argmax) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t batch = input.size(0), channels = input.size(1);
  const int64_t height = input.size(2), width = input.size(3);
  const int64_t s_b = input.stride(0), s_c = input.stride(1);
  const int64_t s_h = input.stride(2), s_w = input.stride(3);
  const int64_t bins = pooled_height * pooled_width;
  const acc_t scale = static_cast<acc_t>(spatial_scale);
  const scalar_t* in = input.const_data_ptr<scalar_t>();
  const scalar_t* r = rois.const_data_ptr<scalar_t>();
  scalar_t* out = output.data_ptr<scalar_t>();
  int32_t* arg = argmax.defined() ? argmax.data_ptr<int32_t>() : nullptr;  // none: values alone
  const int64_t blocks = (channels + kChannelBlock - 1) / kChannelBlock;
  // The vector path needs whole blocks of channels (the last block is moved back to end on
  // the last channel) and, for rows, groups of 4 columns.
  const bool vector_rows = s_w == 1 && width >= 4;
  const ForwardPath path = std::is_same<scalar_t, float>::value &&
          channels >= kChannelBlock && (vector_rows || s_c == 1)
      ? vector_forward_path(arg != nullptr)
      : ForwardPath::kScalar;
  const bool vector_path = path != ForwardPath::kScalar;

  // Items run RoI fastest: item = group * K + j is RoI order[j] and channel group item / K, a
  // group being one block, or with channels inner up to 4 adjacent ones, which read whole
  // 64-byte lines. A thread's range of items holds RoIs of all sizes, so equal ranges are about
  // equal work, and reads one or a few groups' channels: with NCHW input their planes, the RoIs
  // in index order; with channels inner their slice of every pixel, larger than a core's cache,
  // so there each image's RoIs run in bands of the rows of their centres and consecutive items
  // read nearby pixels. Equal shares, a chunk at a time; threads done early help the others. A
  // chunk is one item of a few microseconds, so the threads end within about an item of each
  // other, also where one core runs at half the speed of the others. A thread's buffers live
  // across its chunks, so a chunk allocates nothing.
  const int64_t num_rois = rois.size(0);
  const bool by_centre = s_c == 1 && channels > 1;  // channels inner
  // blocks an item: with channels inner, the vector path reads 4 adjacent blocks at a time
  // (pool_block's nblocks), where the channels hold them; with argmax as many as the lanes
  // have registers for (index_blocks: 4 blocks at two columns keep 16 vectors of maxima and
  // indices).
  const int64_t per_item =
      vector_path && !vector_rows && s_c == 1 ? (arg ? index_blocks(path) : 4) : 1;
  const int64_t groups = (blocks + per_item - 1) / per_item;  // items per RoI
  const int64_t items = num_rois * groups;
  // vector path: the column maxima of one bin row and the results of the item's blocks,
  // channel minor (kChannelBlock entries per column / bin, per block)
  const int64_t lanes = vector_path ? kChannelBlock * per_item : 0;
  const int64_t index_lanes = arg ? lanes : 0;  // the values alone track no index
  const auto make_scratch = [&] {
    return ForwardScratch(width, bins, lanes, index_lanes, pooled_height, pooled_width);
  };
  std::vector<int64_t> first, order;
  if (by_centre) {
    const int64_t bands = cpu::centre_bands(height);
    const auto key = [&](int64_t k) {
      const scalar_t* q = r + k * 5;
      return cpu::centre_band_key(
          static_cast<acc_t>(q[0]), static_cast<acc_t>(q[2]), static_cast<acc_t>(q[4]), scale,
          batch, bands);
    };
    cpu::group_rois(num_rois, batch * bands, key, first, order);
  }
  cpu::PerThread<ForwardScratch> scratch;
  cpu::parallel_shares(items, kForwardChunk, [&](int64_t i0, int64_t i1) {
    std::optional<ForwardScratch> own;
    ForwardScratch& sp = scratch.get_or_own(own, make_scratch);
    std::vector<float>& col_max = sp.col_max;
    std::vector<float>& res = sp.res;
    std::vector<int32_t>& col_idx = sp.col_idx;
    std::vector<int32_t>& res_idx = sp.res_idx;
    RoiWindows& win = sp.win;
    int64_t& win_roi = sp.win_roi;  // the RoI whose windows `win` holds
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t k = by_centre ? order[item % num_rois] : item % num_rois;
      const int64_t group = item / num_rois;
      const int64_t c0 = group * kChannelBlock * per_item;
      const int64_t nc = std::min(kChannelBlock * per_item, channels - c0);
      const auto box = geometry::roi_pool_box_at(r, k, scale, batch, pooled_height, pooled_width);
      scalar_t* o = out + (k * channels + c0) * bins;
      int32_t* a = arg ? arg + (k * channels + c0) * bins : nullptr;
      if (box.batch < 0) {  // only empty bins
        std::fill(o, o + nc * bins, scalar_t(0));
        if (a) std::fill(a, a + nc * bins, -1);
        continue;
      }
      if (k != win_roi) {
        win.set(box, height, width);
        win_roi = k;
      }
      if constexpr (std::is_same<scalar_t, float>::value) {
        if (vector_path) {
          // channels [c0, c0 + nc): per_item adjacent blocks at once where the channels hold
          // them, else a block at a time; a last block that would pass the channels is moved
          // back to end on them
          for (int64_t c = c0; c < c0 + nc;) {
            const int64_t nblocks = c + per_item * kChannelBlock <= c0 + nc ? per_item : 1;
            const int64_t cb = std::min(c, channels - kChannelBlock);  // the call's first channel
            const float* first = in + box.batch * s_b + cb * s_c;
            auto block = [&](auto pool_block) {
              pool_block(
                  first, s_c, s_h, s_w, width, vector_rows, nblocks, win, pooled_height,
                  pooled_width, col_max.data(), col_idx.data(), res.data(), res_idx.data());
            };
#ifdef DETOPS_CPU_AVX2
            if (path == ForwardPath::kAvx512) {
              block(avx512::pool_block<true>);  // with argmax only (vector_forward_path)
            }
            if (path == ForwardPath::kAvx2) {
              block(a ? avx2::pool_block<true> : avx2::pool_block<false>);
            }
#endif
#ifdef DETOPS_CPU_SSE2
            if (path == ForwardPath::kSse2) {
              block(a ? sse2::pool_block<true> : sse2::pool_block<false>);
            }
#endif
            // channel ch is lane ch - cb of the call's results (each block's results follow
            // the one's before, bins * kChannelBlock entries on)
            const int64_t c_end = std::min(c + nblocks * kChannelBlock, c0 + nc);
            for (int64_t ch = c; ch < c_end; ++ch) {
              const int64_t l = ch - cb;
              const int64_t base = (l / kChannelBlock) * bins * kChannelBlock + l % kChannelBlock;
              const int64_t oc = (ch - c0) * bins;
              for (int64_t j = 0; j < bins; ++j) {
                o[oc + j] = res[base + j * kChannelBlock];
                if (a) a[oc + j] = res_idx[base + j * kChannelBlock];
              }
            }
            c = c_end;
          }
          continue;
        }
      }
      pool_channels_scalar(
          in + box.batch * s_b + c0 * s_c, s_c, s_h, s_w, width, nc, win, pooled_height,
          pooled_width, o, a);
    }
  });
}

// The forward; with_argmax false: the values alone, argmax left undefined.
std::tuple<at::Tensor, at::Tensor> roi_pool_forward_cpu(
    const at::Tensor& input, const at::Tensor& rois_in, double spatial_scale,
    int64_t pooled_height, int64_t pooled_width, bool with_argmax) {
  checks::check_roi_pool_inputs(input, rois_in, spatial_scale, pooled_height, pooled_width);
  checks::check_device("detops.roi_pool", "input", input, at::kCPU);
  DETOPS_CHECK(
      input.size(2) * input.size(3) <= std::numeric_limits<int32_t>::max(),
      "detops.roi_pool: input must have H * W < 2^31 (argmax is int32), got ",
      checks::shape_str(input));
  const int64_t k = rois_in.size(0);
  at::Tensor output =
      cpu::empty_output({k, input.size(1), pooled_height, pooled_width}, input.options());
  at::Tensor argmax;
  if (with_argmax) argmax = cpu::empty_output(output.sizes(), input.options().dtype(at::kInt));
  if (k == 0) return {output, argmax};
  const at::Tensor rois = rois_in.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, input.scalar_type(), "detops.roi_pool", [&] {
        batch_indices<scalar_t>("detops.roi_pool", rois, input.size(0));
        if (output.numel() == 0) return;
        roi_pool_forward_typed<scalar_t>(
            input, rois, spatial_scale, pooled_height, pooled_width, output, argmax);
      });
  return {output, argmax};
}

template <typename scalar_t>
bool roi_pool_backward_typed(
    const at::Tensor& grad, const std::vector<int64_t>& roi_batch, const at::Tensor& argmax,
    int64_t pooled_height, int64_t pooled_width, at::Tensor& grad_input) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t batch = grad_input.size(0), channels = grad_input.size(1);
  const int64_t plane_size = grad_input.size(2) * grad_input.size(3);
  const int64_t bins = pooled_height * pooled_width;
  const int64_t g_k = grad.stride(0), g_c = grad.stride(1);
  const int64_t g_h = grad.stride(2), g_w = grad.stride(3);
  const scalar_t* g = grad.const_data_ptr<scalar_t>();
  const int32_t* arg = argmax.const_data_ptr<int32_t>();
  scalar_t* gi = grad_input.data_ptr<scalar_t>();
  // bytes from a (RoI, channel)'s first gradient to past its last (contiguous: bins values)
  const int64_t g_span =
      ((pooled_height - 1) * g_h + (pooled_width - 1) * g_w + 1) * int64_t{sizeof(scalar_t)};

  // RoIs of each image, in RoI order.
  std::vector<int64_t> first, by_image;
  cpu::group_rois_by_image(
      static_cast<int64_t>(roi_batch.size()), batch, [&](int64_t k) { return roi_batch[k]; },
      first, by_image);

  // Chunks of equal work, up to kBackwardChunksPerThread per thread and at least a plane
  // each, taken in order from equal shares (threads done early help the others); the chunking
  // never changes the order in which a plane receives its additions. Chunks of a plane or a
  // few let the threads end within about a plane of each other.
  const int64_t planes = batch * channels;
  const int64_t chunks = std::max<int64_t>(
      1, std::min<int64_t>(planes, int64_t{at::get_num_threads()} * kBackwardChunksPerThread));
  const std::vector<int64_t> bounds = cpu::balanced_plane_ranges(first, channels, chunks);
  constexpr bool kDirect = std::is_same<acc_t, scalar_t>::value;

  // grad_input comes uninitialized: each task writes its planes whole (zeroes, then adds).
  // An argmax outside [-1, H * W) is never followed; it sets `bad`, and the caller reports it.
  // float16 / bfloat16: a float32 plane per thread, kept across its chunks.
  std::atomic<bool> bad{false};
  const auto make_buffer = [&] { return std::vector<acc_t>(kDirect ? 0 : plane_size); };
  cpu::PerThread<std::vector<acc_t>> buffers;
  cpu::parallel_shares(chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    std::optional<std::vector<acc_t>> own;
    std::vector<acc_t>& buffer = buffers.get_or_own(own, make_buffer);
    bool task_bad = false;
    for (int64_t p = bounds[chunk_begin]; p < bounds[chunk_end]; ++p) {
      const int64_t b = p / channels, c = p % channels;
      scalar_t* dst = gi + p * plane_size;
      if (first[b] == first[b + 1]) {  // no RoI on this image
        std::fill(dst, dst + plane_size, scalar_t(0));
        continue;
      }
      acc_t* acc;
      if constexpr (kDirect) {
        acc = dst;
      } else {
        acc = buffer.data();
      }
      std::fill(acc, acc + plane_size, acc_t(0));
      for (int64_t q = first[b]; q < first[b + 1]; ++q) {
        const int64_t k = by_image[q];
        const int32_t* a = arg + (k * channels + c) * bins;
        const scalar_t* gk = g + k * g_k + c * g_c;
        if (q + kBackwardPrefetchRois < first[b + 1]) {
          const int64_t kn = by_image[q + kBackwardPrefetchRois];
          prefetch_range(arg + (kn * channels + c) * bins, bins * sizeof(int32_t));
          prefetch_range(g + kn * g_k + c * g_c, g_span);
        }
        for (int64_t ph = 0; ph < pooled_height; ++ph) {
          for (int64_t pw = 0; pw < pooled_width; ++pw) {
            const int32_t idx = a[ph * pooled_width + pw];
            if (idx >= 0 && idx < plane_size) {
              acc[idx] += static_cast<acc_t>(gk[ph * g_h + pw * g_w]);
            } else if (idx != -1) {
              task_bad = true;
            }
          }
        }
      }
      if constexpr (!kDirect) {
        for (int64_t j = 0; j < plane_size; ++j) dst[j] = static_cast<scalar_t>(acc[j]);
      }
    }
    if (task_bad) bad.store(true, std::memory_order_relaxed);
  });
  return !bad.load();
}

at::Tensor roi_pool_backward_cpu(
    const at::Tensor& grad, const at::Tensor& rois_in, const at::Tensor& argmax_in,
    double spatial_scale, int64_t pooled_height, int64_t pooled_width, int64_t batch_size,
    int64_t channels, int64_t height, int64_t width) {
  const char* op = "detops.roi_pool backward";
  checks::check_roi_pool_backward_inputs(
      grad, rois_in, argmax_in, spatial_scale, pooled_height, pooled_width, batch_size, channels,
      height, width);
  checks::check_device(op, "grad", grad, at::kCPU);
  const at::Tensor rois = rois_in.contiguous();
  if (grad.numel() == 0 || batch_size * channels * height * width == 0) {
    // nothing to add, but a bad batch index is an error as for any gradient
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, grad.scalar_type(), "detops.roi_pool_backward",
        [&] { batch_indices<scalar_t>(op, rois, batch_size); });
    return at::zeros({batch_size, channels, height, width}, grad.options());
  }
  const at::Tensor argmax = argmax_in.contiguous();
  // every element is written by the kernel, each task zeroing its planes first
  at::Tensor grad_input = cpu::empty_output(
      {batch_size, channels, height, width}, grad.options(), cpu::FirstWrites::kOwnRanges);
  bool argmax_ok = true;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, grad.scalar_type(), "detops.roi_pool_backward", [&] {
    const std::vector<int64_t> roi_batch = batch_indices<scalar_t>(op, rois, batch_size);
    argmax_ok = roi_pool_backward_typed<scalar_t>(
        grad, roi_batch, argmax, pooled_height, pooled_width, grad_input);
  });
  if (!argmax_ok) {  // the range, for the message
    const auto range = at::aminmax(argmax);
    DETOPS_CHECK(
        false, op, ": argmax must hold -1 or indices in [0, H * W = ", height * width,
        "), got values in [", std::get<0>(range).item<int32_t>(), ", ",
        std::get<1>(range).item<int32_t>(), "]");
  }
  return grad_input;
}

}  // namespace

TORCH_LIBRARY_IMPL(detops, CPU, m) {
  m.impl("roi_pool", TORCH_FN(RoIPoolEntries<&roi_pool_forward_cpu>::with_argmax));
  m.impl("_roi_pool_values", TORCH_FN(RoIPoolEntries<&roi_pool_forward_cpu>::values));
  m.impl("_roi_pool_backward", TORCH_FN(roi_pool_backward_cpu));
}

}  // namespace ops
}  // namespace detops
