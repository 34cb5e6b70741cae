// NMS and batched (per-category) NMS on CUDA.
//
// 1. Rank boxes by score (stable, descending); batched NMS then groups the ranking by category
//    (stable), so each category is a contiguous run of positions.
// 2. nms_prepare_kernel: boxes in ranked (or category-grouped) order, in the accumulation type.
// 3. nms_mask_kernel: for every 64x64 tile on or above the diagonal, one bit per pair
//    (row box, later column box) whose IoU exceeds the threshold, plus a per-row summary of the
//    nonzero words. Tiles whose row and column boxes share no category are skipped.
// 4. nms_gather_kernel: one block walks the tiles in order. Warp 0 resolves the 64 boxes of a
//    tile in registers (the diagonal words travel by shuffle); then all threads OR the nonzero
//    words of the rows just kept into the suppression words of later tiles. One barrier pair
//    per tile, not per kept box, and the mask never leaves the device.
// 5. Plain NMS writes the kept indices directly; batched NMS marks kept ranks and selects them.
//    The only host sync is the one that sizes the output.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../common/box_iou.h"
#include "../common/checks.h"
#include "cuda_helpers.h"

namespace detops {
namespace ops {
namespace {

constexpr int kTile = 64;
constexpr int kGatherThreads = 1024;
constexpr int kPrepareThreads = 256;
constexpr int64_t kMaxSharedWords = 48 * 1024 / 8;
// Largest mask (plus suppression words) the greedy pass copies into shared memory: within the
// 227 KiB a Hopper or Ampere block may opt into, minus the kernel's static variables.
constexpr int64_t kMaxSharedMaskBytes = 160 * 1024;

using geometry::iou_above;

// Position p's box, converted to the accumulation type, and whether its score is a number.
// Boxes may be strided; `rank` maps positions to ranks (nullptr: the same).
template <typename scalar_t, typename acc_t>
__global__ void nms_prepare_kernel(
    int64_t n, const scalar_t* __restrict__ boxes, int64_t stride0, int64_t stride1,
    const int64_t* __restrict__ pos_orig, const int64_t* __restrict__ rank,
    const bool* __restrict__ score_is_nan_by_rank, acc_t* __restrict__ sorted_boxes,
    bool* __restrict__ valid) {
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < n;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const scalar_t* b = boxes + pos_orig[p] * stride0;
#pragma unroll
    for (int c = 0; c < 4; ++c) sorted_boxes[p * 4 + c] = static_cast<acc_t>(b[c * stride1]);
    valid[p] = !score_is_nan_by_rank[rank ? rank[p] : p];
  }
}

// One 64x64 tile of the suppression mask: bit i of mask[row][col_block] says that box
// col_block * 64 + i ranks after `row` and overlaps it by more than the threshold. Each nonzero
// word also sets bit col_block of the row's summary, so the serial pass reads only those.
template <typename T, bool kClasses>
__global__ void nms_mask_kernel(
    int64_t n, int64_t col_blocks, int64_t summary_words, const T* __restrict__ boxes,
    const int64_t* __restrict__ cls, T threshold, uint64_t* __restrict__ mask,
    unsigned long long* __restrict__ summary) {
  const int64_t row_block = blockIdx.y;
  const int64_t col_block = blockIdx.x;
  if (col_block < row_block) return;
  const int64_t row0 = row_block * kTile, col0 = col_block * kTile;
  const int row_size = static_cast<int>(min(n - row0, static_cast<int64_t>(kTile)));
  const int col_size = static_cast<int>(min(n - col0, static_cast<int64_t>(kTile)));
  if (kClasses) {
    // Positions are grouped by category: the tile is empty unless the categories overlap.
    if (cls[col0] > cls[row0 + row_size - 1]) return;
  }

  __shared__ T sx1[kTile], sy1[kTile], sx2[kTile], sy2[kTile], sarea[kTile];
  __shared__ int64_t scls[kTile];
  const int t = threadIdx.x;
  if (t < col_size) {
    const T* b = boxes + (col0 + t) * 4;
    sx1[t] = b[0];
    sy1[t] = b[1];
    sx2[t] = b[2];
    sy2[t] = b[3];
    sarea[t] = geometry::box_area(b[0], b[1], b[2], b[3]);
    if (kClasses) scls[t] = cls[col0 + t];
  }
  __syncthreads();
  if (t >= row_size) return;

  const int64_t row = row0 + t;
  const T* b = boxes + row * 4;
  const T x1 = b[0], y1 = b[1], x2 = b[2], y2 = b[3];
  const T area = geometry::box_area(x1, y1, x2, y2);
  const int64_t c = kClasses ? cls[row] : 0;
  // With a threshold >= 0 only intersecting pairs can be above it: test that first and
  // leave the division to the few pairs that do intersect.
  const bool need_overlap = threshold >= T(0);
  uint64_t bits = 0;
  for (int i = (row_block == col_block) ? t + 1 : 0; i < col_size; ++i) {
    if (kClasses && scls[i] != c) continue;
    if (need_overlap && !(geometry::min_of(x2, sx2[i]) > geometry::max_of(x1, sx1[i]) &&
                          geometry::min_of(y2, sy2[i]) > geometry::max_of(y1, sy1[i]))) {
      continue;
    }
    if (iou_above(x1, y1, x2, y2, area, sx1[i], sy1[i], sx2[i], sy2[i], sarea[i], threshold)) {
      bits |= 1ULL << i;
    }
  }
  mask[row * col_blocks + col_block] = bits;
  if (bits) atomicOr(summary + row * summary_words + col_block / 64, 1ULL << (col_block % 64));
}

// The greedy pass, in one block, tile by tile. Warp 0 decides the tile's 64 boxes in registers
// (diagonal words travel by shuffle, and only rows with a nonzero diagonal word can suppress
// anything); then all threads OR the mask words of the rows just kept into the suppression
// words of later tiles. One barrier pair per tile. Warp 0 loads the next tile's diagonal words
// while the other threads push, so that latency is hidden.
// Plain NMS (rank == nullptr: positions are ranks) writes the kept original indices in order to
// `out` and their number to `count`; batched NMS marks kept_by_rank instead.
struct TileWords {
  uint64_t d0, d1;     // diagonal words of rows base + lane and base + lane + 32
  uint64_t valid;      // rows that exist and have a score that is a number
};

__device__ __forceinline__ TileWords load_tile(
    int64_t blk, int64_t n, int64_t col_blocks, const uint64_t* __restrict__ mask,
    const bool* __restrict__ valid, int lane) {
  const int64_t r0 = blk * kTile + lane, r1 = r0 + 32;
  TileWords t;
  t.d0 = r0 < n ? mask[r0 * col_blocks + blk] : 0;
  t.d1 = r1 < n ? mask[r1 * col_blocks + blk] : 0;
  const uint32_t v0 = __ballot_sync(0xffffffffu, r0 < n && valid[r0]);
  const uint32_t v1 = __ballot_sync(0xffffffffu, r1 < n && valid[r1]);
  t.valid = static_cast<uint64_t>(v0) | (static_cast<uint64_t>(v1) << 32);
  return t;
}

constexpr int kPushUnroll = 4;

template <bool kSharedWords, bool kSharedMask>
__global__ void __launch_bounds__(kGatherThreads) nms_gather_kernel(
    int64_t n, int64_t col_blocks, int64_t summary_words, const uint64_t* __restrict__ mask_global,
    const unsigned long long* __restrict__ summary, const bool* __restrict__ valid,
    const int64_t* __restrict__ rank, const int64_t* __restrict__ order,
    unsigned long long* __restrict__ removed_global, bool* __restrict__ kept_by_rank,
    int64_t* __restrict__ out, int64_t* __restrict__ count) {
  extern __shared__ unsigned long long removed_shared[];
  unsigned long long* removed = kSharedWords ? removed_shared : removed_global;
  __shared__ uint64_t kept_word;
  __shared__ int kept_rows[kTile];
  for (int64_t j = threadIdx.x; j < col_blocks; j += blockDim.x) removed[j] = 0;
  // A small mask is copied whole into shared memory (after the suppression words), so that
  // the serial walk below waits on shared-memory latency instead of global.
  const uint64_t* mask = mask_global;
  if (kSharedMask) {
    uint64_t* m = reinterpret_cast<uint64_t*>(removed_shared + col_blocks);
    for (int64_t i = threadIdx.x; i < n * col_blocks; i += blockDim.x) m[i] = mask_global[i];
    mask = m;
  }

  const int lane = threadIdx.x & 31;
  const bool warp0 = threadIdx.x < 32;
  TileWords next{};
  if (warp0) next = load_tile(0, n, col_blocks, mask, valid, lane);
  __syncthreads();

  int64_t total = 0;  // kept so far (warp 0)
  for (int64_t blk = 0; blk < col_blocks; ++blk) {
    const int64_t base = blk * kTile;
    if (warp0) {
      const TileWords cur = next;
      const uint64_t nonzero = static_cast<uint64_t>(__ballot_sync(0xffffffffu, cur.d0 != 0)) |
                               (static_cast<uint64_t>(__ballot_sync(0xffffffffu, cur.d1 != 0)) << 32);
      uint64_t alive = cur.valid & ~static_cast<uint64_t>(removed[blk]);
      // Rows are upper-triangular: row b only clears bits above b, so visiting the alive rows
      // with a nonzero word in increasing order decides the tile.
      uint64_t todo = alive & nonzero;
      while (todo) {
        const int bit = __ffsll(static_cast<long long>(todo)) - 1;
        const uint64_t row = __shfl_sync(0xffffffffu, bit < 32 ? cur.d0 : cur.d1, bit & 31);
        alive &= ~row;
        todo &= ~row & (todo - 1);
      }
      const uint64_t kept = alive;
      if (blk + 1 < col_blocks) next = load_tile(blk + 1, n, col_blocks, mask, valid, lane);

      const int64_t r0 = base + lane, r1 = r0 + 32;
      const bool k0 = (kept >> lane) & 1ULL, k1 = (kept >> (lane + 32)) & 1ULL;
      const int i0 = __popcll(kept & ((1ULL << lane) - 1));
      const int i1 = __popcll(kept & ((1ULL << (lane + 32)) - 1));
      if (k0) kept_rows[i0] = lane;
      if (k1) kept_rows[i1] = lane + 32;
      if (rank) {
        if (k0) kept_by_rank[rank[r0]] = true;
        if (k1) kept_by_rank[rank[r1]] = true;
      } else {
        if (k0) out[total + i0] = order[r0];
        if (k1) out[total + i1] = order[r1];
      }
      total += __popcll(kept);
      if (lane == 0) kept_word = kept;
    }
    __syncthreads();
    const int nk = __popcll(kept_word);
    const int64_t later = col_blocks - blk - 1;  // tiles after this one
    if (nk && later > 0) {
      if (rank == nullptr && static_cast<int64_t>(nk) * later <= int64_t{kPushUnroll} * blockDim.x) {
        // Few words: read them directly, all loads in flight at once. (Plain NMS only: batched
        // NMS leaves the tiles between unrelated categories unwritten.)
        const int64_t items = static_cast<int64_t>(nk) * later;
        for (int64_t item0 = threadIdx.x; item0 < items; item0 += int64_t{kPushUnroll} * blockDim.x) {
          uint64_t v[kPushUnroll];
          int64_t js[kPushUnroll];
#pragma unroll
          for (int u = 0; u < kPushUnroll; ++u) {
            const int64_t item = item0 + static_cast<int64_t>(u) * blockDim.x;
            js[u] = -1;
            v[u] = 0;
            if (item < items) {
              const int64_t row = base + kept_rows[item / later];
              js[u] = blk + 1 + item % later;
              v[u] = mask[row * col_blocks + js[u]];
            }
          }
#pragma unroll
          for (int u = 0; u < kPushUnroll; ++u) {
            if (v[u]) atomicOr(removed + js[u], static_cast<unsigned long long>(v[u]));
          }
        }
      } else {
        // Many words: the row summaries name the nonzero ones.
        const int64_t first_word = (blk + 1) / 64;
        const int64_t words = summary_words - first_word;
        const int64_t items = static_cast<int64_t>(nk) * words;
        for (int64_t item0 = threadIdx.x; item0 < items; item0 += int64_t{kPushUnroll} * blockDim.x) {
          unsigned long long sw[kPushUnroll];
          int64_t rows[kPushUnroll], ws[kPushUnroll];
#pragma unroll
          for (int u = 0; u < kPushUnroll; ++u) {
            const int64_t item = item0 + static_cast<int64_t>(u) * blockDim.x;
            sw[u] = 0;
            rows[u] = 0;
            ws[u] = 0;
            if (item < items) {
              rows[u] = base + kept_rows[item / words];
              ws[u] = first_word + item % words;
              sw[u] = summary[rows[u] * summary_words + ws[u]];
              if (ws[u] * 64 <= blk) sw[u] &= (~0ULL << (blk - ws[u] * 64)) << 1;  // after blk only
            }
          }
#pragma unroll
          for (int u = 0; u < kPushUnroll; ++u) {
            while (sw[u]) {
              const int bit = __ffsll(static_cast<long long>(sw[u])) - 1;
              sw[u] &= sw[u] - 1;
              const int64_t j = ws[u] * 64 + bit;
              atomicOr(removed + j, static_cast<unsigned long long>(mask[rows[u] * col_blocks + j]));
            }
          }
        }
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0 && count != nullptr) *count = total;
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

  // rank -> original index, and which ranks have a NaN score.
  auto sorted_scores = scores.sort(/*stable=*/true, 0, /*descending=*/true);
  const at::Tensor order = std::get<1>(sorted_scores);
  const at::Tensor nan_by_rank = std::get<0>(sorted_scores).isnan();
  at::Tensor pos_orig = order;  // position -> original index
  at::Tensor rank;              // position -> rank (undefined: the same)
  at::Tensor cls_sorted;
  if (idxs != nullptr) {
    const at::Tensor cls_by_rank = idxs->to(at::kLong).index_select(0, order);
    auto by_class = cls_by_rank.sort(/*stable=*/true, 0, /*descending=*/false);
    cls_sorted = std::get<0>(by_class).contiguous();
    rank = std::get<1>(by_class).contiguous();
    pos_orig = order.index_select(0, rank);
  }
  const int64_t col_blocks = (n + kTile - 1) / kTile;
  const int64_t summary_words = (col_blocks + 63) / 64;
  at::Tensor mask = at::empty({n * col_blocks}, long_opts);
  at::Tensor summary = at::zeros({n * summary_words}, long_opts);
  at::Tensor valid = at::empty({n}, boxes.options().dtype(at::kBool));
  auto* mask_ptr = reinterpret_cast<uint64_t*>(mask.data_ptr<int64_t>());
  auto* summary_ptr = reinterpret_cast<unsigned long long*>(summary.data_ptr<int64_t>());
  const int64_t* rank_ptr = rank.defined() ? rank.const_data_ptr<int64_t>() : nullptr;

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, boxes.scalar_type(), "detops.nms", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor sorted_boxes = at::empty({n, 4}, boxes.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    nms_prepare_kernel<scalar_t, acc_t><<<cuda::grid_for(n, kPrepareThreads), kPrepareThreads, 0, stream>>>(
        n, boxes.const_data_ptr<scalar_t>(), boxes.stride(0), boxes.stride(1),
        pos_orig.const_data_ptr<int64_t>(), rank_ptr, nan_by_rank.const_data_ptr<bool>(),
        sorted_boxes.data_ptr<acc_t>(), valid.data_ptr<bool>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const acc_t thr = geometry::iou_threshold_as<acc_t>(iou_threshold);
    const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(col_blocks));
    if (idxs != nullptr) {
      nms_mask_kernel<acc_t, true><<<grid, kTile, 0, stream>>>(
          n, col_blocks, summary_words, sorted_boxes.const_data_ptr<acc_t>(),
          cls_sorted.const_data_ptr<int64_t>(), thr, mask_ptr, summary_ptr);
    } else {
      nms_mask_kernel<acc_t, false><<<grid, kTile, 0, stream>>>(
          n, col_blocks, summary_words, sorted_boxes.const_data_ptr<acc_t>(), nullptr, thr,
          mask_ptr, summary_ptr);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });

  at::Tensor kept_by_rank, out, count;
  if (idxs != nullptr) {
    kept_by_rank = at::zeros({n}, boxes.options().dtype(at::kBool));
  } else {
    out = at::empty({n}, long_opts);
    count = at::empty({1}, long_opts);
  }
  at::Tensor removed;
  const bool shared_words = col_blocks <= kMaxSharedWords;
  if (!shared_words) removed = at::empty({col_blocks}, long_opts);
  // Plain NMS over few boxes keeps the whole mask in shared memory, as far as this device lets
  // a block opt into (about 99 KiB on sm_86/89, 163-227 KiB on sm_80/90).
  const auto* props = at::cuda::getCurrentDeviceProperties();
  const int64_t shared_limit = std::min<int64_t>(
      kMaxSharedMaskBytes, static_cast<int64_t>(props->sharedMemPerBlockOptin) - 1024);
  const int64_t shared_mask_bytes = (n * col_blocks + col_blocks) * static_cast<int64_t>(sizeof(uint64_t));
  const bool shared_mask = idxs == nullptr && shared_mask_bytes <= shared_limit;
  auto gather = shared_mask ? nms_gather_kernel<true, true>
                            : (shared_words ? nms_gather_kernel<true, false> : nms_gather_kernel<false, false>);
  const size_t smem = shared_mask ? static_cast<size_t>(shared_mask_bytes)
                                  : (shared_words ? col_blocks * sizeof(uint64_t) : 0);
  if (shared_mask && smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(
        nms_gather_kernel<true, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
        static_cast<int>(shared_limit)));
  }
  gather<<<1, kGatherThreads, smem, stream>>>(
      n, col_blocks, summary_words, mask_ptr, summary_ptr, valid.const_data_ptr<bool>(), rank_ptr,
      order.const_data_ptr<int64_t>(),
      shared_words ? nullptr : reinterpret_cast<unsigned long long*>(removed.data_ptr<int64_t>()),
      kept_by_rank.defined() ? kept_by_rank.data_ptr<bool>() : nullptr,
      out.defined() ? out.data_ptr<int64_t>() : nullptr,
      count.defined() ? count.data_ptr<int64_t>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (idxs != nullptr) {
    return order.masked_select(kept_by_rank);
  }
  // The one host sync: the number of kept boxes sizes the result.
  return out.narrow(0, 0, count.item<int64_t>());
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
