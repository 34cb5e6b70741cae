// Fixed-shape batched NMS on the CPU: images run in parallel (at::parallel_for over B).
//
// For each image, the boxes whose score is above score_threshold are ranked by score (stable,
// descending: ties keep their original order). The greedy pass then visits them by rank and
// keeps a box unless a box kept before it overlaps it by more than iou_threshold, which is
// greedy NMS (only kept boxes suppress), and stops as soon as max_output boxes are kept. Each
// candidate is tested only against the kept boxes, so an image costs at most
// N * min(max_output, kept) IoU tests after the sort.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "../common/box_iou.h"
#include "../common/nms_padded_checks.h"

namespace detops {
namespace ops {
namespace {

constexpr const char* kOp = "detops.nms_padded";

template <typename box_t, typename score_t>
void nms_padded_cpu_typed(
    const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
    double score_threshold, int64_t max_output, int64_t* out, int64_t* counts) {
  using acc_t = at::opmath_type<box_t>;
  using key_t = at::opmath_type<score_t>;
  const int64_t batch = boxes.size(0), n = boxes.size(1);
  const acc_t thr = geometry::iou_threshold_as<acc_t>(iou_threshold);
  // score > score_threshold exactly (as real numbers): key > sthr, see iou_threshold_as.
  const key_t sthr = geometry::iou_threshold_as<key_t>(score_threshold);
  const bool need_overlap = thr >= acc_t(0);
  const box_t* bx = boxes.const_data_ptr<box_t>();
  const score_t* sc = scores.const_data_ptr<score_t>();

  at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int64_t> cand;
    std::vector<key_t> key(n);
    std::vector<acc_t> kx1, ky1, kx2, ky2, karea;
    for (int64_t b = b0; b < b1; ++b) {
      const box_t* ib = bx + b * n * 4;
      const score_t* is = sc + b * n;
      int64_t* ob = out + b * max_output;
      cand.clear();
      for (int64_t i = 0; i < n; ++i) {
        key[i] = static_cast<key_t>(is[i]);
        if (key[i] > sthr) cand.push_back(i);  // NaN never passes
      }
      std::stable_sort(cand.begin(), cand.end(), [&](int64_t u, int64_t v) { return key[u] > key[v]; });

      const int64_t limit = std::min<int64_t>(max_output, static_cast<int64_t>(cand.size()));
      kx1.clear();
      ky1.clear();
      kx2.clear();
      ky2.clear();
      karea.clear();
      int64_t kept = 0;
      for (size_t c = 0; c < cand.size() && kept < limit; ++c) {
        const int64_t i = cand[c];
        const acc_t x1 = static_cast<acc_t>(ib[i * 4 + 0]);
        const acc_t y1 = static_cast<acc_t>(ib[i * 4 + 1]);
        const acc_t x2 = static_cast<acc_t>(ib[i * 4 + 2]);
        const acc_t y2 = static_cast<acc_t>(ib[i * 4 + 3]);
        const acc_t area = geometry::box_area(x1, y1, x2, y2);
        bool suppressed = false;
        for (int64_t k = 0; k < kept; ++k) {
          // With a threshold >= 0 only intersecting pairs can be above it.
          if (need_overlap &&
              !(geometry::min_of(kx2[k], x2) > geometry::max_of(kx1[k], x1) &&
                geometry::min_of(ky2[k], y2) > geometry::max_of(ky1[k], y1))) {
            continue;
          }
          if (geometry::iou_above(kx1[k], ky1[k], kx2[k], ky2[k], karea[k], x1, y1, x2, y2, area, thr)) {
            suppressed = true;
            break;
          }
        }
        if (suppressed) continue;
        kx1.push_back(x1);
        ky1.push_back(y1);
        kx2.push_back(x2);
        ky2.push_back(y2);
        karea.push_back(area);
        ob[kept++] = i;
      }
      counts[b] = kept;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> nms_padded_cpu(
    const at::Tensor& boxes_in, const at::Tensor& scores_in, double iou_threshold,
    double score_threshold, int64_t max_output) {
  checks::check_nms_padded_inputs(kOp, boxes_in, scores_in, iou_threshold, score_threshold, max_output);
  checks::check_device(kOp, "boxes", boxes_in, at::kCPU);
  const int64_t batch = boxes_in.size(0);
  const auto long_opts = boxes_in.options().dtype(at::kLong);
  at::Tensor out = at::full({batch, max_output}, -1, long_opts);
  at::Tensor counts = at::zeros({batch}, long_opts);
  if (batch == 0 || boxes_in.size(1) == 0 || max_output == 0) return {out, counts};

  const at::Tensor boxes = boxes_in.contiguous();
  const at::Tensor scores = scores_in.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, boxes.scalar_type(), kOp, [&] {
    using box_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scores.scalar_type(), kOp, [&] {
      nms_padded_cpu_typed<box_t, scalar_t>(
          boxes, scores, iou_threshold, score_threshold, max_output, out.data_ptr<int64_t>(),
          counts.data_ptr<int64_t>());
    });
  });
  return {out, counts};
}

}  // namespace

TORCH_LIBRARY_IMPL(detops, CPU, m) {
  m.impl("nms_padded", TORCH_FN(nms_padded_cpu));
}

}  // namespace ops
}  // namespace detops
