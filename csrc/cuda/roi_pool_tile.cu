// RoIPool forward on CUDA through shared-memory tiles with a lane per channel, for dense RoIs.
//
// A bin's maximum is a scan of its pixels in row-major order. Spreading one channel's pixels
// over the lanes of a warp (the kernels of roi_pool.cu) makes every lane walk a different bin
// shape, and the per-lane bookkeeping costs several times the loads. Here the 32 lanes of a
// warp hold 32 channels (64 for 16-bit types, two per lane) of the same bin, so every lane
// runs the same loop: one shared-memory load serves 32 channels, conflict-free. A bin is
// scanned in two passes (scan_staged: row maxima without indices, then the row holding the
// maximum by the sequential rule), whose values and argmax are those of the CPU kernel.
//
// The feature map is cut into tiles of core x core pixels:
//   1. roi_pool_tile_keys_kernel keys each bin (k, ph, pw) by the tile holding its first pixel,
//      image * tiles + tile; empty bins and the bins of RoIs with an invalid batch index get
//      the extra key B * tiles (and such an index fails a device assertion, as
//      roi_checks::check_batch_indices_async would). It also takes, per tile, the bounding
//      window of its bins' pixels (from the tile's corner to the furthest bin end), and counts
//      the bins of each key;
//   2. roi_pool_tile_scatter_kernel lists the bins of each key (in any order), over many
//      blocks (group_by_owner of plane_band.cuh, one block, past kScatterKeys keys);
//   3. roi_pool_tile_forward_kernel: a block per (key, group of channels) stages its tile's
//      window, cut down to the staging capacity, of its channels (pixel-major: a pixel's
//      channels are adjacent, 33 words apart from the next pixel, so that both the staging
//      stores and the scans are conflict-free; asynchronous copies for 4- and 8-byte types on
//      sm_80 and newer, in flight while the block works out its bins' places, sizes and output
//      offsets into shared memory), then scans its bins, a warp taking the next untaken bin
//      whenever it finishes one. A bin reaching past the staged window is read from global
//      memory instead (same scan, same result). The block of the extra key writes the empty
//      bins (0, argmax -1);
//   4. bins_to_channels_kernel moves the outputs into place. A warp's results are one bin's 32
//      channels, which lie bins elements apart in [K, C, PH, PW]: written there, each warp
//      store touches 32 sectors for 128 bytes, and those partial sectors keep L2 busy. So the
//      forward writes [K, bins, C] buffers (a whole 128-byte line per warp store) and this
//      kernel transposes them, a RoI's slab of bins x 64 (or fewer) channels at a time through
//      shared memory, both sides coalesced. It costs a read and a write of the outputs, and
//      memory for a second copy during the call. Bins too many for its blocks (past about 400
//      in float32) are written in place.
// The input is read through its strides: contiguous NCHW is staged a pixel at a time along
// rows, channels_last a pixel's channels at a time, both as whole 32-byte sectors.
// The values alone (_roi_pool_values, an undefined argmax): one pass, tracking no row; its
// maximum is the result, and only a bin whose maximum is zero is read again, up to its first
// zero (for the sign). No index is stored or transposed.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../common/roi_pool_geometry.h"
#include "cuda_helpers.h"
#include "plane_band.cuh"
#include "roi_checks.cuh"
#include "roi_pool_kernels.cuh"

namespace detops {
namespace ops {

namespace {

constexpr int kTileThreads = 1024;
constexpr int kTileWarps = kTileThreads / 32;
constexpr int kPixelWords = 33;  // words per staged pixel: one per lane, plus one of padding
constexpr int kTileList = 512;   // bins whose geometry a block holds at once
constexpr int64_t kTileBudget = 200 * 1024;  // bytes of a staged window: one block per SM
constexpr int64_t kTransposeSmem = 28 * 1024;  // shared memory of a bins_to_channels block:
constexpr int kTransposeThreads = 256;          // eight blocks of 256 threads per SM

// The bits of `from` as a To of the same size.
template <typename To, typename From>
__device__ __forceinline__ To bits_as(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bits_as keeps the size");
  To to;
  memcpy(&to, &from, sizeof(To));
  return to;
}

// Channels per lane: two for 16-bit types (a 32-bit word per lane), one otherwise.
template <typename scalar_t>
constexpr int lane_channels() {
  return sizeof(scalar_t) == 2 ? 2 : 1;
}

// One bin of a block's list, worked out once by the block's list step, so that the warp
// scanning the bin computes no geometry and no 64-bit product (24 bytes read, 32 stored).
struct alignas(16) TileBin {
  int64_t out;      // its outputs' offset k * C * bins + r * o_sr, less the channels' part
  int32_t at;       // word of its first pixel's channel 0 in the staged window; -1: past it
  int32_t idx;      // flat index h0 * width + w0 of its first pixel
  int32_t rows, cols;
  int32_t unused[2];
};

struct TileShape {
  int64_t batch, channels;
  int height, width, pooled_height, pooled_width;
  int64_t s_b, s_c, s_h, s_w;  // input strides
  bool channels_inner;         // stride(1) == 1: stage a pixel's channels together
};

struct TilePlan {
  int core = 0;          // tile side in pixels
  int tiles_y = 0, tiles_x = 0;
  int capacity = 0;      // pixels a staged window holds
  bool ok = false;
};

// Tiles whose side is half the side of the largest square window, so that a window holds a
// tile plus as much again of the bins that start in it.
TilePlan plan_tiles(int64_t height, int64_t width, int64_t word_bytes, int64_t budget) {
  TilePlan p;
  const int64_t capacity = budget / (kPixelWords * word_bytes);
  if (capacity < 64 || height <= 0 || width <= 0) return p;
  p.capacity = static_cast<int>(capacity);
  p.core = std::max(4, static_cast<int>(std::sqrt(static_cast<double>(capacity))) / 2);
  p.tiles_y = static_cast<int>(cuda::ceil_div(height, int64_t{p.core}));
  p.tiles_x = static_cast<int>(cuda::ceil_div(width, int64_t{p.core}));
  p.ok = true;
  return p;
}

// keys[i] for bin i = (k * PH + ph) * PW + pw: its tile, or the extra key for empty bins;
// counts[key] (zeroed beforehand): the bins of each key. reach[2 * key], reach[2 * key + 1]
// (zeroed beforehand): the furthest bin end of the tile's bins, in rows and columns from the
// tile's corner. The bins of one RoI mostly share a tile, so each run of lanes with the same
// key takes its count and maxima first and its first lane updates counts and reach: one
// atomic per bin contends on a few words of L2.
template <typename scalar_t>
__global__ void roi_pool_tile_keys_kernel(
    int64_t total, const scalar_t* __restrict__ rois, at::opmath_type<scalar_t> scale,
    TileShape sh, TilePlan plan, int32_t* __restrict__ keys, int32_t* __restrict__ counts,
    int32_t* __restrict__ reach) {
  const int64_t bins = static_cast<int64_t>(sh.pooled_height) * sh.pooled_width;
  const int32_t tiles = plan.tiles_y * plan.tiles_x;
  const int32_t extra = static_cast<int32_t>(sh.batch * tiles);
  const int lane = static_cast<int>(threadIdx.x % 32);
  // whole warps walk the bins, so that every lane takes part in the warp's votes
  for (int64_t base = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x - lane; base < total;
       base += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t i = base + lane;
    int32_t key = -1, reach_y = 0, reach_x = 0;
    if (i < total) {
      const int64_t k = i / bins, r = i - k * bins;
      if (r == 0) {
        roi_checks::assert_batch_index<RoIPoolCheck>(static_cast<double>(rois[k * 5]), sh.batch);
      }
      const int64_t ph = r / sh.pooled_width, pw = r - ph * sh.pooled_width;
      const auto box = geometry::roi_pool_box_at(rois, k, scale, sh.batch, sh.pooled_height, sh.pooled_width);
      int64_t h0, h1, w0, w1;
      if (geometry::roi_pool_bin(box, ph, pw, sh.height, sh.width, h0, h1, w0, w1)) {
        const int64_t ty = h0 / plan.core, tx = w0 / plan.core;
        key = static_cast<int32_t>((box.batch * plan.tiles_y + ty) * plan.tiles_x + tx);
        reach_y = static_cast<int32_t>(h1 - ty * plan.core);
        reach_x = static_cast<int32_t>(w1 - tx * plan.core);
      }
    }
    const int32_t listed = i < total ? (key >= 0 ? key : extra) : -1;
    if (i < total) keys[i] = listed;
    const plane_band::KeyRun run = plane_band::key_run(listed, lane);
    reach_y = plane_band::run_max(reach_y, run, lane);
    reach_x = plane_band::run_max(reach_x, run, lane);
    if (run.start != lane || listed < 0) continue;
    atomicAdd(&counts[listed], run.end - run.start);
    if (key >= 0) {
      atomicMax(&reach[2 * key], reach_y);
      atomicMax(&reach[2 * key + 1], reach_x);
    }
  }
}

// Lists each key's bins from its count (roi_pool_tile_keys_kernel), over many blocks:
// offsets = the exclusive scan of counts (which each block takes for itself), and bin i in
// rows[offsets[key] ..) at a place that a run of lanes with the same key reserves with one
// atomic on cursor[key] (zeroed beforehand), in no particular order within a key. For at most
// kScatterKeys keys; blocks of plane_band::kGroupThreads threads (block_exclusive_scan's).
constexpr int kScatterKeys = 4096;

__global__ void __launch_bounds__(plane_band::kGroupThreads) roi_pool_tile_scatter_kernel(
    const int32_t* __restrict__ keys, int64_t total, int32_t num_keys, const int32_t* __restrict__ counts,
    int32_t* __restrict__ cursor, int32_t* __restrict__ offsets, int32_t* __restrict__ rows) {
  __shared__ int32_t base[kScatterKeys + 1];
  plane_band::block_exclusive_scan<int32_t>(
      static_cast<int64_t>(num_keys) + 1, [&](int64_t i) { return i < num_keys ? counts[i] : 0; },
      [&](int64_t i, int32_t o) {
        base[i] = o;
        if (blockIdx.x == 0) offsets[i] = o;
      });
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = blockDim.x / 32;
  for (int64_t g = blockIdx.x * warps + threadIdx.x / 32; g * 32 < total; g += gridDim.x * warps) {
    const int64_t i = g * 32 + lane;
    const int32_t key = i < total ? keys[i] : -1;
    const plane_band::KeyRun run = plane_band::key_run(key, lane);
    int32_t at = key >= 0 && run.start == lane ? atomicAdd(&cursor[key], run.end - run.start) : 0;
    at = __shfl_sync(0xffffffffu, at, run.start);
    if (key >= 0) rows[base[key] + at + (lane - run.start)] = static_cast<int32_t>(i);
  }
}

// Folds N consecutive pixels of a row into a lane's running maxima of its V channels: px(j)
// is the lane's word at the row's pixel j, idx the flat index of pixel 0. The first maximum
// wins and NaN never does.
template <int N, int V, typename acc_t, typename Px>
__device__ __forceinline__ void take_pixels(Px px, int32_t idx, acc_t (&best)[V], int32_t (&best_i)[V]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const auto word = px(j);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const acc_t v = static_cast<acc_t>(word.v[e]);
      const bool gt = v > best[e];  // selects, not branches
      best[e] = gt ? v : best[e];
      best_i[e] = gt ? idx + j : best_i[e];
    }
  }
}

// The elementwise maximum of two staged words, NaN ignored (the other operand is returned,
// as by fmax; of two zeros either may be). It decides no index, only whether a row holds a
// value above the lanes' running maxima, for which NaN and the sign of zero do not matter.
// 16-bit words take both channels in one packed instruction, without conversion.
template <typename scalar_t, int V>
__device__ __forceinline__ plane_band::Lanes<scalar_t, V> word_max(
    plane_band::Lanes<scalar_t, V> a, plane_band::Lanes<scalar_t, V> b) {
  using Word = plane_band::Lanes<scalar_t, V>;
  if constexpr (V == 2 && std::is_same_v<scalar_t, at::Half>) {
    return bits_as<Word>(__hmax2(bits_as<__half2>(a), bits_as<__half2>(b)));
  } else if constexpr (V == 2 && std::is_same_v<scalar_t, at::BFloat16>) {
    return bits_as<Word>(__hmax2(bits_as<__nv_bfloat162>(a), bits_as<__nv_bfloat162>(b)));
  } else {
    static_assert(V == 1, "two channels per lane are 16-bit");
    if constexpr (std::is_same_v<scalar_t, float>) {
      a.v[0] = fmaxf(a.v[0], b.v[0]);
    } else {
      a.v[0] = fmax(a.v[0], b.v[0]);
    }
    return a;
  }
}

// The maximum of the lane's words of N >= 1 consecutive pixels (q[j * kPixelWords]), taken
// pairwise, so that the N - 1 maxima do not wait on each other.
template <int N, typename scalar_t, int V>
__device__ __forceinline__ plane_band::Lanes<scalar_t, V> pixels_max(
    const plane_band::Lanes<scalar_t, V>* __restrict__ q) {
  if constexpr (N == 1) {
    return q[0];
  } else {
    constexpr int H = N / 2;
    return word_max<scalar_t, V>(pixels_max<H, scalar_t, V>(q), pixels_max<N - H, scalar_t, V>(q + H * kPixelWords));
  }
}

// m, folded with the lane's words of N consecutive pixels.
template <int N, typename scalar_t, int V>
__device__ __forceinline__ plane_band::Lanes<scalar_t, V> fold_pixels(
    const plane_band::Lanes<scalar_t, V>* __restrict__ q, plane_band::Lanes<scalar_t, V> m) {
  if constexpr (N == 0) {
    return m;
  } else {
    return word_max<scalar_t, V>(m, pixels_max<N, scalar_t, V>(q));
  }
}

// Channel e of the lane's words of N consecutive pixels, in order, into its running maximum
// and index (take_pixels on one channel); i is the flat index of pixel 0.
template <int N, int V, typename acc_t, typename scalar_t>
__device__ __forceinline__ void take_channel(
    const plane_band::Lanes<scalar_t, V>* __restrict__ q, int32_t i, int e, acc_t& best, int32_t& best_i) {
  acc_t b[1] = {best};
  int32_t b_i[1] = {best_i};
  take_pixels<N, 1, acc_t>([&](int j) {
    const plane_band::Lanes<scalar_t, V> w = q[j * kPixelWords];
    return plane_band::Lanes<scalar_t, 1>{{e == 0 ? w.v[0] : w.v[V - 1]}};
  }, i, b, b_i);
  best = b[0];
  best_i = b_i[0];
}

// Calls f(R, kChunked) (std::integral_constant values) for R = i + 1 (rows of exactly R
// pixels) or, where kChunked, R = i (rows of chunks of 8 pixels, then R), i in [0, 8).
template <bool kChunked, typename F>
__device__ __forceinline__ void with_rest(int i, F&& f) {
  using std::integral_constant;
  using C = integral_constant<bool, kChunked>;
  constexpr int d = kChunked ? 0 : 1;
  switch (i) {
    case 0: f(integral_constant<int, 0 + d>{}, C{}); break;
    case 1: f(integral_constant<int, 1 + d>{}, C{}); break;
    case 2: f(integral_constant<int, 2 + d>{}, C{}); break;
    case 3: f(integral_constant<int, 3 + d>{}, C{}); break;
    case 4: f(integral_constant<int, 4 + d>{}, C{}); break;
    case 5: f(integral_constant<int, 5 + d>{}, C{}); break;
    case 6: f(integral_constant<int, 6 + d>{}, C{}); break;
    default: f(integral_constant<int, 7 + d>{}, C{}); break;
  }
}

// Calls f(R, kChunked) for rows of `cols` pixels: rows of exactly R = cols pixels, all
// unrolled, up to 8 (every bin of most pooled sizes), and otherwise 8 * (cols / 8) pixels in
// chunks of 8, then R = cols % 8.
template <typename F>
__device__ __forceinline__ void with_row_shape(int cols, F&& f) {
  if (cols <= 8) {
    with_rest<false>(cols - 1, f);
  } else {
    with_rest<true>(cols % 8, f);
  }
}

// Rows of up to 8 pixels a scan takes a step: two, so that the loop's own instructions, about
// as many as a short row's loads, count once for both. Longer rows go one at a time (two cost
// the 16-bit kernel with argmax more than they save), and so do double ones (two spill
// registers at the kernel's limit of 64).
template <bool kChunked, typename scalar_t>
constexpr int rows_per_step() {
  return kChunked || sizeof(scalar_t) == 8 ? 1 : 2;
}

// m folded with the lane's words of one row of pixels from q: `chunks` chunks of 8 (where
// kChunked), then R.
template <int R, bool kChunked, int V, typename scalar_t>
__device__ __forceinline__ plane_band::Lanes<scalar_t, V> fold_row(
    const plane_band::Lanes<scalar_t, V>* __restrict__ q, int chunks, plane_band::Lanes<scalar_t, V> m) {
  if constexpr (kChunked) {
#pragma unroll 1
    for (int c = 0; c < chunks; ++c, q += 8 * kPixelWords) m = fold_pixels<8, scalar_t, V>(q, m);
  }
  return fold_pixels<R, scalar_t, V>(q, m);
}

// The bin's maximum and its first index in row-major order, from the staged window: `rows`
// rows of 8 * chunks + R pixels (with_row_shape), p the lane's word of the bin's first pixel,
// idx its flat index. Two passes:
//   1. each row folds the lanes' words into their running maxima (word_max: a load and one
//      maximum per pixel, no index), and `top` keeps, per channel, the last row that raised
//      it: the first row holding the bin's maximum;
//   2. that row alone is scanned again by the sequential rule, from the lowest value.
// The result is the sequential scan's: a row raises the running maximum exactly when one of
// its values exceeds every value before it, so the sequential scan's last update lies in row
// `top`, and there it is the first pixel holding the row's maximum, which the second pass
// finds. Its value is read back from that pixel, so zeros keep their sign. No row raises
// anything when every value is NaN or at most the lowest value: index -1, as the scan leaves.
// Every load has a constant offset; rows go rows_per_step at a time.
template <int R, bool kChunked, int V, typename acc_t, typename scalar_t>
__device__ __forceinline__ void scan_staged(
    const plane_band::Lanes<scalar_t, V>* __restrict__ p, int row_words, int rows, int chunks,
    int32_t idx, int width, acc_t (&best)[V], int32_t (&best_i)[V]) {
  using Word = plane_band::Lanes<scalar_t, V>;
  Word run;
  int32_t top[V];
#pragma unroll
  for (int e = 0; e < V; ++e) {
    run.v[e] = static_cast<scalar_t>(best[e]);  // the lowest value (-inf for 16-bit types)
    top[e] = -1;
  }
  const Word* row = p;
  constexpr int kRows = rows_per_step<kChunked, scalar_t>();
#pragma unroll kRows
  for (int h = 0; h < rows; ++h, row += row_words) {
    const Word m = fold_row<R, kChunked, V>(row, chunks, run);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      top[e] = static_cast<acc_t>(m.v[e]) > static_cast<acc_t>(run.v[e]) ? h : top[e];
    }
    run = m;
  }
#pragma unroll
  for (int e = 0; e < V; ++e) {
    if (top[e] < 0) continue;
    const Word* q = p + top[e] * row_words;
    int32_t i = idx + top[e] * width;
    if constexpr (kChunked) {
#pragma unroll 1
      for (int c = 0; c < chunks; ++c, q += 8 * kPixelWords, i += 8) take_channel<8, V>(q, i, e, best[e], best_i[e]);
    }
    take_channel<R, V>(q, i, e, best[e], best_i[e]);
  }
}

template <int V, typename acc_t, typename scalar_t>
__device__ __forceinline__ void scan_staged_bin(
    const plane_band::Lanes<scalar_t, V>* __restrict__ p, int row_words, int rows, int cols, int32_t idx,
    int width, acc_t (&best)[V], int32_t (&best_i)[V]) {
  with_row_shape(cols, [&](auto r, auto chunked) {
    scan_staged<decltype(r)::value, decltype(chunked)::value, V>(p, row_words, rows, cols / 8, idx, width, best,
                                                                  best_i);
  });
}

// The values alone (no argmax): the bin's maximum as the sequential scan gives it, from the
// staged window (rows x cols pixels from p, the lane's word of the first). One pass folds
// every pixel into the lanes' maxima from the lowest value, best[] on entry (word_max: a load
// and one maximum per pixel, NaN ignored). Any maximum other than zero has the scan's bits:
// it is the lowest value when nothing exceeds that, else the largest number, and a nonzero
// number has one encoding only. Of a maximum of zero the scan keeps the first zero in
// row-major order (-0 and +0 never replace each other), so that pixel's value is read back.
// No row or index is tracked; rows go as in scan_staged.
template <int V, typename acc_t, typename scalar_t>
__device__ __forceinline__ void values_staged_bin(
    const plane_band::Lanes<scalar_t, V>* __restrict__ p, int row_words, int rows, int cols, acc_t (&best)[V]) {
  using Word = plane_band::Lanes<scalar_t, V>;
  Word m;
#pragma unroll
  for (int e = 0; e < V; ++e) m.v[e] = static_cast<scalar_t>(best[e]);  // the lowest value
  with_row_shape(cols, [&](auto r, auto chunked) {
    constexpr bool kChunked = decltype(chunked)::value;
    constexpr int kRows = rows_per_step<kChunked, scalar_t>();
    const Word* row = p;
#pragma unroll kRows
    for (int h = 0; h < rows; ++h, row += row_words) m = fold_row<decltype(r)::value, kChunked, V>(row, cols / 8, m);
  });
#pragma unroll
  for (int e = 0; e < V; ++e) {
    best[e] = static_cast<acc_t>(m.v[e]);
    if (best[e] != acc_t(0)) continue;
    for (int h = 0; h < rows; ++h) {  // the first zero: one exists, the maximum is one
      int w = 0;
      while (w < cols && static_cast<acc_t>(p[h * row_words + w * kPixelWords].v[e]) != acc_t(0)) ++w;
      if (w < cols) {
        best[e] = static_cast<acc_t>(p[h * row_words + w * kPixelWords].v[e]);
        break;
      }
    }
  }
}

// Copies one staged word: an asynchronous global-to-shared copy where the word is one element
// of 4 or 8 bytes (sm_80 and newer), else a load and a store. Channels past nc (the last word
// of a group of 16-bit channels) are zero.
template <typename scalar_t>
__device__ __forceinline__ void stage_word(
    plane_band::Lanes<scalar_t, lane_channels<scalar_t>()>* dst, const scalar_t* src, int64_t s_c, int ci, int nc) {
  constexpr int V = lane_channels<scalar_t>();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr bool kAsync = V == 1;
#else
  constexpr bool kAsync = false;
#endif
  if constexpr (kAsync) {
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(addr), "l"(src), "n"(sizeof(scalar_t)));
  } else {
    plane_band::Lanes<scalar_t, V> word;
#pragma unroll
    for (int e = 0; e < V; ++e) word.v[e] = ci + e < nc ? src[e * s_c] : scalar_t(0);
    *dst = word;
  }
}

// Stages channels [0, nc) of the window [y0, y0 + wh) x [x0, x0 + ww) of `image` (the group's
// first channel of one image): word j of window pixel p goes to tile[p * kPixelWords + j].
// Channels-inner input: a warp copies the words of one pixel; otherwise a thread copies the
// words of one pixel, consecutive threads taking consecutive pixels. Either way a warp reads
// whole 32-byte sectors and writes 32 different banks. All threads take part. Asynchronous
// copies may still be in flight on return: stage_wait, then a block barrier, make the window
// visible.
template <typename scalar_t>
__device__ __forceinline__ void stage_window(
    const scalar_t* __restrict__ image, const TileShape& sh, int y0, int x0, int wh, int ww, int words,
    int nc, plane_band::Lanes<scalar_t, lane_channels<scalar_t>()>* __restrict__ tile) {
  constexpr int V = lane_channels<scalar_t>();
  const int npix = wh * ww;
  auto pixel = [&](int p) {
    const int r = p / ww, x = p - r * ww;
    return image + static_cast<int64_t>(y0 + r) * sh.s_h + static_cast<int64_t>(x0 + x) * sh.s_w;
  };
  if (sh.channels_inner) {
    // A warp takes pixels warp, warp + kTileWarps, ...: each one's row and column follow from
    // the last one's, without the division per pixel that would be most of this loop's
    // instructions, issued while the block has nothing else to do.
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int r = warp / ww;
    int x = warp - r * ww;
    const scalar_t* src = image + lane * V * sh.s_c + static_cast<int64_t>(y0 + r) * sh.s_h +
                          static_cast<int64_t>(x0 + x) * sh.s_w;
    const int64_t step = kTileWarps * sh.s_w, wrap = sh.s_h - ww * sh.s_w;  // next pixel; next row
    auto* dst = tile + warp * kPixelWords + lane;
    for (int p = warp; p < npix; p += kTileWarps, dst += kTileWarps * kPixelWords) {
      if (lane < words) stage_word<scalar_t>(dst, src, sh.s_c, lane * V, nc);
      src += step;
      for (x += kTileWarps; x >= ww; x -= ww) src += wrap;
    }
  } else {
    for (int p = threadIdx.x; p < npix; p += blockDim.x) {
      const scalar_t* src = pixel(p);
#pragma unroll 8
      for (int j = 0; j < words; ++j) {
        stage_word<scalar_t>(tile + p * kPixelWords + j, src + j * V * sh.s_c, sh.s_c, j * V, nc);
      }
    }
  }
}

// Waits for this thread's copies of stage_window; the caller synchronizes the block after.
__device__ __forceinline__ void stage_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Output element (k, c, r) (r = ph * PW + pw) goes to k * C * bins + c * o_sc + r * o_sr:
// o_sc = bins, o_sr = 1 for [K, C, PH, PW]; o_sc = 1, o_sr = C for [K, bins, C]. Without
// kArgmax the values alone (argmax unused).
template <typename scalar_t, bool kArgmax>
__global__ void __launch_bounds__(kTileThreads, 1) roi_pool_tile_forward_kernel(
    const scalar_t* __restrict__ input, const scalar_t* __restrict__ rois,
    at::opmath_type<scalar_t> scale, const int32_t* __restrict__ offsets,
    const int32_t* __restrict__ rows, const int32_t* __restrict__ reach, TileShape sh, TilePlan plan,
    int64_t list_offset, scalar_t* __restrict__ output, int32_t* __restrict__ argmax, int64_t o_sc, int64_t o_sr) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int V = lane_channels<scalar_t>();
  using Word = plane_band::Lanes<scalar_t, V>;
  extern __shared__ __align__(16) unsigned char smem[];
  Word* tile = reinterpret_cast<Word*>(smem);
  TileBin* list = reinterpret_cast<TileBin*>(smem + list_offset);
  __shared__ int next_bin;          // the next bin of the list that no warp has taken

  const int64_t key = blockIdx.x;
  const int32_t first = offsets[key];
  const int n = offsets[key + 1] - first;
  if (n == 0) return;
  const int64_t tiles = static_cast<int64_t>(plan.tiles_y) * plan.tiles_x;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * (32 * V);
  const int nc = static_cast<int>(min(sh.channels - c0, static_cast<int64_t>(32 * V)));
  const int ph_n = sh.pooled_height, pw_n = sh.pooled_width;
  const int64_t bins = static_cast<int64_t>(ph_n) * pw_n;
  if (key == sh.batch * tiles) {  // empty bins, and the bins of RoIs with an invalid batch index
    for (int64_t i = threadIdx.x; i < static_cast<int64_t>(n) * nc; i += blockDim.x) {
      const int64_t e = i / nc, ci = i - e * nc;
      const int64_t bin = rows[first + e];
      const int64_t k = bin / bins, r = bin - k * bins;
      const int64_t o = k * sh.channels * bins + (c0 + ci) * o_sc + r * o_sr;
      output[o] = scalar_t(0);
      if constexpr (kArgmax) argmax[o] = -1;
    }
    return;
  }
  const int64_t b = key / tiles;
  const int t = static_cast<int>(key - b * tiles);
  const int y0 = (t / plan.tiles_x) * plan.core, x0 = (t % plan.tiles_x) * plan.core;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const scalar_t* image = input + b * sh.s_b + c0 * sh.s_c;

  // The window [y0, y0 + wh) x [x0, x0 + ww): the bins' bounding box, or, when that is larger
  // than the capacity, at least the tile itself. Its copies are in flight while the block
  // lists its bins.
  int wh = reach[2 * key], ww = reach[2 * key + 1];
  if (wh * ww > plan.capacity) {
    wh = min(wh, max(plan.core, plan.capacity / ww));
    ww = min(ww, plan.capacity / wh);
  }
  stage_window<scalar_t>(image, sh, y0, x0, wh, ww, (nc + V - 1) / V, nc, tile);
  const int32_t bins32 = static_cast<int32_t>(bins);
  for (int round = 0; round < n; round += kTileList) {
    const int m = min(kTileList, n - round);
    if (round > 0) __syncthreads();  // the previous round is done with the list and the counter
    if (threadIdx.x == 0) next_bin = kTileWarps;
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
      const int32_t bin = rows[first + round + i];
      const int32_t k = bin / bins32, r = bin - k * bins32;  // bins of all RoIs < 2^30
      const int32_t ph = r / pw_n, pw = r - ph * pw_n;
      const auto box = geometry::roi_pool_box_at(rois, k, scale, sh.batch, sh.pooled_height, sh.pooled_width);
      int64_t h0, h1, w0, w1;
      geometry::roi_pool_bin(box, int64_t{ph}, int64_t{pw}, sh.height, sh.width, h0, h1, w0, w1);
      // the bin's first pixel lies in the tile, so a bin within the window's extent is staged
      const bool staged = h1 - y0 <= wh && w1 - x0 <= ww;
      const int32_t at = staged ? ((static_cast<int32_t>(h0) - y0) * ww + static_cast<int32_t>(w0) - x0) * kPixelWords
                                : -1;
      list[i] = TileBin{k * sh.channels * bins + r * o_sr, at, static_cast<int32_t>(h0 * sh.width + w0),
                        static_cast<int32_t>(h1 - h0), static_cast<int32_t>(w1 - w0), {0, 0}};
    }
    if (round == 0) stage_wait();
    __syncthreads();  // the list, the counter and (first round) the window are in place

    const int width = sh.width;
    // Bins differ in size: a warp takes the next untaken bin when it is done with one.
    for (int e = warp; e < m; e = __shfl_sync(0xffffffffu, lane == 0 ? atomicAdd(&next_bin, 1) : 0, 0)) {
      const TileBin bin = list[e];
      acc_t best[V];
      int32_t best_i[V];
#pragma unroll
      for (int v = 0; v < V; ++v) {
        best[v] = geometry::roi_pool_lowest<acc_t>();
        best_i[v] = -1;
      }
      if (bin.at >= 0) {
        const Word* p = tile + bin.at + lane;
        if constexpr (kArgmax) {
          scan_staged_bin<V>(p, ww * kPixelWords, bin.rows, bin.cols, bin.idx, width, best, best_i);
        } else {
          values_staged_bin<V>(p, ww * kPixelWords, bin.rows, bin.cols, best);
        }
      } else {  // past the window: the same scan over global memory
        const int h0 = bin.idx / width, w0 = bin.idx - h0 * width;
        for (int h = h0; h < h0 + bin.rows; ++h) {
          const scalar_t* src = image + static_cast<int64_t>(h) * sh.s_h;
          for (int w = w0; w < w0 + bin.cols; ++w) {
            take_pixels<1, V, acc_t>([&](int) {
              Word wd;
#pragma unroll
              for (int v = 0; v < V; ++v) {
                const int ci = lane * V + v;
                wd.v[v] = ci < nc ? src[static_cast<int64_t>(w) * sh.s_w + ci * sh.s_c] : scalar_t(0);
              }
              return wd;
            }, h * width + w, best, best_i);
          }
        }
      }
      const int64_t o = bin.out + (c0 + lane * V) * o_sc;
      if (V > 1 && o_sc == 1 && sh.channels % V == 0 && lane * V + V <= nc) {
        // the lane's channels side by side ([K, bins, C] with C even, so o is even): one store
        // of its word and one of its indices, half the L2 sectors of a store per element
        Word w;
        plane_band::Lanes<int32_t, V> w_i;
#pragma unroll
        for (int v = 0; v < V; ++v) {
          w.v[v] = static_cast<scalar_t>(best[v]);
          w_i.v[v] = best_i[v];
        }
        *reinterpret_cast<Word*>(output + o) = w;
        if constexpr (kArgmax) *reinterpret_cast<plane_band::Lanes<int32_t, V>*>(argmax + o) = w_i;
      } else {
#pragma unroll
        for (int v = 0; v < V; ++v) {
          if (lane * V + v < nc) {
            output[o + v * o_sc] = static_cast<scalar_t>(best[v]);
            if constexpr (kArgmax) argmax[o + v * o_sc] = best_i[v];
          }
        }
      }
    }
  }
}

// Shared memory of bins_to_channels_kernel: bins rows of cc + 1 values, then (with argmax) as
// many int32 indices, 16-byte aligned.
__host__ __device__ inline int64_t transpose_values_bytes(int64_t bins, int64_t cc, int64_t value_bytes) {
  return (bins * (cc + 1) * value_bytes + 15) / 16 * 16;
}
__host__ __device__ inline int64_t transpose_smem(int64_t bins, int64_t cc, int64_t value_bytes, bool with_argmax) {
  return transpose_values_bytes(bins, cc, value_bytes) + (with_argmax ? bins * (cc + 1) * 4 : 0);
}

// Channels per bins_to_channels block: the most of 64, 32, 16, 8 whose slab fits kTransposeSmem
// (with argmax: 64 for 7 x 7 bins, 16 for 14 x 14 in float32), or 0 when even 8 do not (more
// than about 400 bins in float32 with argmax): the forward then writes its outputs in place.
inline int transpose_channels(int64_t bins, int64_t value_bytes, bool with_argmax) {
  for (int cc = 64; cc >= 8; cc /= 2) {
    if (transpose_smem(bins, cc, value_bytes, with_argmax) <= kTransposeSmem) return cc;
  }
  return 0;
}

// Reads a bins x nc slab, row r at in + src + r * channels (nc adjacent elements), into s,
// rows of cc + 1 elements. With vec (channels and nc multiples of a 16-byte vector's elements,
// so that every row starts 16-byte aligned in a buffer of whole vectors): 16-byte loads,
// kUnroll of them in flight per thread before their shared stores, since the staged buffer
// comes from DRAM and one 4-byte load per thread in flight left the transpose of the values
// alone latency-bound; else element by element. All threads take part.
template <typename T>
__device__ __forceinline__ void slab_to_shared(
    const T* __restrict__ in, int64_t src, int64_t channels, int bins, int nc, int cc, bool vec, T* __restrict__ s) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kUnroll = 4;
  if (!vec) {
    for (int i = threadIdx.x; i < bins * nc; i += blockDim.x) {
      const int r = i / nc, c = i - r * nc;
      s[r * (cc + 1) + c] = in[src + static_cast<int64_t>(r) * channels + c];
    }
    return;
  }
  const int per_row = nc / kVec;
  const int nv = bins * per_row;
  for (int base = threadIdx.x; base < nv; base += kUnroll * blockDim.x) {
    uint4 w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * static_cast<int>(blockDim.x);
      if (i < nv) {
        const int r = i / per_row, c = (i - r * per_row) * kVec;
        w[u] = *reinterpret_cast<const uint4*>(in + src + static_cast<int64_t>(r) * channels + c);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * static_cast<int>(blockDim.x);
      if (i < nv) {
        const int r = i / per_row, c = (i - r * per_row) * kVec;
        T e[kVec];
        memcpy(e, &w[u], sizeof(e));
#pragma unroll
        for (int j = 0; j < kVec; ++j) s[r * (cc + 1) + c + j] = e[j];
      }
    }
  }
}

// out[k][c][r] = in[k][r][c], for the values and the argmax: [K, bins, C] -> [K, C, bins]. A
// block per RoI and group of CC channels: it reads the group's bins x CC slab (bins rows of CC
// adjacent channels) into shared memory and writes it out as the CC x bins run it fills, which
// is contiguous in the output. CC + 1 words per staged row: both phases are conflict-free.
// Without kArgmax the values alone, read with slab_to_shared's 16-byte loads where vec_v holds
// (at most 40 registers, six blocks an SM). With kArgmax a value and its index are read together,
// element by element, eight blocks an SM: those two loads per thread in flight already keep
// DRAM busy, and 16-byte loads would slow the 16-bit kernel.
template <typename scalar_t, bool kArgmax>
__global__ void __launch_bounds__(kTransposeThreads, kArgmax ? 8 : 6) bins_to_channels_kernel(
    const scalar_t* __restrict__ in_v, const int32_t* __restrict__ in_a, int64_t num_rois, int bins,
    int64_t channels, int cc, bool vec_v, scalar_t* __restrict__ out_v, int32_t* __restrict__ out_a) {
  extern __shared__ __align__(16) unsigned char smem[];
  scalar_t* sv = reinterpret_cast<scalar_t*>(smem);
  int32_t* sa = reinterpret_cast<int32_t*>(smem + transpose_values_bytes(bins, cc, sizeof(scalar_t)));  // kArgmax
  const int64_t groups = (channels + cc - 1) / cc;
  for (int64_t t = blockIdx.x; t < num_rois * groups; t += gridDim.x) {
    const int64_t k = t / groups;
    const int64_t c0 = (t - k * groups) * cc;
    const int nc = static_cast<int>(min(static_cast<int64_t>(cc), channels - c0));
    const int n = bins * nc;
    const int64_t src = k * bins * channels + c0;
    if constexpr (kArgmax) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int r = i / nc, c = i - r * nc;
        sv[r * (cc + 1) + c] = in_v[src + static_cast<int64_t>(r) * channels + c];
        sa[r * (cc + 1) + c] = in_a[src + static_cast<int64_t>(r) * channels + c];
      }
    } else {
      slab_to_shared(in_v, src, channels, bins, nc, cc, vec_v, sv);
    }
    __syncthreads();
    const int64_t dst = (k * channels + c0) * bins;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int c = i / bins, r = i - c * bins;
      out_v[dst + i] = sv[r * (cc + 1) + c];
      if constexpr (kArgmax) out_a[dst + i] = sa[r * (cc + 1) + c];
    }
    __syncthreads();
  }
}

// Bytes of a staged word: a lane's channels of one pixel.
int64_t word_bytes(int64_t elem_bytes) {
  return elem_bytes == 2 ? 4 : elem_bytes;
}

TilePlan plan_for(int64_t height, int64_t width, int64_t word) {
  const int64_t list_bytes = kTileList * static_cast<int64_t>(sizeof(TileBin));
  return plan_tiles(height, width, word, plane_band::band_budget(kTileBudget, list_bytes + 16));
}

// The tile plan for these shapes, or one with ok == false where the tile kernel cannot take
// them.
TilePlan tile_plan(const RoIPoolShape& s) {
  const TilePlan none;
  if (s.num_rois <= 0 || s.channels <= 0 || s.height <= 0 || s.width <= 0) return none;
  if (s.height * s.width >= (int64_t{1} << 31) || s.num_rois * s.pooled_height * s.pooled_width >= (int64_t{1} << 30)) {
    return none;
  }
  const int64_t elem_bytes = static_cast<int64_t>(at::elementSize(s.dtype));
  const int64_t lanes = 32 * (elem_bytes == 2 ? 2 : 1);
  if (cuda::ceil_div(s.channels, lanes) > 65535) return none;
  const TilePlan plan = plan_for(s.height, s.width, word_bytes(elem_bytes));
  if (!plan.ok || s.batch * plan.tiles_y * plan.tiles_x >= (int64_t{1} << 30)) return none;
  return plan;
}

}  // namespace

bool roi_pool_tile_takes(const RoIPoolShape& s) {
  return tile_plan(s).ok;
}

// The tile kernel beats the rows kernel of roi_pool.cu when the bins are dense on the map and
// there are channels enough to keep at least half of a warp's lanes busy; with fewer, the rows
// kernel, whose lanes split a channel's pixels instead, wastes less.
bool roi_pool_tile_pays(const RoIPoolShape& s) {
  const int64_t lanes = 32 * (at::elementSize(s.dtype) == 2 ? 2 : 1);
  const double bins = static_cast<double>(s.num_rois) * s.pooled_height * s.pooled_width;
  const double pixels = static_cast<double>(s.batch) * s.height * s.width;
  return 2 * s.channels >= lanes && 4.0 * bins >= pixels;
}

void roi_pool_tile_forward(
    const at::Tensor& input, const at::Tensor& rois, double spatial_scale, int64_t pooled_height,
    int64_t pooled_width, at::Tensor& output, at::Tensor& argmax) {
  const int64_t batch = input.size(0), channels = input.size(1);
  const int64_t height = input.size(2), width = input.size(3);
  const TilePlan plan = tile_plan(RoIPoolShape{
      batch, channels, height, width, rois.size(0), pooled_height, pooled_width, input.scalar_type()});
  TORCH_INTERNAL_ASSERT(plan.ok, "detops.roi_pool: no tile plan");
  const int64_t total = rois.size(0) * pooled_height * pooled_width;
  const int64_t num_keys = batch * plan.tiles_y * plan.tiles_x + 1;  // the last: empty bins
  // keys, rows, offsets, then counts, reach and cursor (zeroed)
  const int64_t zeroed = (num_keys + 1) + 2 * num_keys + num_keys;
  at::Tensor index = at::empty({2 * total + (num_keys + 1) + zeroed}, rois.options().dtype(at::kInt));
  int32_t* keys = index.data_ptr<int32_t>();
  int32_t* rows = keys + total;
  int32_t* offsets = rows + total;
  int32_t* counts = offsets + num_keys + 1;
  int32_t* reach = counts + num_keys + 1;
  int32_t* cursor = reach + 2 * num_keys;
  const TileShape shape{batch, channels, static_cast<int>(height), static_cast<int>(width),
                        static_cast<int>(pooled_height), static_cast<int>(pooled_width),
                        input.stride(0), input.stride(1), input.stride(2), input.stride(3),
                        channels > 1 && input.stride(1) == 1};
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "detops.roi_pool", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    constexpr int V = lane_channels<scalar_t>();
    const acc_t scale = static_cast<acc_t>(spatial_scale);
    C10_CUDA_CHECK(cudaMemsetAsync(counts, 0, zeroed * sizeof(int32_t), stream));
    roi_pool_tile_keys_kernel<scalar_t><<<cuda::grid_for(total, 256), 256, 0, stream>>>(
        total, rois.const_data_ptr<scalar_t>(), scale, shape, plan, keys, counts, reach);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (num_keys < kScatterKeys) {
      // many blocks: one block grouping every bin is a long serial step for tens of thousands
      // of bins
      roi_pool_tile_scatter_kernel<<<cuda::grid_for(total, plane_band::kGroupThreads), plane_band::kGroupThreads, 0,
                                     stream>>>(keys, total, static_cast<int32_t>(num_keys), counts, cursor, offsets, rows);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      plane_band::group_by_owner<int32_t>(keys, total, num_keys, counts, offsets, rows, 0, /*in_order=*/false, stream);
    }
    const int64_t list_offset = cuda::round_up(static_cast<int64_t>(plan.capacity) * kPixelWords * word_bytes(input.element_size()), 16);
    const int64_t smem = list_offset + kTileList * static_cast<int64_t>(sizeof(TileBin));
    const bool with_argmax = argmax.defined();  // else the values alone
    auto kernel = with_argmax ? roi_pool_tile_forward_kernel<scalar_t, true>
                              : roi_pool_tile_forward_kernel<scalar_t, false>;
    plane_band::allow_smem(kernel, smem);
    const dim3 grid(static_cast<unsigned>(num_keys), static_cast<unsigned>(cuda::ceil_div(channels, int64_t{32 * V})));
    // Outputs go through [K, bins, C] buffers and bins_to_channels_kernel (see the top of the
    // file) when its blocks' slabs fit in shared memory; straight to [K, C, PH, PW] otherwise.
    const int64_t bins = pooled_height * pooled_width;
    const int cc = transpose_channels(bins, sizeof(scalar_t), with_argmax);
    at::Tensor stage_v, stage_a;
    if (cc > 0) {
      stage_v = at::empty({output.numel()}, output.options());
      if (with_argmax) stage_a = at::empty({argmax.numel()}, argmax.options());
    }
    auto pointer = [](at::Tensor& t) { return t.defined() ? t.data_ptr<int32_t>() : nullptr; };
    kernel<<<grid, kTileThreads, static_cast<size_t>(smem), stream>>>(
        input.const_data_ptr<scalar_t>(), rois.const_data_ptr<scalar_t>(), scale, offsets, rows, reach,
        shape, plan, list_offset, cc > 0 ? stage_v.data_ptr<scalar_t>() : output.data_ptr<scalar_t>(),
        cc > 0 ? pointer(stage_a) : pointer(argmax), cc > 0 ? 1 : bins, cc > 0 ? channels : 1);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (cc > 0) {
      const int64_t blocks = rois.size(0) * cuda::ceil_div(channels, int64_t{cc});
      const auto tsmem = static_cast<size_t>(transpose_smem(bins, cc, sizeof(scalar_t), with_argmax));
      const auto tgrid = static_cast<unsigned>(std::min<int64_t>(blocks, int64_t{1} << 20));
      auto transpose = with_argmax ? bins_to_channels_kernel<scalar_t, true> : bins_to_channels_kernel<scalar_t, false>;
      // 16-byte loads where every row of the staged values starts on a whole vector (cc is a
      // multiple of every vector's elements; the buffer is a fresh allocation)
      const bool vec_v = channels % (16 / static_cast<int64_t>(sizeof(scalar_t))) == 0;
      transpose<<<tgrid, kTransposeThreads, tsmem, stream>>>(
          stage_v.const_data_ptr<scalar_t>(), pointer(stage_a), rois.size(0), static_cast<int>(bins), channels, cc,
          vec_v, output.data_ptr<scalar_t>(), pointer(argmax));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

}  // namespace ops
}  // namespace detops
