// NMS and batched (per-category) NMS on CUDA.
//
// 1. Rank boxes by score (descending, ties by index). Batched NMS then groups the ranking by
//    category (stable), so each category is a contiguous run of positions. Up to kMaxCountRank
//    boxes (max_count_rank_batched with categories) one kernel counts, for each box, the boxes
//    ahead of it (nms_rank.cuh) and writes the ranked boxes. Larger inputs are ranked by cub's
//    stable radix sort of 32-bit score keys (then of the categories, batched) and
//    nms_prepare_sorted_kernel; float64 scores by torch's stable sort and nms_prepare_kernel.
// 2. nms_mask_kernel: for every 64x64 tile on or below the diagonal, one bit per pair (row box,
//    earlier column box) whose IoU exceeds the threshold. A block per row tile and column
//    stride holds its row boxes in registers and walks its column tiles; intersecting pairs
//    are decided mostly without a division (nms_tile.cuh). Only nonzero words
//    are written, and each sets a bit in its row's summary, so later passes read only those
//    words. Tiles whose row and column boxes share no category are never visited.
// 3. The greedy pass. Up to kMaxBlockPass boxes (not batched), nms_block_pass_kernel: one block
//    decides tile after tile with the decisions in shared memory. Otherwise
//    nms_dataflow_kernel (one cooperative launch): greedy NMS keeps box j when no kept box
//    before it overlaps it. A box is decided as soon as that is known: suppressed once a kept
//    earlier box overlaps it, kept once every overlapping earlier box is decided and suppressed.
//    Each warp owns 32 positions and decides them in rank order as their inputs arrive from
//    the other warps, so decisions flow along the suppression chains with no grid-wide
//    barrier per step. Then the kept boxes are written out in rank order (batched NMS first
//    marks them by rank, since its positions are grouped by category).
// 4. The kept count is copied to the host (the one sync, which a variable-length result needs).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cooperative_groups.h>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda/atomic>
#include <torch/library.h>


#include "../common/box_iou.h"
#include "../common/checks.h"
#include "../common/kernel_choice.h"
#include "cuda_helpers.h"
#include "nms_rank.cuh"
#include "nms_tile.cuh"
#include "radix_sort.cuh"

namespace detops {
namespace ops {
namespace {

namespace cg = cooperative_groups;
using nms_rank::block_count_rank;
using nms_rank::kMaxCountRank;
using nms_rank::kRankWarps;
using nms_rank::score_key;
using nms_tile::bit_range;
using nms_tile::Box4;
using nms_tile::kTile;
constexpr int kPrepareThreads = 256;
constexpr int kFixThreads = 512;
constexpr int kPassThreads = 1024;      // the one-block pass
constexpr int64_t kMaxBlockPass = 4096;  // boxes it takes (64 tiles, 2 per warp)
constexpr int kBatchWords = 8;
constexpr int64_t kMaskSpread = 16;      // fewest blocks per row tile of the mask
constexpr int64_t kMaskBlocksPerSm = 32;  // resident 64-thread blocks per SM


// Packed lower-triangular layouts. Row j (tile r = j / 64) has r + 1 mask words (tiles 0..r)
// and r / 64 + 1 summary words (one bit per mask word).
__host__ __device__ __forceinline__ int64_t mask_row_offset(int64_t j) {
  const int64_t r = j / kTile;
  return int64_t{kTile} * (r * (r + 1) / 2) + (j - r * kTile) * (r + 1);
}

__host__ __device__ __forceinline__ int64_t summary_row_offset(int64_t j) {
  const int64_t r = j / kTile;
  const int64_t q = r / 64, m = r % 64;
  // sum over tiles r' < r of (r' / 64 + 1)
  const int64_t before = 64 * (q * (q - 1) / 2) + q * m + r;
  return int64_t{kTile} * before + (j - r * kTile) * (q + 1);
}

inline int64_t mask_words(int64_t n) {
  return n == 0 ? 0 : mask_row_offset(n - 1) + (n - 1) / kTile + 1;
}

inline int64_t summary_words(int64_t n) {
  return n == 0 ? 0 : summary_row_offset(n - 1) + (n - 1) / kTile / 64 + 1;
}

// Ranks up to kMaxCountRank float, half or bfloat16 scores by counting (nms_rank.cuh): higher
// scores first, equal scores by index, NaN last. Block b ranks boxes 32 b .. 32 b + 31 and
// writes, per rank, the original index, the box in float and whether the score is a number.
// Also clears the mask's row summaries.
template <typename scalar_t>
__global__ void __launch_bounds__(kRankWarps * 32) nms_rank_kernel(
    int64_t n, const scalar_t* __restrict__ scores, int64_t score_stride,
    const scalar_t* __restrict__ boxes, int64_t stride0, int64_t stride1, int64_t* __restrict__ order,
    float* __restrict__ sorted_boxes, bool* __restrict__ valid, unsigned long long* __restrict__ summary,
    int64_t summary_size) {
  __shared__ __align__(16) uint32_t keys[kMaxCountRank];
  __shared__ int partial[kRankWarps][32];
  for (int64_t w = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; w < summary_size;
       w += int64_t{gridDim.x} * blockDim.x) {
    summary[w] = 0;
  }
  const int count = static_cast<int>(n);
  const int padded = (count + 31) & ~31;
#pragma unroll 4
  for (int j = threadIdx.x; j < padded; j += blockDim.x) {
    keys[j] = j < count ? score_key(static_cast<float>(scores[j * score_stride])) : 0u;  // past n: never ahead
  }
  __syncthreads();
  const int p = block_count_rank(keys, padded, blockIdx.x, partial);
  const int i = blockIdx.x * 32 + threadIdx.x;
  if (threadIdx.x < 32 && i < count) {
    order[p] = i;
    valid[p] = keys[i] != 0;
    const scalar_t* b = boxes + i * stride0;
#pragma unroll
    for (int c = 0; c < 4; ++c) sorted_boxes[p * 4 + c] = static_cast<float>(b[c * stride1]);
  }
}

// Batched NMS's counts over keys [from, to) (multiples of 4) for the box of key `mine` and
// category `mc`: boxes ahead of it by score (as count_ahead), and boxes ahead of its position,
// those of lower categories and those of its category ahead by score.
template <bool kOrEqual>
__device__ __forceinline__ void count_ahead_by_category(
    const uint32_t* keys, const int64_t* cls, int from, int to, uint32_t mine, int64_t mc, int& by_score,
    int& by_position) {
  const uint4* k4 = reinterpret_cast<const uint4*>(keys);
  const longlong2* c2 = reinterpret_cast<const longlong2*>(cls);
  auto step = [&](uint32_t k, int64_t c) {
    const bool ahead = kOrEqual ? k >= mine : k > mine;
    by_score += ahead;
    by_position += c < mc || (c == mc && ahead);
  };
#pragma unroll 2
  for (int q = from / 4; q < to / 4; ++q) {
    const uint4 k = k4[q];
    const longlong2 c01 = c2[2 * q], c23 = c2[2 * q + 1];
    step(k.x, c01.x);
    step(k.y, c01.y);
    step(k.z, c23.x);
    step(k.w, c23.y);
  }
}

// Batched NMS up to max_count_rank_batched boxes, ranked by counting (nms_rank.cuh) with their
// categories: box i's rank R is the number of boxes ahead of it by score, and its position P
// the number of boxes of lower categories plus those of its category ahead of it by score, so
// positions group the ranking by category (ascending) as the stable sort by category of
// torch's path does. Block b takes boxes 32 b .. 32 b + 31 and writes order[R] = i,
// rank[P] = R, cls_sorted[P] and, at P, the box in float and whether the score is a number.
// Also clears the mask's row summaries. Dynamic shared memory: the categories, then the keys.
template <typename scalar_t>
__global__ void __launch_bounds__(kRankWarps * 32) nms_batched_rank_kernel(
    int64_t n, const scalar_t* __restrict__ scores, int64_t score_stride, const int64_t* __restrict__ idxs,
    int64_t idx_stride, const scalar_t* __restrict__ boxes, int64_t stride0, int64_t stride1,
    int64_t* __restrict__ order, int64_t* __restrict__ rank, int64_t* __restrict__ cls_sorted,
    float* __restrict__ sorted_boxes, bool* __restrict__ valid, unsigned long long* __restrict__ summary,
    int64_t summary_size) {
  extern __shared__ __align__(16) int64_t batched_rank_smem[];
  __shared__ int partial_score[kRankWarps][32], partial_position[kRankWarps][32];
  for (int64_t w = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; w < summary_size;
       w += int64_t{gridDim.x} * blockDim.x) {
    summary[w] = 0;
  }
  const int count = static_cast<int>(n);
  const int padded = (count + 31) & ~31;
  int64_t* const cls = batched_rank_smem;                               // [padded]
  uint32_t* const keys = reinterpret_cast<uint32_t*>(cls + padded);  // [padded]
#pragma unroll 4
  for (int j = threadIdx.x; j < padded; j += blockDim.x) {
    const bool real = j < count;
    keys[j] = real ? score_key(static_cast<float>(scores[j * score_stride])) : 0u;
    cls[j] = real ? idxs[j * idx_stride] : INT64_MAX;  // past n: never ahead
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int i0 = blockIdx.x * 32, i = i0 + lane;
  const uint32_t mine = keys[i];
  const int64_t mc = cls[i];
  const int groups = padded / 32;
  const int lo = 32 * (groups * warp / kRankWarps), hi = 32 * (groups * (warp + 1) / kRankWarps);
  int by_score = 0, by_position = 0;
  count_ahead_by_category<true>(keys, cls, lo, min(hi, i0), mine, mc, by_score, by_position);
  count_ahead_by_category<false>(keys, cls, max(lo, i0 + 32), hi, mine, mc, by_score, by_position);
  if (lo <= i0 && i0 < hi) {
    for (int j = i0; j < i0 + 32; ++j) {
      const uint32_t k = keys[j];
      const int64_t c = cls[j];
      const bool ahead = k > mine || (k == mine && j < i);
      by_score += ahead;
      by_position += c < mc || (c == mc && ahead);
    }
  }
  partial_score[warp][lane] = by_score;
  partial_position[warp][lane] = by_position;
  __syncthreads();
  if (warp == 0 && i < count) {
    int r = 0, p = 0;
#pragma unroll
    for (int w = 0; w < kRankWarps; ++w) {
      r += partial_score[w][lane];
      p += partial_position[w][lane];
    }
    order[r] = i;
    rank[p] = r;
    cls_sorted[p] = mc;
    valid[p] = mine != 0;
    const scalar_t* b = boxes + i * stride0;
#pragma unroll
    for (int c = 0; c < 4; ++c) sorted_boxes[p * 4 + c] = static_cast<float>(b[c * stride1]);
  }
}

// Zeroes the mask's row summaries (a grid-stride loop of the prepare kernels).
__device__ __forceinline__ void clear_summary(unsigned long long* __restrict__ summary, int64_t summary_size) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < summary_size;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    summary[i] = 0;
  }
}

// Position p's box, converted to the accumulation type, and whether its score is a number.
// Boxes may be strided; `rank` maps positions to ranks (nullptr: the same). Also clears the
// mask's row summaries.
template <typename scalar_t, typename acc_t>
__global__ void nms_prepare_kernel(
    int64_t n, const scalar_t* __restrict__ boxes, int64_t stride0, int64_t stride1,
    const int64_t* __restrict__ pos_orig, const int64_t* __restrict__ rank,
    const bool* __restrict__ score_is_nan_by_rank, acc_t* __restrict__ sorted_boxes,
    bool* __restrict__ valid, unsigned long long* __restrict__ summary, int64_t summary_size) {
  clear_summary(summary, summary_size);
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < n;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const scalar_t* b = boxes + pos_orig[p] * stride0;
#pragma unroll
    for (int c = 0; c < 4; ++c) sorted_boxes[p * 4 + c] = static_cast<acc_t>(b[c * stride1]);
    valid[p] = !score_is_nan_by_rank[rank ? rank[p] : p];
  }
}

// Larger inputs with scores of float precision or less are ranked by cub's radix sort (see
// rank_by_radix_sort): the keys of nms_rank.cuh's score_key, inverted, so that an ascending
// stable sort gives the counting rank's order (higher scores first, equal scores by index, NaN
// last), with 32-bit indices as values.
template <typename score_t>
__global__ void nms_score_keys_kernel(
    int64_t n, const score_t* __restrict__ scores, int64_t stride, uint32_t* __restrict__ keys,
    int32_t* __restrict__ index) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    keys[i] = ~score_key(static_cast<float>(scores[i * stride]));
    index[i] = static_cast<int32_t>(i);
  }
}

// The key of a NaN score, which no number's key equals.
constexpr uint32_t kNaNScoreKey = ~uint32_t{0};

// Batched NMS: the category of each rank as a key that sorts as the int64 does (its sign bit
// flipped), with the rank as value.
__global__ void nms_category_keys_kernel(
    int64_t n, const int32_t* __restrict__ order, const int64_t* __restrict__ cls, int64_t stride,
    uint64_t* __restrict__ keys, int32_t* __restrict__ rank) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < n;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    keys[r] = static_cast<uint64_t>(cls[order[r] * stride]) ^ (uint64_t{1} << 63);
    rank[r] = static_cast<int32_t>(r);
  }
}

// nms_prepare_kernel for a ranking by rank_by_radix_sort: order[r] (rank -> original index) and,
// batched, rank[p] and cls_sorted[p] in 64 bits as the later kernels read them; position p's
// box and whether its score is a number (its sorted key is not kNaNScoreKey). Also clears the
// mask's row summaries.
template <typename scalar_t, typename acc_t>
__global__ void nms_prepare_sorted_kernel(
    int64_t n, const scalar_t* __restrict__ boxes, int64_t stride0, int64_t stride1,
    const uint32_t* __restrict__ score_keys, const int32_t* __restrict__ order32,
    const int32_t* __restrict__ rank32, const uint64_t* __restrict__ cls_keys, int64_t* __restrict__ order,
    int64_t* __restrict__ rank, int64_t* __restrict__ cls_sorted, acc_t* __restrict__ sorted_boxes,
    bool* __restrict__ valid, unsigned long long* __restrict__ summary, int64_t summary_size) {
  clear_summary(summary, summary_size);
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < n;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    order[p] = order32[p];
    int64_t r = p;
    if (rank32 != nullptr) {
      r = rank32[p];
      rank[p] = r;
      cls_sorted[p] = static_cast<int64_t>(cls_keys[p] ^ (uint64_t{1} << 63));
    }
    const scalar_t* b = boxes + static_cast<int64_t>(order32[r]) * stride0;
#pragma unroll
    for (int c = 0; c < 4; ++c) sorted_boxes[p * 4 + c] = static_cast<acc_t>(b[c * stride1]);
    valid[p] = score_keys[r] != kNaNScoreKey;
  }
}

// The 64x64 tiles (row tile >= column tile) of the lower-triangular suppression mask: bit i of
// row j's word for column tile c says that box c * 64 + i ranks before j and overlaps it by
// more than the threshold. Block (w, y) takes row tile r = tiles - 1 - y (the longest rows
// first) and column tiles r - w, r - w - W, ... (W = gridDim.x), each thread one row box
// held in registers. With categories (positions grouped by category, ascending), a column
// tile whose last category is below the row tile's first holds no pair, and neither does any
// tile before it, so the block stops there; within a tile a row's columns of its own category
// are one range. Each row's word is nms_tile::overlap_word (see nms_tile.cuh): intersecting
// pairs of plain boxes decided without a division, other rows by the general loop.
// Only nonzero words are written, and each row's summary word gets its bits once per run of
// tiles of one word.
template <typename T, bool kClasses>
__global__ void __launch_bounds__(kTile) nms_mask_kernel(
    int64_t n, const Box4<T>* __restrict__ boxes, const int64_t* __restrict__ cls, T threshold,
    uint64_t* __restrict__ mask, unsigned long long* __restrict__ summary) {
  const int64_t tiles = (n + kTile - 1) / kTile;
  const int64_t r = tiles - 1 - blockIdx.y;
  const int64_t row0 = r * kTile;
  const int row_size = static_cast<int>(min(n - row0, static_cast<int64_t>(kTile)));
  const int t = threadIdx.x;
  __shared__ nms_tile::ColumnTile<T> tile;
  __shared__ int64_t scls[kClasses ? kTile : 1];

  const int64_t row = row0 + min(t, row_size - 1);
  const Box4<T> rb = boxes[row];
  const T area = geometry::box_area(rb.x1, rb.y1, rb.x2, rb.y2);
  const int64_t rc = kClasses ? cls[row] : 0;
  const int64_t first_cls = kClasses ? cls[row0] : 0;
  const bool division_free = geometry::iou_division_free_threshold(threshold);
  const bool plain_row = division_free && geometry::iou_plain_box(rb.x1, rb.y1, rb.x2, rb.y2, area);
  unsigned long long* const srow = summary + summary_row_offset(row);
  int64_t sum_word = -1;
  unsigned long long sum_bits = 0;

  for (int64_t c = r - blockIdx.x; c >= 0; c -= gridDim.x) {
    const int64_t col0 = c * kTile;
    const int col_size = static_cast<int>(min(n - col0, static_cast<int64_t>(kTile)));
    if (kClasses && cls[col0 + col_size - 1] < first_cls) break;
    __syncthreads();  // the previous tile is read
    const bool plain_column = nms_tile::stage_column(tile, t, t < col_size ? boxes + col0 + t : nullptr);
    if (kClasses && t < col_size) scls[t] = cls[col0 + t];
    const bool plain_tile = __syncthreads_and(plain_column);
    if (t >= row_size) continue;
    int begin = 0, end = c == r ? t : col_size;
    if (kClasses && end > 0 && (scls[0] != rc || scls[end - 1] != rc)) {
      // the row's category within the tile's ascending ones: [first >= rc, first > rc)
      int lo = 0, hi = end;
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (scls[mid] < rc) lo = mid + 1; else hi = mid;
      }
      begin = lo;
      hi = end;
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (scls[mid] <= rc) lo = mid + 1; else hi = mid;
      }
      end = lo;
    }
    const uint64_t valid = bit_range(begin, end);
    if (!valid) continue;
    const uint64_t bits =
        nms_tile::overlap_word(rb, area, tile, threshold, plain_row && plain_tile, division_free) & valid;
    if (bits) {
      mask[mask_row_offset(row) + c] = bits;
      if (c / 64 != sum_word) {
        if (sum_bits) atomicOr(srow + sum_word, sum_bits);
        sum_word = c / 64;
        sum_bits = 0;
      }
      sum_bits |= 1ULL << (c % 64);
    }
  }
  if (sum_bits) atomicOr(srow + sum_word, sum_bits);
}

__device__ __forceinline__ unsigned long long load_acquire(unsigned long long* p) {
  return ::cuda::atomic_ref<unsigned long long, ::cuda::thread_scope_device>(*p).load(
      ::cuda::std::memory_order_acquire);
}

__device__ __forceinline__ unsigned long long load_relaxed(unsigned long long* p) {
  return ::cuda::atomic_ref<unsigned long long, ::cuda::thread_scope_device>(*p).load(
      ::cuda::std::memory_order_relaxed);
}

// The greedy pass as a dataflow over the mask (see the top of the file), then the output.
// Launched cooperatively, so every block is resident and may wait on the others. Per tile,
// `decided` and `kept` hold one bit per position (a warp owns 32 positions, half a word):
// a kept box's bit in `kept` is published before its bit in `decided` (release / acquire).
template <bool kBatched>
__global__ void __launch_bounds__(kFixThreads) nms_dataflow_kernel(
    int64_t n, const uint64_t* __restrict__ mask, const unsigned long long* __restrict__ summary,
    const bool* __restrict__ valid, unsigned long long* kept, unsigned long long* decided,
    const int64_t* __restrict__ order, const int64_t* __restrict__ rank, int64_t* __restrict__ out,
    int64_t* __restrict__ count, unsigned long long* kept_ranks) {
  cg::grid_group grid = cg::this_grid();
  const int lane = threadIdx.x & 31;
  const int64_t warps_per_block = blockDim.x / 32;
  const int64_t gwarp = blockIdx.x * warps_per_block + threadIdx.x / 32;
  const int64_t nwarps = gridDim.x * warps_per_block;
  const int64_t groups = (n + 31) / 32;
  const int64_t tiles = (n + kTile - 1) / kTile;
  auto* kept32 = reinterpret_cast<unsigned int*>(kept);
  auto* decided32 = reinterpret_cast<unsigned int*>(decided);
  auto* kept_ranks32 = reinterpret_cast<unsigned int*>(kept_ranks);

  // Positions past n and boxes whose score is NaN are decided (not kept) from the start.
  for (int64_t g = gwarp; g < 2 * tiles; g += nwarps) {
    const int64_t j = g * 32 + lane;
    const unsigned int live = __ballot_sync(0xffffffffu, j < n && valid[j]);
    if (lane == 0) {
      kept32[g] = 0u;
      decided32[g] = ~live;
      if (kBatched) kept_ranks32[g] = 0u;
    }
  }
  grid.sync();

  // A box is suppressed once a kept box before it overlaps it, and kept once every box before
  // it that overlaps it is decided and not kept. The earliest undecided box can always be
  // decided, so the loop ends. Within its 32 positions a warp decides in rank order.
  bool all_done = false;
  while (!all_done) {
    all_done = true;
    bool progress = false;
    for (int64_t g = gwarp; g < groups; g += nwarps) {
      const int shift = static_cast<int>(g & 1) * 32;
      const unsigned int dec = static_cast<unsigned int>(load_acquire(decided + g / 2) >> shift);
      if (dec == 0xffffffffu) continue;
      all_done = false;
      const unsigned int kept_now = static_cast<unsigned int>(load_relaxed(kept + g / 2) >> shift);
      const int64_t j = g * 32 + lane;
      bool ext_kept = false, ext_pending = false;
      unsigned int in_group = 0;  // overlapping earlier positions of this warp's 32
      if (!((dec >> lane) & 1u)) {
        // The row's nonzero mask words, a batch at a time: all `decided` words of a batch are
        // read at once, then (after an acquire fence) the `kept` words, so one batch costs two
        // memory round trips however many words it has.
        const int64_t r = j / kTile;
        const unsigned long long* srow = summary + summary_row_offset(j);
        const uint64_t* mrow = mask + mask_row_offset(j);
        int64_t sw = 0;
        unsigned long long sbits = srow[0];
        while (!ext_kept) {
          int64_t ws[kBatchWords];
          uint64_t ms[kBatchWords];
          int count_words = 0;
          while (count_words < kBatchWords) {
            while (!sbits && sw < r / 64) sbits = srow[++sw];
            if (!sbits) break;
            const int b = __ffsll(static_cast<long long>(sbits)) - 1;
            sbits &= sbits - 1;
            const int64_t w = sw * 64 + b;
            uint64_t m = mrow[w];
            if (w == r) {
              in_group = static_cast<unsigned int>(m >> shift);
              m &= ~(0xffffffffULL << shift);
              if (!m) continue;
            }
            ws[count_words] = w;
            ms[count_words] = m;
            ++count_words;
          }
          if (count_words == 0) break;
          unsigned long long d[kBatchWords], k[kBatchWords];
#pragma unroll
          for (int q = 0; q < kBatchWords; ++q) d[q] = q < count_words ? load_relaxed(decided + ws[q]) : ~0ULL;
          ::cuda::atomic_thread_fence(::cuda::std::memory_order_acquire, ::cuda::thread_scope_device);
#pragma unroll
          for (int q = 0; q < kBatchWords; ++q) k[q] = q < count_words ? load_relaxed(kept + ws[q]) : 0ULL;
#pragma unroll
          for (int q = 0; q < kBatchWords; ++q) {
            if (q < count_words) {
              if (ms[q] & d[q] & k[q]) ext_kept = true;
              if (ms[q] & ~d[q]) ext_pending = true;
            }
          }
          if (count_words < kBatchWords) break;
        }
      }
      const unsigned int ext_kept_b = __ballot_sync(0xffffffffu, ext_kept);
      const unsigned int pending_b = __ballot_sync(0xffffffffu, ext_pending);
      unsigned int dec_new = dec, kept_new = kept_now;
      for (int l = 0; l < 32; ++l) {
        if ((dec_new >> l) & 1u) continue;
        const unsigned int ig = __shfl_sync(0xffffffffu, in_group, l);
        if (((ext_kept_b >> l) & 1u) || (ig & kept_new)) {
          dec_new |= 1u << l;  // suppressed
        } else if (!((pending_b >> l) & 1u) && !(ig & ~dec_new)) {
          dec_new |= 1u << l;  // kept
          kept_new |= 1u << l;
        }
      }
      if (dec_new != dec) {
        progress = true;
        if (lane == 0) {
          if (kept_new != kept_now) {
            ::cuda::atomic_ref<unsigned long long, ::cuda::thread_scope_device>(kept[g / 2])
                .fetch_or(static_cast<unsigned long long>(kept_new & ~kept_now) << shift,
                          ::cuda::std::memory_order_relaxed);
          }
          ::cuda::atomic_ref<unsigned long long, ::cuda::thread_scope_device>(decided[g / 2])
              .fetch_or(static_cast<unsigned long long>(dec_new & ~dec) << shift,
                        ::cuda::std::memory_order_release);
        }
      }
    }
    if (!all_done && !progress) __nanosleep(100);
  }
  grid.sync();

  // Batched: positions are grouped by category; the kept ones are marked by rank.
  if (kBatched) {
    for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n;
         j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      if ((__ldcg(kept32 + j / 32) >> (j % 32)) & 1u) {
        const int64_t k = rank[j];
        atomicOr(kept_ranks32 + k / 32, 1u << (k % 32));
      }
    }
    grid.sync();
  }
  const unsigned int* const kept_words = kBatched ? kept_ranks32 : kept32;
  // Kept ranks, in order, to `out`: each block writes a contiguous range of words.
  using Reduce = cub::BlockReduce<int, kFixThreads>;
  using Scan = cub::BlockScan<int, kFixThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } temp;
  __shared__ int base_shared;
  const int64_t per_block = (groups + gridDim.x - 1) / gridDim.x;
  const int64_t w0 = min(groups, blockIdx.x * per_block), w1 = min(groups, w0 + per_block);
  int before = 0;
  for (int64_t w = threadIdx.x; w < w0; w += blockDim.x) before += __popc(__ldcg(kept_words + w));
  before = Reduce(temp.reduce).Sum(before);
  if (threadIdx.x == 0) base_shared = before;
  __syncthreads();
  int64_t base = base_shared;
  for (int64_t c0 = w0; c0 < w1; c0 += blockDim.x) {
    const int64_t w = c0 + threadIdx.x;
    unsigned int word = w < w1 ? __ldcg(kept_words + w) : 0u;
    int offset = 0, total = 0;
    Scan(temp.scan).ExclusiveSum(__popc(word), offset, total);
    int64_t o = base + offset;
    while (word) {
      const int b = __ffs(word) - 1;
      word &= word - 1;
      out[o++] = order[w * 32 + b];
    }
    base += total;
    __syncthreads();
  }
  if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) *count = base;
}

// NMS's greedy pass in one block for up to kMaxBlockPass positions (at most 64 tiles), tile by
// tile in rank order, with the decisions in shared memory. Warp w decides tiles w and w + 32
// (rows tile * 64 + lane and + 32 of each). Before deciding tile t it folds, column tile by
// column tile as each is decided, the words of its undecided rows: a row is suppressed once one
// of its words meets the kept boxes of that column tile. Each row holds its next nonzero word,
// loaded as soon as the one before it is folded. To decide tile t, its warp waits for tile
// t - 1 (a counter in shared memory, no block-wide barrier), folds that column and decides the
// tile's 64 rows from their words of the tile itself (kept once every earlier overlapping row
// of the tile is decided and not kept), in as many rounds as the tile's longest chain. So a
// tile costs shared-memory round trips, not the global ones between blocks of the cooperative
// pass.
// Shared memory (dynamic): per row its word of its own tile, and the bits of its nonzero words
// of earlier tiles not folded yet.
inline size_t block_pass_smem(int64_t n) {
  return static_cast<size_t>(2 * n) * sizeof(uint64_t);
}

__global__ void __launch_bounds__(kPassThreads) nms_block_pass_kernel(
    int64_t n, const uint64_t* __restrict__ mask, const unsigned long long* __restrict__ summary,
    const bool* __restrict__ valid, const int64_t* __restrict__ order, int64_t* __restrict__ out,
    int64_t* __restrict__ count) {
  constexpr int kWarps = kPassThreads / 32;
  constexpr int kOwned = static_cast<int>(kMaxBlockPass / kTile / kWarps);  // tiles per warp
  static_assert(kMaxBlockPass <= 64 * kTile, "a row's earlier column tiles fit one summary word");
  constexpr int kNone = kTile;  // no nonzero word left
  extern __shared__ uint64_t pass_smem[];
  uint64_t* const diag = pass_smem;     // [n]
  uint64_t* const unfolded = pass_smem + n;  // [n]
  __shared__ uint64_t kept[kMaxBlockPass / kTile];
  __shared__ int decided_tiles;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tiles = static_cast<int>((n + kTile - 1) / kTile);

  // Per owned row (tile warp + 32 s, half h; bit 2 s + h of `ext`): its next nonzero word of an
  // earlier column tile (kNone: none) and that word.
  int next[kOwned][2];
  uint64_t word[kOwned][2];
  unsigned int ext = 0;  // decided, not kept: suppressed from an earlier tile, past n, or NaN
  auto row_of = [&](int s, int h) { return int64_t{warp + kWarps * s} * kTile + lane + 32 * h; };
  auto advance = [&](int s, int h) {
    const int64_t j = row_of(s, h);
    const uint64_t bits = unfolded[j];
    next[s][h] = bits ? __ffsll(static_cast<long long>(bits)) - 1 : kNone;
    if (bits) word[s][h] = mask[mask_row_offset(j) + next[s][h]];
  };
  if (threadIdx.x == 0) decided_tiles = 0;
#pragma unroll
  for (int s = 0; s < kOwned; ++s) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int rt = warp + kWarps * s;
      const int64_t j = row_of(s, h);
      next[s][h] = kNone;
      word[s][h] = 0;
      if (rt >= tiles) continue;
      if (j >= n || !valid[j]) {
        ext |= 1u << (2 * s + h);
        if (j < n) diag[j] = 0;
        continue;
      }
      const uint64_t bits = summary[summary_row_offset(j)];
      diag[j] = (bits >> rt) & 1u ? mask[mask_row_offset(j) + rt] : 0;
      unfolded[j] = bits & bit_range(0, rt);
      advance(s, h);
    }
  }
  __syncthreads();

  // Folds column tile c (kept word kp) into row (s, h) if that is its next nonzero word.
  auto fold = [&](int s, int h, int c, uint64_t kp) {
    if (next[s][h] != c) return;
    if (word[s][h] & kp) {  // suppressed: nothing more to read
      ext |= 1u << (2 * s + h);
      next[s][h] = kNone;
      return;
    }
    const int64_t j = row_of(s, h);
    unfolded[j] &= unfolded[j] - 1;
    advance(s, h);
  };
  // Column c into the rows of owned tiles [from, to).
  auto fold_rows = [&](int c, uint64_t kp, int from, int to) {
#pragma unroll
    for (int s = 0; s < kOwned; ++s) {
      if (s >= from && s < to) {
        fold(s, 0, c, kp);
        fold(s, 1, c, kp);
      }
    }
  };
  // Until tiles 0 .. c are decided. Every lane reads the counter (acquire), so every lane sees
  // their kept words; the warp leaves together.
  auto wait_decided = [&](int c) {
    while (!__all_sync(0xffffffffu, ::cuda::atomic_ref<int, ::cuda::thread_scope_block>(decided_tiles).load(
                                        ::cuda::std::memory_order_acquire) > c)) {
      __nanosleep(20);
    }
  };

  int c = 0;  // the next column tile to fold
#pragma unroll
  for (int s = 0; s < kOwned; ++s) {
    const int t = warp + kWarps * s;
    if (t < tiles) {
      for (; c < t - 1; ++c) {
        wait_decided(c);
        fold_rows(c, kept[c], s, kOwned);
      }
      uint64_t last = 0;  // kept boxes of tile t - 1
      if (t > 0) {
        wait_decided(t - 1);
        last = kept[t - 1];
        fold_rows(t - 1, last, s, s + 1);
      }
      // Tile t's rows: decided not kept (ext), or kept once no earlier overlapping row of the
      // tile is undecided or kept; the earliest undecided row is always decided.
      const unsigned int e = ext >> (2 * s);
      const int64_t j0 = int64_t{t} * kTile + lane, j1 = j0 + 32;
      const uint64_t d0 = j0 < n ? diag[j0] : 0, d1 = j1 < n ? diag[j1] : 0;
      uint64_t dec = __ballot_sync(0xffffffffu, e & 1u) | static_cast<uint64_t>(__ballot_sync(0xffffffffu, e & 2u)) << 32;
      uint64_t keep = 0;
      while (dec != ~0ULL) {
        const bool open0 = !((dec >> lane) & 1u), open1 = !((dec >> (lane + 32)) & 1u);
        const bool sup0 = open0 && (d0 & keep), sup1 = open1 && (d1 & keep);
        const bool k0 = open0 && !sup0 && !(d0 & ~dec), k1 = open1 && !sup1 && !(d1 & ~dec);
        const uint64_t kb = __ballot_sync(0xffffffffu, k0) | static_cast<uint64_t>(__ballot_sync(0xffffffffu, k1)) << 32;
        const uint64_t sup = __ballot_sync(0xffffffffu, sup0) | static_cast<uint64_t>(__ballot_sync(0xffffffffu, sup1)) << 32;
        keep |= kb;
        dec |= kb | sup;
      }
      if (lane == 0) {
        kept[t] = keep;
        ::cuda::atomic_ref<int, ::cuda::thread_scope_block>(decided_tiles).store(t + 1, ::cuda::std::memory_order_release);
      }
      if (t > 0) fold_rows(t - 1, last, s + 1, kOwned);
      c = t;
    }
  }
  __syncthreads();

  // The kept positions (ranks) in order, to `out`: each thread 8 consecutive ones per round.
  using Scan = cub::BlockScan<int, kPassThreads>;
  __shared__ typename Scan::TempStorage scan;
  int64_t base = 0;
  for (int64_t r0 = 0; r0 < int64_t{tiles} * kTile; r0 += int64_t{kPassThreads} * 8) {
    const int64_t p = r0 + int64_t{threadIdx.x} * 8;
    unsigned int bits = p < int64_t{tiles} * kTile ? static_cast<unsigned int>((kept[p / kTile] >> (p % kTile)) & 0xffu) : 0u;
    int offset = 0, total = 0;
    Scan(scan).ExclusiveSum(__popc(bits), offset, total);
    int64_t o = base + offset;
    while (bits) {
      const int b = __ffs(bits) - 1;
      bits &= bits - 1;
      out[o++] = order[p + b];
    }
    base += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) *count = base;
}

// Ranks by counting (nms_rank_kernel, or nms_batched_rank_kernel given categories `idxs`,
// which also writes rank and cls_sorted).
template <typename scalar_t>
void launch_count_rank(
    int64_t n, const at::Tensor& scores, const at::Tensor& boxes, const at::Tensor* idxs, int64_t* order,
    int64_t* rank, int64_t* cls_sorted, at::opmath_type<scalar_t>* sorted_boxes, bool* valid,
    unsigned long long* summary, int64_t summary_size, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>(cuda::ceil_div(n, 32));
  if (idxs == nullptr) {
    nms_rank_kernel<scalar_t><<<blocks, kRankWarps * 32, 0, stream>>>(
        n, scores.const_data_ptr<scalar_t>(), scores.stride(0), boxes.const_data_ptr<scalar_t>(), boxes.stride(0),
        boxes.stride(1), order, sorted_boxes, valid, summary, summary_size);
  } else {
    const at::Tensor cls = idxs->to(at::kLong);
    const size_t smem = static_cast<size_t>(cuda::round_up(n, 32)) * (sizeof(int64_t) + sizeof(uint32_t));
    if (smem > 44 * 1024) {  // with the static partial counts, past the default 48 KiB
      C10_CUDA_CHECK(cudaFuncSetAttribute(
          nms_batched_rank_kernel<scalar_t>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    }
    nms_batched_rank_kernel<scalar_t><<<blocks, kRankWarps * 32, smem, stream>>>(
        n, scores.const_data_ptr<scalar_t>(), scores.stride(0), cls.const_data_ptr<int64_t>(), cls.stride(0),
        boxes.const_data_ptr<scalar_t>(), boxes.stride(0), boxes.stride(1), order, rank, cls_sorted, sorted_boxes,
        valid, summary, summary_size);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <>
void launch_count_rank<double>(
    int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor*, int64_t*, int64_t*, int64_t*, double*, bool*,
    unsigned long long*, int64_t, cudaStream_t) {
  TORCH_INTERNAL_ASSERT(false, "detops.nms: float64 scores are ranked by torch's sort");
}

// Ranks n boxes (scores of float, half or bfloat16) by two stable radix sorts of cub where
// batched (scores, then categories `idxs` of the ranking), one otherwise, and writes the ranked
// boxes as nms_prepare_kernel does after torch's sorts: order (rank -> original index), and,
// batched, rank (position -> rank) and cls_sorted, all int64.
template <typename box_t, typename acc_t>
void rank_by_radix_sort(
    int64_t n, const at::Tensor& scores, const at::Tensor& boxes, const at::Tensor* idxs, int64_t* order,
    int64_t* rank, int64_t* cls_sorted, acc_t* sorted_boxes, bool* valid, unsigned long long* summary,
    int64_t summary_size, cudaStream_t stream) {
  const bool batched = idxs != nullptr;
  // 32-bit keys, sorted keys, indices and the order; batched also 64-bit category keys (in and
  // sorted), ranks and sorted ranks
  const int64_t words = 4 * n + (batched ? 6 * n : 0);  // 4-byte words
  at::Tensor temp = cuda::empty_written({words}, boxes.options().dtype(at::kInt));
  auto* base = reinterpret_cast<uint32_t*>(temp.data_ptr<int32_t>());
  uint32_t* keys = base;
  uint32_t* keys_sorted = keys + n;
  auto* index = reinterpret_cast<int32_t*>(keys_sorted + n);
  int32_t* order32 = index + n;
  const auto grid = cuda::grid_for(n, kPrepareThreads);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scores.scalar_type(), "detops.nms", [&] {  // not float64
    nms_score_keys_kernel<scalar_t><<<grid, kPrepareThreads, 0, stream>>>(
        n, scores.const_data_ptr<scalar_t>(), scores.stride(0), keys, index);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  cuda::sort_pairs(keys, keys_sorted, index, order32, n, ~uint32_t{0}, boxes.device(), stream);
  int32_t* rank32 = nullptr;
  uint64_t* cls_keys = nullptr;
  if (batched) {
    // 8-byte aligned: 4 * n words come before them
    auto* cls_in = reinterpret_cast<uint64_t*>(order32 + n);
    cls_keys = cls_in + n;
    auto* ranks_in = reinterpret_cast<int32_t*>(cls_keys + n);
    rank32 = ranks_in + n;
    const at::Tensor cls = idxs->to(at::kLong);
    nms_category_keys_kernel<<<grid, kPrepareThreads, 0, stream>>>(
        n, order32, cls.const_data_ptr<int64_t>(), cls.stride(0), cls_in, ranks_in);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    cuda::sort_pairs(cls_in, cls_keys, ranks_in, rank32, n, ~uint64_t{0}, boxes.device(), stream);
  }
  nms_prepare_sorted_kernel<box_t, acc_t><<<cuda::grid_for(std::max(n, summary_size), kPrepareThreads), kPrepareThreads, 0, stream>>>(
      n, boxes.const_data_ptr<box_t>(), boxes.stride(0), boxes.stride(1), keys_sorted, order32, rank32, cls_keys,
      order, rank, cls_sorted, sorted_boxes, valid, summary, summary_size);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Batched NMS counts up to this many boxes: their categories and keys, 12 bytes a box, in the
// block's shared memory beside 2 KiB of partial counts (8192 from 100 KiB per block on).
int64_t max_count_rank_batched(const cudaDeviceProp* props) {
  const int64_t fit = (static_cast<int64_t>(props->sharedMemPerBlockOptin) - 4096) / 12 / 32 * 32;
  return std::min<int64_t>(kMaxCountRank, fit);
}

// How the boxes are ranked by score (step 1): small inputs whose scores have the boxes' dtype,
// float precision or less, by counting; larger ones of float precision or less by cub's radix
// sort of 32-bit keys; float64 scores by torch's stable sort.
enum class NmsRank { kCount, kRadixSort, kTorchSort };

// A ranking forced by set_nms_kernel (common/kernel_choice.h) is taken where the input allows
// it; otherwise, and under kAuto, the selection's own choice.
NmsRank select_rank(int64_t n, bool batched, at::ScalarType boxes, at::ScalarType scores, const cudaDeviceProp* props) {
  const bool count_takes =
      n <= (batched ? max_count_rank_batched(props) : kMaxCountRank) && scores == boxes && boxes != at::kDouble;
  const bool radix_takes = scores != at::kDouble;
  switch (nms_kernel().rank) {
    case NmsRankChoice::kCount:
      if (count_takes) return NmsRank::kCount;
      break;
    case NmsRankChoice::kRadix:
      if (radix_takes) return NmsRank::kRadixSort;
      break;
    case NmsRankChoice::kSort:
      return NmsRank::kTorchSort;
    case NmsRankChoice::kAuto:
      break;
  }
  if (count_takes) return NmsRank::kCount;
  if (radix_takes) return NmsRank::kRadixSort;
  return NmsRank::kTorchSort;
}

// The greedy pass (step 3): one block where the positions and their words fit it (not batched:
// its categories' chains run in parallel in the cooperative pass), else the cooperative
// dataflow kernel.
enum class NmsPass { kBlock, kDataflow };

// A pass forced by set_nms_kernel (common/kernel_choice.h) is taken where the input allows it.
NmsPass select_pass(int64_t n, bool batched, const cudaDeviceProp* props) {
  const bool block_takes =
      !batched && n <= kMaxBlockPass && block_pass_smem(n) + 8 * 1024 <= props->sharedMemPerBlockOptin;
  if (nms_kernel().pass == NmsPassChoice::kDataflow) return NmsPass::kDataflow;
  return block_takes ? NmsPass::kBlock : NmsPass::kDataflow;
}

template <bool kBatched>
int dataflow_blocks_per_sm() {
  static const int blocks = [] {
    int b = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &b, nms_dataflow_kernel<kBatched>, kFixThreads, 0));
    return std::max(b, 1);
  }();
  return blocks;
}

at::Tensor nms_cuda_impl(
    const char* op, const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor* idxs,
    double iou_threshold) {
  checks::check_nms_inputs(op, boxes, scores, idxs, iou_threshold);
  checks::check_device(op, "boxes", boxes, at::kCUDA);
  const int64_t n = boxes.size(0);
  DETOPS_CHECK(
      (n + kTile - 1) / kTile <= 65535, op, ": too many boxes for one call (at most ",
      int64_t{65535} * kTile, "), got ", n);
  c10::cuda::CUDAGuard guard(boxes.device());
  if (n == 0) {
    return at::empty({0}, boxes.options().dtype(at::kLong));
  }
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto long_opts = boxes.options().dtype(at::kLong);
  const auto* props = at::cuda::getCurrentDeviceProperties();
  const bool batched = idxs != nullptr;

  const NmsRank ranking = select_rank(n, batched, boxes.scalar_type(), scores.scalar_type(), props);
  const bool count_rank = ranking == NmsRank::kCount;
  const bool radix_rank = ranking == NmsRank::kRadixSort;

  at::Tensor order;     // rank -> original index (torch's sort)
  at::Tensor rank;      // position -> rank (batched NMS, torch's sort)
  at::Tensor cls_sorted;
  const int64_t tiles = (n + kTile - 1) / kTile;
  const int64_t summary_size = summary_words(n);
  const int64_t acc_size = boxes.scalar_type() == at::kDouble ? 8 : 4;
  // One scratch allocation: mask, row summaries, `kept` and `decided` words (one per tile
  // each; batched NMS also kept ranks), the counting or radix rank's order (batched NMS: also
  // rank and cls_sorted), ranked boxes (aligned for vector loads) and the valid flags.
  const int64_t off_summary = mask_words(n);
  const int64_t off_flags = off_summary + summary_size;
  const int64_t off_order = off_flags + (batched ? 3 : 2) * tiles;
  const int64_t off_boxes =
      cuda::round_up(off_order + (count_rank || radix_rank ? (batched ? 3 : 1) * n : 0), 4);  // 32-byte aligned
  const int64_t off_valid = off_boxes + cuda::ceil_div(4 * n * acc_size, 8);
  const int64_t scratch_size = off_valid + cuda::ceil_div(n, 8);
  at::Tensor scratch = at::empty({scratch_size}, long_opts);
  int64_t* base = scratch.data_ptr<int64_t>();
  auto* mask_ptr = reinterpret_cast<uint64_t*>(base);
  auto* summary_ptr = reinterpret_cast<unsigned long long*>(base + off_summary);
  auto* kept = reinterpret_cast<unsigned long long*>(base + off_flags);
  auto* decided = reinterpret_cast<unsigned long long*>(base + off_flags + tiles);
  auto* kept_ranks = batched ? reinterpret_cast<unsigned long long*>(base + off_flags + 2 * tiles) : nullptr;
  bool* valid_mut = reinterpret_cast<bool*>(base + off_valid);
  const int64_t* order_ptr = base + off_order;
  const int64_t* rank_ptr = nullptr;  // position -> rank (batched NMS)
  const int64_t* cls_ptr = nullptr;   // position -> category (batched NMS)

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, boxes.scalar_type(), "detops.nms", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    auto* sorted_boxes = reinterpret_cast<acc_t*>(base + off_boxes);
    if (count_rank) {
      int64_t* const counted_rank = batched ? base + off_order + n : nullptr;
      int64_t* const counted_cls = batched ? base + off_order + 2 * n : nullptr;
      launch_count_rank<scalar_t>(
          n, scores, boxes, idxs, base + off_order, counted_rank, counted_cls, sorted_boxes, valid_mut, summary_ptr,
          summary_size, stream);
      rank_ptr = counted_rank;
      cls_ptr = counted_cls;
    } else if (radix_rank) {
      int64_t* const sorted_rank = batched ? base + off_order + n : nullptr;
      int64_t* const sorted_cls = batched ? base + off_order + 2 * n : nullptr;
      rank_by_radix_sort<scalar_t, acc_t>(
          n, scores, boxes, idxs, base + off_order, sorted_rank, sorted_cls, sorted_boxes, valid_mut, summary_ptr,
          summary_size, stream);
      rank_ptr = sorted_rank;
      cls_ptr = sorted_cls;
    } else {
      auto sorted_scores = scores.sort(/*stable=*/true, 0, /*descending=*/true);
      order = std::get<1>(sorted_scores);
      order_ptr = order.const_data_ptr<int64_t>();
      const at::Tensor nan_by_rank = std::get<0>(sorted_scores).isnan();
      at::Tensor pos_orig = order;  // position -> original index
      if (batched) {
        const at::Tensor cls_by_rank = idxs->to(at::kLong).index_select(0, order);
        auto by_class = cls_by_rank.sort(/*stable=*/true, 0, /*descending=*/false);
        cls_sorted = std::get<0>(by_class).contiguous();
        rank = std::get<1>(by_class).contiguous();
        pos_orig = order.index_select(0, rank);
        rank_ptr = rank.const_data_ptr<int64_t>();
        cls_ptr = cls_sorted.const_data_ptr<int64_t>();
      }
      nms_prepare_kernel<scalar_t, acc_t><<<cuda::grid_for(std::max(n, summary_size), kPrepareThreads), kPrepareThreads, 0, stream>>>(
          n, boxes.const_data_ptr<scalar_t>(), boxes.stride(0), boxes.stride(1),
          pos_orig.const_data_ptr<int64_t>(), rank.defined() ? rank.const_data_ptr<int64_t>() : nullptr,
          nan_by_rank.const_data_ptr<bool>(), sorted_boxes, valid_mut, summary_ptr, summary_size);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    const acc_t thr = geometry::iou_threshold_as<acc_t>(iou_threshold);
    // Column strides: about four waves of blocks, one column tile each where that fills the
    // GPU (their latency in series costs more than their instructions), at least kMaskSpread.
    const int64_t waves = cuda::ceil_div(4 * int64_t{props->multiProcessorCount} * kMaskBlocksPerSm, tiles);
    const dim3 mask_grid(
        static_cast<unsigned>(std::min<int64_t>(tiles, std::max<int64_t>(kMaskSpread, waves))),
        static_cast<unsigned>(tiles));
    const auto* boxes4 = reinterpret_cast<const Box4<acc_t>*>(sorted_boxes);
    if (batched) {
      nms_mask_kernel<acc_t, true><<<mask_grid, kTile, 0, stream>>>(
          n, boxes4, cls_ptr, thr, mask_ptr, summary_ptr);
    } else {
      nms_mask_kernel<acc_t, false><<<mask_grid, kTile, 0, stream>>>(n, boxes4, nullptr, thr, mask_ptr, summary_ptr);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });

  // The kept indices in rank order, and their count after them.
  at::Tensor result = at::empty({n + 1}, long_opts);
  int64_t* out = result.data_ptr<int64_t>();
  int64_t* count = out + n;
  const uint64_t* mask_cptr = mask_ptr;
  const unsigned long long* summary_cptr = summary_ptr;
  const bool* valid_ptr = valid_mut;

  if (select_pass(n, batched, props) == NmsPass::kBlock) {
    const size_t pass_smem = block_pass_smem(n);
    if (pass_smem > 40 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(
          nms_block_pass_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(pass_smem)));
    }
    nms_block_pass_kernel<<<1, kPassThreads, pass_smem, stream>>>(
        n, mask_cptr, summary_cptr, valid_ptr, order_ptr, out, count);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    const int per_sm = batched ? dataflow_blocks_per_sm<true>() : dataflow_blocks_per_sm<false>();
    const int64_t wanted = cuda::ceil_div(n, kFixThreads);
    const int blocks = static_cast<int>(std::max<int64_t>(
        1, std::min<int64_t>(wanted, static_cast<int64_t>(per_sm) * props->multiProcessorCount)));
    void* args[] = {const_cast<int64_t*>(&n), &mask_cptr, &summary_cptr, &valid_ptr, &kept, &decided,
                    &order_ptr, &rank_ptr, &out, &count, &kept_ranks};
    const void* fn = batched ? reinterpret_cast<const void*>(nms_dataflow_kernel<true>)
                             : reinterpret_cast<const void*>(nms_dataflow_kernel<false>);
    C10_CUDA_CHECK(cudaLaunchCooperativeKernel(fn, dim3(blocks), dim3(kFixThreads), args, 0, stream));
  }

  // The one host sync: the number of kept boxes sizes the result.
  int64_t kept_count = 0;
  C10_CUDA_CHECK(cudaMemcpyAsync(&kept_count, count, sizeof(int64_t), cudaMemcpyDeviceToHost, stream));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  return result.narrow(0, 0, kept_count);
}

at::Tensor nms_cuda(const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold) {
  return nms_cuda_impl("detops.nms", boxes, scores, nullptr, iou_threshold);
}

at::Tensor batched_nms_cuda(
    const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& idxs,
    double iou_threshold) {
  return nms_cuda_impl("detops.batched_nms", boxes, scores, &idxs, iou_threshold);
}

}  // namespace

TORCH_LIBRARY_IMPL(detops, CUDA, m) {
  m.impl("nms", TORCH_FN(nms_cuda));
  m.impl("batched_nms", TORCH_FN(batched_nms_cuda));
}

}  // namespace ops
}  // namespace detops
