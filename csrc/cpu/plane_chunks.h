// Work split for the CPU RoI kernels: RoIs grouped by image (or by image and the rows of their
// centres) and, for the backwards that own whole (image, channel) planes of grad_input, the
// planes cut into chunks of equal work.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace detops {
namespace cpu {

// RoI indices grouped by a key, each group in RoI order (a stable counting sort): the RoIs
// whose key is j are order[first[j], first[j + 1]). key_of(k) is RoI k's key, in [0, keys).
template <typename KeyOf>
void group_rois(
    int64_t num_rois, int64_t keys, KeyOf key_of, std::vector<int64_t>& first,
    std::vector<int64_t>& order) {
  first.assign(keys + 1, 0);
  order.resize(num_rois);
  for (int64_t k = 0; k < num_rois; ++k) ++first[key_of(k) + 1];
  for (int64_t j = 0; j < keys; ++j) first[j + 1] += first[j];
  std::vector<int64_t> fill(first.begin(), first.end() - 1);
  for (int64_t k = 0; k < num_rois; ++k) order[fill[key_of(k)]++] = k;
}

// Map rows of a band of RoI centres (centre_band_key).
constexpr int64_t kCentreBandRows = 8;

// Bands of kCentreBandRows rows on a map of `height` rows, at least one.
inline int64_t centre_bands(int64_t height) {
  return std::max<int64_t>(1, (height + kCentreBandRows - 1) / kCentreBandRows);
}

// A RoI's key in an order by image and the band of map rows that holds its centre, for
// group_rois with batch * bands keys: image * bands + band. The centre row is
// (y1 + y2) / 2 * scale; outside the map it takes the nearest band, NaN band 0. An image index
// outside [0, batch) (a RoI the kernel leaves empty or rejects) counts as image 0.
template <typename T>
int64_t centre_band_key(T image, T y1, T y2, T scale, int64_t batch, int64_t bands) {
  const int64_t b =
      image >= T(0) && image < static_cast<T>(batch) ? static_cast<int64_t>(image) : 0;
  const T row = (y1 + y2) * (T(0.5) * scale) / static_cast<T>(kCentreBandRows);
  const int64_t band =
      row >= T(0) ? (row < static_cast<T>(bands) ? static_cast<int64_t>(row) : bands - 1) : 0;
  return b * bands + band;
}

// RoI indices grouped by image, each group in RoI order: the RoIs of image b are
// order[first[b], first[b + 1]). image_of(k) is RoI k's image, in [0, batch).
template <typename ImageOf>
void group_rois_by_image(
    int64_t num_rois, int64_t batch, ImageOf image_of, std::vector<int64_t>& first,
    std::vector<int64_t>& order) {
  group_rois(num_rois, batch, image_of, first, order);
}

// Splits the planes p = b * channels + c of a [B, C, H, W] gradient, where every plane of image
// b costs first[b + 1] - first[b] units of work (its RoIs; first is the prefix count, B + 1
// entries), into `chunks` consecutive ranges of about equal cost: range j is
// [bounds[j], bounds[j + 1]). Planes of images without RoIs cost nothing.
inline std::vector<int64_t> balanced_plane_ranges(
    const std::vector<int64_t>& first, int64_t channels, int64_t chunks) {
  const int64_t batch = static_cast<int64_t>(first.size()) - 1;
  const int64_t total = first[batch] * channels;
  std::vector<int64_t> bounds(chunks + 1, batch * channels);
  bounds[0] = 0;
  int64_t b = 0;
  for (int64_t j = 1; j < chunks; ++j) {
    // the first plane whose cost before it reaches j / chunks of the total
    const int64_t target = total / chunks * j + total % chunks * j / chunks;
    while (b < batch && first[b + 1] * channels <= target) ++b;
    if (b == batch) break;
    const int64_t n = first[b + 1] - first[b];  // > 0: image b holds the target
    const int64_t c = (target - first[b] * channels + n - 1) / n;
    bounds[j] = std::max(bounds[j - 1], b * channels + std::min(c, channels));
  }
  return bounds;
}

}  // namespace cpu
}  // namespace detops
