// Fixed-shape batched NMS on CUDA, with no host synchronisation: every size comes from the
// input shapes and max_output, so the op can be captured in a CUDA graph.
//
// 1. nms_padded_key_kernel: key[b, i] = score (float32, float64 for float64 scores) when it is
//    above score_threshold, else -inf. Passing scores are > -inf, so they all sort first.
// 2. torch's stable descending sort of each row of keys: order[b, p] = position in N of rank p.
// 3. nms_padded_count_kernel: nvalid[b], the number of passing boxes (the last rank p with a
//    key > -inf writes p + 1; a row with none writes 0 at p = 0).
// 4. nms_padded_gather_kernel: boxes in rank order, in the accumulation type.
// 5. nms_padded_mask_kernel: for every 64x64 tile on or above the diagonal of each image whose
//    rows and columns are below nvalid[b], one bit per pair (row box, later column box) whose
//    IoU exceeds the threshold. The grid covers the worst case (all N valid); tiles past
//    nvalid[b] exit at once and are never read.
// 6. nms_padded_greedy_kernel: one block per image walks its tiles in order. Warp 0 decides a
//    tile's 64 boxes in registers (diagonal words travel by shuffle, loaded two tiles ahead)
//    and passes the next two tiles their suppression by the rows just kept through warp-wide
//    ORs; the other warps OR the kept rows' words into the suppression words of the tiles
//    after those and write the kept indices (positions in N). It stops once max_output boxes
//    are kept, and writes -1 padding and the count.
//
// Up to nms_rank::kMaxCountRank boxes per image whose scores have the boxes' dtype (float,
// half or bfloat16), nms_padded_rank_kernel replaces steps 1-4 with one launch: it ranks each
// image by counting (nms_rank.cuh) and writes order, the ranked boxes and nvalid.
//
// Memory: the mask holds B * N * ceil(N / 64) 64-bit words (B * N * ceil(N / 64) * 8 bytes:
// 22 MB for B = 8, N = 4700, 400 MB for B = 8, N = 20000). The suppression words of one image
// live in shared memory, which bounds N at 6144 * 64 = 393,216.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <tuple>

#include "../common/box_iou.h"
#include "../common/kernel_choice.h"
#include "../common/nms_padded_checks.h"
#include "cuda_helpers.h"
#include "nms_rank.cuh"
#include "nms_tile.cuh"

namespace detops {
namespace ops {
namespace {

constexpr const char* kOp = "detops.nms_padded";
using nms_tile::kTile;
constexpr int kPrepareThreads = 256;
constexpr int kGreedyThreads = 512;
// Suppression words of one image in (static-limit) shared memory: 48 KiB of 64-bit words.
constexpr int64_t kMaxColBlocks = 48 * 1024 / 8;
constexpr int64_t kMaxBoxes = kMaxColBlocks * kTile;

// key = score if score > thr (thr from iou_threshold_as: exact comparison), else -inf.
template <typename score_t, typename key_t>
__global__ void nms_padded_key_kernel(
    int64_t batch, int64_t n, const score_t* __restrict__ scores, int64_t stride0,
    int64_t stride1, key_t thr, key_t neg_inf, key_t* __restrict__ key) {
  const int64_t total = batch * n;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = i / n, p = i - b * n;
    const key_t v = static_cast<key_t>(scores[b * stride0 + p * stride1]);
    // NaN fails the comparison. -0 becomes +0: a radix sort would rank +0 before -0, but they
    // are equal scores and must keep their original order.
    key[i] = v > thr ? (v == key_t(0) ? key_t(0) : v) : neg_inf;
  }
}

// nvalid[b]: passing keys are > -inf and sorted first, so exactly one rank p of each row writes.
template <typename key_t>
__global__ void nms_padded_count_kernel(
    int64_t batch, int64_t n, const key_t* __restrict__ sorted_key, key_t neg_inf,
    int64_t* __restrict__ nvalid) {
  const int64_t total = batch * n;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = i / n, p = i - b * n;
    if (sorted_key[i] > neg_inf) {
      if (p == n - 1 || !(sorted_key[i + 1] > neg_inf)) nvalid[b] = p + 1;
    } else if (p == 0) {
      nvalid[b] = 0;
    }
  }
}

// sorted_boxes[b, p] = boxes[b, order[b, p]] in the accumulation type (boxes may be strided).
template <typename box_t, typename acc_t>
__global__ void nms_padded_gather_kernel(
    int64_t batch, int64_t n, const box_t* __restrict__ boxes, int64_t stride0, int64_t stride1,
    int64_t stride2, const int64_t* __restrict__ order, acc_t* __restrict__ sorted_boxes) {
  const int64_t total = batch * n;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = i / n;
    const box_t* src = boxes + b * stride0 + order[i] * stride1;
#pragma unroll
    for (int c = 0; c < 4; ++c) sorted_boxes[i * 4 + c] = static_cast<acc_t>(src[c * stride2]);
  }
}

// Steps 1-4 in one kernel, by counting: key = the score's key (nms_rank::score_key) when the
// score is above score_threshold, else 0, so passing boxes rank first (higher scores first,
// equal scores by index) and the others after them by index, as the sort of steps 1-2 orders
// them. Block (b, group) ranks boxes group * 32 .. + 31 of image b and writes their order and
// boxes; group 0 also writes nvalid[b], the number of nonzero keys.
template <typename scalar_t>
__global__ void __launch_bounds__(nms_rank::kRankWarps * 32) nms_padded_rank_kernel(
    int64_t n, int64_t groups, const scalar_t* __restrict__ scores, int64_t score_stride0,
    int64_t score_stride1, float thr, const scalar_t* __restrict__ boxes, int64_t stride0, int64_t stride1,
    int64_t stride2, int64_t* __restrict__ order, float* __restrict__ sorted_boxes, int64_t* __restrict__ nvalid) {
  constexpr int kWarps = nms_rank::kRankWarps;
  __shared__ __align__(16) uint32_t keys[nms_rank::kMaxCountRank];
  __shared__ int partial[kWarps][32];
  __shared__ int passing[kWarps];
  const int64_t b = blockIdx.x / groups;
  const int group = static_cast<int>(blockIdx.x - b * groups);
  const int count = static_cast<int>(n);
  const int padded = (count + 31) & ~31;
  const scalar_t* img_scores = scores + b * score_stride0;
  int pass = 0;
#pragma unroll 4
  for (int j = threadIdx.x; j < padded; j += blockDim.x) {
    const float v = j < count ? static_cast<float>(img_scores[j * score_stride1]) : 0.0f;
    const uint32_t k = j < count && v > thr ? nms_rank::score_key(v) : 0u;  // past n: never ahead
    keys[j] = k;
    pass += k != 0;
  }
  for (int o = 16; o > 0; o >>= 1) pass += __shfl_xor_sync(0xffffffffu, pass, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) passing[warp] = pass;
  __syncthreads();
  const int p = nms_rank::block_count_rank(keys, padded, group, partial);
  const int i = group * 32 + lane;
  if (warp == 0 && i < count) {
    order[b * n + p] = i;
    const scalar_t* src = boxes + b * stride0 + i * stride1;
#pragma unroll
    for (int c = 0; c < 4; ++c) sorted_boxes[(b * n + p) * 4 + c] = static_cast<float>(src[c * stride2]);
    if (group == 0 && lane == 0) {
      int total = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total += passing[w];
      nvalid[b] = total;
    }
  }
}

// One 64x64 tile of one image's mask: bit i of mask[b][row][col_block] says that the box of
// rank col_block * 64 + i ranks after `row` and overlaps it by more than the threshold.
// blockIdx.x = b * col_blocks + col_block, blockIdx.y = row_block; 64 threads.
template <typename T>
__global__ void __launch_bounds__(kTile) nms_padded_mask_kernel(
    int64_t n, int64_t col_blocks, const T* __restrict__ sorted_boxes,
    const int64_t* __restrict__ nvalid, T threshold, uint64_t* __restrict__ mask) {
  const int64_t b = blockIdx.x / col_blocks;
  const int64_t col_block = blockIdx.x - b * col_blocks;
  const int64_t row_block = blockIdx.y;
  if (col_block < row_block) return;
  const int64_t nv = nvalid[b];
  const int64_t row0 = row_block * kTile, col0 = col_block * kTile;
  if (col0 >= nv) return;  // col0 >= row0, so the rows are past nv too (or the tile is unused)
  const int row_size = static_cast<int>(min(nv - row0, static_cast<int64_t>(kTile)));
  const int col_size = static_cast<int>(min(nv - col0, static_cast<int64_t>(kTile)));
  const auto* img = reinterpret_cast<const nms_tile::Box4<T>*>(sorted_boxes) + b * n;

  __shared__ nms_tile::ColumnTile<T> tile;
  const int t = threadIdx.x;
  const bool plain_tile = __syncthreads_and(nms_tile::stage_column(tile, t, t < col_size ? img + col0 + t : nullptr));
  if (t >= row_size) return;

  const int64_t row = row0 + t;
  const nms_tile::Box4<T> rb = img[row];
  const T area = geometry::box_area(rb.x1, rb.y1, rb.x2, rb.y2);
  const bool division_free = geometry::iou_division_free_threshold(threshold);
  const bool plain = division_free && plain_tile && geometry::iou_plain_box(rb.x1, rb.y1, rb.x2, rb.y2, area);
  const uint64_t bits = nms_tile::overlap_word(rb, area, tile, threshold, plain, division_free) &
                        nms_tile::bit_range(row_block == col_block ? t + 1 : 0, col_size);
  mask[(b * n + row) * col_blocks + col_block] = bits;
}

// The lowest `count` set bits of `bits` (count <= popcount(bits)).
__device__ __forceinline__ uint64_t lowest_set_bits(uint64_t bits, int count) {
  uint64_t out = 0;
  for (int k = 0; k < count; ++k) {
    const uint64_t low = bits & (0ULL - bits);
    out |= low;
    bits ^= low;
  }
  return out;
}

// OR of a 64-bit word over the 32 lanes of a warp (all lanes active).
__device__ __forceinline__ uint64_t warp_or(uint64_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return static_cast<uint64_t>(__reduce_or_sync(0xffffffffu, static_cast<unsigned>(v))) |
         (static_cast<uint64_t>(__reduce_or_sync(0xffffffffu, static_cast<unsigned>(v >> 32))) << 32);
#else
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v |= __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
#endif
}

// The greedy pass of image b = blockIdx.x, tile by tile, until max_output boxes are kept.
// Dynamic shared memory: the suppression words of the image's tiles (`removed`).
// Warp 0 decides tile t from registers loaded two tiles ahead: the tile's diagonal words, and
// each of its rows' words of tiles t + 1 and t + 2. So the suppression of the next two tiles by
// the rows kept in tile t is an OR across the warp (`carry1`, `carry2`), not a round trip
// through memory. The other warps take the kept rows' words of the tiles after those: in step
// t they load tile t - 1's and OR them into `removed` in step t + 1, so their loads' round trip
// overlaps a step; warp 0 reads those words from tile t + 2 on. They also write the kept
// indices. One barrier per tile; kept words and rows are double-buffered across it.
__global__ void __launch_bounds__(kGreedyThreads) nms_padded_greedy_kernel(
    int64_t n, int64_t col_blocks, const uint64_t* __restrict__ mask,
    const int64_t* __restrict__ order, const int64_t* __restrict__ nvalid, int64_t max_output,
    int64_t* __restrict__ out, int64_t* __restrict__ counts) {
  extern __shared__ unsigned long long removed[];
  __shared__ unsigned long long kept_word[2];
  __shared__ int kept_rows[2][kTile];

  const int64_t b = blockIdx.x;
  const int64_t nv = nvalid[b];
  const int64_t tiles = (nv + kTile - 1) / kTile;
  const uint64_t* mask_b = mask + b * n * col_blocks;
  const int64_t* order_b = order + b * n;
  int64_t* out_b = out + b * max_output;
  const int lane = threadIdx.x & 31;
  const bool warp0 = threadIdx.x < 32;
  const int helper = static_cast<int>(threadIdx.x) - 32, helpers = static_cast<int>(blockDim.x) - 32;
  // ORs into `removed` as two 32-bit atomics (a 64-bit one is a compare-and-swap loop in
  // shared memory), each only where it sets a bit.
  auto* const removed32 = reinterpret_cast<unsigned int*>(removed);
  auto or_into = [](unsigned int* dst, uint64_t v) {
    if (static_cast<unsigned int>(v)) atomicOr(dst, static_cast<unsigned int>(v));
    if (v >> 32) atomicOr(dst + 1, static_cast<unsigned int>(v >> 32));
  };

#pragma unroll 1
  for (int64_t j = threadIdx.x; j < tiles; j += blockDim.x) removed[j] = 0;
  // Row `row`'s word of tile `col` (rows and tiles past the image's boxes: none).
  auto word = [&](int64_t row, int64_t col) -> uint64_t {
    return row < nv && col < tiles ? mask_b[row * col_blocks + col] : 0;
  };
  // Warp 0's words of a tile: its rows' (lane and lane + 32) diagonal words (d) and words of
  // the next two tiles (w, x), loaded two tiles ahead.
  struct TileWords {
    uint64_t d0 = 0, d1 = 0, w0 = 0, w1 = 0, x0 = 0, x1 = 0;
  };
  auto load_words = [&](int64_t t, TileWords& tw) {
    if (!warp0) return;
    const int64_t r = t * kTile + lane;
    tw.d0 = word(r, t);
    tw.d1 = word(r + 32, t);
    tw.w0 = word(r, t + 1);
    tw.w1 = word(r + 32, t + 1);
    tw.x0 = word(r, t + 2);
    tw.x1 = word(r + 32, t + 2);
  };
  TileWords wa, wb, wc;
  load_words(0, wa);
  load_words(1, wb);
  __syncthreads();

  // Warp 0: tile t's suppression by the rows kept in tiles t - 1 and t - 2 (carry1), and tile
  // t + 1's by those kept in tile t - 1 (carry2).
  uint64_t carry1 = 0, carry2 = 0;
  int64_t total = 0;  // kept in the tiles decided so far; the same in every thread
  int64_t last = -1;  // the last tile decided
  // A helper's work left from the step before: two words to OR into `removed` (targets j, j2)
  // and a kept index to write at `out_at` (-1: none).
  uint64_t v = 0, v2 = 0;
  int64_t j = 0, j2 = 0, out_at = -1, index = 0;

  // Decides tile t from `cur`; loads tile t + 2's words into `ahead`. Returns whether to go on.
  auto step = [&](int64_t t, const TileWords& cur, TileWords& ahead) -> bool {
    if (t >= tiles || total >= max_output) return false;
    if (warp0) {
      load_words(t + 2, ahead);
      const int64_t rows = nv - t * kTile;  // >= 1
      const uint64_t in_range = rows >= kTile ? ~0ULL : ((1ULL << rows) - 1);
      uint64_t alive = in_range & ~(static_cast<uint64_t>(removed[t]) | carry1);
      const uint64_t nonzero = static_cast<uint64_t>(__ballot_sync(0xffffffffu, cur.d0 != 0)) |
                               (static_cast<uint64_t>(__ballot_sync(0xffffffffu, cur.d1 != 0)) << 32);
      // Diagonal words are upper-triangular (row i only has bits above i): visiting the alive
      // rows with a nonzero word in increasing order decides the tile. `todo` is the same in
      // every lane, so the shuffles below are uniform.
      uint64_t todo = alive & nonzero;
      while (todo) {
        const int bit = __ffsll(static_cast<long long>(todo)) - 1;
        const uint64_t row = __shfl_sync(0xffffffffu, bit < 32 ? cur.d0 : cur.d1, bit & 31);
        alive &= ~row;
        todo &= ~row & (todo - 1);
      }
      uint64_t kept = alive;
      const int64_t room = max_output - total;  // >= 1
      if (__popcll(kept) > room) kept = lowest_set_bits(kept, static_cast<int>(room));
      const bool k0 = (kept >> lane) & 1ULL, k1 = (kept >> (lane + 32)) & 1ULL;
      const int buf = static_cast<int>(t & 1);
      if (k0) kept_rows[buf][__popcll(kept & ((1ULL << lane) - 1))] = lane;
      if (k1) kept_rows[buf][__popcll(kept & ((1ULL << (lane + 32)) - 1))] = lane + 32;
      carry1 = carry2 | warp_or((k0 ? cur.w0 : 0) | (k1 ? cur.w1 : 0));
      carry2 = warp_or((k0 ? cur.x0 : 0) | (k1 ? cur.x1 : 0));
      if (lane == 0) kept_word[buf] = kept;
    } else {
      // The last step's loads, now arrived: ORs into tiles t + 1 on, and a kept index.
      or_into(removed32 + 2 * j, v);
      or_into(removed32 + 2 * j2, v2);
      if (out_at >= 0) out_b[out_at] = index;
      v = v2 = 0;
      out_at = -1;
      if (t > 0) {
        // Tile p = t - 1, decided before the last barrier: its kept rows' suppression of tiles
        // t + 2 on (tiles t and t + 1 get it through warp 0's carries), and its kept indices,
        // written by the last helpers. The first two words per thread and the index are
        // loaded now and used in the next step, so the loads' round trip overlaps a step;
        // any further words (more than two per thread) are ORed now.
        const int64_t p = t - 1;
        const int pb = static_cast<int>(p & 1);
        const int nk = __popcll(kept_word[pb]);
        const int out_i = helpers - 1 - helper;  // nk <= 64 < helpers
        if (out_i < nk) {
          out_at = total - nk + out_i;
          index = order_b[p * kTile + kept_rows[pb][out_i]];
        }
        const int later = static_cast<int>(tiles - t - 2);  // < kMaxColBlocks
        const int items = later > 0 ? nk * later : 0;
        // Item i: kept row q = i / later, tile t + 2 + i % later. The quotient is taken in
        // floating point (an integer division is about 30 instructions): q < nk <= 64, and
        // (i + 0.5) / later lies at least 0.5 / later > 2^-14 from an integer, while
        // __fdividef's error below 64 is at most 2 ulp = 2^-17.
        auto item_word = [&](int item, int64_t& target) -> uint64_t {
          if (item >= items) return 0;
          const int q = static_cast<int>(__fdividef(static_cast<float>(item) + 0.5f, static_cast<float>(later)));
          target = t + 2 + (item - q * later);
          return mask_b[(p * kTile + kept_rows[pb][q]) * col_blocks + target];
        };
        v = item_word(helper, j);
        v2 = item_word(helper + helpers, j2);
        for (int item = helper + 2 * helpers; item < items; item += 2 * helpers) {
          int64_t ja = 0, jb = 0;
          const uint64_t va = item_word(item, ja), vb = item_word(item + helpers, jb);
          or_into(removed32 + 2 * ja, va);
          or_into(removed32 + 2 * jb, vb);
        }
      }
    }
    __syncthreads();
    total += __popcll(kept_word[t & 1]);
    last = t;
    return true;
  };
  for (int64_t t = 0;; t += 3) {
    if (!step(t, wa, wc)) break;
    if (!step(t + 1, wb, wa)) break;
    if (!step(t + 2, wc, wb)) break;
  }
  // A helper's index loaded in the last step (its ORs are no longer needed).
  if (out_at >= 0) out_b[out_at] = index;

  // The last tile's kept indices, then -1 padding.
  if (last >= 0) {
    const int pb = static_cast<int>(last & 1);
    const int nk = __popcll(kept_word[pb]);
    const int64_t before = total - nk;
    for (int i = threadIdx.x; i < nk; i += blockDim.x) out_b[before + i] = order_b[last * kTile + kept_rows[pb][i]];
  }
#pragma unroll 1
  for (int64_t k = total + threadIdx.x; k < max_output; k += blockDim.x) out_b[k] = -1;
  if (threadIdx.x == 0) counts[b] = total;
}

template <typename scalar_t>
void launch_rank(
    const at::Tensor& boxes, const at::Tensor& scores, double score_threshold, int64_t groups, at::Tensor& order,
    at::Tensor& sorted_boxes, at::Tensor& nvalid, cudaStream_t stream) {
  const int64_t batch = boxes.size(0), n = boxes.size(1);
  nms_padded_rank_kernel<scalar_t><<<static_cast<unsigned>(batch * groups), nms_rank::kRankWarps * 32, 0, stream>>>(
      n, groups, scores.const_data_ptr<scalar_t>(), scores.stride(0), scores.stride(1),
      geometry::iou_threshold_as<float>(score_threshold), boxes.const_data_ptr<scalar_t>(), boxes.stride(0),
      boxes.stride(1), boxes.stride(2), order.data_ptr<int64_t>(), sorted_boxes.data_ptr<float>(),
      nvalid.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <>
void launch_rank<double>(
    const at::Tensor&, const at::Tensor&, double, int64_t, at::Tensor&, at::Tensor&, at::Tensor&, cudaStream_t) {
  TORCH_INTERNAL_ASSERT(false, "detops.nms_padded: float64 scores are ranked by torch's sort");
}

// How the boxes of each image are ranked by score: by counting (nms_padded_rank_kernel, one
// launch for steps 1-4) where an image holds at most nms_rank::kMaxCountRank boxes whose scores
// have the boxes' dtype, float precision or less; else by torch's stable sort of the keys.
enum class PaddedRank { kCount, kTorchSort };

// A forced kSort (set_nms_kernel, common/kernel_choice.h) is always taken, a forced kCount where
// the input allows it; kAuto and kRadix: the selection's own choice.
PaddedRank select_rank(int64_t batch, int64_t n, at::ScalarType boxes, at::ScalarType scores) {
  const int64_t groups = cuda::ceil_div(n, 32);
  if (nms_kernel().rank == NmsRankChoice::kSort) return PaddedRank::kTorchSort;
  if (n <= nms_rank::kMaxCountRank && scores == boxes && scores != at::kDouble &&
      batch <= std::numeric_limits<int32_t>::max() / groups) {
    return PaddedRank::kCount;
  }
  return PaddedRank::kTorchSort;
}

std::tuple<at::Tensor, at::Tensor> nms_padded_cuda(
    const at::Tensor& boxes, const at::Tensor& scores, double iou_threshold,
    double score_threshold, int64_t max_output) {
  checks::check_nms_padded_inputs(kOp, boxes, scores, iou_threshold, score_threshold, max_output);
  checks::check_device(kOp, "boxes", boxes, at::kCUDA);
  const int64_t batch = boxes.size(0), n = boxes.size(1);
  DETOPS_CHECK(
      n <= kMaxBoxes, kOp, ": at most ", kMaxBoxes, " boxes per image on CUDA, got boxes ",
      checks::shape_str(boxes));
  c10::cuda::CUDAGuard guard(boxes.device());
  const auto long_opts = boxes.options().dtype(at::kLong);
  if (batch == 0 || n == 0 || max_output == 0) {
    return {at::full({batch, max_output}, -1, long_opts), at::zeros({batch}, long_opts)};
  }

  const int64_t col_blocks = (n + kTile - 1) / kTile;
  const int64_t words_per_image = n * col_blocks;  // <= 393216 * 6144: no overflow
  const auto* props = at::cuda::getCurrentDeviceProperties();
  const int64_t max_words = static_cast<int64_t>(props->totalGlobalMem / sizeof(uint64_t));
  DETOPS_CHECK(
      batch <= max_words / words_per_image, kOp, ": the suppression mask for B = ", batch,
      " images of N = ", n, " boxes needs B * N * ceil(N / 64) * 8 = ",
      static_cast<double>(batch) * static_cast<double>(words_per_image) * 8.0,
      " bytes, more than this GPU's ", static_cast<int64_t>(props->totalGlobalMem),
      " bytes; split the batch or lower N");
  DETOPS_CHECK(
      batch * col_blocks <= std::numeric_limits<int32_t>::max(), kOp,
      ": too many images for one launch, got boxes ", checks::shape_str(boxes));

  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t groups = cuda::ceil_div(n, 32);
  const bool count_rank = select_rank(batch, n, boxes.scalar_type(), scores.scalar_type()) == PaddedRank::kCount;
  at::Tensor order;  // [B, N]: position in N of rank p
  at::Tensor nvalid = at::empty({batch}, long_opts);
  if (!count_rank) {
    const at::ScalarType key_type = scores.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    at::Tensor key = at::empty({batch, n}, scores.options().dtype(key_type));
    const unsigned prep_grid = cuda::grid_for(batch * n, kPrepareThreads);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, scores.scalar_type(), kOp, [&] {
      using key_t = at::opmath_type<scalar_t>;
      nms_padded_key_kernel<scalar_t, key_t><<<prep_grid, kPrepareThreads, 0, stream>>>(
          batch, n, scores.const_data_ptr<scalar_t>(), scores.stride(0), scores.stride(1),
          geometry::iou_threshold_as<key_t>(score_threshold),
          -std::numeric_limits<key_t>::infinity(), key.data_ptr<key_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });

    // Stable, descending, per row: ties keep their original order (torch's sort runs on the
    // current stream and does not synchronize).
    auto sorted = key.sort(/*stable=*/true, /*dim=*/1, /*descending=*/true);
    const at::Tensor sorted_key = std::get<0>(sorted).contiguous();
    order = std::get<1>(sorted).contiguous();
    AT_DISPATCH_FLOATING_TYPES(key_type, kOp, [&] {
      nms_padded_count_kernel<scalar_t><<<prep_grid, kPrepareThreads, 0, stream>>>(
          batch, n, sorted_key.const_data_ptr<scalar_t>(), -std::numeric_limits<scalar_t>::infinity(),
          nvalid.data_ptr<int64_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  } else {
    order = at::empty({batch, n}, long_opts);
  }

  at::Tensor mask = at::empty({batch * words_per_image}, long_opts);
  auto* mask_ptr = reinterpret_cast<uint64_t*>(mask.data_ptr<int64_t>());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, boxes.scalar_type(), kOp, [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor sorted_boxes =
        at::empty({batch, n, 4}, boxes.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    if (count_rank) {
      launch_rank<scalar_t>(boxes, scores, score_threshold, groups, order, sorted_boxes, nvalid, stream);
    } else {
      nms_padded_gather_kernel<scalar_t, acc_t><<<cuda::grid_for(batch * n, kPrepareThreads), kPrepareThreads, 0, stream>>>(
          batch, n, boxes.const_data_ptr<scalar_t>(), boxes.stride(0), boxes.stride(1),
          boxes.stride(2), order.const_data_ptr<int64_t>(), sorted_boxes.data_ptr<acc_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    const dim3 grid(static_cast<unsigned>(batch * col_blocks), static_cast<unsigned>(col_blocks));
    nms_padded_mask_kernel<acc_t><<<grid, kTile, 0, stream>>>(
        n, col_blocks, sorted_boxes.const_data_ptr<acc_t>(), nvalid.const_data_ptr<int64_t>(),
        geometry::iou_threshold_as<acc_t>(iou_threshold), mask_ptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });

  at::Tensor out = at::empty({batch, max_output}, long_opts);
  at::Tensor counts = at::empty({batch}, long_opts);
  const size_t smem = static_cast<size_t>(col_blocks) * sizeof(unsigned long long);
  if (smem > 40 * 1024) {  // with the kernel's static shared memory, past the default 48 KiB
    C10_CUDA_CHECK(cudaFuncSetAttribute(
        nms_padded_greedy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  nms_padded_greedy_kernel<<<static_cast<unsigned>(batch), kGreedyThreads, smem, stream>>>(
      n, col_blocks, mask_ptr, order.const_data_ptr<int64_t>(), nvalid.const_data_ptr<int64_t>(),
      max_output, out.data_ptr<int64_t>(), counts.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, counts};
}

}  // namespace

TORCH_LIBRARY_IMPL(detops, CUDA, m) {
  m.impl("nms_padded", TORCH_FN(nms_padded_cuda));
}

}  // namespace ops
}  // namespace detops
