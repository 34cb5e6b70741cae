// Bands of rows of one H x W feature plane staged in shared memory, for RoI kernels in which
// many RoIs read the same plane (dense RoIs on one feature map, as in the FPN levels of a
// detector). Gathering each RoI's pixels from global memory fetches a whole 32-byte sector per
// pixel and fetches the same sectors again for every overlapping RoI; staging a band of the
// plane once and serving every RoI of the image from it reads each pixel from L2 about once.
//
// A plane is cut into bands of `core` rows. Band i owns the RoI rows (bin rows) whose first
// pixel row lies in [i * core, (i + 1) * core), and stages rows [i * core, i * core + core +
// overlap) clamped to H, so that a bin row starting near the end of its band still finds its
// pixels in shared memory. A bin row reaching past the staged window reads those pixels from
// global memory instead (same values, same arithmetic), so results never depend on the plan.
//
// Backward kernels accumulate a band in shared memory and write it out once. In overlapping
// bands, rows that only one band stages are stored, rows two bands stage (shared_row) are
// zeroed beforehand (zero_shared_rows) and added with global atomics. In bands without overlap
// (overlap 0: roi_pool's backward, roi_align's where sliced_plan takes it), a bin row is listed
// under every band its rows touch (group_by_owner's spans) and each band stores only its own
// rows.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

#include "cuda_helpers.h"

namespace detops {
namespace ops {
namespace plane_band {

// How one plane is staged. rows = core + overlap rows of `stride` elements each.
struct BandPlan {
  int core = 0;     // rows a band owns
  int overlap = 0;  // rows staged past the owned ones
  int bands = 0;    // ceil(H / core)
  int stride = 0;   // shared-memory elements per staged row (see padded_stride)
  int64_t smem_bytes = 0;
  bool ok = false;  // false: the plane is too wide to stage useful bands
};

// Shared-memory elements per staged row: an odd count, so that the rows of one column spread
// over the 32 banks (kernels that read many RoIs at once read many rows at similar columns).
inline int padded_stride(int64_t width) {
  return static_cast<int>(width % 2 == 0 ? width + 1 : width);
}

// Bands of `budget_bytes` of elem_bytes-sized elements for an H x W plane. The overlap is a
// quarter of the staged rows; at least `min_rows` rows must fit for the plan to be worth it.
inline BandPlan plan_bands(
    int64_t height, int64_t width, int64_t elem_bytes, int64_t budget_bytes, int min_rows = 16) {
  BandPlan p;
  if (height <= 0 || width <= 0 || width > (1 << 20)) return p;
  p.stride = padded_stride(width);
  const int64_t fit = budget_bytes / (static_cast<int64_t>(p.stride) * elem_bytes);
  if (fit < min_rows) return p;
  int64_t rows = std::min<int64_t>(fit, height);
  int64_t overlap = rows >= height ? 0 : rows / 4;
  int64_t core = rows - overlap;
  p.core = static_cast<int>(core);
  p.overlap = static_cast<int>(overlap);
  p.bands = static_cast<int>(cuda::ceil_div(height, core));
  p.smem_bytes = rows * p.stride * elem_bytes;
  p.ok = true;
  return p;
}

// The rows a band stages: [first, last).
struct BandRows {
  int first, last;
};

__device__ __forceinline__ BandRows band_rows(const BandPlan& p, int band, int height) {
  const int first = band * p.core;
  return BandRows{first, min(height, first + p.core + p.overlap)};
}

// The NC values of one staged pixel, for bands that stage NC channel planes interleaved.
template <typename T, int NC>
struct alignas(NC * sizeof(T)) Lanes {
  T v[NC];
};

// Copies rows [rows.first, rows.last) of NC row-major planes with `width` columns into `smem`,
// interleaved: staged pixel (r, x) holds the planes' values at (rows.first + r, x), at pixel
// index r * p.stride + x (p planned for pixels of NC values). All threads of the block take
// part; the caller synchronizes. Interleaved planes are copied a pixel per lane, so that a
// warp stores consecutive pixels (no bank conflicts; a lane storing the pixels of its own
// 16-byte vectors of each plane would conflict four ways). Four 16-bit planes whose rows are
// whole 4-byte pairs are copied a pair of pixels per lane, so that each load reads 128 bytes of
// a plane from a 128-byte boundary of the first plane's row: half the load requests. A single
// plane whose rows are whole 16-byte vectors is read a vector at a time, four loads per thread
// in flight, and stored element by element (the shared rows have an odd stride).
template <typename T, int NC>
__device__ __forceinline__ void stage_rows(
    const T* const (&planes)[NC], int width, const BandPlan& p, BandRows rows, T* __restrict__ smem) {
  using Pixel = Lanes<T, NC>;
  Pixel* dst_pixels = reinterpret_cast<Pixel*>(smem);
  constexpr int kPerVec = sizeof(T) >= 16 ? 1 : static_cast<int>(16 / sizeof(T));
  const int64_t offset = static_cast<int64_t>(rows.first) * width;
  const int n_rows = rows.last - rows.first;
  bool vectors = NC == 1 && sizeof(T) < 16 && width % kPerVec == 0;
#pragma unroll
  for (int j = 0; j < NC; ++j) vectors = vectors && reinterpret_cast<uintptr_t>(planes[j] + offset) % 16 == 0;
  if (vectors) {
    struct alignas(16) Vec {
      T v[kPerVec];
    };
    const int vw = width / kPerVec;
    const int total = n_rows * vw;
    constexpr int kUnroll = 4;
    for (int base = threadIdx.x; base < total; base += kUnroll * blockDim.x) {
      Vec v[kUnroll][NC];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * blockDim.x;
        if (i < total) {
#pragma unroll
          for (int j = 0; j < NC; ++j) v[u][j] = reinterpret_cast<const Vec*>(planes[j] + offset)[i];
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * blockDim.x;
        if (i < total) {
          const int r = i / vw;
          Pixel* dst = dst_pixels + r * p.stride + (i - r * vw) * kPerVec;
#pragma unroll
          for (int e = 0; e < kPerVec; ++e) {
            Pixel px;
#pragma unroll
            for (int j = 0; j < NC; ++j) px.v[j] = v[u][j].v[e];
            dst[e] = px;
          }
        }
      }
    }
    return;
  }
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if constexpr (sizeof(T) == 2 && NC == 4) {
    bool pairs = width % 2 == 0;
#pragma unroll
    for (int j = 0; j < NC; ++j) pairs = pairs && reinterpret_cast<uintptr_t>(planes[j] + offset) % 4 == 0;
    if (pairs) {
      // Lane l takes pair x2 = l - s + 32 k of the row (pixels 2 x2, 2 x2 + 1; s: the first
      // plane's row start past a 128-byte boundary, in pairs) and stores pixel (l >> 3) & 1 of
      // it first: the 16 lanes of each 8-byte store phase then write 16 different 8-byte bank
      // pairs, at either parity of the row's odd stride.
      const int first = (lane >> 3) & 1;
      for (int r = static_cast<int>(threadIdx.x / 32); r < n_rows; r += warps) {
        const int64_t row = offset + static_cast<int64_t>(r) * width;
        // the row in each plane, as opaque pointers: a load's address is then one wide
        // multiply-add (the compiler would otherwise rebuild each plane's 64-bit offset)
        const uint32_t* src[NC];
#pragma unroll
        for (int j = 0; j < NC; ++j) {
          src[j] = reinterpret_cast<const uint32_t*>(planes[j] + row);
          asm("" : "+l"(src[j]));
        }
        const int shift = static_cast<int>((reinterpret_cast<uintptr_t>(src[0]) / 4) % 32);
        uint2* dst = reinterpret_cast<uint2*>(dst_pixels + r * p.stride);
        // two steps of 32 pairs at a time, their loads issued before their stores; a pair
        // before the row's start (or a second step past its end) loads the row's first pair
        // and stores nothing
        for (int x2 = lane - shift; 2 * x2 < width; x2 += 64) {
          const bool second = 2 * (x2 + 32) < width;
          const int at0 = max(x2, 0), at1 = second ? x2 + 32 : at0;
          uint32_t v[2][NC];
#pragma unroll
          for (int j = 0; j < NC; ++j) {
            asm volatile("ld.global.u32 %0, [%1];" : "=r"(v[0][j]) : "l"(src[j] + at0));
            asm volatile("ld.global.u32 %0, [%1];" : "=r"(v[1][j]) : "l"(src[j] + at1));
          }
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            // pixel 2 x2 (lo) and 2 x2 + 1 (hi): the low and high halves of the planes' words
            const uint2 lo{__byte_perm(v[k][0], v[k][1], 0x5410), __byte_perm(v[k][2], v[k][3], 0x5410)};
            const uint2 hi{__byte_perm(v[k][0], v[k][1], 0x7632), __byte_perm(v[k][2], v[k][3], 0x7632)};
            const int xk = 2 * (x2 + 32 * k);
            if (k == 0 ? x2 >= 0 : second) {
              dst[xk + first] = first ? hi : lo;
              dst[xk + 1 - first] = first ? lo : hi;
            }
          }
        }
      }
      return;
    }
  }
  for (int r = static_cast<int>(threadIdx.x / 32); r < n_rows; r += warps) {
    const int64_t row = offset + static_cast<int64_t>(r) * width;
    Pixel* dst = dst_pixels + r * p.stride;
    for (int c = lane; c < width; c += 32) {
      Pixel px;
#pragma unroll
      for (int j = 0; j < NC; ++j) px.v[j] = planes[j][row + c];
      dst[c] = px;
    }
  }
}

// Walks items e * pw_n + pw of a block's list, blockDim.x apart, without a division per item.
struct ListWalk {
  int e, pw, step_e, step_pw;
  __device__ __forceinline__ explicit ListWalk(int pw_n)
      : ListWalk(pw_n, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x)) {}
  // Items first, first + step, ... (the walkers of a block take first = 0 .. step - 1).
  __device__ __forceinline__ ListWalk(int pw_n, int first, int step)
      : e(first / pw_n), pw(first - e * pw_n), step_e(step / pw_n), step_pw(step - step_e * pw_n) {}
  __device__ __forceinline__ void next(int pw_n) {
    e += step_e;
    pw += step_pw;
    if (pw >= pw_n) {
      pw -= pw_n;
      ++e;
    }
  }
};

// Whether staged row r of band `bi` is also staged by a neighbouring band: such rows are
// zeroed beforehand (zero_shared_rows) and added to with atomics, every other row is stored.
// The last band's rows past its core are its own (no band after it).
__device__ __forceinline__ bool shared_row(const BandPlan& plan, int bi, int r) {
  const int first = bi * plan.core;
  return (bi > 0 && r < first + plan.overlap) || (r >= first + plan.core && bi + 1 < plan.bands);
}

// Zeroes rows [first, first + overlap) of bands 1 .. bands - 1 (clamped to H) in every plane
// of a contiguous [planes, H, W] buffer: warps take rows in turn, lanes along a row, 16 bytes
// at a time where every row starts on 16 bytes (else an element at a time).
template <typename T>
__global__ void zero_shared_rows_kernel(
    T* __restrict__ data, int64_t rows, int height, int width, BandPlan plan, bool vectors) {
  const int64_t per_plane = static_cast<int64_t>(plan.bands - 1) * plan.overlap;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; i < rows; i += warps) {
    const int64_t p = i / per_plane;
    const int j = static_cast<int>(i - p * per_plane);
    const int y = (1 + j / plan.overlap) * plan.core + j % plan.overlap;
    if (y >= height) continue;
    T* row = data + (p * height + y) * width;
    if (vectors) {
      uint4* v = reinterpret_cast<uint4*>(row);
      const int n = static_cast<int>(width * sizeof(T) / 16);
      for (int x = lane; x < n; x += 32) v[x] = make_uint4(0, 0, 0, 0);
    } else {
      for (int x = lane; x < width; x += 32) row[x] = T(0);
    }
  }
}

// Zeroes, in every (image, channel) plane of a contiguous [planes, H, W] buffer, the rows that
// two bands stage. The others are written whole by their band. One launch for all bands,
// rather than a memset (a host call) per band.
template <typename T>
void zero_shared_rows(T* data, int64_t planes, int64_t height, int64_t width, const BandPlan& plan,
                      cudaStream_t stream) {
  if (plan.bands <= 1 || plan.overlap <= 0 || planes <= 0 || width <= 0) return;
  const int64_t rows = planes * (plan.bands - 1) * plan.overlap;
  const bool vectors = reinterpret_cast<uintptr_t>(data) % 16 == 0 && (width * sizeof(T)) % 16 == 0;
  zero_shared_rows_kernel<T><<<cuda::grid_for(rows, 8), 256, 0, stream>>>(
      data, rows, static_cast<int>(height), static_cast<int>(width), plan, vectors);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Programmatic dependent launch (compute capability 9.0 and later): a kernel launched by
// launch_early may start while the kernel before it in the stream still runs, once every block
// of that kernel has called let_dependents_start(), and does work that does not depend on it
// (staging its first band) before wait_for_prior_grid(). Elsewhere both are no-ops and the
// launch is an ordinary one.
__device__ __forceinline__ void let_dependents_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Returns once the kernel before this one in the stream has finished and its writes are
// visible (at once where this kernel was not launched early).
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Whether launch_early launches early on the current device.
inline bool early_launch_supported() {
  return at::cuda::getCurrentDeviceProperties()->major >= 9;
}

// kernel<<<grid, threads, smem, stream>>>(args...), launched early (see let_dependents_start)
// where `early` (only where early_launch_supported()). Its blocks must call
// wait_for_prior_grid() before they read anything the kernels before it write.
template <typename... Params, typename... Args>
void launch_early(
    void (*kernel)(Params...), bool early, dim3 grid, int threads, size_t smem, cudaStream_t stream,
    Args&&... args) {
  if (!early) {
    kernel<<<grid, threads, smem, stream>>>(std::forward<Args>(args)...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

constexpr int kGroupThreads = 1024;
constexpr int kGroupWarps = kGroupThreads / 32;
constexpr int64_t kGroupSharedBytes = 46 * 1024;  // under the 48 KiB a block gets without opt-in
constexpr int kRowShift = 6;  // list entries (k << kRowShift) | r

// The most keys whose lists list_keys_heaviest_first ranks: a key for each kGroupThreads / 64
// threads of a grouping block.
constexpr int kMaxHeavyFirstKeys = 64;

// A key and its list: rows[first .. first + n).
struct KeyList {
  int32_t key, first, n;
};

// The keys [0, num_keys) (at most kMaxHeavyFirstKeys) by the length of their lists, longest
// first, equal lists in key order: table[r] is the key with the r-th longest list, with its
// list. first_of(k), k <= num_keys: the first entry of key k's list (first_of(k + 1) - first_of(k)
// entries). Each key's rank is counted by kGroupThreads / kMaxHeavyFirstKeys lanes of one warp,
// a share of the keys each. All threads of a grouping block (kGroupThreads) call it, once
// first_of's values are written and visible to the block.
template <typename F>
__device__ __forceinline__ void list_keys_heaviest_first(int num_keys, F first_of, KeyList* __restrict__ table) {
  constexpr int kParts = kGroupThreads / kMaxHeavyFirstKeys;
  static_assert(kParts <= 32 && (kParts & (kParts - 1)) == 0, "a key's lanes lie in one warp");
  const int key = static_cast<int>(threadIdx.x) / kParts, part = static_cast<int>(threadIdx.x) % kParts;
  const bool mine = key < num_keys;
  const int32_t first = mine ? static_cast<int32_t>(first_of(key)) : 0;
  const int32_t n = mine ? static_cast<int32_t>(first_of(key + 1)) - first : 0;
  int rank = 0;  // the keys ahead of this one: longer lists, or equal ones of lower keys
  if (mine) {
    for (int j = part; j < num_keys; j += kParts) {
      const int32_t nj = static_cast<int32_t>(first_of(j + 1) - first_of(j));
      rank += nj > n || (nj == n && j < key);
    }
  }
#pragma unroll
  for (int d = kParts / 2; d > 0; d /= 2) rank += __shfl_xor_sync(0xffffffffu, rank, d);
  if (mine && part == 0) table[rank] = KeyList{key, first, n};
}

// Bin row i as the grouping kernels list it: i, or (k << kRowShift) | r for i = k * row_div + r
// where row_div > 0.
template <typename index_t>
__device__ __forceinline__ index_t listed_row(index_t i, index_t row_div) {
  return row_div > 0 ? ((i / row_div) << kRowShift) | (i % row_div) : i;
}

// The inclusive prefix sum of v over lanes 0 .. lane of the warp, by shuffles. All lanes call it.
template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const T u = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += u;
  }
  return v;
}

// An exclusive scan of load(0 .. m) by the whole block (kGroupThreads threads): store(i, the sum
// of load(0 .. i - 1)) for each i < m, a pass of blockDim values at a time (shuffles within a
// warp, then across the warps' sums). Each thread loads and stores only its own i of a pass.
template <typename index_t, typename Load, typename Store>
__device__ __forceinline__ void block_exclusive_scan(int64_t m, Load load, Store store) {
  __shared__ index_t warp_sums[kGroupWarps];
  __shared__ index_t carry;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < m; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const index_t v = i < m ? load(i) : index_t(0);
    const index_t incl = warp_inclusive_scan(v, lane);
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) warp_sums[lane] = warp_inclusive_scan(warp_sums[lane], lane);
    __syncthreads();
    if (i < m) store(i, carry + (warp > 0 ? warp_sums[warp - 1] : index_t(0)) + incl - v);
    __syncthreads();
    if (threadIdx.x == 0) carry += warp_sums[kGroupWarps - 1];
    __syncthreads();
  }
}

// The lanes of the warp whose key has the same low key_bits bits as this lane's, one ballot
// per bit. All lanes call it.
template <typename index_t>
__device__ __forceinline__ unsigned lanes_with_key(index_t key, int key_bits) {
  unsigned peers = 0xffffffffu;
  for (int bit = 0; bit < key_bits; ++bit) {
    const bool set = (key >> bit) & 1;
    const unsigned b = __ballot_sync(0xffffffffu, set);
    peers &= set ? b : ~b;
  }
  return peers;
}

// The warp's run of equal keys that holds this lane (runs of consecutive lanes; key -1 marks
// lanes past the items, which form runs of their own): lanes [start, end). All lanes call it.
struct KeyRun {
  int start, end;
};

template <typename index_t>
__device__ __forceinline__ KeyRun key_run(index_t key, int lane) {
  const index_t prev = __shfl_up_sync(0xffffffffu, key, 1);
  const unsigned starts = __ballot_sync(0xffffffffu, lane == 0 || prev != key);
  const unsigned later = lane == 31 ? 0u : starts & (0xffffffffu << (lane + 1));
  return KeyRun{31 - __clz(starts & (0xffffffffu >> (31 - lane))), later ? __ffs(later) - 1 : 32};
}

// The maximum of v over the lanes of this lane's run, to the run's first lane (the others get
// the maximum of their rest of the run). All lanes call it.
__device__ __forceinline__ int32_t run_max(int32_t v, const KeyRun& run, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int32_t u = __shfl_down_sync(0xffffffffu, v, d);
    if (lane + d < run.end) v = max(v, u);
  }
  return v;
}

// Groups bin rows by owner in one block, in no particular order (a counting sort by shared
// atomics; the order within an owner depends on timing): owner `key`'s rows are
// rows[offsets[key] .. offsets[key + 1]), each listed as in group_by_owner_kernel. counts:
// num_keys + 1 ints of scratch, used only when the counts do not fit in shared memory. Launch
// with kGroupThreads threads, through group_by_owner.
// spans (or null: one each): item i is listed under the spans[i] consecutive keys from keys[i]
// on (the bands a bin row's sample rows touch), so rows holds the sum of the spans. With
// mark_ends, an entry also tells whether the item is listed under the key before this one
// (kListedBefore) and the key after it (kListedAfter); listed rows must then be below 2^30.
constexpr int kGroupSharedKeys = 4096;
constexpr int32_t kListedBefore = int32_t{1} << 30;
constexpr int32_t kListedAfter = std::numeric_limits<int32_t>::min();  // bit 31

template <typename index_t>
__global__ void __launch_bounds__(kGroupThreads) group_by_owner_unordered_kernel(
    const index_t* __restrict__ keys, index_t total, index_t num_keys, index_t* __restrict__ counts,
    index_t* __restrict__ offsets, index_t* __restrict__ rows, index_t row_div = 0,
    const uint8_t* __restrict__ spans = nullptr, bool mark_ends = false) {
  let_dependents_start();  // a band kernel launched early stages its first band meanwhile
  __shared__ index_t local[kGroupSharedKeys];
  index_t* cnt = num_keys < kGroupSharedKeys ? local : counts;
  for (index_t i = threadIdx.x; i <= num_keys; i += blockDim.x) cnt[i] = 0;
  __syncthreads();
  for (index_t i = threadIdx.x; i < total; i += blockDim.x) {
    const index_t key = keys[i];
    const int span = spans != nullptr ? spans[i] : 1;
    for (int s = 0; s < span; ++s) atomicAdd(&cnt[key + s], index_t(1));
  }
  __syncthreads();
  // offsets: the exclusive scan of the counts (offsets[num_keys]: all entries); each count becomes
  // the next free slot of its owner
  block_exclusive_scan<index_t>(
      static_cast<int64_t>(num_keys) + 1, [&](int64_t i) { return i < num_keys ? cnt[i] : index_t(0); },
      [&](int64_t i, index_t o) {
        offsets[i] = o;
        if (i < num_keys) cnt[i] = o;
      });
  for (index_t i = threadIdx.x; i < total; i += blockDim.x) {
    const index_t key = keys[i], listed = listed_row(i, row_div);
    const int span = spans != nullptr ? spans[i] : 1;
    for (int s = 0; s < span; ++s) {
      const index_t marks = !mark_ends ? index_t(0)
                                       : static_cast<index_t>((s > 0 ? kListedBefore : 0) | (s + 1 < span ? kListedAfter : 0));
      rows[atomicAdd(&cnt[key + s], index_t(1))] = listed | marks;
    }
  }
}

// Groups bin rows by owner in one block, stably (a counting sort): owner `key`'s rows are
// rows[offsets[key] .. offsets[key + 1]), in increasing order of their index, so that the lists
// are the same on every call. The kernels' order of work follows them, and so do the bits of
// those whose sums depend on where in the list a bin lies (the conflict-free band forward's
// swizzled order of loads and adds). Bin row i = k * row_div + r is listed as i, or, with
// row_div > 0 (at most 64), as (k << kRowShift) | r, so that kernels need no division to find
// the RoI.
//
// The items are cut into `ranges` consecutive ranges (at most one per warp); warp w counts
// range w's items of each key (32 at a time, the lanes of one key counted once), an exclusive
// scan of the counts in (key, range) order gives every range its first slot in each key's
// list, and warp w then writes range w's items in order. No atomics, so no order that depends
// on timing. The counts take ranges * num_keys ints of shared memory, or of `counts` (num_keys
// ints of scratch) where even one range's do not fit (`in_shared` false: ranges is 1, one warp
// walks all items). With heavy_first, the keys before the last by their lists' lengths, as
// list_keys_heaviest_first writes them. Launch with kGroupThreads threads, through group_by_owner.
template <typename index_t>
__global__ void __launch_bounds__(kGroupThreads) group_by_owner_kernel(
    const index_t* __restrict__ keys, index_t total, index_t num_keys, index_t* __restrict__ counts,
    index_t* __restrict__ offsets, index_t* __restrict__ rows, index_t row_div, int ranges,
    bool in_shared, KeyList* __restrict__ heavy_first) {
  let_dependents_start();  // a band kernel launched early stages its first band meanwhile
  extern __shared__ __align__(16) unsigned char group_smem[];
  index_t* const hist = in_shared ? reinterpret_cast<index_t*>(group_smem) : counts;  // [key][range]
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const unsigned before_lane = (1u << lane) - 1;
  const int64_t m = static_cast<int64_t>(ranges) * num_keys;
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) hist[i] = 0;
  __syncthreads();
  const index_t per = (total + ranges - 1) / ranges;
  const index_t begin = warp < ranges ? min(total, static_cast<index_t>(warp * per)) : total;
  const index_t end = min(total, static_cast<index_t>(begin + per));
  // Calls f(i, key, peers) for each item i of this warp's range, 32 at a time (key -1 and no
  // item past the end); peers: the lanes with the same key. The keys of kHeld chunks load at
  // once, so that a warp waits on one load per kHeld chunks; a range of kHeld chunks or fewer
  // keeps its keys from the first walk for the second (`held` true).
  constexpr int kHeld = 8;
  // 2^key_bits - 1 >= num_keys, so the -1 of lanes past the end matches no key
  const int key_bits = 32 - __clz(static_cast<int>(num_keys));
  auto same_key = [&](index_t key) { return lanes_with_key(key, key_bits); };
  index_t keys_held[kHeld];
  auto walk = [&](bool held, auto&& f) {
    for (index_t base = begin; base < end; base += 32 * kHeld) {
      if (!held) {
#pragma unroll
        for (int u = 0; u < kHeld; ++u) {
          const index_t i = base + 32 * u + lane;
          keys_held[u] = i < end ? keys[i] : index_t(-1);
        }
      }
#pragma unroll
      for (int u = 0; u < kHeld; ++u) {
        if (base + 32 * u >= end) break;
        f(base + 32 * u + lane, keys_held[u], same_key(keys_held[u]));
        __syncwarp();
      }
    }
  };
  // 1. counts of each key in each range; a key's lowest lane adds its lanes
  walk(false, [&](index_t, index_t key, unsigned peers) {
    if (key >= 0 && (peers & before_lane) == 0) hist[static_cast<int64_t>(key) * ranges + warp] += __popc(peers);
  });
  __syncthreads();
  // 2. exclusive scan in (key, range) order
  block_exclusive_scan<index_t>(m, [&](int64_t i) { return hist[i]; }, [&](int64_t i, index_t o) { hist[i] = o; });
  for (index_t key = threadIdx.x; key <= num_keys; key += blockDim.x) {
    offsets[key] = key < num_keys ? hist[static_cast<int64_t>(key) * ranges] : total;
  }
  __syncthreads();
  if (heavy_first != nullptr) {
    list_keys_heaviest_first(
        static_cast<int>(num_keys) - 1, [&](int k) { return hist[static_cast<int64_t>(k) * ranges]; }, heavy_first);
    __syncthreads();  // before the slots move on
  }
  // 3. each range's items, in order, from its first slot of their key
  walk(end - begin <= 32 * kHeld, [&](index_t i, index_t key, unsigned peers) {
    if (key < 0) return;
    index_t* const slot = hist + static_cast<int64_t>(key) * ranges + warp;
    const index_t at = *slot + __popc(peers & before_lane);
    rows[at] = listed_row(i, row_div);
    __syncwarp(peers);
    if ((peers & before_lane) == 0) *slot += __popc(peers);
  });
}

// Lists keys[0 .. total) in [0, num_keys) by owner: in index order within each owner
// (group_by_owner_kernel) where `in_order`, else in any order (group_by_owner_unordered_kernel,
// for kernels whose results do not depend on the order of their work; faster, and with many
// keys much faster). counts: num_keys + 1 ints of scratch, used only when the counts do not fit
// in shared memory.
// spans, mark_ends (not in order only): as in group_by_owner_unordered_kernel.
// heavy_first (in order only, num_keys - 1 <= kMaxHeavyFirstKeys): see group_by_owner_kernel.
template <typename index_t>
void group_by_owner(
    const index_t* keys, int64_t total, int64_t num_keys, index_t* counts, index_t* offsets,
    index_t* rows, int row_div, bool in_order, cudaStream_t stream, const uint8_t* spans = nullptr,
    bool mark_ends = false, KeyList* heavy_first = nullptr) {
  TORCH_INTERNAL_ASSERT(!in_order || (spans == nullptr && !mark_ends), "group_by_owner: spans are grouped in no order");
  TORCH_INTERNAL_ASSERT(!mark_ends || sizeof(index_t) == 4, "group_by_owner: marks are bits 30 and 31 of int32 entries");
  TORCH_INTERNAL_ASSERT(
      heavy_first == nullptr || (in_order && num_keys >= 1 && num_keys - 1 <= kMaxHeavyFirstKeys),
      "group_by_owner: keys heaviest first are ranked in order, up to kMaxHeavyFirstKeys");
  if (!in_order) {
    group_by_owner_unordered_kernel<index_t><<<1, kGroupThreads, 0, stream>>>(
        keys, static_cast<index_t>(total), static_cast<index_t>(num_keys), counts, offsets, rows,
        static_cast<index_t>(row_div), spans, mark_ends);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const int64_t fit = kGroupSharedBytes / static_cast<int64_t>(sizeof(index_t));
  const int ranges = static_cast<int>(std::clamp<int64_t>(fit / std::max<int64_t>(num_keys, 1), 1, kGroupWarps));
  const bool in_shared = ranges * num_keys <= fit;
  const size_t smem = in_shared ? static_cast<size_t>(ranges * num_keys) * sizeof(index_t) : 0;
  group_by_owner_kernel<index_t><<<1, kGroupThreads, smem, stream>>>(
      keys, static_cast<index_t>(total), static_cast<index_t>(num_keys), counts, offsets, rows,
      static_cast<index_t>(row_div), ranges, in_shared, heavy_first);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The budget for a staged band on the current device: `wanted`, or less where a block may not
// have `wanted + other_bytes` of shared memory (sm_86 / sm_89 allow 99 KiB, sm_75 64 KiB).
inline int64_t band_budget(int64_t wanted, int64_t other_bytes) {
  const int64_t limit =
      static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin);
  return std::min(wanted, limit - other_bytes - 1024);
}

// Raises a kernel's dynamic shared-memory limit (a host-side attribute of the kernel on the
// current device). Set once per kernel, device and size: the call costs about a microsecond of
// host time, which a lone call of a RoI op waits for.
template <typename Kernel>
void allow_smem(Kernel kernel, int64_t bytes) {
  struct Set {
    const void* kernel;
    int device, bytes;
  };
  static std::mutex mutex;
  static std::vector<Set> done;
  const int device = static_cast<int>(c10::cuda::current_device());
  const void* key = reinterpret_cast<const void*>(kernel);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = std::find_if(done.begin(), done.end(), [&](const Set& s) { return s.kernel == key && s.device == device; });
  if (it != done.end() && it->bytes >= bytes) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  if (it == done.end()) {
    done.push_back(Set{key, device, static_cast<int>(bytes)});
  } else {
    it->bytes = static_cast<int>(bytes);
  }
}

}  // namespace plane_band
}  // namespace ops
}  // namespace detops
