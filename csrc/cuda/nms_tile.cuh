// One row box against a 64-box column tile of an NMS suppression mask: the inner loop of the
// mask kernels of nms / batched_nms (nms.cu) and nms_padded (nms_padded.cu).
//
// A block stages a column tile in shared memory (stage_column), then each thread computes the
// word of its row box (overlap_word). Pairs are first tested for intersection (four
// comparisons: an IoU above a threshold >= 0 needs one), and a warp none of whose rows meets
// a column skips it. Where the threshold allows the division-free decision and the row box and
// every box of the tile are plain (geometry::iou_plain_box), each intersecting pair is decided
// by geometry::iou_decided_plain, without clamps, range checks or a division; the pairs it
// leaves undecided (within 2^-20 of the union from the threshold) get iou_above's division
// after the loop. Other rows take the general loop: iou_decided_without_division, then the
// division for the pairs it leaves. Both loops decide every pair as iou_above does.
#pragma once

#include <cstdint>
#include <limits>

#include "../common/box_iou.h"

namespace detops {
namespace ops {
namespace nms_tile {

constexpr int kTile = 64;

// A box as one aligned vector, so that a shared-memory tile serves it in one load.
template <typename T>
struct alignas(4 * sizeof(T)) Box4 {
  T x1, y1, x2, y2;
};

template <typename T>
struct ColumnTile {
  Box4<T> box[kTile];
  T area[kTile];
};

// Bits [begin, end) of a 64-bit word.
__device__ __forceinline__ uint64_t bit_range(int begin, int end) {
  if (begin >= end) return 0;
  const uint64_t below_end = end >= 64 ? ~0ULL : (1ULL << end) - 1;
  return below_end & (~0ULL << begin);
}

// Thread t stages column box *src, or, with src == nullptr (past the tile's last box), a NaN
// box, which fails every intersection test. Returns whether the staged box lets the tile take
// the plain loop (a NaN box does: no pair with it gets past the intersection test).
template <typename T>
__device__ __forceinline__ bool stage_column(ColumnTile<T>& tile, int t, const Box4<T>* src) {
  if (src == nullptr) {
    const T nan = std::numeric_limits<T>::quiet_NaN();
    tile.box[t] = Box4<T>{nan, nan, nan, nan};
    tile.area[t] = nan;
    return true;
  }
  const Box4<T> b = *src;
  const T area = geometry::box_area(b.x1, b.y1, b.x2, b.y2);
  tile.box[t] = b;
  tile.area[t] = area;
  return geometry::iou_plain_box(b.x1, b.y1, b.x2, b.y2, area);
}

template <typename T>
__device__ __forceinline__ bool intersect(const Box4<T>& a, const Box4<T>& b) {
  return a.x2 > b.x1 && b.x2 > a.x1 && a.y2 > b.y1 && b.y2 > a.y1;
}

// Bit i is set when IoU(row box, column box i) > threshold, for all 64 columns (the caller
// masks the ones it needs). `plain`: the threshold is division-free
// (geometry::iou_division_free_threshold), and the row box and every box of the tile are plain.
template <typename T>
__device__ __forceinline__ uint64_t overlap_word(
    const Box4<T>& rb, T area, const ColumnTile<T>& tile, T threshold, bool plain, bool division_free) {
  uint64_t bits = 0;
  if (plain) {
    uint64_t undecided = 0;
#pragma unroll
    for (int i = 0; i < kTile; ++i) {
      const Box4<T> b = tile.box[i];
      if (!intersect(rb, b)) continue;
      bool above;
      if (!geometry::iou_decided_plain(
              rb.x1, rb.y1, rb.x2, rb.y2, area, b.x1, b.y1, b.x2, b.y2, tile.area[i], threshold, above)) {
        undecided |= uint64_t{1} << i;
      }
      if (above) bits |= uint64_t{1} << i;
    }
    // The pairs within delta of the boundary (rare): the division decides them.
    while (undecided) {
      const int i = __ffsll(static_cast<long long>(undecided)) - 1;
      undecided &= undecided - 1;
      const Box4<T> b = tile.box[i];
      if (geometry::iou_above(rb.x1, rb.y1, rb.x2, rb.y2, area, b.x1, b.y1, b.x2, b.y2, tile.area[i], threshold)) {
        bits |= uint64_t{1} << i;
      }
    }
    return bits;
  }
  const bool need_overlap = threshold >= T(0);
#pragma unroll
  for (int i = 0; i < kTile; ++i) {
    const Box4<T> b = tile.box[i];
    if (need_overlap && !intersect(rb, b)) continue;
    const T carea = tile.area[i];
    bool above;
    if (division_free && geometry::iou_decided_without_division(
                             rb.x1, rb.y1, rb.x2, rb.y2, area, b.x1, b.y1, b.x2, b.y2, carea, threshold, above)) {
      if (above) bits |= uint64_t{1} << i;
    } else if (geometry::iou_above(rb.x1, rb.y1, rb.x2, rb.y2, area, b.x1, b.y1, b.x2, b.y2, carea, threshold)) {
      bits |= uint64_t{1} << i;
    }
  }
  return bits;
}

}  // namespace nms_tile
}  // namespace ops
}  // namespace detops
