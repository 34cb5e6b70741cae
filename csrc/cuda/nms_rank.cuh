// Ranking scores by counting, shared by the NMS CUDA kernel files. The rank of entry i is the
// number of entries ahead of it: a higher key, or the same key and a lower index. That is the
// order of a stable descending sort, computed without one: every rank is independent, so a
// block of kRankWarps warps ranks 32 entries (one per lane) while its warps count over shares
// of all the keys, staged in shared memory. n keys cost n * n comparisons, spread over many
// blocks, where a radix sort of a few thousand keys runs in one block with a pass per digit: up
// to kMaxCountRank keys, counting takes less time.
#pragma once

#include <cstdint>

namespace detops {
namespace ops {
namespace nms_rank {

constexpr int kRankWarps = 8;        // per block
constexpr int kMaxCountRank = 8192;  // keys one block stages (32 KiB)

// A key whose unsigned order is the order of the score: NaN lowest (0), -0.0 equal to +0.0.
// Any other score's key is above 0.
__device__ __forceinline__ uint32_t score_key(float s) {
  if (s != s) return 0;
  if (s == 0.0f) s = 0.0f;
  const uint32_t u = __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// c + 1 where a + b carries out of 32 bits (`add.cc`, `addc`): for unsigned k and m,
// k + ~m carries exactly when k > m, and k + (0 - m) exactly when k >= m (m > 0). ptxas adds
// the carries of two such sums in one instruction: 1.5 instructions a comparison, against three
// for a compare, an add and a select.
__device__ __forceinline__ int add_carry(int c, uint32_t a, uint32_t b) {
  asm("{\n\t.reg .u32 sum;\n\tadd.cc.u32 sum, %1, %2;\n\taddc.u32 %0, %0, 0;\n\t}" : "+r"(c) : "r"(a), "r"(b));
  return c;
}

// Entries ahead of key `mine` among keys [from, to) (multiples of 4): keys above it, or also
// those equal to it (kOrEqual: they all have lower indices). Every lane reads the same keys.
template <bool kOrEqual>
__device__ __forceinline__ int count_ahead(const uint32_t* keys, int from, int to, uint32_t mine) {
  const uint4* k4 = reinterpret_cast<const uint4*>(keys);
  // kOrEqual with mine == 0: k + 0 never carries, but every key is ahead (returned below)
  const uint32_t addend = kOrEqual ? 0u - mine : ~mine;
  int c0 = 0, c1 = 0, c2 = 0, c3 = 0;
#pragma unroll 4
  for (int q = from / 4; q < to / 4; ++q) {
    const uint4 k = k4[q];
    c0 = add_carry(c0, k.x, addend);
    c1 = add_carry(c1, k.y, addend);
    c2 = add_carry(c2, k.z, addend);
    c3 = add_carry(c3, k.w, addend);
  }
  if (kOrEqual && mine == 0) return max(to - from, 0);
  return (c0 + c1) + (c2 + c3);
}

// The rank of entry group * 32 + lane among keys [0, padded) (padded: a multiple of 32, the
// keys past the real ones 0, which are never ahead), valid in warp 0 after the call. Every
// thread of the block calls it once the keys are staged; `partial` is block shared memory.
__device__ __forceinline__ int block_count_rank(
    const uint32_t* keys, int padded, int group, int (&partial)[kRankWarps][32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int i0 = group * 32, i = i0 + lane;
  const uint32_t mine = keys[i];
  // This warp's share [lo, hi) of the keys, in whole groups of 32: before this group a key
  // ahead may be equal, after it it must be higher, and within it the index decides.
  const int groups = padded / 32;
  const int lo = 32 * (groups * warp / kRankWarps), hi = 32 * (groups * (warp + 1) / kRankWarps);
  int ahead = count_ahead<true>(keys, lo, min(hi, i0), mine) + count_ahead<false>(keys, max(lo, i0 + 32), hi, mine);
  if (lo <= i0 && i0 < hi) {
    for (int j = i0; j < i0 + 32; ++j) {
      const uint32_t k = keys[j];
      ahead += k > mine || (k == mine && j < i);
    }
  }
  partial[warp][lane] = ahead;
  __syncthreads();
  int rank = 0;
  if (warp == 0) {
#pragma unroll
    for (int w = 0; w < kRankWarps; ++w) rank += partial[w][lane];
  }
  return rank;
}

}  // namespace nms_rank
}  // namespace ops
}  // namespace detops
