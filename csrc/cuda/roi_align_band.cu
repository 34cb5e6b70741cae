// RoIAlign on CUDA through plane bands (plane_band.cuh), for dense RoIs on NCHW maps with a
// fixed sampling grid (sampling_ratio 1..kMaxBandGrid). roi_align.cu's selection functions pick
// these kernels through the predicates and launchers at the end of this file
// (roi_align_kernels.cuh).
//
// The gather kernels of roi_align.cu read each sample's pixels from global memory: a 32-byte
// sector per pixel pair, fetched again for every RoI that samples near it, so dense RoIs (an
// FPN level of a detector) read each plane many times over. Here a block per (image, band of
// rows, group of channels) stages the band of its channel planes in shared memory once and
// computes, from it, every bin row its band owns, for all RoIs of the image:
//   1. band_taps_kernel (launched early, so that it starts as the kernel before it ends: it waits
//      for that kernel first) computes each RoI's sample rows and columns once (the two pixel
//      rows / columns a sample reads and their weights, the rules of bilinear_sample) and the
//      owner of each bin row (k, ph): the band holding its first pixel row, keyed
//      image * bands + band. A bin row none of whose sample rows lies on the map (all of an
//      out-of-map RoI's, or of a RoI with an invalid batch index) gets the discard key
//      batch * bands instead: no band block reads it, the forward's blocks of that key write
//      its bins as zeros and the backward gives it no gradient. So RoIs far outside the map
//      (the other levels' RoIs of a sync-free multi-level pooler) cost no band work;
//   2. the bin rows are listed by owner (plane_band::group_by_owner; for the swizzled forward
//      in bin-row order, so that its sums, whose order follows the list, give the same bits on
//      every call: there, where the sizes allow, the taps kernel ranks each bin row among its
//      block's of the same owner and group_ranked_kernel, launched early, places it).
//      Each block then, for each channel of its group (each two, four, eight or sixteen
//      channels, in the forward), stages the band and computes its listed bins. On compute
//      capability 9.0 and later the forward is launched to start while the grouping still runs
//      (plane_band::launch_early): the blocks of its first wave stage their first band
//      meanwhile, and wait for the lists only then.
// Forward: pixel rows past the staged window (a bin row taller than the overlap) are read from
// global memory. The forward is bound by load wavefronts (the taps from L1/L2, shared-memory
// reads with bank conflicts), not by arithmetic: so taps are 8 bytes, loaded two at a time,
// and the band holds channel planes interleaved, so that one list entry, one set of taps and
// weights, and one shared load serve several channels.
//   swizzled (float32, float16 and bfloat16 maps, roi_align_band_forward_swizzled_kernel):
//     32-byte staged pixels of eight float32 or sixteen 16-bit channels, placed so that the
//     loads of a warp hit no bank twice, computed in float32; while a block computes, it asks
//     L2 for the band of a block about a wave later (prefetch_later_band). Its blocks keep the
//     start of their list in the shared memory after the band, and where the grid holds two
//     waves or more, the blocks of the last group of channels share each key's list with a row
//     of blocks added to the grid (split_last_group), so that the blocks that start last end
//     sooner; those two rows and the one before them take their keys longest list first (the
//     grouping ranks them: plane_band::list_keys_heaviest_first);
//   band (float64 maps, and maps too wide for the swizzled bands, roi_align_band_forward_kernel):
//     two or four interleaved channels per staged pixel, a bin the same sum, term for term, as
//     in the tiled gather kernel.
// Backward (the atomic one): the block scatters into a band of acc_t in shared memory with
// shared-memory atomics, then writes the band out.
//   sliced (roi_align_band_backward_swizzled_kernel with kSliced; 16-bit gradients, and float32
//     ones whose overlapping bands would share at least half their rows): swizzled bands without
//     overlap; each bin row is listed in every band its sample rows touch, each band adds only
//     its own rows and stores them all in the gradient's type, so there are no shared rows, no
//     tail and no float32 buffer;
//   swizzled (other float32 accumulators): eight channels per staged pixel, every warp-wide add
//     on 32 different banks, in the forward's overlapping bands;
//   band (float64): one channel at a time, in overlapping bands.
//   In overlapping bands, rows that two bands stage (the first `overlap` rows of every band but
//   the first) are zeroed beforehand and added with global atomics; every other row is written
//   once with a plain store, so the buffer needs no zeroing. Pixels past a block's window are
//   left to band_tail_backward_kernel, which runs after and adds them with global atomics.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/Atomic.cuh>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../common/roi_align_geometry.h"
#include "cuda_helpers.h"
#include "plane_band.cuh"
#include "roi_align_kernels.cuh"
#include "roi_align_rois.cuh"
#include "roi_checks.cuh"

namespace detops {
namespace ops {

namespace {

using plane_band::BandPlan;
using plane_band::BandRows;
using plane_band::ListWalk;
using roi_align::RoIBins;
using roi_align_cuda::axis_tap;
using roi_align_cuda::bins_of;

constexpr int kBandThreads = 512;
constexpr int kWideBandThreads = 1024;  // blocks of the forward's double-size bands
constexpr int kMaxBandGrid = 4;  // sampling ratios the band kernels take
// Shared memory for a band: two blocks fit on an SM.
constexpr int64_t kBandBudget = 100 * 1024;  // less where the device allows less (band_budget)

// A sample row or column as the band kernels read it, in 8 bytes (16 for double): the first
// pixel row / column and its weight. The second one and its weight follow as in axis_weights:
// hi = lo + 1 except on the last pixel (hi = lo there), h = 1 - l (the same expression as
// axis_tap, so the same value). lo < 0: the sample reads nothing.
template <typename T>
struct alignas(8) BandTap {
  int32_t lo_;
  T l;
  __device__ __forceinline__ bool valid() const { return lo_ >= 0; }
  __device__ __forceinline__ int32_t lo() const { return lo_; }
  __device__ __forceinline__ int32_t hi(int size) const { return lo_ < size - 1 ? lo_ + 1 : lo_; }
  __device__ __forceinline__ T h() const { return T(1) - l; }
};

// The G taps of one bin row or column (16-byte aligned when G is even: a RoI's taps start at
// a multiple of (PH + PW) * G taps, a bin's at a multiple of G), two 8-byte taps per load where
// they pair up: the kernels are bound by load wavefronts, not by instructions.
template <typename acc_t, int G>
__device__ __forceinline__ void load_taps(const BandTap<acc_t>* __restrict__ src, BandTap<acc_t> (&out)[G]) {
  if constexpr (sizeof(BandTap<acc_t>) == 8 && G % 2 == 0) {
    struct alignas(16) TapPair {
      BandTap<acc_t> a, b;
    };
#pragma unroll
    for (int q = 0; q < G; q += 2) {
      const TapPair v = *reinterpret_cast<const TapPair*>(src + q);
      out[q] = v.a;
      out[q + 1] = v.b;
    }
  } else {
#pragma unroll
    for (int q = 0; q < G; ++q) out[q] = src[q];
  }
}

using plane_band::KeyList;
using plane_band::kMaxHeavyFirstKeys;

// band_taps_kernel's check_op: no batch-index check, or the assertion of roi_align or of
// _roi_align_backward
constexpr int kNoCheck = -1;
constexpr int kCheckForward = 0;
constexpr int kCheckBackward = 1;

// The ranked grouping (group_ranked_kernel): a chunk is one block of band_taps_kernel, its
// kRankThreads items (a thread each). Where keys run to kRankKeys and chunks x keys to
// kRankEntries, the setup lists bin rows in order in two parallel steps instead of
// group_by_owner_kernel's one block walking all of them.
constexpr int kRankThreads = 256;
constexpr int kRankWarps = kRankThreads / 32;
constexpr int kRankKeys = 512;
constexpr int kRankEntries = 4096;

// Within this block's chunk of items (one a thread, index order = thread order), the rank of
// this thread's bin row (key >= 0; -1: no bin row) among the chunk's bin rows of its key, and
// the chunk's count of each key, to chunk_counts[blockIdx.x * num_keys + key]: the lanes of one
// key found by one ballot per key bit, each key's count per warp, then the warps' exclusive
// prefixes per key. ranks[row] holds the bin row's (key, chunk) slot, key * gridDim.x +
// blockIdx.x (below kRankEntries), above its rank (below kRankThreads, 8 bits), so that the
// grouping places it with one load. All threads of the block call it.
__device__ __forceinline__ void rank_in_chunk(
    int32_t key, int64_t row, int num_keys, int32_t* __restrict__ ranks, int32_t* __restrict__ chunk_counts) {
  __shared__ int32_t counts[kRankKeys * kRankWarps];  // [key][warp]
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  for (int e = tid; e < num_keys * kRankWarps; e += kRankThreads) counts[e] = 0;
  // 2^key_bits - 1 >= num_keys, so that the -1 of threads without a bin row matches no key
  const unsigned peers = plane_band::lanes_with_key(key, 32 - __clz(num_keys));
  const unsigned before = peers & ((1u << lane) - 1);
  __syncthreads();
  if (key >= 0 && before == 0) counts[key * kRankWarps + warp] = __popc(peers);
  __syncthreads();
  for (int k = tid; k < num_keys; k += kRankThreads) {
    int32_t run = 0;
#pragma unroll
    for (int w = 0; w < kRankWarps; ++w) {
      const int32_t c = counts[k * kRankWarps + w];
      counts[k * kRankWarps + w] = run;
      run += c;
    }
    chunk_counts[static_cast<int64_t>(blockIdx.x) * num_keys + k] = run;
  }
  __syncthreads();
  static_assert(kRankThreads <= 256 && kRankEntries <= (1 << 23), "a slot and a rank in one int32");
  if (key >= 0) {
    const int32_t slot = key * static_cast<int32_t>(gridDim.x) + static_cast<int32_t>(blockIdx.x);
    ranks[row] = (slot << 8) | (counts[key * kRankWarps + warp] + __popc(before));
  }
}

// Taps of RoI k (rois: [K, 5] of roi_t, read in acc_t): PH * G row taps, then PW * G column
// taps. keys[k * PH + ph]: the owner of bin row (k, ph); tall[k * PH + ph]: 1 when the bin row
// reads pixel rows past its owner's window, or, where `spans` (bands without overlap, at most
// 255 of them), the number of bands from the owner on that its sample rows touch. With a check
// (kCheckForward, kCheckBackward), a RoI whose batch index is invalid also fails that op's
// device assertion, so that the op needs no launch of its own for it. With ranks (launched with
// one item a thread, a block of kRankThreads per chunk), each block also ranks its bin rows
// among its own of the same owner (rank_in_chunk) for group_ranked_kernel, out of num_keys
// owners.
template <typename acc_t, typename roi_t>
__global__ void band_taps_kernel(
    int64_t num_rois, const roi_t* __restrict__ rois, int64_t batch, int height, int width,
    int pooled_height, int pooled_width, acc_t scale, int grid, bool aligned, BandPlan plan,
    BandTap<acc_t>* __restrict__ taps, int32_t* __restrict__ keys, uint8_t* __restrict__ tall,
    int check_op, bool spans, int32_t* __restrict__ ranks = nullptr, int32_t* __restrict__ chunk_counts = nullptr,
    int num_keys = 0) {
  // Launched early (plane_band::launch_early): the kernel before it in the stream may still run,
  // and may have written the RoIs or may still read memory this kernel writes. The grouping
  // after it, launched early as well, waits for its writes.
  plane_band::wait_for_prior_grid();
  plane_band::let_dependents_start();
  const int per = pooled_height + pooled_width;
  int32_t my_key = -1;  // the owner of this thread's bin row (ranks: one item a thread)
  int64_t my_row = -1;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < num_rois * per;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t k = i / per;
    const int j = static_cast<int>(i - k * per);
    acc_t roi[5];  // in acc_t: a 16-bit RoI's values exactly
#pragma unroll
    for (int e = 0; e < 5; ++e) roi[e] = static_cast<acc_t>(rois[k * 5 + e]);
    if (check_op != kNoCheck && j == 0) {
      if (check_op == kCheckForward) {
        roi_checks::assert_batch_index<RoIAlignCheck>(static_cast<double>(roi[0]), batch);
      } else {
        roi_checks::assert_batch_index<RoIAlignBackwardCheck>(static_cast<double>(roi[0]), batch);
      }
    }
    const int64_t b = roi_align::roi_batch_index(roi[0], batch);
    const RoIBins<acc_t> r =
        bins_of(roi, scale, pooled_height, pooled_width, int64_t{grid}, aligned);
    const bool is_y = j < pooled_height;
    const int p = is_y ? j : j - pooled_height;
    BandTap<acc_t>* out = taps + k * per * grid + (is_y ? p : pooled_height + p) * grid;
    int lo_min = INT_MAX, hi_max = -1;
    for (int q = 0; q < grid; ++q) {
      BandTap<acc_t> t{-1, acc_t(0)};
      int32_t hi = -1;
      if (b >= 0) {
        const acc_t v = is_y
            ? roi_align::sample_coord(r.start_h, r.bin_h, int64_t{p}, int64_t{q}, r.grid_h)
            : roi_align::sample_coord(r.start_w, r.bin_w, int64_t{p}, int64_t{q}, r.grid_w);
        const auto a = axis_tap(v, is_y ? height : width);
        t = BandTap<acc_t>{a.lo, a.l};
        hi = a.hi;
      }
      out[q] = t;
      if (t.valid()) {
        lo_min = min(lo_min, t.lo());
        hi_max = max(hi_max, hi);
      }
    }
    if (is_y) {
      // A bin row belongs to the band whose core rows hold its first sample row, or to the last
      // band (whose window reaches the map's last row). One with no sample row on the map (or
      // of an invalid RoI) is all zeros and has no gradient: it goes to the discard key
      // batch * bands, which no band block visits.
      const int band = lo_min == INT_MAX ? 0 : min(lo_min / plan.core, plan.bands - 1);
      my_key = (b < 0 || lo_min == INT_MAX) ? static_cast<int32_t>(batch * plan.bands)
                                            : static_cast<int32_t>(b * plan.bands + band);
      my_row = k * pooled_height + p;
      keys[my_row] = my_key;
      if (spans) {
        tall[k * pooled_height + p] = static_cast<uint8_t>(
            lo_min == INT_MAX ? 1 : min(plan.bands - 1, hi_max / plan.core) - band + 1);
      } else {
        const int last = min(height, band * plan.core + plan.core + plan.overlap);
        tall[k * pooled_height + p] = hi_max >= last ? 1 : 0;
      }
    }
  }
  if (ranks != nullptr) rank_in_chunk(my_key, my_row, num_keys, ranks, chunk_counts);
}

// Owner `key`'s bin rows to rows[offsets[key] .. offsets[key + 1]), in bin-row order (the lists
// of plane_band::group_by_owner_kernel, the same entries in the same places), from
// band_taps_kernel's ranks: an exclusive scan of the chunks' counts in (key, chunk) order gives
// each chunk its first entry in each key's list, and bin row (k, ph) goes to the entry of its
// (key, chunk) slot plus its rank (both in ranks[k * pooled_height + ph]). With heavy_first, the keys
// before the last (the discard key) by their lists' lengths (plane_band::list_keys_heaviest_first).
// One block of kGroupThreads; launched early after band_taps_kernel (it waits for its writes),
// and lets the band kernel after it start.
//
// The band kernel's first wave waits for these lists, so the block keeps its chain of L2 round
// trips short: each thread loads its kRankEntries / kGroupThreads consecutive counts and its
// first kGroupHeld bin rows' ranks at once, scans the counts in one pass (its own sum, then the
// block's sums by shuffles), and places those bin rows from registers, walking (k, ph) without
// a division. Where the lists fit in kGroupListBytes (in_shared: launched with total ints of
// dynamic shared memory), the bin rows are placed in shared memory and the lists copied out in
// order, so that the block's stores are whole lines rather than one scattered store per bin
// row.
constexpr int kGroupHeld = 16;
constexpr int64_t kGroupListBytes = 64 * 1024;

__global__ void __launch_bounds__(plane_band::kGroupThreads) group_ranked_kernel(
    const int32_t* __restrict__ ranks, const int32_t* __restrict__ chunk_counts, int32_t total, int pooled_height,
    int num_keys, int chunks, int32_t* __restrict__ offsets, int32_t* __restrict__ rows,
    KeyList* __restrict__ heavy_first, bool in_shared) {
  constexpr int kThreads = plane_band::kGroupThreads;
  constexpr int kPer = kRankEntries / kThreads;  // counts a thread scans
  static_assert(kRankEntries % kThreads == 0 && kThreads / 32 <= 32, "one pass of the scan, one warp of sums");
  plane_band::let_dependents_start();  // a band kernel launched early stages its first band meanwhile
  plane_band::wait_for_prior_grid();   // the ranks and counts
  __shared__ int32_t first[kRankEntries];  // [key][chunk]: the chunk's first slot in the key's list
  __shared__ int32_t warp_sums[kThreads / 32];
  extern __shared__ int32_t shared_rows[];  // in_shared: the lists
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  // bin rows base + u * kThreads + tid, u < kGroupHeld: their slots and ranks
  int32_t held[kGroupHeld];
  auto hold = [&](int32_t base) {
#pragma unroll
    for (int u = 0; u < kGroupHeld; ++u) {
      const int32_t r = base + u * kThreads + tid;
      held[u] = r < total ? ranks[r] : 0;
    }
  };
  hold(0);
  // counts e = tid * kPer + u in (key, chunk) order
  const int m = num_keys * chunks;  // at most kRankEntries (the host's check)
  int32_t count[kPer], sum = 0;
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int e = tid * kPer + u;
    count[u] = e < m ? chunk_counts[(e % chunks) * num_keys + e / chunks] : 0;
    sum += count[u];
  }
  const int32_t incl = plane_band::warp_inclusive_scan(sum, lane);
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int32_t w = plane_band::warp_inclusive_scan(lane < kThreads / 32 ? warp_sums[lane] : 0, lane);
    if (lane < kThreads / 32) warp_sums[lane] = w;
  }
  __syncthreads();
  int32_t run = (warp > 0 ? warp_sums[warp - 1] : 0) + incl - sum;
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int e = tid * kPer + u;
    if (e < m) first[e] = run;
    run += count[u];
  }
  __syncthreads();
  for (int key = tid; key <= num_keys; key += kThreads) {
    offsets[key] = key < num_keys ? first[key * chunks] : total;
  }
  if (heavy_first != nullptr) {
    plane_band::list_keys_heaviest_first(num_keys - 1, [&](int k) { return first[k * chunks]; }, heavy_first);
  }
  auto place = [&](int32_t* __restrict__ out) {
    ListWalk w(pooled_height, tid, kThreads);  // bin row r = w.e * pooled_height + w.pw
    for (int32_t base = 0; base < total; base += kGroupHeld * kThreads) {
      if (base > 0) hold(base);
#pragma unroll
      for (int u = 0; u < kGroupHeld; ++u, w.next(pooled_height)) {
        if (base + u * kThreads + tid >= total) break;
        out[first[held[u] >> 8] + (held[u] & 0xff)] = (w.e << plane_band::kRowShift) | w.pw;
      }
    }
  };
  if (!in_shared) {
    place(rows);
    return;
  }
  place(shared_rows);
  __syncthreads();
  for (int32_t i = tid; i < total; i += kThreads) rows[i] = shared_rows[i];
}

struct BandShape {
  int64_t channels;
  int height, width, pooled_height, pooled_width;
  int channels_per_block;
};

// A block's list entry (k << kRowShift) | ph (group_by_owner_kernel): its RoI, ph, and the
// RoI's taps.
template <typename acc_t>
struct BinRow {
  int64_t k;
  int ph;
  const BandTap<acc_t>* taps;
};

template <typename acc_t, int G>
__device__ __forceinline__ BinRow<acc_t> bin_row(
    int32_t listed, const BandShape& sh, const BandTap<acc_t>* __restrict__ taps) {
  const int32_t k = listed >> plane_band::kRowShift;
  return BinRow<acc_t>{k, static_cast<int>(listed & ((1 << plane_band::kRowShift) - 1)),
                       taps + static_cast<int64_t>(k) * (sh.pooled_height + sh.pooled_width) * G};
}

// The taps of bin (br.ph, pw): its sample rows ty and columns tx.
template <typename acc_t, int G>
__device__ __forceinline__ void load_bin_taps(
    const BinRow<acc_t>& br, int pw, const BandShape& sh, BandTap<acc_t> (&ty)[G], BandTap<acc_t> (&tx)[G]) {
  load_taps<acc_t, G>(br.taps + br.ph * G, ty);
  load_taps<acc_t, G>(br.taps + (sh.pooled_height + pw) * G, tx);
}

// Whether every sample row of a bin row (its taps ty) lies in the staged window (the band
// owns the bin row, so its first pixel row is not above it).
template <typename acc_t, int G>
__device__ __forceinline__ bool rows_in_window(const BandTap<acc_t> (&ty)[G], int height, BandRows window) {
  bool in = true;
#pragma unroll
  for (int q = 0; q < G; ++q) in = in && (!ty[q].valid() || ty[q].hi(height) < window.last);
  return in;
}

// A band kernel's block: its band and image, where its bin rows lie in the grouped list, and
// its group of channels.
struct BandBlock {
  int bi;             // band
  int64_t b;          // image
  int32_t first_row;  // its first list entry
  int n;              // its list entries
  int64_t c0;         // its first channel
  int nc;             // its channels
};

// The band, image and channels of block (x, y) of a band kernel's grid: x its key (image *
// bands + band), y its group of channels (its list is left empty).
__device__ __forceinline__ BandBlock band_place_at(const BandShape& sh, const BandPlan& plan, int64_t x, int64_t y) {
  BandBlock k;
  k.bi = static_cast<int>(x % plan.bands);
  k.b = x / plan.bands;
  k.first_row = 0;
  k.n = 0;
  k.c0 = y * sh.channels_per_block;
  k.nc = static_cast<int>(min(sh.channels - k.c0, static_cast<int64_t>(sh.channels_per_block)));
  return k;
}

// The block's band, image and channels, which its place in the grid gives.
__device__ __forceinline__ BandBlock band_place(const BandShape& sh, const BandPlan& plan) {
  return band_place_at(sh, plan, blockIdx.x, blockIdx.y);
}

__device__ __forceinline__ BandBlock band_block(
    const int32_t* __restrict__ offsets, const BandShape& sh, const BandPlan& plan, int64_t key) {
  BandBlock k = band_place_at(sh, plan, key, blockIdx.y);
  k.first_row = offsets[key];
  k.n = offsets[key + 1] - k.first_row;
  return k;
}

__device__ __forceinline__ BandBlock band_block(
    const int32_t* __restrict__ offsets, const BandShape& sh, const BandPlan& plan) {
  return band_block(offsets, sh, plan, blockIdx.x);
}

// Whether this block of a band forward launched early stages its first channels' band before
// the lists are ready: the first `early_blocks` blocks in launch order (about one wave, which
// starts while the grouping runs), except the discard key's. The others wait first, so that
// a band without bin rows stages nothing.
__device__ __forceinline__ bool stages_early(int early_blocks, int32_t discard) {
  return static_cast<int>(blockIdx.x) != discard &&
      blockIdx.x + static_cast<int64_t>(blockIdx.y) * gridDim.x < early_blocks;
}

// Adds v to the acc_t at a shared address (a compare-and-swap loop on GPUs without a native
// shared-memory float add, as atomicAdd on a shared pointer).
template <typename T>
__device__ __forceinline__ void add_shared(uint32_t addr, T v);
template <>
__device__ __forceinline__ void add_shared<float>(uint32_t addr, float v) {
  asm volatile("red.shared.add.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}
template <>
__device__ __forceinline__ void add_shared<double>(uint32_t addr, double v) {
  asm volatile("red.shared.add.f64 [%0], %1;" ::"r"(addr), "d"(v) : "memory");
}

// Loads of NC channels' values at a shared address (the band stages NC channel planes
// interleaved, each pixel's NC values side by side): one load of 2, 4, 8 or 16 bytes. Loads go
// through ld.shared with 32-bit shared addresses, so that an element's address is one add (row
// + column bytes); with C++ pointers the compiler rebuilds row * stride + column and the shared
// window base for every load.
using plane_band::Lanes;
template <typename T, int NC>
__device__ __forceinline__ Lanes<T, NC> load_shared_lanes(uint32_t addr) {
  constexpr int kBytes = static_cast<int>(NC * sizeof(T));
  static_assert(kBytes == 2 || kBytes == 4 || kBytes == 8 || kBytes == 16, "a staged pixel is 2 to 16 bytes");
  Lanes<T, NC> out;
  if constexpr (kBytes == 16) {
    uint32_t w[4];
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "r"(addr));
    memcpy(&out, w, 16);
  } else if constexpr (kBytes == 8) {
    uint32_t w[2];
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "r"(addr));
    memcpy(&out, w, 8);
  } else if constexpr (kBytes == 4) {
    uint32_t w;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(w) : "r"(addr));
    memcpy(&out, &w, 4);
  } else {
    unsigned short w;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(w) : "r"(addr));
    memcpy(&out, &w, 2);
  }
  return out;
}

// Pixel rows of the staged band: row(y) is a shared address, at(row, x) the NC values of
// pixel x (x scaled by the bytes of a pixel's NC values).
template <typename scalar_t, int NC = 1>
struct StagedRows {
  using row_t = uint32_t;
  uint32_t base;  // shared address of the first staged row
  int first, stride_bytes;
  __device__ __forceinline__ row_t row(int y) const {
    return base + static_cast<uint32_t>((y - first) * stride_bytes);
  }
  __device__ __forceinline__ Lanes<scalar_t, NC> at(row_t r, int32_t col_bytes) const {
    return load_shared_lanes<scalar_t, NC>(r + static_cast<uint32_t>(col_bytes));
  }
};

// The same pixels from the NC channel planes in global memory (the values the band stages).
template <typename scalar_t, int NC = 1>
struct PlaneRows {
  using row_t = int64_t;  // element offset of the row in a plane
  const scalar_t* plane[NC];
  int64_t width;
  __device__ __forceinline__ row_t row(int y) const { return y * width; }
  __device__ __forceinline__ Lanes<scalar_t, NC> at(row_t r, int32_t col_bytes) const {
    const int64_t i = r + col_bytes / static_cast<int32_t>(NC * sizeof(scalar_t));
    Lanes<scalar_t, NC> out;
#pragma unroll
    for (int j = 0; j < NC; ++j) out.v[j] = plane[j][i];
    return out;
  }
};

// The forward's blocks of the discard key: the discarded bin rows' bins of their channel
// group are zeros.
template <typename scalar_t, typename acc_t, int G>
__device__ __forceinline__ void zero_discarded_bins(
    const BandBlock& blk, const int32_t* __restrict__ rows, const BandShape& sh,
    const BandTap<acc_t>* __restrict__ taps, scalar_t* __restrict__ output) {
  const int pw_n = sh.pooled_width;
  const int64_t bins = static_cast<int64_t>(sh.pooled_height) * pw_n;
  const int64_t per_row = static_cast<int64_t>(blk.nc) * pw_n;
  for (int64_t i = threadIdx.x; i < blk.n * per_row; i += blockDim.x) {
    const int64_t e = i / per_row, rem = i - e * per_row;
    const int64_t ci = rem / pw_n, pw = rem - ci * pw_n;
    const BinRow<acc_t> br = bin_row<acc_t, G>(rows[blk.first_row + e], sh, taps);
    output[(br.k * sh.channels + blk.c0 + ci) * bins + br.ph * pw_n + pw] = scalar_t(0);
  }
}

// A band forward block's list, once the grouping has written it (a block of a kernel launched
// early waits for it here). The discard key's blocks write their bins' zeros here and come
// back, as blocks without bin rows do, with n == 0: nothing more to do.
template <typename scalar_t, typename acc_t, int G>
__device__ __forceinline__ BandBlock listed_band_block(
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ rows, const BandShape& sh,
    const BandPlan& plan, int32_t discard, const BandTap<acc_t>* __restrict__ taps,
    scalar_t* __restrict__ output, int64_t key = -1) {
  plane_band::wait_for_prior_grid();  // the lists and taps
  BandBlock blk = band_block(offsets, sh, plan, key < 0 ? static_cast<int64_t>(blockIdx.x) : key);
  if (blk.n > 0 && static_cast<int32_t>(blockIdx.x) == discard) {
    zero_discarded_bins<scalar_t, acc_t, G>(blk, rows, sh, taps, output);
    blk.n = 0;
  }
  return blk;
}

// Adds the samples of the bin with taps ty, tx to sum, NC channels at a time, the same
// expression, term for term, as the tiled gather kernel. pixels: StagedRows or PlaneRows (the
// same values, from shared or global memory).
template <typename scalar_t, typename acc_t, int G, int NC, typename Pixels>
__device__ __forceinline__ void add_samples(
    const Pixels& pixels, const BandTap<acc_t> (&ty)[G], const BandTap<acc_t> (&tx)[G],
    const BandShape& sh, acc_t (&sum)[NC]) {
  constexpr int32_t kBytes = static_cast<int32_t>(NC * sizeof(scalar_t));  // a pixel's NC values
#pragma unroll
  for (int iy = 0; iy < G; ++iy) {
    if (!ty[iy].valid()) continue;
    const acc_t yl = ty[iy].l, yh = ty[iy].h();
    const auto rlo = pixels.row(ty[iy].lo()), rhi = pixels.row(ty[iy].hi(sh.height));
#pragma unroll
    for (int ix = 0; ix < G; ++ix) {
      if (!tx[ix].valid()) continue;
      const acc_t xl = tx[ix].l, xh = tx[ix].h();
      const int32_t xlo = tx[ix].lo() * kBytes, xhi = tx[ix].hi(sh.width) * kBytes;
      const auto v1 = pixels.at(rlo, xlo), v2 = pixels.at(rlo, xhi);
      const auto v3 = pixels.at(rhi, xlo), v4 = pixels.at(rhi, xhi);
#pragma unroll
      for (int j = 0; j < NC; ++j) {
        sum[j] += (yh * xh) * static_cast<acc_t>(v1.v[j]) + (yh * xl) * static_cast<acc_t>(v2.v[j]) +
            (yl * xh) * static_cast<acc_t>(v3.v[j]) + (yl * xl) * static_cast<acc_t>(v4.v[j]);
      }
    }
  }
}

// NC = 2 or 4: the band holds NC channel planes interleaved (1 / NC of the rows of NC = 1 in
// the same shared memory), so that each bin's list entry, taps and weights, and each
// shared-memory load instruction, serve NC channels. The kernel is bound by load wavefronts
// (taps from L1/L2, shared-memory reads with bank conflicts), not by arithmetic.
template <typename scalar_t, typename acc_t, int G, int NC, int kThreads = kBandThreads>
__global__ void __launch_bounds__(kThreads) roi_align_band_forward_kernel(
    const scalar_t* __restrict__ input, const BandTap<acc_t>* __restrict__ taps,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ rows, BandShape sh,
    BandPlan plan, int32_t discard, scalar_t* __restrict__ output, int early_blocks) {
  extern __shared__ __align__(16) unsigned char smem[];
  scalar_t* band = reinterpret_cast<scalar_t*>(smem);
  const BandBlock place = band_place(sh, plan);
  const BandRows window = plane_band::band_rows(plan, place.bi, sh.height);
  const int64_t plane_size = static_cast<int64_t>(sh.height) * sh.width;
  // the planes of channels c0 + ci .. c0 + ci + NC - 1; past the group's last channel, the last
  // again (staged and computed, not written)
  auto planes_at = [&](int ci) {
    PlaneRows<scalar_t, NC> planes;
    planes.width = sh.width;
#pragma unroll
    for (int j = 0; j < NC; ++j) {
      planes.plane[j] = input + (place.b * sh.channels + place.c0 + min(ci + j, place.nc - 1)) * plane_size;
    }
    return planes;
  };
  const bool early = stages_early(early_blocks, discard);
  if (early) plane_band::stage_rows<scalar_t, NC>(planes_at(0).plane, sh.width, plan, window, band);
  const BandBlock blk = listed_band_block<scalar_t, acc_t, G>(offsets, rows, sh, plan, discard, taps, output);
  if (blk.n == 0) return;
  const int64_t c0 = blk.c0;
  const int n = blk.n, nc = blk.nc;
  const int pw_n = sh.pooled_width;
  const int64_t bins = static_cast<int64_t>(sh.pooled_height) * pw_n;
  constexpr int32_t kBytes = static_cast<int32_t>(NC * sizeof(scalar_t));  // a staged pixel
  const StagedRows<scalar_t, NC> staged_rows{static_cast<uint32_t>(__cvta_generic_to_shared(band)), window.first,
                                             plan.stride * kBytes};
  for (int ci = 0; ci < nc; ci += NC) {
    const int64_t c = c0 + ci;
    const PlaneRows<scalar_t, NC> planes = planes_at(ci);
    if (ci > 0) __syncthreads();  // the previous channels' band is no longer read
    if (ci > 0 || !early) plane_band::stage_rows<scalar_t, NC>(planes.plane, sh.width, plan, window, band);
    __syncthreads();
    for (ListWalk w(pw_n); w.e < n; w.next(pw_n)) {
      const int pw = w.pw;
      const BinRow<acc_t> br = bin_row<acc_t, G>(rows[blk.first_row + w.e], sh, taps);
      BandTap<acc_t> ty[G], tx[G];
      load_bin_taps<acc_t, G>(br, pw, sh, ty, tx);
      // A bin row taller than the overlap reads its pixel rows from global memory (the same
      // values).
      acc_t sum[NC];
#pragma unroll
      for (int j = 0; j < NC; ++j) sum[j] = 0;
      if (rows_in_window<acc_t, G>(ty, sh.height, window)) {
        add_samples<scalar_t, acc_t, G, NC>(staged_rows, ty, tx, sh, sum);
      } else {
        add_samples<scalar_t, acc_t, G, NC>(planes, ty, tx, sh, sum);
      }
      scalar_t* out = output + (br.k * sh.channels + c) * bins + br.ph * pw_n + pw;
#pragma unroll
      for (int j = 0; j < NC; ++j) {
        if (j == 0 || ci + j < nc) out[j * bins] = static_cast<scalar_t>(sum[j] / static_cast<acc_t>(G * G));
      }
    }
  }
}

// Forward from bands of interleaved channel planes in 32-byte staged pixels (eight float32
// channels, or sixteen float16 / bfloat16 ones), without shared-memory bank conflicts. Two
// lanes take a bin, one per 16-byte half of its channels, so the eight lanes of a 16-byte load
// phase read the pixels of four bins. Staged rows are 2 mod 4 pixels long, so pixel x of
// staged row r lies in 32-byte slot (2r + x) mod 4 of its 128-byte line, and the four pixels
// of a sample, (lo, lo), (lo, hi), (hi, lo), (hi, hi), in slots a, a + 1, a + 2, a + 3 (mod 4).
// The bin in place j of its phase reads them in that cyclic order from the one in slot j, so
// at each of the four loads the four bins of a phase read four different slots wherever their
// samples lie: one wavefront per phase. (Bins as in roi_align_band_forward_kernel, where the
// eight lanes of a phase read eight unrelated pixels, about 2.5 wavefronts per phase.) A bin's
// four terms are added in that order, one multiply-add each (16-bit values unpacked to float32
// first), so its rounding differs from the gather kernels'.
constexpr int kSwizzledPixelBytes = 32;
// The most shared memory the swizzled forward gives its block's list, after the band.
constexpr int64_t kSwizzledListBytes = 8192;

// Asks L2 for the band that block `ahead` blocks after this one in launch order stages (its
// rows of each of its channels' planes, a bulk prefetch per plane by the first threads), so
// that the staging of later blocks reads L2 instead of DRAM. Blocks start in about launch
// order, one per SM, so with ahead about a wave of blocks the rows arrive while this block
// computes. Rows are
// rounded inwards to 16 bytes, as the bulk prefetch needs; a hint only, on sm_90 and later.
// The row of blocks a split adds (split_last_group) lies past the last group of channels, so
// nothing is asked for it: its blocks stage the bands the last group's blocks staged before.
// In rows from heavy_from on, the later block's key is the one heavy_first ranks at its place
// in the row, as in the kernel. Called by the block's first warp.
template <typename T>
__device__ __forceinline__ void prefetch_later_band(
    const T* __restrict__ input, const int32_t* __restrict__ offsets, const BandShape& sh,
    const BandPlan& plan, int32_t discard, int ahead, int heavy_from, const KeyList* __restrict__ heavy_first) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (ahead <= 0) return;
  const int64_t later = blockIdx.x + static_cast<int64_t>(blockIdx.y) * gridDim.x + ahead;
  int64_t key = later % gridDim.x;
  const int64_t group = later / gridDim.x;
  if (group >= gridDim.y || key >= discard) return;
  // the later block's key and list length, read by one lane and handed to the warp by a
  // shuffle: read by every lane, they make the compiler put a WARPSYNC.ALL before each item's
  // swap shuffles in the kernel's item loop
  int32_t later_key = static_cast<int32_t>(key), n = 0;
  if (threadIdx.x % 32 == 0) {
    if (group >= heavy_from) {
      const KeyList h = heavy_first[key];
      later_key = h.key;
      n = h.n;
    } else {
      n = offsets[key + 1] - offsets[key];
    }
  }
  key = __shfl_sync(0xffffffffu, later_key, 0);
  n = __shfl_sync(0xffffffffu, n, 0);
  if (static_cast<int>(threadIdx.x) >= sh.channels_per_block || n == 0) return;
  const int64_t c = group * sh.channels_per_block + threadIdx.x;
  if (c >= sh.channels) return;
  const BandRows w = plane_band::band_rows(plan, static_cast<int>(key % plan.bands), sh.height);
  const int64_t image = key / plan.bands;
  const T* first = input + ((image * sh.channels + c) * sh.height + w.first) * sh.width;
  const T* last = first + static_cast<int64_t>(w.last - w.first) * sh.width;
  const uint64_t a = (reinterpret_cast<uint64_t>(first) + 15) & ~uint64_t{15};
  const uint64_t e = reinterpret_cast<uint64_t>(last) & ~uint64_t{15};
  if (e > a) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(static_cast<uint32_t>(e - a)) : "memory");
  }
#endif
}

// Threads of a block of roi_align_band_forward_swizzled_kernel (one block per SM): float32 768,
// up to 80 registers a thread (the fastest of 640 to 1024); 16-bit maps 512, whose lanes at
// sampling ratio 2 hold the sums of a bin's sixteen channels and take 128 registers without
// spilling (at 768 or 1024 threads they spill).
template <typename scalar_t>
struct SwizzledForwardThreads : std::integral_constant<int, sizeof(scalar_t) == 4 ? 768 : 512> {};

// The 16-byte half pixel at a shared address as float: four float32 channels, or eight 16-bit
// ones unpacked from their words (bfloat16 by a shift or a mask, float16 by conversions).
template <typename T>
__device__ __forceinline__ Lanes<float, 16 / sizeof(T)> load_staged_half(uint32_t addr) {
  if constexpr (sizeof(T) == 4) {
    return load_shared_lanes<float, 4>(addr);
  } else {
    uint32_t w[4];
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "r"(addr));
    Lanes<float, 8> out;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        out.v[2 * i] = __uint_as_float(w[i] << 16);
        out.v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
      } else {
        static_assert(std::is_same_v<T, at::Half>, "float16 or bfloat16");
        asm("{.reg .f16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f32.f16 %0, lo;\n\tcvt.f32.f16 %1, hi;}"
            : "=f"(out.v[2 * i]), "=f"(out.v[2 * i + 1])
            : "r"(w[i]));
      }
    }
    return out;
  }
}

// A lane's pixel pairs (x, x + 1) of N planes, loaded from global memory one pair per plane,
// and split into the two staged half pixels: the N values of pixel x + first, then of pixel
// x + 1 - first. float32: 8-byte pairs; 16-bit types: 4-byte pairs, the halves built by byte
// permutes (pixel x in the low 16 bits of each word).
template <typename T, int N>
struct PixelPairs {
  static_assert(sizeof(T) == 2 && N % 2 == 0, "pairs of 16-bit pixels");
  uint32_t w[N];
  __device__ __forceinline__ void load(int j, const T* p) {
    asm volatile("ld.global.u32 %0, [%1];" : "=r"(w[j]) : "l"(p));
  }
  __device__ __forceinline__ void split(int first, Lanes<T, N>& lo, Lanes<T, N>& hi) const {
    const uint32_t low_halves = 0x5410, high_halves = 0x7632;
    const uint32_t sel_lo = first ? high_halves : low_halves, sel_hi = first ? low_halves : high_halves;
    uint32_t a[N / 2], b[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      a[i] = __byte_perm(w[2 * i], w[2 * i + 1], sel_lo);
      b[i] = __byte_perm(w[2 * i], w[2 * i + 1], sel_hi);
    }
    memcpy(&lo, a, sizeof(a));
    memcpy(&hi, b, sizeof(b));
  }
};
template <int N>
struct PixelPairs<float, N> {
  float2 v[N];
  __device__ __forceinline__ void load(int j, const float* p) {
    asm volatile("ld.global.v2.f32 {%0, %1}, [%2];" : "=f"(v[j].x), "=f"(v[j].y) : "l"(p));
  }
  __device__ __forceinline__ void split(int first, Lanes<float, N>& lo, Lanes<float, N>& hi) const {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      lo.v[j] = first ? v[j].y : v[j].x;
      hi.v[j] = first ? v[j].x : v[j].y;
    }
  }
};

// One block per SM: its band takes the SM's shared memory. ahead: see prefetch_later_band
// (0: none). The band starts at the dynamic window, 32-byte aligned, since a load of a pixel's
// other half is at its address ^ 16: static shared variables would come before the window and
// shift it, so the kernel declares none.
template <typename scalar_t, int G, int kThreads>
__global__ void __launch_bounds__(kThreads) roi_align_band_forward_swizzled_kernel(
    const scalar_t* __restrict__ input, const BandTap<float>* __restrict__ taps,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ rows, BandShape sh,
    BandPlan plan, int32_t discard, scalar_t* __restrict__ output, int ahead, int list_cap, int heavy_from,
    const KeyList* __restrict__ heavy_first, int early_blocks) {
  static_assert(sizeof(scalar_t) == 4 || sizeof(scalar_t) == 2, "float32 or 16-bit maps");
  constexpr int kLane = 16 / static_cast<int>(sizeof(scalar_t));  // channels per lane: 16 bytes
  constexpr int kPixel = 2 * kLane;                                 // channels per staged pixel: 32 bytes
  using Half = Lanes<scalar_t, kLane>;
  extern __shared__ __align__(16) unsigned char smem[];
  // Where the grid has a row of blocks more than there are groups of channels (the host's
  // choice: split_last_group), the last group's blocks and that row's take the first and the
  // second half of each key's list, the same channels: the blocks that start last then end
  // sooner.
  const int groups = static_cast<int>((sh.channels + sh.channels_per_block - 1) / sh.channels_per_block);
  const bool split = static_cast<int>(gridDim.y) > groups;
  const bool second_half = static_cast<int>(blockIdx.y) == groups;
  // The block's key: its column, or in the rows from heavy_from on (the last to start, none of
  // them in the first wave), the key with the blockIdx.x-th longest list, so that the longest
  // of them start first: heavy_first[blockIdx.x], with its list, as the grouping ranked them.
  // The discard key's column keeps its place.
  int32_t key = static_cast<int32_t>(blockIdx.x);
  const bool heavy = static_cast<int>(blockIdx.y) >= heavy_from && key < discard;
  KeyList heavy_list{key, 0, 0};
  if (heavy) {
    plane_band::wait_for_prior_grid();  // the ranked keys
    heavy_list = heavy_first[key];
    key = heavy_list.key;
  }
  const BandBlock place_in_grid = band_place_at(sh, plan, key, min(static_cast<int>(blockIdx.y), groups - 1));
  const int64_t b = place_in_grid.b, c0 = place_in_grid.c0;
  const int nc = place_in_grid.nc;
  const BandRows window = plane_band::band_rows(plan, place_in_grid.bi, sh.height);
  const int n_rows = window.last - window.first;
  const int64_t plane_size = static_cast<int64_t>(sh.height) * sh.width;
  const int lane = static_cast<int>(threadIdx.x % 32), half = lane & 1;
  Half* const staged = reinterpret_cast<Half*>(smem);
  // this lane's planes (channels c0 + ci + kLane * half ..); past the group's last channel, the
  // last again (staged and computed, not written)
  const scalar_t* const lane_planes = input + (b * sh.channels + c0) * plane_size;
  // channel c0 + ci + kLane * h + j (h: the half of a staged pixel, this lane's by default)
  auto plane = [&](int ci, int j, int h = -1) {
    return lane_planes + min(ci + kLane * (h < 0 ? half : h) + j, nc - 1) * plane_size;
  };
  // stages channels c0 + ci .. c0 + ci + kPixel - 1, a warp per staged row. Where the planes'
  // pixel pairs are aligned (8 bytes of float32, 4 of 16-bit values; an even width), lane l
  // loads pixels x, x + 1 of the kLane planes of half (l >> 2) & 1, x = 2 ((l & 3) + 4 (l >> 3))
  // + 32 k - s, so that each load reads 32 pixels (128 or 64 bytes) of each of two planes, from
  // a 32-pixel boundary of the first plane's row (s: its offset from the boundary, in pixels).
  // The lane stores its two half pixels (PixelPairs::split), pixel x + ((l >> 1) & 1) first, so
  // that each store's eight lanes of a phase write eight different 16-byte bank groups.
  // Otherwise a lane per half pixel: each load reads 16 pixels of each of two planes, and the
  // warp stores 512 consecutive bytes.
  const bool pairs = sh.width % 2 == 0 && reinterpret_cast<uintptr_t>(input) % (2 * sizeof(scalar_t)) == 0;
  auto stage = [&](int ci) {
    if (pairs) {
      const int pair_half = (lane >> 2) & 1, first = (lane >> 1) & 1;
      const scalar_t* src[kLane];
#pragma unroll
      for (int j = 0; j < kLane; ++j) src[j] = plane(ci, j, pair_half);
      for (int r = static_cast<int>(threadIdx.x / 32); r < n_rows; r += static_cast<int>(blockDim.x / 32)) {
        const int64_t row = static_cast<int64_t>(window.first + r) * sh.width;
        // the row in each plane, as opaque pointers: a load's address is then one wide
        // multiply-add (the compiler would otherwise rebuild each plane's 64-bit offset)
        const scalar_t* src_row[kLane];
#pragma unroll
        for (int j = 0; j < kLane; ++j) {
          src_row[j] = src[j] + row;
          asm("" : "+l"(src_row[j]));
        }
        const int shift = static_cast<int>((reinterpret_cast<uintptr_t>(src_row[0]) / sizeof(scalar_t)) % 32);
        Half* dst = staged + static_cast<int64_t>(r) * plan.stride * 2 + pair_half;
        // two steps of 32 pixels at a time, their loads issued before their stores; a pair
        // before the row's first pixel (or a second step past its end) loads the first pair
        // of its step (the same 128 bytes) and stores nothing
        for (int x = 2 * ((lane & 3) + 4 * (lane >> 3)) - shift; x < sh.width; x += 64) {
          const bool second = x + 32 < sh.width;
          const int at0 = max(x, 0), at1 = second ? x + 32 : at0;
          PixelPairs<scalar_t, kLane> v[2];
#pragma unroll
          for (int j = 0; j < kLane; ++j) {
            v[0].load(j, src_row[j] + at0);
            v[1].load(j, src_row[j] + at1);
          }
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            Half lo, hi;
            v[k].split(first, lo, hi);
            const int xk = x + 32 * k;
            if (k == 0 ? x >= 0 : second) {
              dst[2 * (xk + first)] = lo;
              dst[2 * (xk + 1 - first)] = hi;
            }
          }
        }
      }
      return;
    }
    for (int r = static_cast<int>(threadIdx.x / 32); r < n_rows; r += static_cast<int>(blockDim.x / 32)) {
      const int64_t row = static_cast<int64_t>(window.first + r) * sh.width;
      Half* dst = staged + static_cast<int64_t>(r) * plan.stride * 2 + half;
#pragma unroll 2
      for (int x = lane >> 1; x < sh.width; x += 16) {
        Half v;
#pragma unroll
        for (int j = 0; j < kLane; ++j) v.v[j] = plane(ci, j)[row + x];
        dst[2 * x] = v;
      }
    }
  };
  const bool early = stages_early(early_blocks, discard);
  if (early) stage(0);
  if (second_half && static_cast<int32_t>(blockIdx.x) == discard) return;  // the last group's block zeroes them all
  // (its first row and entries; its channels are place_in_grid's)
  BandBlock blk;
  if (heavy) {
    blk = band_place_at(sh, plan, key, blockIdx.y);
    blk.first_row = heavy_list.first;
    blk.n = heavy_list.n;
  } else {
    blk = listed_band_block<scalar_t, float, G>(offsets, rows, sh, plan, discard, taps, output, key);
  }
  // the block's entries [e0, e1) of the list: where split, the last group's block takes about
  // 5/8 of them and the split row's, which starts about a row of blocks later, the rest. A split
  // at a multiple of 4 entries keeps each item's place in the walk (items of the second part
  // start at its first lane pair), so the bins get the same bits as without the split.
  int e0 = 0, e1 = blk.n;
  if (split && static_cast<int>(blockIdx.y) >= groups - 1) {
    const int mid = static_cast<int>((static_cast<int64_t>(blk.n) * 5 / 8) & ~int64_t{3});
    if (second_half) {
      e0 = mid;
    } else {
      e1 = mid;
    }
  }
  if (e0 >= e1) return;
  const int pw_n = sh.pooled_width;
  const int plane_bins = sh.pooled_height * pw_n;  // at most 64 x 64
  const uint32_t band = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int32_t pitch = plan.stride * kSwizzledPixelBytes;  // bytes per staged row
  const int place = (lane >> 1) & 3;  // the bin's place in its load phase
  const int32_t* const list = rows + blk.first_row;
  // The block's first list_cap list entries in shared memory after the band, so that each item
  // finds its entry in a shared load rather than an L2 round trip ahead of its taps. Each
  // thread's first entry is loaded before the staging and stored after it.
  int32_t* const shared_list = reinterpret_cast<int32_t*>(smem + plan.smem_bytes);
  const int listed_n = min(e1 - e0, list_cap);
  const int32_t own_entry = static_cast<int>(threadIdx.x) < listed_n ? list[e0 + threadIdx.x] : 0;
  for (int ci = 0; ci < nc; ci += kPixel) {
    const int64_t c = c0 + ci;
    if (ci > 0) __syncthreads();  // the previous channels' band is no longer read
    if (ci > 0 || !early) stage(ci);
    if (ci == 0) {
      if (static_cast<int>(threadIdx.x) < listed_n) shared_list[threadIdx.x] = own_entry;
      for (int e = static_cast<int>(threadIdx.x + blockDim.x); e < listed_n; e += static_cast<int>(blockDim.x)) {
        shared_list[e] = list[e0 + e];
      }
    }
    __syncthreads();
    if (ci == 0 && threadIdx.x < 32) prefetch_later_band(input, offsets, sh, plan, discard, ahead, heavy_from, heavy_first);
    // Lane pair (2i, 2i + 1) computes item i of the walk: a bin's kPixel channels. At sampling
    // ratio 2 the pair splits the bin's sample rows instead of its channels: lane h takes sample
    // row h with all kPixel channels, each of its sample's four loads reading the 16-byte half h
    // of its pixel and then the other half (the address ^ 16), and the pair swaps the other
    // half's sums at the end, one shuffle per channel. The swizzle's starting slot, the
    // addresses and the weights of a sample then serve kPixel channels instead of kLane, fewer
    // instructions per sample (16-bit maps' lanes hold sixteen sums, in blocks of 512 threads). A
    // load phase still reads eight different 16-byte bank groups: at load k, lanes h of its four
    // bins read slot place + k of half h, then of half 1 - h. Other ratios: lane h takes the
    // channels of half h and every sample.
    constexpr bool kSplit = G == 2;
    const int32_t taps_per_roi = (sh.pooled_height + pw_n) * G;
    // output element of RoI k, bin (ph, pw) of this lane's first channel: k * per_roi + lane_out
    // + ph * pw_n + pw (the host keeps (channels + kPixel) * bins below 2^31; k * per_roi in 64
    // bits)
    const int32_t per_roi = static_cast<int32_t>(sh.channels) * plane_bins;
    const int32_t lane_out = static_cast<int32_t>(c + kLane * half) * plane_bins;
    const int left = nc - ci - kLane * half;
    // the walk goes on while any lane of the warp has items (a lane pair has as many as its
    // other lane), so that the lane pairs' swaps see every lane of the warp
    ListWalk w(pw_n, static_cast<int>(threadIdx.x >> 1), static_cast<int>(blockDim.x >> 1));
    for (w.e += e0; __any_sync(~0u, w.e < e1); w.next(pw_n)) {
      const bool active = w.e < e1;
      const int pw = w.pw;
      const int32_t listed = !active ? 0 : w.e - e0 < listed_n ? shared_list[w.e - e0] : list[w.e];
      const int32_t k = listed >> plane_band::kRowShift;
      const int ph = listed & ((1 << plane_band::kRowShift) - 1);
      const BandTap<float>* const roi_taps = taps + static_cast<int64_t>(k) * taps_per_roi;
      BandTap<float> ty[G], tx[G];
      load_taps<float, G>(roi_taps + ph * G, ty);
      load_taps<float, G>(roi_taps + (sh.pooled_height + pw) * G, tx);
      float sum[kLane], other[kLane];
#pragma unroll
      for (int j = 0; j < kLane; ++j) sum[j] = other[j] = 0.f;
      if (!active) {
        // past the list (the taps of RoI 0 were read for nothing): only the swap below
      } else if (rows_in_window<float, G>(ty, sh.height, window)) {
#pragma unroll
        for (int r = 0; r < (kSplit ? G / 2 : G); ++r) {
          // this lane's sample row: every lane of the warp takes the same steps
          const BandTap<float> t = kSplit ? (half ? ty[2 * r + 1] : ty[2 * r]) : ty[r];
          if (!t.valid()) continue;
          const int ry = t.lo() - window.first;
          const uint32_t rlo = band + static_cast<uint32_t>(ry * pitch + half * 16);
          const uint32_t rhi = rlo + static_cast<uint32_t>((t.hi(sh.height) - t.lo()) * pitch);
          const float yl = t.l, yh = t.h();
#pragma unroll
          for (int ix = 0; ix < G; ++ix) {
            if (!tx[ix].valid()) continue;
            const int xlo = tx[ix].lo(), xhi = tx[ix].hi(sh.width);
            const float xl = tx[ix].l, xh = tx[ix].h();
            // start o places along the cycle (lo, lo), (lo, hi), (hi, lo), (hi, hi)
            const int o = (place - 2 * ry - xlo) & 3;
            const bool ox = (o & 1) != 0, oy = (o & 2) != 0, oc = ox != oy;
            const uint32_t col0 = static_cast<uint32_t>((ox ? xhi : xlo) * kSwizzledPixelBytes);
            const uint32_t col1 = static_cast<uint32_t>((ox ? xlo : xhi) * kSwizzledPixelBytes);
            const float wx0 = ox ? xl : xh, wx1 = ox ? xh : xl;
            const uint32_t a0 = (oy ? rhi : rlo) + col0, a1 = (oc ? rhi : rlo) + col1;
            const uint32_t a2 = (oy ? rlo : rhi) + col0, a3 = (oc ? rlo : rhi) + col1;
            const float w0 = (oy ? yl : yh) * wx0, w1 = (oc ? yl : yh) * wx1;
            const float w2 = (oy ? yh : yl) * wx0, w3 = (oc ? yh : yl) * wx1;
            // the sample's four taps of the pixel halves at a0 ^ flip .. a3 ^ flip, added to acc
            auto add_taps = [&](float (&acc)[kLane], uint32_t flip) {
              const auto v0 = load_staged_half<scalar_t>(a0 ^ flip);
              const auto v1 = load_staged_half<scalar_t>(a1 ^ flip);
              const auto v2 = load_staged_half<scalar_t>(a2 ^ flip);
              const auto v3 = load_staged_half<scalar_t>(a3 ^ flip);
#pragma unroll
              for (int j = 0; j < kLane; ++j) {
                acc[j] = fmaf(w0, v0.v[j], acc[j]);
                acc[j] = fmaf(w1, v1.v[j], acc[j]);
                acc[j] = fmaf(w2, v2.v[j], acc[j]);
                acc[j] = fmaf(w3, v3.v[j], acc[j]);
              }
            };
            add_taps(sum, 0u);
            if constexpr (kSplit) add_taps(other, 16u);
          }
        }
      } else {  // a bin row taller than the overlap: its pixels from global memory (lane h: its
                // half's channels, every sample; nothing to swap)
        PlaneRows<scalar_t, kLane> pixels;
        pixels.width = sh.width;
#pragma unroll
        for (int j = 0; j < kLane; ++j) pixels.plane[j] = plane(ci, j);
        add_samples<scalar_t, float, G, kLane>(pixels, ty, tx, sh, sum);
      }
      if constexpr (kSplit) {
#pragma unroll
        for (int j = 0; j < kLane; ++j) sum[j] += __shfl_xor_sync(~0u, other[j], 1);
      }
      if (!active) continue;
      scalar_t* out = output + (static_cast<uint64_t>(static_cast<uint32_t>(k)) * static_cast<uint32_t>(per_roi) +
                                static_cast<uint32_t>(lane_out + ph * pw_n + pw));
      if (left >= kLane) {
#pragma unroll
        for (int j = 0; j < kLane; ++j) out[j * plane_bins] = static_cast<scalar_t>(sum[j] / static_cast<float>(G * G));
      } else {
#pragma unroll
        for (int j = 0; j < kLane; ++j) {
          if (j < left) out[j * plane_bins] = static_cast<scalar_t>(sum[j] / static_cast<float>(G * G));
        }
      }
    }
  }
}

template <typename scalar_t, typename acc_t, int G>
__global__ void __launch_bounds__(kBandThreads) roi_align_band_backward_kernel(
    const scalar_t* __restrict__ grad, const BandTap<acc_t>* __restrict__ taps,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ rows, BandShape sh,
    BandPlan plan, acc_t* __restrict__ grad_input) {
  extern __shared__ __align__(16) unsigned char smem[];
  acc_t* band = reinterpret_cast<acc_t*>(smem);
  const BandBlock blk = band_block(offsets, sh, plan);
  const int64_t b = blk.b, c0 = blk.c0;
  const int bi = blk.bi, n = blk.n, nc = blk.nc;
  const BandRows window = plane_band::band_rows(plan, bi, sh.height);
  const int pw_n = sh.pooled_width;
  const int64_t plane_size = static_cast<int64_t>(sh.height) * sh.width;
  const int64_t bins = static_cast<int64_t>(sh.pooled_height) * pw_n;
  const int staged = (window.last - window.first) * plan.stride;
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const StagedRows<acc_t> staged_rows{static_cast<uint32_t>(__cvta_generic_to_shared(band)), window.first,
                                      plan.stride * static_cast<int>(sizeof(acc_t))};
  constexpr uint32_t kBytes = sizeof(acc_t);
  for (int ci = 0; ci < nc; ++ci) {
    const int64_t c = c0 + ci;
    if (ci > 0) __syncthreads();  // the previous channel's band is written out
    for (int i = threadIdx.x; i < staged; i += blockDim.x) band[i] = acc_t(0);
    __syncthreads();
    for (ListWalk w(pw_n); w.e < n; w.next(pw_n)) {
      const int pw = w.pw;
      const BinRow<acc_t> br = bin_row<acc_t, G>(rows[blk.first_row + w.e], sh, taps);
      const acc_t go = static_cast<acc_t>(grad[(br.k * sh.channels + c) * bins + br.ph * pw_n + pw]);
      if (go == acc_t(0)) continue;
      const acc_t gv = go / static_cast<acc_t>(G * G);
      BandTap<acc_t> ty[G], tx[G];
      load_bin_taps<acc_t, G>(br, pw, sh, ty, tx);
#pragma unroll
      for (int iy = 0; iy < G; ++iy) {
        if (!ty[iy].valid()) continue;
        const acc_t yl = ty[iy].l, yh = ty[iy].h();
        const int32_t ylo = ty[iy].lo(), yhi = ty[iy].hi(sh.height);
        // pixel rows past the window are added by band_tail_backward_kernel
        const bool lo_in = ylo < window.last, hi_in = yhi < window.last;
        const uint32_t rlo = staged_rows.row(lo_in ? ylo : window.first);
        const uint32_t rhi = staged_rows.row(hi_in ? yhi : window.first);
#pragma unroll
        for (int ix = 0; ix < G; ++ix) {
          if (!tx[ix].valid()) continue;
          const acc_t xl = tx[ix].l, xh = tx[ix].h();
          const uint32_t xlo = tx[ix].lo() * kBytes, xhi = tx[ix].hi(sh.width) * kBytes;
          if (lo_in) {
            add_shared(rlo + xlo, (yh * xh) * gv);
            add_shared(rlo + xhi, (yh * xl) * gv);
          }
          if (hi_in) {
            add_shared(rhi + xlo, (yl * xh) * gv);
            add_shared(rhi + xhi, (yl * xl) * gv);
          }
        }
      }
    }
    __syncthreads();
    acc_t* out = grad_input + (b * sh.channels + c) * plane_size;
    for (int r = window.first + static_cast<int>(threadIdx.x / 32); r < window.last; r += warps) {
      const acc_t* src = band + (r - window.first) * plan.stride;
      acc_t* dst = out + static_cast<int64_t>(r) * sh.width;
      if (plane_band::shared_row(plan, bi, r)) {
        for (int x = lane; x < sh.width; x += 32) {
          if (src[x] != acc_t(0)) gpuAtomicAdd(dst + x, src[x]);
        }
      } else {
        for (int x = lane; x < sh.width; x += 32) dst[x] = src[x];
      }
    }
  }
}

// Backward into float32 bands of eight interleaved channel planes, the forward's swizzled
// layout, for gradients of float32 or of a 16-bit type (read as float32: the band and the sums
// are float32 in every case): two lanes take a bin, one per half of its eight
// channels, and add its samples' pixels in the cyclic order that puts the four bins of a load
// phase on four different 32-byte slots. A lane's four channels of one pixel are four adds;
// the s-th goes to channel (s + p) mod 4 of its half, p the lane's phase in the warp, so that
// the four phases of a warp hit different banks as well: every warp-wide add touches 32
// different banks and takes one round of the shared-memory add (roi_align_band_backward_kernel's
// adds of unrelated pixels conflict).
// kSliced (bands without overlap, sliced_plan): the block's list holds every bin row whose
// sample rows touch its rows, and it adds only the pixels of its own rows; it then stores every
// row in the gradient's type (grad_input is of scalar_t). Else (the forward's overlapping
// bands): rows two bands stage are added to a float32 grad_input with global atomics, and
// pixels past the window are left to band_tail_backward_kernel.
template <typename scalar_t, int G, bool kSliced = false>
__global__ void __launch_bounds__(kWideBandThreads) roi_align_band_backward_swizzled_kernel(
    const scalar_t* __restrict__ grad, const BandTap<float>* __restrict__ taps,
    const int32_t* __restrict__ offsets, const int32_t* __restrict__ rows, BandShape sh,
    BandPlan plan, std::conditional_t<kSliced, scalar_t, float>* __restrict__ grad_input) {
  constexpr int kLane = 4;           // channels per lane
  constexpr int kPixel = 2 * kLane;  // channels per staged pixel
  extern __shared__ __align__(16) unsigned char smem[];
  const BandBlock blk = band_block(offsets, sh, plan);
  const int64_t b = blk.b, c0 = blk.c0;
  const int bi = blk.bi, n = blk.n, nc = blk.nc;
  const BandRows window = plane_band::band_rows(plan, bi, sh.height);
  const int n_rows = window.last - window.first;
  const int pw_n = sh.pooled_width;
  const int64_t plane_size = static_cast<int64_t>(sh.height) * sh.width;
  const int64_t bins = static_cast<int64_t>(sh.pooled_height) * pw_n;
  const uint32_t band = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int32_t pitch = plan.stride * kSwizzledPixelBytes;
  const int lane = static_cast<int>(threadIdx.x % 32), half = lane & 1;
  const int place = (lane >> 1) & 3, phase = (lane >> 3) & 3;
  const int warps = static_cast<int>(blockDim.x / 32);
  float4* const staged = reinterpret_cast<float4*>(smem);
  const int staged_vectors = n_rows * plan.stride * 2;
  for (int ci = 0; ci < nc; ci += kPixel) {
    if (ci > 0) __syncthreads();  // the previous channels' band is written out
    for (int i = static_cast<int>(threadIdx.x); i < staged_vectors; i += static_cast<int>(blockDim.x)) {
      staged[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    __syncthreads();
    // the lane's s-th add of a pixel goes to its channel (s + phase) mod 4
    int32_t channel_bytes[kLane];
#pragma unroll
    for (int s = 0; s < kLane; ++s) channel_bytes[s] = ((s + phase) & 3) * 4;
    for (ListWalk w(pw_n, static_cast<int>(threadIdx.x >> 1), static_cast<int>(blockDim.x >> 1)); w.e < n;
         w.next(pw_n)) {
      const int pw = w.pw;
      const BinRow<float> br = bin_row<float, G>(rows[blk.first_row + w.e], sh, taps);
      float gv[kLane];
      bool any = false;
#pragma unroll
      for (int s = 0; s < kLane; ++s) {
        const int ch = ci + kLane * half + ((s + phase) & 3);
        // the same expression as roi_align_band_backward_kernel: go / count
        gv[s] = ch < nc ? static_cast<float>(grad[(br.k * sh.channels + c0 + ch) * bins + br.ph * pw_n + pw]) /
                static_cast<float>(G * G)
                        : 0.f;
        any = any || gv[s] != 0.f;
      }
      if (!any) continue;
      BandTap<float> ty[G], tx[G];
      load_bin_taps<float, G>(br, pw, sh, ty, tx);
#pragma unroll
      for (int iy = 0; iy < G; ++iy) {
        if (!ty[iy].valid()) continue;
        const int32_t ylo = ty[iy].lo(), yhi = ty[iy].hi(sh.height);
        // pixel rows past the window: added by band_tail_backward_kernel, or, sliced, by the
        // bands they lie in (a bin row is listed in each), as are those above it
        const bool lo_in = ylo < window.last && (!kSliced || ylo >= window.first);
        const bool hi_in = yhi < window.last && (!kSliced || yhi >= window.first);
        const int ry = ylo - window.first;
        const uint32_t rlo = band + static_cast<uint32_t>(ry * pitch + half * 16);
        const uint32_t rhi = rlo + static_cast<uint32_t>((yhi - ylo) * pitch);
        const float yl = ty[iy].l, yh = ty[iy].h();
#pragma unroll
        for (int ix = 0; ix < G; ++ix) {
          if (!tx[ix].valid()) continue;
          const int xlo = tx[ix].lo(), xhi = tx[ix].hi(sh.width);
          const float xl = tx[ix].l, xh = tx[ix].h();
          const int o = (place - 2 * ry - xlo) & 3;
          const bool ox = (o & 1) != 0, oy = (o & 2) != 0, oc = ox != oy;
          const uint32_t col0 = static_cast<uint32_t>((ox ? xhi : xlo) * kSwizzledPixelBytes);
          const uint32_t col1 = static_cast<uint32_t>((ox ? xlo : xhi) * kSwizzledPixelBytes);
          const float wx0 = ox ? xl : xh, wx1 = ox ? xh : xl;
          // the four pixels in the phase's order: (row is hi, address, weight)
          const bool hi_t[4] = {oy, oc, !oy, !oc};
          const uint32_t addr[4] = {(oy ? rhi : rlo) + col0, (oc ? rhi : rlo) + col1, (oy ? rlo : rhi) + col0,
                                    (oc ? rlo : rhi) + col1};
          const float wt[4] = {(oy ? yl : yh) * wx0, (oc ? yl : yh) * wx1, (oy ? yh : yl) * wx0,
                               (oc ? yh : yl) * wx1};
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            if (!(hi_t[t] ? hi_in : lo_in)) continue;
#pragma unroll
            for (int s = 0; s < kLane; ++s) add_shared(addr[t] + static_cast<uint32_t>(channel_bytes[s]), wt[t] * gv[s]);
          }
        }
      }
    }
    __syncthreads();
    // a warp per staged row, a lane per half pixel: rows two bands stage are added with global
    // atomics, the others stored (sliced: every row, in the gradient's type)
    for (int r = static_cast<int>(threadIdx.x / 32); r < n_rows; r += warps) {
      const int y = window.first + r;
      const bool shared = !kSliced && plane_band::shared_row(plan, bi, y);
      const float4* src = staged + static_cast<int64_t>(r) * plan.stride * 2 + half;
      auto* dst = grad_input + (b * sh.channels + c0 + ci + kLane * half) * plane_size + static_cast<int64_t>(y) * sh.width;
      for (int x = lane >> 1; x < sh.width; x += 16) {
        const float4 v4 = src[2 * x];
        const float v[kLane] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
        for (int j = 0; j < kLane; ++j) {
          if (ci + kLane * half + j >= nc) continue;
          auto* d = dst + j * plane_size + x;
          if constexpr (kSliced) {
            *d = static_cast<scalar_t>(v[j]);
          } else if (shared) {
            if (v[j] != 0.f) gpuAtomicAdd(d, v[j]);
          } else {
            *d = v[j];
          }
        }
      }
    }
  }
}

// After the band kernel: the pixels of tall bin rows that lie past their owner's window,
// with global atomics. One thread per (bin row, channel); most return at once.
template <typename scalar_t, typename acc_t>
__global__ void band_tail_backward_kernel(
    const scalar_t* __restrict__ grad, const BandTap<acc_t>* __restrict__ taps,
    const int32_t* __restrict__ keys, const uint8_t* __restrict__ tall, int64_t num_rois,
    BandShape sh, int g, acc_t count, BandPlan plan, acc_t* __restrict__ grad_input) {
  const int ph_n = sh.pooled_height, pw_n = sh.pooled_width;
  const int64_t total = num_rois * ph_n * sh.channels;
  const int64_t bins = static_cast<int64_t>(ph_n) * pw_n;
  const int64_t plane_size = static_cast<int64_t>(sh.height) * sh.width;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t j = i / sh.channels, c = i - j * sh.channels;
    if (!tall[j]) continue;
    const int64_t k = j / ph_n;
    const int ph = static_cast<int>(j - k * ph_n);
    const int32_t key = keys[j];
    const int64_t b = key / plan.bands;
    const BandRows window = plane_band::band_rows(plan, key % plan.bands, sh.height);
    const BandTap<acc_t>* t = taps + k * (ph_n + pw_n) * g;
    acc_t* plane = grad_input + (b * sh.channels + c) * plane_size;
    for (int pw = 0; pw < pw_n; ++pw) {
      const acc_t go = static_cast<acc_t>(grad[(k * sh.channels + c) * bins + ph * pw_n + pw]);
      if (go == acc_t(0)) continue;
      const acc_t gv = go / count;
      for (int iy = 0; iy < g; ++iy) {
        const BandTap<acc_t> ty = t[ph * g + iy];
        if (!ty.valid()) continue;
        const int32_t yhi = ty.hi(sh.height);
        const bool lo_out = ty.lo() >= window.last, hi_out = yhi >= window.last;
        if (!lo_out && !hi_out) continue;
        const acc_t yl = ty.l, yh = ty.h();
        acc_t* rlo = plane + static_cast<int64_t>(ty.lo()) * sh.width;
        acc_t* rhi = plane + static_cast<int64_t>(yhi) * sh.width;
        for (int ix = 0; ix < g; ++ix) {
          const BandTap<acc_t> tx = t[(ph_n + pw) * g + ix];
          if (!tx.valid()) continue;
          const acc_t xl = tx.l, xh = tx.h();
          if (lo_out) {
            gpuAtomicAdd(rlo + tx.lo(), (yh * xh) * gv);
            gpuAtomicAdd(rlo + tx.hi(sh.width), (yh * xl) * gv);
          }
          if (hi_out) {
            gpuAtomicAdd(rhi + tx.lo(), (yl * xh) * gv);
            gpuAtomicAdd(rhi + tx.hi(sh.width), (yl * xl) * gv);
          }
        }
      }
    }
  }
}

// The launch of one band pass: plan, taps, and the bin rows grouped by owner.
struct BandSetup {
  BandPlan plan;
  BandShape shape;
  // one allocation: the taps, then the index (keys, rows, offsets, counts: int32; the ranked
  // grouping's ranks and chunk counts; the keys heaviest first), then tall
  at::Tensor scratch;
  int64_t taps_bytes = 0;
  int64_t rows_total = 0, num_keys = 0;
  int64_t listed_cap = 0;  // room for list entries: rows_total, or rows_total * bands with spans
  uint8_t* tall = nullptr;
  // in order, with at most kMaxHeavyFirstKeys keys: the keys by their lists' lengths, longest
  // first (plane_band::list_keys_heaviest_first)
  KeyList* heavy_first = nullptr;
  dim3 grid;
  size_t smem = 0;

  template <typename acc_t>
  const BandTap<acc_t>* tap_ptr() const {
    return reinterpret_cast<const BandTap<acc_t>*>(scratch.const_data_ptr<uint8_t>());
  }
  int32_t* index() const { return reinterpret_cast<int32_t*>(scratch.data_ptr<uint8_t>() + taps_bytes); }
  const int32_t* keys() const { return index(); }
  const int32_t* rows() const { return keys() + rows_total; }
  const int32_t* offsets() const { return rows() + listed_cap; }
};

// Channels per block of a band kernel with num_keys bands in all: about four blocks per block
// slot of the GPU, so that a slow block (a band with many bin rows) does not leave the GPU idle
// at the end; a multiple of the channels a block stages at once.
int64_t channels_per_block(int64_t num_keys, int64_t channels, int64_t channel_step) {
  const int64_t slots = 2 * static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  const int64_t groups = std::max<int64_t>(1, std::min<int64_t>({channels, cuda::ceil_div(4 * slots, num_keys), 65535}));
  return cuda::ceil_div(cuda::ceil_div(channels, groups), channel_step) * channel_step;
}

// The band plan for an H x W plane of elem_bytes-sized staged pixels, in kBandBudget.
BandPlan band_plan(int64_t height, int64_t width, int64_t elem_bytes, int64_t budget = kBandBudget) {
  return plane_band::plan_bands(height, width, elem_bytes, plane_band::band_budget(budget, 0));
}

// Rows of 32-byte pixels that a block's shared memory holds for a plane `width` wide, in rows
// of `stride` pixels (2 mod 4), or 0 where fewer than 16 fit.
int64_t swizzled_rows(int64_t width, int64_t& stride) {
  if (width <= 0 || width > (1 << 20)) return 0;
  stride = width + (6 - width % 4) % 4;
  const int64_t fit = plane_band::band_budget(1 << 30, 0) / (stride * kSwizzledPixelBytes);
  return fit < 16 ? 0 : fit;
}

// Bands of `core` + `overlap` rows of 32-byte pixels, rows `stride` pixels apart, for a plane
// `height` rows tall: the fewest whose last window reaches row `height`. With overlap, a band
// whose rows would all lie inside the window before it has no blocks: its bin rows belong to
// that last band (band_taps_kernel), which holds them whole.
BandPlan swizzled_bands(int64_t height, int64_t stride, int64_t core, int64_t overlap) {
  BandPlan p;
  p.stride = static_cast<int>(stride);
  p.core = static_cast<int>(core);
  p.overlap = static_cast<int>(overlap);
  p.bands = static_cast<int>(cuda::ceil_div(std::max<int64_t>(height - overlap, 1), core));
  p.smem_bytes = (core + overlap) * stride * kSwizzledPixelBytes;
  return p;
}

// The band plan of roi_align_band_forward_swizzled_kernel for an H x W plane: 32-byte pixels
// in rows of 2 mod 4 pixels, as many rows as a block's shared memory holds. The overlap holds
// the bin rows of RoIs up to half the map's height wherever they start (their sample rows span
// about H / 2 / pooled_height * (grid - 1) / grid + 2 pixel rows: 10 for 7x7 bins of a
// 200-row map, 6 for 14x14 ones), at most 3/8 of the rows; taller bin rows read global memory.
// Not ok where the bands would hold fewer than 16 rows, or the batch's bands overflow the keys.
BandPlan swizzled_plan(int64_t batch, int64_t height, int64_t width, int64_t pooled_height, int64_t grid) {
  int64_t stride = 0;
  const int64_t fit = height > 0 ? swizzled_rows(width, stride) : 0;
  if (fit == 0) return BandPlan{};
  const int64_t rows = std::min<int64_t>(fit, height);
  const int64_t span = cuda::ceil_div(height * (grid - 1), 2 * pooled_height * grid) + 2;
  const int64_t overlap = rows >= height ? 0 : std::clamp<int64_t>(span - 1, 1, rows * 3 / 8);
  BandPlan p = swizzled_bands(height, stride, rows - overlap, overlap);
  p.ok = batch * p.bands < (int64_t{1} << 30);
  return p;
}

// The band plan of the sliced float32 backward (roi_align_band_backward_swizzled_kernel with
// kSliced) for an H x W plane: the swizzled layout (32-byte pixels in rows of 2 mod 4 pixels),
// bands without overlap of about equal height, as many rows as a block's shared memory holds.
// A bin row is listed in every band its sample rows touch, so the lists take up to
// bin_rows * bands entries. Not ok where the bands would hold fewer than 16 rows, a map has
// more than 255 bands, or the lists would overflow int32.
BandPlan sliced_plan(int64_t batch, int64_t channels, int64_t height, int64_t width, int64_t bin_rows) {
  int64_t stride = 0;
  const int64_t fit = height > 0 ? swizzled_rows(width, stride) : 0;
  if (fit == 0) return BandPlan{};
  // The fewest bands that fit, or up to three more where the blocks then fill the GPU's last
  // wave better: a block's time taken as proportional to its rows, the kernel's to the waves
  // times the rows of a band.
  const int64_t fewest = cuda::ceil_div(height, std::min(fit, height));
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  int64_t bands = fewest;
  double best = 0.0;
  for (int64_t n = fewest; n <= fewest + 3 && n <= height; ++n) {
    const int64_t rows = cuda::ceil_div(height, n);
    const int64_t per_sm = std::max<int64_t>(1, static_cast<int64_t>(props->sharedMemPerMultiprocessor) /
                                                    (rows * stride * kSwizzledPixelBytes + 1024));
    const int64_t blocks = batch * n * cuda::ceil_div(channels, channels_per_block(batch * n, channels, kSwizzledPixelBytes / 4));
    const double cost = static_cast<double>(cuda::ceil_div(blocks, per_sm * props->multiProcessorCount)) * rows;
    if (n == fewest || cost < best) {
      best = cost;
      bands = n;
    }
  }
  BandPlan p = swizzled_bands(height, stride, cuda::ceil_div(height, bands), 0);
  p.ok = p.bands <= 255 && batch * p.bands < (int64_t{1} << 30) && bin_rows * p.bands < (int64_t{1} << 31) - 1;
  return p;
}

// Pixels read by all samples of one channel (four per sample) per pixel of the maps.
double reads_per_pixel(
    int64_t batch, int64_t height, int64_t width, int64_t num_rois, int64_t pooled_height,
    int64_t pooled_width, int64_t sampling_ratio) {
  return static_cast<double>(num_rois) * pooled_height * pooled_width * sampling_ratio * sampling_ratio * 4 /
      (static_cast<double>(batch) * height * width);
}

// The taps and the owners' lists of bin rows (band_taps_kernel, plane_band::group_by_owner),
// from rois [K, 5] of roi_t (contiguous).
// in_order: each owner's list in bin-row order, the same on every call, for kernels whose sums
// follow the list (else in whatever order the grouping's atomics leave it).
// spans: each bin row listed under every band its sample rows touch, not only its owner's (for
// plans without overlap, sliced_plan; in no order).
template <typename acc_t, typename roi_t>
BandSetup setup_bands(
    const at::Tensor& rois, int64_t batch, int64_t channels, int64_t height, int64_t width,
    int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio, bool aligned,
    double spatial_scale, const BandPlan& plan, cudaStream_t stream, int64_t channel_step = 1,
    int check_op = kNoCheck, bool in_order = false, bool spans = false) {
  TORCH_INTERNAL_ASSERT(!spans || (plan.overlap == 0 && plan.bands <= 255 && !in_order));
  BandSetup s;
  s.plan = plan;
  const int64_t num_rois = rois.size(0);
  const int64_t per = (pooled_height + pooled_width) * sampling_ratio;
  s.rows_total = num_rois * pooled_height;
  s.listed_cap = spans ? s.rows_total * s.plan.bands : s.rows_total;
  s.num_keys = batch * s.plan.bands;
  // the taps' size is a multiple of 8 bytes, so the index after them is aligned
  s.taps_bytes = num_rois * per * static_cast<int64_t>(sizeof(BandTap<acc_t>));
  const int64_t items = num_rois * (pooled_height + pooled_width);
  const unsigned taps_blocks = cuda::grid_for(items, kRankThreads);
  // in order, the lists from the taps kernel's ranks where its blocks are the chunks
  // (group_ranked_kernel); else group_by_owner_kernel
  const int64_t chunks = cuda::ceil_div(items, int64_t{kRankThreads});
  const int64_t grouped_keys = s.num_keys + 1;  // the owners and the discard key
  const bool ranked = in_order && !spans && chunks == taps_blocks && grouped_keys <= kRankKeys &&
      chunks * grouped_keys <= kRankEntries && s.rows_total < (int64_t{1} << 31);
  const int64_t rank_ints = ranked ? s.rows_total + chunks * grouped_keys : 0;
  const bool heavy_first = in_order && s.num_keys <= kMaxHeavyFirstKeys;
  const int64_t heavy_ints = heavy_first ? s.num_keys * int64_t{sizeof(KeyList) / 4} : 0;
  // num_keys owners plus the discard key: offsets and counts hold num_keys + 2 entries
  const int64_t index_ints = s.rows_total + s.listed_cap + 2 * (s.num_keys + 2) + rank_ints + heavy_ints;
  s.scratch = at::empty({s.taps_bytes + 4 * index_ints + s.rows_total}, rois.options().dtype(at::kByte));
  int32_t* keys = s.index();
  int32_t* rows = keys + s.rows_total;
  int32_t* offsets = rows + s.listed_cap;
  int32_t* counts = offsets + s.num_keys + 2;
  int32_t* ranks = ranked ? counts + s.num_keys + 2 : nullptr;
  int32_t* chunk_counts = ranked ? ranks + s.rows_total : nullptr;
  s.heavy_first = heavy_first ? reinterpret_cast<KeyList*>(counts + s.num_keys + 2 + rank_ints) : nullptr;
  s.tall = reinterpret_cast<uint8_t*>(keys + index_ints);
  // launched early: its launch does not wait for the kernel before it to end, so it starts as
  // that kernel ends
  plane_band::launch_early(
      band_taps_kernel<acc_t, roi_t>, plane_band::early_launch_supported(), dim3(taps_blocks), kRankThreads, 0, stream,
      num_rois, rois.const_data_ptr<roi_t>(), batch, static_cast<int>(height),
      static_cast<int>(width), static_cast<int>(pooled_height), static_cast<int>(pooled_width),
      static_cast<acc_t>(spatial_scale), static_cast<int>(sampling_ratio), aligned, s.plan,
      reinterpret_cast<BandTap<acc_t>*>(s.scratch.data_ptr<uint8_t>()), keys, s.tall, check_op, spans, ranks,
      chunk_counts, static_cast<int>(grouped_keys));
  if (ranked) {
    // launched early: the block is resident when the taps end, and the band kernel launched
    // early after it starts staging while the taps and the lists are made
    const int64_t static_bytes = 4 * (kRankEntries + plane_band::kGroupWarps);  // first, warp_sums
    const bool in_shared = s.rows_total * 4 <= plane_band::band_budget(kGroupListBytes, static_bytes);
    const int64_t list_smem = in_shared ? s.rows_total * 4 : 0;
    plane_band::allow_smem(group_ranked_kernel, list_smem);
    plane_band::launch_early(
        group_ranked_kernel, plane_band::early_launch_supported(), dim3(1), plane_band::kGroupThreads,
        static_cast<size_t>(list_smem), stream, ranks, chunk_counts, static_cast<int32_t>(s.rows_total),
        static_cast<int>(pooled_height), static_cast<int>(grouped_keys), static_cast<int>(chunks), offsets, rows,
        s.heavy_first, in_shared);
  } else {
    plane_band::group_by_owner<int32_t>(
        keys, s.rows_total, grouped_keys, counts, offsets, rows, static_cast<int>(pooled_height), in_order, stream,
        spans ? s.tall : nullptr, /*mark_ends=*/false, s.heavy_first);
  }
  const int64_t per_block = channels_per_block(s.num_keys, channels, channel_step);
  s.shape = BandShape{channels, static_cast<int>(height), static_cast<int>(width),
                      static_cast<int>(pooled_height), static_cast<int>(pooled_width),
                      static_cast<int>(per_block)};
  s.grid = dim3(static_cast<unsigned>(s.num_keys), static_cast<unsigned>(cuda::ceil_div(channels, per_block)));
  s.smem = static_cast<size_t>(s.plan.smem_bytes);
  return s;
}

// Blocks of a band kernel that an SM holds at once, by their shared memory and threads.
int64_t blocks_per_sm(size_t smem, int threads) {
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  return std::max<int64_t>(1, std::min<int64_t>(
      static_cast<int64_t>(props->sharedMemPerMultiprocessor) / static_cast<int64_t>(smem + 1024),
      props->maxThreadsPerMultiProcessor / threads));
}

// Whether the swizzled band forward's blocks of the last group of channels each take part of
// their key's list (about 5/8), the rest going to a row of blocks added to the grid: where the grid
// holds two waves of blocks or more, so that the blocks that start last end sooner, for the
// price of staging their bands twice (and where the grid has a row to spare).
bool split_last_group(dim3 grid, int64_t wave) {
  return grid.y >= 2 && grid.y < 65535 && static_cast<int64_t>(grid.x) * grid.y >= 2 * wave;
}

// Calls f(std::integral_constant<int, G>) for G = grid in 1..kMaxBandGrid.
template <typename F>
void with_grid(int64_t grid, F&& f) {
  switch (grid) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    default: f(std::integral_constant<int, 4>()); break;
  }
}

}  // namespace

bool roi_align_band_takes(const RoIAlignShape& s, int64_t staged_bytes) {
  if (s.sampling_ratio < 1 || s.sampling_ratio > kMaxBandGrid) return false;
  if (s.num_rois <= 0 || s.channels <= 0 || s.pooled_height > 64 || s.pooled_width > 64) return false;
  if (s.height >= (int64_t{1} << 30) || s.width >= (int64_t{1} << 30)) return false;
  if (s.num_rois * s.pooled_height >= (int64_t{1} << 30)) return false;
  // list entries (k << kRowShift) | ph fit in int32
  if (s.num_rois >= (int64_t{1} << (31 - plane_band::kRowShift))) return false;
  const BandPlan plan = band_plan(s.height, s.width, staged_bytes);
  return plan.ok && s.batch * plan.bands < (int64_t{1} << 30);
}

// The band backward beats the atomic scatter once the samples read about as many pixels as the
// maps hold.
bool roi_align_band_backward_pays(const RoIAlignShape& s) {
  return reads_per_pixel(s.batch, s.height, s.width, s.num_rois, s.pooled_height, s.pooled_width,
                         s.sampling_ratio) >= 1.0;
}

// The band forward beats the tiled gather when the samples read each pixel several times over
// and the maps outgrow L2 (the gather's repeated sectors then come from DRAM), or, for maps
// that take the swizzled kernel (float32 and 16-bit ones), from about 11 MiB of maps on.
bool roi_align_band_forward_pays(const RoIAlignShape& s) {
  const int64_t elem_bytes = static_cast<int64_t>(at::elementSize(s.dtype));
  const double reads = reads_per_pixel(
      s.batch, s.height, s.width, s.num_rois, s.pooled_height, s.pooled_width, s.sampling_ratio);
  const bool swizzled = (elem_bytes == 4 || elem_bytes == 2) &&
      swizzled_plan(s.batch, s.height, s.width, s.pooled_height, s.sampling_ratio).ok;
  const double pixels = static_cast<double>(s.batch) * s.height * s.width;
  return reads >= 4.0 && pixels * s.channels * elem_bytes >= (swizzled ? 10.0 : 48.0) * (1 << 20);
}

// float32 and 16-bit maps whose bands of 32-byte pixels hold 16 rows or more. The kernel finds a
// RoI's outputs by 32-bit products: (channels + 8 or 16) x bins below 2^31, the 8 or 16 (a
// staged pixel's channels) for the lanes past a last, partial group of channels.
bool roi_align_band_forward_swizzled_takes(const RoIAlignShape& s) {
  if (s.dtype != at::kFloat && at::elementSize(s.dtype) != 2) return false;
  const int64_t pixel_channels = kSwizzledPixelBytes / static_cast<int64_t>(at::elementSize(s.dtype));
  return (s.channels + pixel_channels) * s.pooled_height * s.pooled_width < (int64_t{1} << 31) &&
      swizzled_plan(s.batch, s.height, s.width, s.pooled_height, s.sampling_ratio).ok;
}

// Gradients accumulated in float32 (of float32, float16 or bfloat16) whose maps' bands of 32-byte
// pixels hold 16 rows or more.
bool roi_align_band_backward_swizzled_takes(const RoIAlignShape& s) {
  return at::toOpMathType(s.dtype) == at::kFloat &&
      swizzled_plan(s.batch, s.height, s.width, s.pooled_height, s.sampling_ratio).ok;
}

// Swizzled bands without overlap where sliced_plan allows: for 16-bit gradients always (no
// float32 buffer to convert), for float32 ones where two overlapping bands would share at least
// half of each band's rows, which they add with global atomics (with fewer shared rows the
// overlapping bands are faster).
bool roi_align_band_backward_sliced_takes(const RoIAlignShape& s) {
  if (at::toOpMathType(s.dtype) != at::kFloat) return false;
  const BandPlan overlapping = swizzled_plan(s.batch, s.height, s.width, s.pooled_height, s.sampling_ratio);
  const bool shared_half = 4 * overlapping.overlap >= overlapping.core + overlapping.overlap;
  return (s.dtype != at::kFloat || shared_half) &&
      sliced_plan(s.batch, s.channels, s.height, s.width, s.num_rois * s.pooled_height).ok;
}

void roi_align_band_forward(
    RoIAlignForwardKernel which, const at::Tensor& input, const at::Tensor& rois, double spatial_scale,
    int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio, bool aligned, at::Tensor& output) {
  TORCH_INTERNAL_ASSERT(which == RoIAlignForwardKernel::kBandSwizzled || which == RoIAlignForwardKernel::kBand);
  const bool swizzled = which == RoIAlignForwardKernel::kBandSwizzled;
  const int64_t batch = input.size(0), channels = input.size(1);
  const int64_t height = input.size(2), width = input.size(3);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "detops.roi_align", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    // Swizzled: 32-byte staged pixels of eight float32 or sixteen 16-bit channels. Otherwise
    // channels per staged pixel: four (16 bytes of float, 8 of half or bfloat16), two of double;
    // fewer where a band would hold too few rows, so that one list entry, one set of taps and one
    // shared load serve several channels. Float bins as tall as 7x7 ones or taller get bands of
    // twice the shared memory, in blocks of kWideBandThreads (one per SM): in bands of 16-byte
    // pixels more of their bin rows would reach past the window and read global memory.
    constexpr int64_t kPixelChannels = kSwizzledPixelBytes / static_cast<int64_t>(sizeof(scalar_t));
    BandPlan plan = swizzled ? swizzled_plan(batch, height, width, pooled_height, sampling_ratio) : BandPlan{};
    int nc = swizzled ? static_cast<int>(kPixelChannels) : sizeof(scalar_t) == 8 ? 2 : 4;
    bool wide = !swizzled && sizeof(scalar_t) == 4 && pooled_height <= 7;
    if (!swizzled) {
      plan = band_plan(height, width, nc * input.element_size(), wide ? 2 * kBandBudget : kBandBudget);
      while (nc > 1 && (!plan.ok || nc > channels)) {
        nc /= 2;
        wide = false;
        plan = band_plan(height, width, nc * input.element_size());
      }
    }
    TORCH_INTERNAL_ASSERT(!swizzled || (sizeof(scalar_t) <= 4 && plan.ok), "detops.roi_align: no swizzled band plan");
    const BandSetup s = setup_bands<acc_t, scalar_t>(
        rois, batch, channels, height, width, pooled_height, pooled_width, sampling_ratio, aligned,
        spatial_scale, plan, stream, nc,
        kCheckForward,  // the caller leaves the batch-index check to the setup
        /*in_order=*/swizzled);  // the swizzled kernel's sums follow the list order: the same lists, the same bits
    // one more column of blocks: those of the discard key, which write its bins' zeros
    dim3 grid(s.grid.x + 1, s.grid.y);
    // Launched early (plane_band::launch_early): the blocks of the first wave, which start while
    // the grouping runs, stage their first band meanwhile.
    const bool early = plane_band::early_launch_supported();
    const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
    auto launch = [&](auto kernel, int threads, size_t smem, auto... more) {
      plane_band::allow_smem(kernel, static_cast<int64_t>(smem));
      // blocks of one wave
      const int early_blocks = early ? static_cast<int>(blocks_per_sm(smem, threads) * props->multiProcessorCount) : 0;
      plane_band::launch_early(
          kernel, early, grid, threads, smem, stream, input.const_data_ptr<scalar_t>(), s.tap_ptr<acc_t>(),
          s.offsets(), s.rows(), s.shape, s.plan, static_cast<int32_t>(s.num_keys), output.data_ptr<scalar_t>(),
          more..., early_blocks);
    };
    with_grid(sampling_ratio, [&](auto g) {
      constexpr int G = decltype(g)::value;
      if constexpr (sizeof(scalar_t) <= 4) {
        if (swizzled) {
          // Each block asks L2 for the band of the block three quarters of a wave after it
          // where a block's staging takes about as long as its computation: up to about 16
          // samples' pixels per map pixel. With more samples the computation outlasts the
          // staging and the prefetched rows would wait in L2 long enough to be evicted.
          const double reads = reads_per_pixel(
              batch, height, width, rois.size(0), pooled_height, pooled_width, sampling_ratio);
          const int ahead = reads <= 16.0 ? 3 * props->multiProcessorCount / 4 : 0;
          // The shared memory left after the band, as far as the SM still holds as many blocks,
          // holds the start of a block's list; the last group's blocks are split where the grid
          // has two waves or more.
          constexpr int kThreads = SwizzledForwardThreads<scalar_t>::value;
          const int64_t per_sm = blocks_per_sm(s.smem, kThreads);
          const int64_t room = std::min<int64_t>(
              plane_band::band_budget(1 << 30, 0),
              static_cast<int64_t>(props->sharedMemPerMultiprocessor) / per_sm - 1024) - static_cast<int64_t>(s.smem);
          const int64_t list_bytes = std::clamp<int64_t>(room, 0, kSwizzledListBytes) / 16 * 16;
          const bool split = split_last_group(grid, per_sm * props->multiProcessorCount);
          if (split) grid.y += 1;
          const int list_ints = static_cast<int>(list_bytes / 4);
          const size_t smem = s.smem + static_cast<size_t>(list_bytes);
          const int64_t wave = blocks_per_sm(smem, kThreads) * props->multiProcessorCount;
          // Where the last group is split, its row, the split row and the row before them take
          // their keys heaviest first (the last blocks to start then are the lightest), as far
          // as the grouping ranked the keys (at most kMaxHeavyFirstKeys) and none of those rows
          // is in the first wave, whose blocks stage their band before the lists exist.
          int heavy_from = static_cast<int>(grid.y);
          if (split && s.heavy_first != nullptr) {
            const int64_t from = static_cast<int64_t>(grid.y) - 3;
            if (from >= 1 && from * grid.x >= (early ? wave : 0)) heavy_from = static_cast<int>(from);
          }
          launch(roi_align_band_forward_swizzled_kernel<scalar_t, G, kThreads>, kThreads, smem, ahead, list_ints,
                 heavy_from, static_cast<const KeyList*>(s.heavy_first));
          return;
        }
      }
      auto with_nc = [&](auto lanes) {
        constexpr int NC = decltype(lanes)::value;
        if constexpr (NC * sizeof(scalar_t) <= 16) {
          if constexpr (NC == 4 && sizeof(scalar_t) == 4) {
            if (wide) {
              launch(roi_align_band_forward_kernel<scalar_t, acc_t, G, NC, kWideBandThreads>, kWideBandThreads, s.smem);
              return;
            }
          }
          launch(roi_align_band_forward_kernel<scalar_t, acc_t, G, NC>, kBandThreads, s.smem);
        }
      };
      switch (nc) {
        case 4: with_nc(std::integral_constant<int, 4>()); break;
        case 2: with_nc(std::integral_constant<int, 2>()); break;
        default: with_nc(std::integral_constant<int, 1>()); break;
      }
    });
  });
}

at::Tensor roi_align_band_backward(
    RoIAlignBackwardKernel which, const at::Tensor& grad, const at::Tensor& rois, double spatial_scale,
    int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio, bool aligned, int64_t batch,
    int64_t channels, int64_t height, int64_t width) {
  TORCH_INTERNAL_ASSERT(
      which == RoIAlignBackwardKernel::kBandSliced || which == RoIAlignBackwardKernel::kBandSwizzled ||
      which == RoIAlignBackwardKernel::kBand);
  const at::ScalarType acc_type = at::toOpMathType(grad.scalar_type());
  const bool swizzled = which == RoIAlignBackwardKernel::kBandSwizzled;
  TORCH_INTERNAL_ASSERT(which == RoIAlignBackwardKernel::kBand || acc_type == at::kFloat);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor g = grad.contiguous();
  at::Tensor grad_input;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "detops._roi_align_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    // Sliced: swizzled bands without overlap, each storing its own rows in grad's dtype.
    // Otherwise the forward's overlapping bands (swizzled, or one channel at a time) into a
    // buffer of acc_t, whose rows two bands stage are zeroed first and added with global atomics.
    if constexpr (std::is_same_v<acc_t, float>) {
      if (which == RoIAlignBackwardKernel::kBandSliced) {
        const BandPlan splan = sliced_plan(batch, channels, height, width, rois.size(0) * pooled_height);
        TORCH_INTERNAL_ASSERT(splan.ok, "detops._roi_align_backward: no sliced band plan");
        const BandSetup s = setup_bands<acc_t, scalar_t>(
            rois, batch, channels, height, width, pooled_height, pooled_width, sampling_ratio,
            aligned, spatial_scale, splan, stream, kSwizzledPixelBytes / static_cast<int>(sizeof(float)),
            kCheckBackward, /*in_order=*/false, /*spans=*/true);
        // every element stored by its band
        grad_input = cuda::empty_written({batch, channels, height, width}, grad.options());
        with_grid(sampling_ratio, [&](auto gc) {
          constexpr int G = decltype(gc)::value;
          auto kernel = roi_align_band_backward_swizzled_kernel<scalar_t, G, true>;
          plane_band::allow_smem(kernel, static_cast<int64_t>(s.smem));
          kernel<<<s.grid, kWideBandThreads, s.smem, stream>>>(
              g.const_data_ptr<scalar_t>(), s.tap_ptr<acc_t>(), s.offsets(), s.rows(), s.shape, s.plan,
              grad_input.data_ptr<scalar_t>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
        return;
      }
    }
    const BandPlan rplan = swizzled ? swizzled_plan(batch, height, width, pooled_height, sampling_ratio) : BandPlan{};
    TORCH_INTERNAL_ASSERT(!swizzled || rplan.ok, "detops._roi_align_backward: no swizzled band plan");
    at::Tensor acc = at::empty({batch, channels, height, width}, grad.options().dtype(acc_type));
    const BandSetup s = setup_bands<acc_t, scalar_t>(
        rois, batch, channels, height, width, pooled_height, pooled_width, sampling_ratio,
        aligned, spatial_scale, swizzled ? rplan : band_plan(height, width, sizeof(acc_t)), stream,
        swizzled ? kSwizzledPixelBytes / static_cast<int>(sizeof(float)) : 1,
        kCheckBackward);  // as in the forward
    // Rows two bands stage start at zero; every other row is stored by its band.
    plane_band::zero_shared_rows(acc.data_ptr<acc_t>(), batch * channels, height, width, s.plan, stream);
    const acc_t count = static_cast<acc_t>(sampling_ratio * sampling_ratio);
    auto launch = [&](auto kernel, int threads) {
      plane_band::allow_smem(kernel, static_cast<int64_t>(s.smem));
      kernel<<<s.grid, threads, s.smem, stream>>>(
          g.const_data_ptr<scalar_t>(), s.tap_ptr<acc_t>(), s.offsets(), s.rows(), s.shape, s.plan,
          acc.data_ptr<acc_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    with_grid(sampling_ratio, [&](auto gc) {
      constexpr int G = decltype(gc)::value;
      if constexpr (std::is_same_v<acc_t, float>) {
        if (swizzled) {
          launch(roi_align_band_backward_swizzled_kernel<scalar_t, G>, kWideBandThreads);
          return;
        }
      }
      launch(roi_align_band_backward_kernel<scalar_t, acc_t, G>, kBandThreads);
    });
    const int64_t tail_items = rois.size(0) * pooled_height * channels;
    band_tail_backward_kernel<scalar_t, acc_t><<<cuda::grid_for(tail_items, 256), 256, 0, stream>>>(
        g.const_data_ptr<scalar_t>(), s.tap_ptr<acc_t>(), s.keys(), s.tall, rois.size(0), s.shape,
        static_cast<int>(sampling_ratio), count, s.plan, acc.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    grad_input = acc.to(grad.scalar_type());  // acc itself where grad is float32 or float64
  });
  return grad_input;
}

}  // namespace ops
}  // namespace detops
