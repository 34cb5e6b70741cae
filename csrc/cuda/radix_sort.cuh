// Stable sorts of (key, value) pairs by cub's radix sort, over only the key bits in use.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <climits>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <type_traits>

#include "cuda_helpers.h"

namespace detops {
namespace cuda {

// The number of low bits that hold every key in [0, max_key]: at least 1, at most the key's
// width.
template <typename key_t>
int key_bits(uint64_t max_key) {
  int bits = 1;
  while (bits < static_cast<int>(8 * sizeof(key_t)) && (uint64_t{1} << bits) <= max_key) ++bits;
  return bits;
}

// Sorts n (key, value) pairs by key into keys_out / values_out; pairs with equal keys keep
// their input order. Keys lie in [0, max_key], so as unsigned they sort the same and the
// passes look only at the bits that range uses (a 17-bit key takes three 8-bit passes instead
// of four). Values move as they are: pass raw bits (uint16_t, uint32_t, ...) for types cub does
// not know. Scratch space comes from torch's caching allocator on `device`, on `stream`.
template <typename key_t, typename value_t>
void sort_pairs(
    const key_t* keys_in, key_t* keys_out, const value_t* values_in, value_t* values_out, int64_t n,
    uint64_t max_key, at::Device device, cudaStream_t stream) {
  static_assert(std::is_integral_v<key_t>, "integer keys");
  if (n <= 0) return;
  using ukey_t = std::make_unsigned_t<key_t>;
  const int end_bit = key_bits<key_t>(max_key);
  auto sort = [&](void* temp, size_t& bytes, auto count) {
    return cub::DeviceRadixSort::SortPairs(
        temp, bytes, reinterpret_cast<const ukey_t*>(keys_in), reinterpret_cast<ukey_t*>(keys_out), values_in,
        values_out, count, 0, end_bit, stream);
  };
  auto run = [&](auto count) {
    size_t bytes = 0;
    C10_CUDA_CHECK(sort(nullptr, bytes, count));
    at::Tensor temp = empty_written({static_cast<int64_t>(bytes)}, at::TensorOptions().device(device).dtype(at::kByte));
    C10_CUDA_CHECK(sort(temp.data_ptr(), bytes, count));
  };
  if (n <= INT_MAX) {
    run(static_cast<int>(n));  // 32-bit offsets where they suffice
  } else {
    run(n);
  }
}

}  // namespace cuda
}  // namespace detops
