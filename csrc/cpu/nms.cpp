// NMS and batched (per-category) NMS on the CPU.
//
// Boxes are ranked by score (stable, descending) and, for batched NMS, grouped by category, so
// every category is a contiguous segment of the ranking; segments are independent and run in
// parallel. Within a segment the greedy pass visits boxes by rank. A pair with no positive
// intersection never has IoU > t >= 0, so only nearby boxes are ever tested:
//   * segments of 1024+ boxes (greedy_grid): each box asks whether a box kept before it
//     suppresses it, looking only at kept boxes stored in the cells of a uniform 2-D grid that
//     it can reach (one grid per segment, cells about half the largest typical box size);
//   * shorter segments (greedy_window): each kept box suppresses the lower-ranked boxes in its
//     x-window, found by binary search in x1 order; suppressed boxes are never tested again;
//   * segments under 48 boxes, or a negative threshold (every pair is a candidate): the dense
//     pairwise pass.
// Every decision is the same iou_above test (csrc/common/box_iou.h), so all passes agree.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "../common/box_iou.h"
#include "../common/checks.h"

namespace detops {
namespace ops {
namespace {

using geometry::iou_above;

// Segments shorter than this use the dense pass: the window's sort does not pay off.
constexpr int64_t kWindowMinBoxes = 48;

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
void greedy_window(const RankedBoxes<T>& b, int64_t s, int64_t e, T thr, uint8_t* keep) {
  // Boxes that can overlap anything: a valid score and a non-NaN area, in x1 order, copied
  // into contiguous arrays so that a window scan reads memory in order.
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
  const int64_t len = e - s;
  std::vector<T> X1(m), Y1(m), X2(m), Y2(m), A(m), X2max(m);
  std::vector<int64_t> slot(len, -1);  // position -> index in x order
  for (int64_t a = 0; a < m; ++a) {
    const int64_t p = s + xs[a];
    X1[a] = b.x1[p];
    Y1[a] = b.y1[p];
    X2[a] = b.x2[p];
    Y2[a] = b.y2[p];
    A[a] = b.area[p];
    X2max[a] = a ? geometry::max_of(X2max[a - 1], X2[a]) : X2[a];
    slot[xs[a]] = a;
  }

  // Suppression flags in x order, beside the coordinates they gate.
  std::vector<uint8_t> removed(m, 0);
  for (int64_t p = 0; p < len; ++p) {
    const int64_t a = slot[p];
    if (!b.valid[s + p] || (a >= 0 && removed[a])) continue;
    keep[s + p] = 1;
    if (a < 0) continue;  // NaN area: overlaps nothing
    const T ix1 = X1[a], iy1 = Y1[a], ix2 = X2[a], iy2 = Y2[a], ia = A[a];
    // Only boxes with x1 < ix2 and x2 > ix1 can intersect box p: before `lo` every x2 is
    // <= ix1 (prefix maximum), from `hi` on every x1 is >= ix2.
    const int64_t lo = std::upper_bound(X2max.begin(), X2max.end(), ix1) - X2max.begin();
    const int64_t hi = std::lower_bound(X1.begin(), X1.end(), ix2) - X1.begin();
    for (int64_t c = lo; c < hi; ++c) {
      // only lower-ranked boxes still in play, then a cheap overlap test before the IoU
      if (removed[c] || xs[c] <= p || !(X2[c] > ix1)) continue;
      if (!(geometry::min_of(iy2, Y2[c]) > geometry::max_of(iy1, Y1[c]))) continue;
      if (iou_above(ix1, iy1, ix2, iy2, ia, X1[c], Y1[c], X2[c], Y2[c], A[c], thr)) removed[c] = 1;
    }
  }
}

// A box takes part in suppressions (for a threshold >= 0) only if it has a positive width
// and height and a finite area. IoU > t >= 0 needs a positive intersection, which a box with
// x2 <= x1 or y2 <= y1 (or a NaN coordinate) never has; with an infinite or NaN area every
// IoU is 0 or NaN. Such boxes are kept whenever their score is not NaN.
template <typename T>
bool takes_part(const RankedBoxes<T>& b, int64_t p) {
  return b.x2[p] > b.x1[p] && b.y2[p] > b.y1[p] && std::isfinite(b.area[p]);
}

// One axis of the grid: anchors (x1 or y1) in [lo, lo + n / inv) map to cells 0..n-1, values
// outside clamp to the first or last cell. The map is monotone in v (every step is a rounded,
// monotone operation), which is all the queries need.
struct GridAxis {
  double lo = 0, inv = 0;
  int64_t n = 1;

  GridAxis(double lo_, double hi, double cell) : lo(lo_) {
    const double extent = hi - lo;
    double k = cell > 0 ? std::ceil(extent / cell) : 1.0;
    if (!(k >= 1)) k = 1;  // also NaN
    n = k > 1024 ? 1024 : static_cast<int64_t>(k);
    inv = extent > 0 ? static_cast<double>(n) / extent : 0.0;
  }
  int64_t cell(double v) const {
    const double c = std::floor((v - lo) * inv);
    return c <= 0 ? 0 : (c >= static_cast<double>(n - 1) ? n - 1 : static_cast<int64_t>(c));
  }
};

// Boxes in structure-of-arrays form.
template <typename T>
struct BoxSlab {
  std::vector<T> x1, y1, x2, y2, area;

  explicit BoxSlab(int64_t n = 0) : x1(n), y1(n), x2(n), y2(n), area(n) {}
  int64_t size() const { return static_cast<int64_t>(x1.size()); }
  void set(int64_t k, const RankedBoxes<T>& b, int64_t p) {
    x1[k] = b.x1[p];
    y1[k] = b.y1[p];
    x2[k] = b.x2[p];
    y2[k] = b.y2[p];
    area[k] = b.area[p];
  }
  void push(const RankedBoxes<T>& b, int64_t p) {
    x1.push_back(b.x1[p]);
    y1.push_back(b.y1[p]);
    x2.push_back(b.x2[p]);
    y2.push_back(b.y2[p]);
    area.push_back(b.area[p]);
  }
  // True when one of the boxes k0..k1-1 suppresses box p of b. The strict-overlap test comes
  // first: without a positive intersection IoU > thr >= 0 fails.
  bool any_suppresses(int64_t k0, int64_t k1, const RankedBoxes<T>& b, int64_t p, T thr) const {
    const T ax1 = b.x1[p], ay1 = b.y1[p], ax2 = b.x2[p], ay2 = b.y2[p], aa = b.area[p];
    for (int64_t k = k0; k < k1; ++k) {
      if (x1[k] < ax2 && ax1 < x2[k] && y1[k] < ay2 && ay1 < y2[k] &&
          iou_above(x1[k], y1[k], x2[k], y2[k], area[k], ax1, ay1, ax2, ay2, aa, thr)) {
        return true;
      }
    }
    return false;
  }
};

// Segments with at least this many boxes use the grid pass.
constexpr int64_t kGridMinBoxes = 1024;
// Grid cell side as a fraction of the reach (the largest width / height a box in the grid has).
constexpr double kCellPerReach = 0.5;
// Boxes per block of the multi-threaded grid pass.
constexpr int64_t kGridBlock = 1024;

// Kept boxes indexed in a uniform 2-D grid by the cell of their (x1, y1) corner. A box is
// stored in the grid only if its width and height are at most the reach (rx, ry); wider or
// taller kept boxes go to a short list that every query reads. A kept box B can overlap box A
// only if B.x1 < A.x2 and B.x1 > A.x1 - rx (and the same in y), so a query for A reads the
// cells between those anchors; the cell map is monotone, so no such B is missed.
template <typename T>
class KeptGrid {
 public:
  struct Cells {
    int64_t x0, x1, y0, y1;
  };

  // Sized for the boxes of positions s..e-1 that have a valid score and take part.
  KeptGrid(const RankedBoxes<T>& b, int64_t s, int64_t e) : s_(s), gx_(0, 0, 0), gy_(0, 0, 0) {
    double minx = std::numeric_limits<double>::infinity(), maxx = -minx, miny = minx, maxy = -minx;
    double sumw = 0, sumh = 0, maxw = 0, maxh = 0;
    int64_t m = 0;
    for (int64_t p = s; p < e; ++p) {
      if (!b.valid[p] || !takes_part(b, p)) continue;
      const double x1 = b.x1[p], y1 = b.y1[p];
      const double w = static_cast<double>(b.x2[p]) - x1, h = static_cast<double>(b.y2[p]) - y1;
      minx = std::min(minx, x1);
      maxx = std::max(maxx, x1);
      miny = std::min(miny, y1);
      maxy = std::max(maxy, y1);
      sumw += w;
      sumh += h;
      maxw = std::max(maxw, w);
      maxh = std::max(maxh, h);
      ++m;
    }
    if (m == 0) minx = maxx = miny = maxy = 0;
    // The reach is the largest box size, unless a few outliers make it much larger than the
    // typical box; those go to the wide list.
    const double mm = static_cast<double>(std::max<int64_t>(m, 1));
    rx_ = std::min(maxw, 4.0 * sumw / mm);
    ry_ = std::min(maxh, 4.0 * sumh / mm);
    // A stored box has fl(x2 - x1) <= rx, so its exact width is at most rx * (1 + 2^-53):
    // queries reach a little further.
    qx_ = rx_ * (1 + 1e-9);
    qy_ = ry_ * (1 + 1e-9);
    double cellx = rx_ * kCellPerReach, celly = ry_ * kCellPerReach;
    gx_ = GridAxis(minx, maxx, cellx);
    gy_ = GridAxis(miny, maxy, celly);
    while (gx_.n * gy_.n > 4 * m + 64) {  // keep the cell count in proportion to the box count
      cellx *= 2;
      celly *= 2;
      gx_ = GridAxis(minx, maxx, cellx);
      gy_ = GridAxis(miny, maxy, celly);
    }
    const int64_t ncell = gx_.n * gy_.n;
    // Cell of every box that would be stored in the grid if kept (-1: the wide list, or not
    // stored); cell capacities are those counts.
    cell_of_.assign(e - s, -1);
    start_.assign(ncell + 1, 0);
    for (int64_t p = s; p < e; ++p) {
      if (!b.valid[p] || !takes_part(b, p)) continue;
      const double x1 = b.x1[p], y1 = b.y1[p];
      if (static_cast<double>(b.x2[p]) - x1 <= rx_ && static_cast<double>(b.y2[p]) - y1 <= ry_) {
        const int64_t c = gy_.cell(y1) * gx_.n + gx_.cell(x1);
        cell_of_[p - s] = c;
        ++start_[c + 1];
      }
    }
    for (int64_t c = 0; c < ncell; ++c) start_[c + 1] += start_[c];
    fill_.assign(start_.begin(), start_.end() - 1);
    grid_ = BoxSlab<T>(start_[ncell]);
  }

  int64_t num_cells() const { return gx_.n * gy_.n; }

  // The cells that can hold a kept box overlapping box p.
  Cells cells(const RankedBoxes<T>& b, int64_t p) const {
    constexpr double kNegInf = -std::numeric_limits<double>::infinity();
    const double x1 = b.x1[p], y1 = b.y1[p];
    return Cells{
        gx_.cell(std::nextafter(x1 - qx_, kNegInf)), gx_.cell(static_cast<double>(b.x2[p])),
        gy_.cell(std::nextafter(y1 - qy_, kNegInf)), gy_.cell(static_cast<double>(b.y2[p]))};
  }

  // True when a kept box suppresses box p: wide-list entries from wide_from on, and in each
  // cell c of `r` the slots from first(c) (a negative value skips the cell) to the cell's fill.
  template <typename First>
  bool suppressed(
      const RankedBoxes<T>& b, int64_t p, T thr, const Cells& r, int64_t wide_from,
      const First& first) const {
    if (wide_.any_suppresses(wide_from, wide_.size(), b, p, thr)) return true;
    for (int64_t cy = r.y0; cy <= r.y1; ++cy) {
      for (int64_t c = cy * gx_.n + r.x0, c_end = cy * gx_.n + r.x1; c <= c_end; ++c) {
        const int64_t k0 = first(c);
        if (k0 >= 0 && grid_.any_suppresses(k0, fill_[c], b, p, thr)) return true;
      }
    }
    return false;
  }

  // Box p was kept; returns its cell, or -1 when it went to the wide list.
  int64_t insert(const RankedBoxes<T>& b, int64_t p) {
    const int64_t c = cell_of_[p - s_];
    if (c >= 0) {
      grid_.set(fill_[c]++, b, p);
    } else {
      wide_.push(b, p);
    }
    return c;
  }

  int64_t start(int64_t c) const { return start_[c]; }
  int64_t fill(int64_t c) const { return fill_[c]; }
  int64_t wide_size() const { return wide_.size(); }

 private:
  int64_t s_;
  double rx_ = 0, ry_ = 0, qx_ = 0, qy_ = 0;
  GridAxis gx_, gy_;
  std::vector<int64_t> cell_of_;  // position - s -> cell, or -1
  std::vector<int64_t> start_;    // first slot of each cell (and the end)
  std::vector<int64_t> fill_;     // next free slot of each cell
  BoxSlab<T> grid_;
  BoxSlab<T> wide_;
};

// Greedy pass that asks, for every box in rank order, whether a box kept before it suppresses
// it, looking only at kept boxes in the grid cells it can reach. Requires thr >= 0.
//
// With several threads, positions go in blocks: first every box of the block is tested, in
// parallel, against the boxes kept before the block; then, in rank order, the survivors are
// tested against the boxes kept earlier in the same block (found through per-cell marks of
// where the block's boxes begin), and inserted when kept.
template <typename T>
void greedy_grid(const RankedBoxes<T>& b, int64_t s, int64_t e, T thr, uint8_t* keep) {
  KeptGrid<T> grid(b, s, e);
  const bool parallel = at::get_num_threads() > 1 && !at::in_parallel_region() && e - s > kGridBlock;
  if (!parallel) {
    const auto all = [&grid](int64_t c) { return grid.start(c); };
    for (int64_t p = s; p < e; ++p) {
      if (!b.valid[p]) continue;
      if (takes_part(b, p)) {
        if (grid.suppressed(b, p, thr, grid.cells(b, p), 0, all)) continue;
        grid.insert(b, p);
      }
      keep[p] = 1;
    }
    return;
  }

  const int64_t ncell = grid.num_cells();
  std::vector<int64_t> block_of(ncell, -1);  // last block that stored a box in the cell
  std::vector<int64_t> block_first(ncell, 0);  // the cell's first slot of that block
  std::vector<uint8_t> hit(kGridBlock);
  for (int64_t b0 = s; b0 < e; b0 += kGridBlock) {
    const int64_t b1 = std::min(e, b0 + kGridBlock);
    const int64_t wide_before = grid.wide_size();
    at::parallel_for(b0, b1, 64, [&](int64_t q0, int64_t q1) {
      const auto all = [&grid](int64_t c) { return grid.start(c); };
      for (int64_t q = q0; q < q1; ++q) {
        hit[q - b0] = b.valid[q] && takes_part(b, q) &&
            grid.suppressed(b, q, thr, grid.cells(b, q), 0, all);
      }
    });
    const auto this_block = [&](int64_t c) { return block_of[c] == b0 ? block_first[c] : -1; };
    for (int64_t p = b0; p < b1; ++p) {
      if (!b.valid[p] || hit[p - b0]) continue;
      if (takes_part(b, p)) {
        if (grid.suppressed(b, p, thr, grid.cells(b, p), wide_before, this_block)) continue;
        const int64_t c = grid.insert(b, p);
        if (c >= 0 && block_of[c] != b0) {
          block_of[c] = b0;
          block_first[c] = grid.fill(c) - 1;
        }
      }
      keep[p] = 1;
    }
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
      if (thr >= acc_t(0) && e - s >= kGridMinBoxes) {
        greedy_grid(rb, s, e, thr, keep.data());
      } else if (thr >= acc_t(0) && e - s >= kWindowMinBoxes) {
        greedy_window(rb, s, e, thr, keep.data());
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
