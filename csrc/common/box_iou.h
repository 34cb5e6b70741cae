// Box geometry used by the NMS kernels on every device.
//
// Boxes are (x1, y1, x2, y2). All arithmetic happens in the accumulation type T (float for
// float16 / bfloat16 / float32 boxes, double for float64). Every product and sum is rounded
// explicitly, so a CUDA compiler cannot contract `a + b - w * h` into a fused multiply-add:
// CPU and CUDA kernels therefore decide every IoU comparison identically.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "macros.h"

namespace detops {
namespace geometry {

template <typename T>
DETOPS_HOST_DEVICE_INLINE T mul_rn(T a, T b) {
#ifdef __CUDA_ARCH__
  return a * b;  // specialised below for float and double
#else
  return a * b;
#endif
}

template <typename T>
DETOPS_HOST_DEVICE_INLINE T add_rn(T a, T b) {
  return a + b;
}

#ifdef __CUDA_ARCH__
template <>
__device__ inline float mul_rn<float>(float a, float b) {
  return __fmul_rn(a, b);
}
template <>
__device__ inline double mul_rn<double>(double a, double b) {
  return __dmul_rn(a, b);
}
template <>
__device__ inline float add_rn<float>(float a, float b) {
  return __fadd_rn(a, b);
}
template <>
__device__ inline double add_rn<double>(double a, double b) {
  return __dadd_rn(a, b);
}
#endif

// max / min written as comparisons so that host and device agree bit for bit (fmaxf and
// std::max treat NaN differently). NaN boxes never matter here: their area is NaN, which
// makes every IoU involving them NaN.
template <typename T>
DETOPS_HOST_DEVICE_INLINE T max_of(T a, T b) {
  return a < b ? b : a;
}

template <typename T>
DETOPS_HOST_DEVICE_INLINE T min_of(T a, T b) {
  return b < a ? b : a;
}

// max(x, 0) that maps NaN to 0.
template <typename T>
DETOPS_HOST_DEVICE_INLINE T clamp_positive(T x) {
  return x > T(0) ? x : T(0);
}

template <typename T>
DETOPS_HOST_DEVICE_INLINE T box_area(T x1, T y1, T x2, T y2) {
  return mul_rn(x2 - x1, y2 - y1);
}

// True when IoU(a, b) > threshold, with IoU = inter / (area_a + area_b - inter), computed as
// IEEE division in T. A NaN IoU (NaN coordinates, or two empty boxes) is never above the
// threshold. `threshold` is the threshold already converted by `iou_threshold_as<T>`.
template <typename T>
DETOPS_HOST_DEVICE_INLINE bool iou_above(
    T ax1, T ay1, T ax2, T ay2, T area_a,
    T bx1, T by1, T bx2, T by2, T area_b,
    T threshold) {
  const T w = clamp_positive(min_of(ax2, bx2) - max_of(ax1, bx1));
  const T h = clamp_positive(min_of(ay2, by2) - max_of(ay1, by1));
  const T inter = mul_rn(w, h);
  const T uni = add_rn(area_a, area_b) - inter;
  return inter / uni > threshold;
}

// iou_above's decision, where it can be made without the division: returns true and sets
// `above` when decided, false when the pair is left to iou_above. The IEEE quotient q' of
// inter / uni is above t exactly when the real quotient q lies above t's rounding boundary,
// which is within one ulp of t. r = inter - t * uni with one rounding (a fused multiply-add)
// is within a factor 1 +- 2^-24 of the real difference, and one ulp of t is at most 2^-23 uni
// in those units (t < 1), so r > delta (delta = 2^-20 uni for float; 8 epsilons in general)
// means q > t + ulp(t), hence q' > t, and r < -delta means q < t, hence q' <= t. Pairs closer
// than that to the boundary are left to the division, and so are thresholds and unions
// outside the ranges where these bounds hold (t below 2^-10 or not below 1, uni outside
// [2^-60, 2^60] or NaN). No branches: min / max may treat NaN differently from min_of /
// max_of, but a NaN coordinate makes the area, hence the union, NaN; other values give
// iou_above's inter and union bit for bit. The caller checks the threshold's range once.
template <typename T>
struct IouMargin {
  T uni;    // area_a + area_b - inter, as iou_above computes it
  T r;      // inter - t * uni with one rounding
  T delta;  // 8 epsilons of uni
};

// The quantities of the division-free decision for a pair whose intersection has sides w and
// h (both >= 0).
template <typename T>
DETOPS_HOST_DEVICE_INLINE IouMargin<T> iou_margin(T w, T h, T area_a, T area_b, T threshold) {
  using std::fma;
  const T inter = mul_rn(w, h);
  const T uni = add_rn(area_a, area_b) - inter;
  return {uni, fma(-threshold, uni, inter), uni * (T(8) * std::numeric_limits<T>::epsilon())};
}

template <typename T>
DETOPS_HOST_DEVICE_INLINE bool iou_decided_without_division(
    T ax1, T ay1, T ax2, T ay2, T area_a,
    T bx1, T by1, T bx2, T by2, T area_b,
    T threshold, bool& above) {
  using std::fmax;
  using std::fmin;
  const T w = fmax(fmin(ax2, bx2) - fmax(ax1, bx1), T(0));
  const T h = fmax(fmin(ay2, by2) - fmax(ay1, by1), T(0));
  const IouMargin<T> m = iou_margin(w, h, area_a, area_b, threshold);
  above = m.r > m.delta;
  return m.uni >= T(0x1p-60) && m.uni <= T(0x1p60) && (above || m.r < -m.delta);
}

// The thresholds for which iou_decided_without_division's bounds hold.
template <typename T>
DETOPS_HOST_DEVICE_INLINE bool iou_division_free_threshold(T threshold) {
  return threshold >= T(0x1p-10) && threshold < T(1);
}

// Whether a box is "plain" for iou_decided_plain: x2 > x1, y2 > y1 and an area (box_area) in
// [2^-58, 2^58]. NaN coordinates or areas fail it.
template <typename T>
DETOPS_HOST_DEVICE_INLINE bool iou_plain_box(T x1, T y1, T x2, T y2, T area) {
  return x2 > x1 && y2 > y1 && area >= T(0x1p-58) && area <= T(0x1p58);
}

// iou_decided_without_division for two plain boxes (iou_plain_box) that pass the intersection
// test (a.x2 > b.x1, b.x2 > a.x1, and the same in y), without its clamps and its union range
// check, which such pairs never need:
// - w = min(x2) - max(x1) is positive: each of the four differences it may be is (two by the
//   boxes, two by the test), so it equals the clamped w; likewise h.
// - inter = w * h rounded is at most each area (w and h are at most each box's own sides,
//   rounded the same way, and rounding is monotonic), so with M = max(area_a, area_b),
//   s = area_a + area_b rounded is at least M and uni = s - inter rounded is at least
//   M (1 - 2^-23) rounded, above M / 2 >= 2^-59; and uni <= s <= 2M <= 2^59. So uni is
//   always in iou_decided_without_division's range [2^-60, 2^60].
// inter, uni, r and delta come from the same iou_margin, so a decided pair is decided as
// iou_decided_without_division decides it, hence as iou_above does.
// Returns false for the pairs within delta of the boundary, left to iou_above.
template <typename T>
DETOPS_HOST_DEVICE_INLINE bool iou_decided_plain(
    T ax1, T ay1, T ax2, T ay2, T area_a,
    T bx1, T by1, T bx2, T by2, T area_b,
    T threshold, bool& above) {
  using std::fabs;
  using std::fmax;
  using std::fmin;
  const IouMargin<T> m =
      iou_margin(fmin(ax2, bx2) - fmax(ax1, bx1), fmin(ay2, by2) - fmax(ay1, by1), area_a, area_b, threshold);
  above = m.r > m.delta;
  return fabs(m.r) > m.delta;
}

// The threshold in T such that, for every value v of type T, `v > t` holds exactly when
// the real number v is greater than the double `threshold`: the largest T not above it.
// (For a float IoU this equals comparing the IoU promoted to double with the double
// threshold, without any double arithmetic in the kernel.)
template <typename T>
inline T iou_threshold_as(double threshold) {
  T t = static_cast<T>(threshold);
  if (static_cast<double>(t) > threshold) {
    t = std::nextafter(t, -std::numeric_limits<T>::infinity());
  }
  return t;
}

}  // namespace geometry
}  // namespace detops
