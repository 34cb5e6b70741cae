// NMS and batched (per-category) NMS on CUDA.
//
// 1. Rank boxes by score (stable, descending); batched NMS then groups the ranking by category
//    (stable), so each category is a contiguous run of positions.
// 2. nms_mask_kernel: for every 64x64 tile on or above the diagonal, one bit per pair
//    (row box, later column box) whose IoU exceeds the threshold. Tiles whose row and column
//    boxes share no category are skipped and never read.
// 3. nms_gather_kernel: one block walks the tiles in order. Warp 0 resolves the 64 boxes of a
//    tile in registers (the diagonal words travel by shuffle); then all threads OR the rows of
//    the boxes just kept into the suppression words of the later tiles, one word per thread.
//    One barrier per tile, not per kept box, and the mask never leaves the device.
// 4. The kept flags, indexed by rank, select the original indices: the only host sync is the
//    one that sizes the output.
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
constexpr int kGatherThreads = 512;
constexpr int64_t kMaxSharedWords = 48 * 1024 / 8;

using geometry::iou_above;

template <typename T, bool kClasses>
__global__ void nms_mask_kernel(
    int64_t n, int64_t col_blocks, const T* __restrict__ boxes, const int64_t* __restrict__ cls,
    T threshold, uint64_t* __restrict__ mask) {
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
  uint64_t bits = 0;
  for (int i = (row_block == col_block) ? t + 1 : 0; i < col_size; ++i) {
    if (kClasses && scls[i] != c) continue;
    if (iou_above(x1, y1, x2, y2, area, sx1[i], sy1[i], sx2[i], sy2[i], sarea[i], threshold)) {
      bits |= 1ULL << i;
    }
  }
  mask[row * col_blocks + col_block] = bits;
}

// end_block[p]: one past the last tile holding p's category (nullptr: every row runs to the
// end). rank[p]: the rank of position p (nullptr: positions are ranks).
template <bool kSharedWords>
__global__ void __launch_bounds__(kGatherThreads) nms_gather_kernel(
    int64_t n, int64_t col_blocks, const uint64_t* __restrict__ mask,
    const bool* __restrict__ valid, const int32_t* __restrict__ end_block,
    const int64_t* __restrict__ rank, uint64_t* __restrict__ removed_global,
    bool* __restrict__ kept_by_rank) {
  extern __shared__ uint64_t removed_shared[];
  uint64_t* removed = kSharedWords ? removed_shared : removed_global;
  __shared__ uint64_t kept_word;
  for (int64_t j = threadIdx.x; j < col_blocks; j += blockDim.x) removed[j] = 0;
  __syncthreads();

  const int lane = threadIdx.x & 31;
  for (int64_t blk = 0; blk < col_blocks; ++blk) {
    const int64_t base = blk * kTile;
    if (threadIdx.x < 32) {
      const int64_t r0 = base + lane, r1 = base + lane + 32;
      const uint64_t d0 = r0 < n ? mask[r0 * col_blocks + blk] : 0;
      const uint64_t d1 = r1 < n ? mask[r1 * col_blocks + blk] : 0;
      const uint32_t v0 = __ballot_sync(0xffffffffu, r0 < n && valid[r0]);
      const uint32_t v1 = __ballot_sync(0xffffffffu, r1 < n && valid[r1]);
      const uint64_t valid_bits = static_cast<uint64_t>(v0) | (static_cast<uint64_t>(v1) << 32);
      uint64_t rem = removed[blk];
      uint64_t kept = 0;
      uint64_t cand = valid_bits & ~rem;
      while (cand) {
        const int bit = __ffsll(static_cast<long long>(cand)) - 1;
        kept |= 1ULL << bit;
        const uint64_t row = __shfl_sync(0xffffffffu, bit < 32 ? d0 : d1, bit & 31);
        rem |= row;
        // Only later boxes of the tile are still undecided.
        cand = valid_bits & ~rem & ((~0ULL << bit) << 1);
      }
      if (lane == 0) kept_word = kept;
      if ((kept >> lane) & 1ULL) kept_by_rank[rank ? rank[r0] : r0] = true;
      if ((kept >> (lane + 32)) & 1ULL) kept_by_rank[rank ? rank[r1] : r1] = true;
    }
    __syncthreads();
    const uint64_t kept = kept_word;
    if (kept) {
      // Positions are sorted by category, so the last kept row reaches furthest.
      const int64_t last = base + 63 - __clzll(static_cast<long long>(kept));
      const int64_t end = end_block ? end_block[last] : col_blocks;
      for (int64_t j = blk + 1 + threadIdx.x; j < end; j += blockDim.x) {
        uint64_t acc = 0;
        uint64_t k = kept;
        while (k) {
          const int bit = __ffsll(static_cast<long long>(k)) - 1;
          k &= k - 1;
          const int64_t row = base + bit;
          if (end_block == nullptr || j < end_block[row]) acc |= mask[row * col_blocks + j];
        }
        removed[j] |= acc;
      }
    }
    __syncthreads();
  }
}

at::Tensor nms_cuda_impl(
    const char* op, const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor* idxs,
    double iou_threshold) {
  checks::check_nms_inputs(op, boxes, scores, idxs, iou_threshold);
  checks::check_device(op, "boxes", boxes, at::kCUDA);
  const int64_t n = boxes.size(0);
  TORCH_CHECK(
      n < (int64_t{1} << 31) / 2 && (n + kTile - 1) / kTile <= 65535, op,
      ": too many boxes for one call, got ", n);
  c10::cuda::CUDAGuard guard(boxes.device());
  if (n == 0) {
    return at::empty({0}, boxes.options().dtype(at::kLong));
  }
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto long_opts = boxes.options().dtype(at::kLong);

  // rank -> original index.
  const at::Tensor order = std::get<1>(scores.sort(/*stable=*/true, 0, /*descending=*/true));
  at::Tensor pos_orig = order;  // position -> original index
  at::Tensor rank;              // position -> rank (undefined: identity)
  at::Tensor cls_sorted, end_block;
  if (idxs != nullptr) {
    const at::Tensor cls_by_rank = idxs->to(at::kLong).index_select(0, order);
    auto sorted = cls_by_rank.sort(/*stable=*/true, 0, /*descending=*/false);
    cls_sorted = std::get<0>(sorted).contiguous();
    rank = std::get<1>(sorted).contiguous();
    pos_orig = order.index_select(0, rank);
    // One past the last position of each box's category, as a tile count.
    const at::Tensor seg_end = at::searchsorted(cls_sorted, cls_sorted, /*out_int32=*/false, /*right=*/true);
    end_block = seg_end.add(kTile - 1).div(kTile, "floor").to(at::kInt).contiguous();
  }
  const at::Tensor valid = scores.index_select(0, pos_orig).isnan().logical_not().contiguous();
  const int64_t col_blocks = (n + kTile - 1) / kTile;
  at::Tensor mask = at::empty({n * col_blocks}, long_opts);
  at::Tensor kept_by_rank = at::zeros({n}, boxes.options().dtype(at::kBool));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, boxes.scalar_type(), "detops.nms", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto acc_dtype = c10::CppTypeToScalarType<acc_t>::value;
    const at::Tensor sorted_boxes = boxes.index_select(0, pos_orig).to(acc_dtype).contiguous();
    const acc_t thr = geometry::iou_threshold_as<acc_t>(iou_threshold);
    const dim3 grid(static_cast<unsigned>(col_blocks), static_cast<unsigned>(col_blocks));
    auto* mask_ptr = reinterpret_cast<uint64_t*>(mask.data_ptr<int64_t>());
    if (idxs != nullptr) {
      nms_mask_kernel<acc_t, true><<<grid, kTile, 0, stream>>>(
          n, col_blocks, sorted_boxes.const_data_ptr<acc_t>(), cls_sorted.const_data_ptr<int64_t>(),
          thr, mask_ptr);
    } else {
      nms_mask_kernel<acc_t, false><<<grid, kTile, 0, stream>>>(
          n, col_blocks, sorted_boxes.const_data_ptr<acc_t>(), nullptr, thr, mask_ptr);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });

  const auto* mask_ptr = reinterpret_cast<const uint64_t*>(mask.const_data_ptr<int64_t>());
  const int32_t* end_ptr = end_block.defined() ? end_block.const_data_ptr<int32_t>() : nullptr;
  const int64_t* rank_ptr = rank.defined() ? rank.const_data_ptr<int64_t>() : nullptr;
  if (col_blocks <= kMaxSharedWords) {
    nms_gather_kernel<true><<<1, kGatherThreads, col_blocks * sizeof(uint64_t), stream>>>(
        n, col_blocks, mask_ptr, valid.const_data_ptr<bool>(), end_ptr, rank_ptr, nullptr,
        kept_by_rank.data_ptr<bool>());
  } else {
    at::Tensor removed = at::empty({col_blocks}, long_opts);
    nms_gather_kernel<false><<<1, kGatherThreads, 0, stream>>>(
        n, col_blocks, mask_ptr, valid.const_data_ptr<bool>(), end_ptr, rank_ptr,
        reinterpret_cast<uint64_t*>(removed.data_ptr<int64_t>()), kept_by_rank.data_ptr<bool>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return order.masked_select(kept_by_rank);
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
