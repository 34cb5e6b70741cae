// NMS and batched (per-category) NMS on the CPU.
//
// Boxes are ranked by score (stable, descending) and, for batched NMS, grouped by category, so
// every category is a contiguous segment of the ranking; segments are independent and run in
// parallel. Within a segment the greedy pass needs, for each kept box, the lower-ranked boxes
// it overlaps by more than the threshold. Instead of testing all N^2 / 2 pairs, boxes are
// swept in x1 order and only pairs whose x-extents overlap are tested (a pair with no
// intersection can never have IoU > t >= 0). A negative threshold makes every pair a
// candidate, so it takes the dense pairwise path.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "../common/box_iou.h"
#include "../common/checks.h"

namespace detops {
namespace ops {
namespace {

using geometry::iou_above;

// Segments shorter than this use the dense pass: the sweep's sort does not pay off.
constexpr int64_t kSweepMinBoxes = 48;
// Sweep positions handed to one task.
constexpr int64_t kSweepGrain = 256;

template <typename T>
struct RankedBoxes {
  std::vector<T> x1, y1, x2, y2, area;
  std::vector<uint8_t> valid;  // score is not NaN

  explicit RankedBoxes(int64_t n) : x1(n), y1(n), x2(n), y2(n), area(n), valid(n) {}

  bool above(int64_t i, int64_t j, T thr) const {
    return iou_above(
        x1[i], y1[i], x2[i], y2[i], area[i], x1[j], y1[j], x2[j], y2[j], area[j], thr);
  }
};

template <typename T>
void greedy_dense(const RankedBoxes<T>& b, int64_t s, int64_t e, T thr, uint8_t* keep) {
  std::vector<uint8_t> removed(e - s, 0);
  for (int64_t p = s; p < e; ++p) {
    if (!b.valid[p] || removed[p - s]) continue;
    keep[p] = 1;
    for (int64_t q = p + 1; q < e; ++q) {
      if (!removed[q - s] && b.above(p, q, thr)) removed[q - s] = 1;
    }
  }
}

template <typename T>
void greedy_sweep(const RankedBoxes<T>& b, int64_t s, int64_t e, T thr, uint8_t* keep) {
  // Boxes that can take part in an overlap: a valid score and a non-NaN area.
  std::vector<int32_t> xs;
  xs.reserve(e - s);
  for (int64_t p = s; p < e; ++p) {
    if (b.valid[p] && !std::isnan(b.area[p])) xs.push_back(static_cast<int32_t>(p - s));
  }
  std::sort(xs.begin(), xs.end(), [&](int32_t u, int32_t v) {
    const T a = b.x1[s + u], c = b.x1[s + v];
    return a < c || (!(c < a) && u < v);
  });
  const int64_t m = static_cast<int64_t>(xs.size());

  // Pairs (higher-ranked, lower-ranked) with IoU above the threshold, gathered per task.
  const int64_t ntasks = std::max<int64_t>(1, (m + kSweepGrain - 1) / kSweepGrain);
  std::vector<std::vector<std::pair<int32_t, int32_t>>> found(ntasks);
  at::parallel_for(0, ntasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      auto& out = found[t];
      const int64_t a_end = std::min(m, (t + 1) * kSweepGrain);
      for (int64_t a = t * kSweepGrain; a < a_end; ++a) {
        const int64_t i = s + xs[a];
        const T ix2 = b.x2[i], iy1 = b.y1[i], iy2 = b.y2[i];
        for (int64_t c = a + 1; c < m; ++c) {
          const int64_t j = s + xs[c];
          if (!(b.x1[j] < ix2)) break;  // sorted by x1: no later box overlaps i in x
          if (!(geometry::min_of(iy2, b.y2[j]) > geometry::max_of(iy1, b.y1[j]))) continue;
          if (b.above(i, j, thr)) {
            const auto lo = static_cast<int32_t>(std::min(i, j) - s);
            const auto hi = static_cast<int32_t>(std::max(i, j) - s);
            out.emplace_back(lo, hi);
          }
        }
      }
    }
  });

  // Adjacency in compressed rows, keyed by the higher-ranked box.
  const int64_t len = e - s;
  std::vector<int64_t> offsets(len + 1, 0);
  for (const auto& v : found)
    for (const auto& pr : v) ++offsets[pr.first + 1];
  std::partial_sum(offsets.begin(), offsets.end(), offsets.begin());
  std::vector<int32_t> adj(offsets[len]);
  {
    std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
    for (const auto& v : found)
      for (const auto& pr : v) adj[fill[pr.first]++] = pr.second;
  }

  std::vector<uint8_t> removed(len, 0);
  for (int64_t p = 0; p < len; ++p) {
    if (!b.valid[s + p] || removed[p]) continue;
    keep[s + p] = 1;
    for (int64_t k = offsets[p]; k < offsets[p + 1]; ++k) removed[adj[k]] = 1;
  }
}

template <typename box_t>
at::Tensor nms_cpu_typed(
    const at::Tensor& boxes_in, const at::Tensor& scores_in, const at::Tensor* idxs_in,
    double iou_threshold) {
  using acc_t = at::opmath_type<box_t>;
  const int64_t n = boxes_in.size(0);
  const acc_t thr = geometry::iou_threshold_as<acc_t>(iou_threshold);

  const at::Tensor scores = scores_in.contiguous();
  // rank -> original index, by descending score; ties keep the original order.
  const at::Tensor order = std::get<1>(scores.sort(/*stable=*/true, 0, /*descending=*/true));
  const int64_t* ord = order.const_data_ptr<int64_t>();

  // position -> rank. Batched NMS groups the ranking by category (stable, so each category
  // stays in score order); positions of one category form one segment.
  std::vector<int64_t> rank_of(n);
  std::iota(rank_of.begin(), rank_of.end(), 0);
  std::vector<int64_t> seg_start{0};
  if (idxs_in != nullptr) {
    const at::Tensor idxs = idxs_in->to(at::kLong).contiguous();
    const int64_t* cls = idxs.const_data_ptr<int64_t>();
    std::stable_sort(rank_of.begin(), rank_of.end(), [&](int64_t a, int64_t b) {
      return cls[ord[a]] < cls[ord[b]];
    });
    for (int64_t p = 1; p < n; ++p) {
      if (cls[ord[rank_of[p]]] != cls[ord[rank_of[p - 1]]]) seg_start.push_back(p);
    }
  }
  seg_start.push_back(n);

  const at::Tensor boxes = boxes_in.contiguous();
  const box_t* bx = boxes.const_data_ptr<box_t>();
  RankedBoxes<acc_t> rb(n);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, scores.scalar_type(), "detops.nms", [&] {
        using score_t = scalar_t;
        const score_t* sc = scores.const_data_ptr<score_t>();
        at::parallel_for(0, n, 4096, [&](int64_t p0, int64_t p1) {
          for (int64_t p = p0; p < p1; ++p) {
            const int64_t i = ord[rank_of[p]];
            const acc_t x1 = static_cast<acc_t>(bx[i * 4 + 0]);
            const acc_t y1 = static_cast<acc_t>(bx[i * 4 + 1]);
            const acc_t x2 = static_cast<acc_t>(bx[i * 4 + 2]);
            const acc_t y2 = static_cast<acc_t>(bx[i * 4 + 3]);
            rb.x1[p] = x1;
            rb.y1[p] = y1;
            rb.x2[p] = x2;
            rb.y2[p] = y2;
            rb.area[p] = geometry::box_area(x1, y1, x2, y2);
            rb.valid[p] = !std::isnan(static_cast<double>(sc[i]));
          }
        });
      });

  std::vector<uint8_t> keep(n, 0);  // by position
  const int64_t nseg = static_cast<int64_t>(seg_start.size()) - 1;
  at::parallel_for(0, nseg, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t s = seg_start[g], e = seg_start[g + 1];
      if (thr >= acc_t(0) && e - s >= kSweepMinBoxes) {
        greedy_sweep(rb, s, e, thr, keep.data());
      } else {
        greedy_dense(rb, s, e, thr, keep.data());
      }
    }
  });

  // Kept boxes in rank order: descending score, ties by original index.
  std::vector<uint8_t> kept_rank(n, 0);
  for (int64_t p = 0; p < n; ++p) kept_rank[rank_of[p]] = keep[p];
  const int64_t count = std::count(kept_rank.begin(), kept_rank.end(), uint8_t(1));
  at::Tensor out = at::empty({count}, boxes_in.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0, k = 0; r < n; ++r) {
    if (kept_rank[r]) o[k++] = ord[r];
  }
  return out;
}

at::Tensor nms_cpu_impl(
    const char* op, const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor* idxs,
    double iou_threshold) {
  checks::check_nms_inputs(op, boxes, scores, idxs, iou_threshold);
  checks::check_device(op, "boxes", boxes, at::kCPU);
  if (boxes.size(0) == 0) {
    return at::empty({0}, boxes.options().dtype(at::kLong));
  }
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, boxes.scalar_type(), "detops.nms", [&] {
    out = nms_cpu_typed<scalar_t>(boxes, scores, idxs, iou_threshold);
  });
  return out;
}

at::Tensor nms_cpu(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold) {
  return nms_cpu_impl("detops.nms", boxes, scores, nullptr, iou_threshold);
}

at::Tensor batched_nms_cpu(
    const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs,
    double iou_threshold) {
  return nms_cpu_impl("detops.batched_nms", boxes, scores, &idxs, iou_threshold);
}

}  // namespace

TORCH_LIBRARY_IMPL(detops, CPU, m) {
  m.impl("nms", TORCH_FN(nms_cpu));
  m.impl("batched_nms", TORCH_FN(batched_nms_cpu));
}

}  // namespace ops
}  // namespace detops
