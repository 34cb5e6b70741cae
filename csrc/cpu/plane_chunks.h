// Work split for CPU backward kernels that own whole (image, channel) planes of grad_input.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace detops {
namespace cpu {

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
