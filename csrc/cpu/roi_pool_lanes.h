// Eight float32 / int32 lanes for the vector path of the CPU roi_pool forward
// (roi_pool_block.h): Sse2Lanes, two SSE2 registers per vector, for every x86-64 CPU;
// Avx2Lanes, one AVX2 register; and Avx512Lanes, Avx2Lanes whose index steps use AVX-512VL's
// mask registers. The last two are compiled with per-function target attributes, so that a
// generic x86-64 build carries them and picks one at run time (cpu_has_avx2(),
// cpu_has_avx512vl()).
//
// A vector holds one value per channel of a block of 8; load_halves and transpose4 also view
// it as two halves of 4 lanes. All comparisons are ordered: false when a lane holds NaN.
#pragma once

#include <cstdint>

#if defined(__SSE2__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 2)
#define DETOPS_CPU_SSE2 1
#include <emmintrin.h>
#endif

#if defined(DETOPS_CPU_SSE2) && defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define DETOPS_CPU_AVX2 1
#include <immintrin.h>
// Functions that use AVX2 instructions; callers check cpu_has_avx2() first.
#define DETOPS_AVX2_FN __attribute__((target("avx2")))
#define DETOPS_AVX2_INLINE __attribute__((target("avx2"), always_inline)) inline
// Functions that use AVX-512VL instructions on 256-bit vectors; callers check
// cpu_has_avx512vl() first.
#define DETOPS_AVX512_FN __attribute__((target("avx2,avx512f,avx512vl")))
#define DETOPS_AVX512_INLINE __attribute__((target("avx2,avx512f,avx512vl"), always_inline)) inline
#endif

namespace detops {
namespace cpu {

#ifdef DETOPS_CPU_SSE2
struct Sse2Lanes {
  struct F {
    __m128 lo, hi;
  };
  struct I {
    __m128i lo, hi;
  };
  // Channel blocks that step 1 of the argmax reads in one pass with channels inner: 2, as for
  // Avx2Lanes (a vector here is two registers).
  static constexpr int kIndexBlocks = 2;

  static F fill(float v) {
    const __m128 x = _mm_set1_ps(v);
    return {x, x};
  }
  static I fill(int32_t v) {
    const __m128i x = _mm_set1_epi32(v);
    return {x, x};
  }
  static I iota4() {  // 0, 1, 2, 3 in each half
    const __m128i x = _mm_setr_epi32(0, 1, 2, 3);
    return {x, x};
  }
  static I add(I a, I b) {
    return {_mm_add_epi32(a.lo, b.lo), _mm_add_epi32(a.hi, b.hi)};
  }
  static F load(const float* p) {
    return {_mm_loadu_ps(p), _mm_loadu_ps(p + 4)};
  }
  static I load(const int32_t* p) {
    const __m128i* q = reinterpret_cast<const __m128i*>(p);
    return {_mm_loadu_si128(q), _mm_loadu_si128(q + 1)};
  }
  // 4 floats from lo, then 4 from hi
  static F load_halves(const float* lo, const float* hi) {
    return {_mm_loadu_ps(lo), _mm_loadu_ps(hi)};
  }
  static void store(float* p, F v) {
    _mm_storeu_ps(p, v.lo);
    _mm_storeu_ps(p + 4, v.hi);
  }
  static void store(int32_t* p, I v) {
    __m128i* q = reinterpret_cast<__m128i*>(p);
    _mm_storeu_si128(q, v.lo);
    _mm_storeu_si128(q + 1, v.hi);
  }

  // mask ? a : b (SSE2 has no blend instruction)
  static __m128 select(__m128 mask, __m128 a, __m128 b) {
    return _mm_or_ps(_mm_and_ps(mask, a), _mm_andnot_ps(mask, b));
  }
  static __m128i select(__m128i mask, __m128i a, __m128i b) {
    return _mm_or_si128(_mm_and_si128(mask, a), _mm_andnot_si128(mask, b));
  }
  // Where v > m: m = v. MAXPS returns its first operand where it is greater and its second
  // otherwise (NaN in either, or equal values, -0 / +0 included), so m keeps its bits there.
  static void keep_greater(F v, F& m) {
    m = {_mm_max_ps(v.lo, m.lo), _mm_max_ps(v.hi, m.hi)};
  }
  // Bit l set where lane l of v is zero (either sign).
  static int zero_lanes(F v) {
    const __m128 zero = _mm_setzero_ps();
    return _mm_movemask_ps(_mm_cmpeq_ps(v.lo, zero)) |
           _mm_movemask_ps(_mm_cmpeq_ps(v.hi, zero)) << 4;
  }
  // Where v > m: m = v and r = idx. MAXPS takes v exactly where the ordered v > m holds, so m
  // needs no select, and its chain of dependent instructions is one MAXPS per value, as
  // without an index; the comparison only steers r.
  static void keep_greater(F v, I idx, F& m, I& r) {
    const __m128 lo = _mm_cmpgt_ps(v.lo, m.lo), hi = _mm_cmpgt_ps(v.hi, m.hi);
    m = {_mm_max_ps(v.lo, m.lo), _mm_max_ps(v.hi, m.hi)};
    r = {select(_mm_castps_si128(lo), idx.lo, r.lo), select(_mm_castps_si128(hi), idx.hi, r.hi)};
  }
  // Where v > best, or v == best and i < bi: best = v and bi = i.
  static void keep_first_max(F v, I i, F& best, I& bi) {
    const __m128 lo = _mm_or_ps(
        _mm_cmpgt_ps(v.lo, best.lo),
        _mm_and_ps(_mm_cmpeq_ps(v.lo, best.lo), _mm_castsi128_ps(_mm_cmplt_epi32(i.lo, bi.lo))));
    const __m128 hi = _mm_or_ps(
        _mm_cmpgt_ps(v.hi, best.hi),
        _mm_and_ps(_mm_cmpeq_ps(v.hi, best.hi), _mm_castsi128_ps(_mm_cmplt_epi32(i.hi, bi.hi))));
    best = {select(lo, v.lo, best.lo), select(hi, v.hi, best.hi)};
    bi = {select(_mm_castps_si128(lo), i.lo, bi.lo), select(_mm_castps_si128(hi), i.hi, bi.hi)};
  }

  // Transposes the 4 x 4 matrix a, b, c, d (rows) within each half.
  static void transpose4(__m128& a, __m128& b, __m128& c, __m128& d) {
    const __m128 t0 = _mm_unpacklo_ps(a, b), t1 = _mm_unpackhi_ps(a, b);
    const __m128 t2 = _mm_unpacklo_ps(c, d), t3 = _mm_unpackhi_ps(c, d);
    a = _mm_movelh_ps(t0, t2);
    b = _mm_movehl_ps(t2, t0);
    c = _mm_movelh_ps(t1, t3);
    d = _mm_movehl_ps(t3, t1);
  }
  static void transpose4(F& a, F& b, F& c, F& d) {
    transpose4(a.lo, b.lo, c.lo, d.lo);
    transpose4(a.hi, b.hi, c.hi, d.hi);
  }
  static void transpose4(I& a, I& b, I& c, I& d) {
    F fa{_mm_castsi128_ps(a.lo), _mm_castsi128_ps(a.hi)};
    F fb{_mm_castsi128_ps(b.lo), _mm_castsi128_ps(b.hi)};
    F fc{_mm_castsi128_ps(c.lo), _mm_castsi128_ps(c.hi)};
    F fd{_mm_castsi128_ps(d.lo), _mm_castsi128_ps(d.hi)};
    transpose4(fa, fb, fc, fd);
    a = {_mm_castps_si128(fa.lo), _mm_castps_si128(fa.hi)};
    b = {_mm_castps_si128(fb.lo), _mm_castps_si128(fb.hi)};
    c = {_mm_castps_si128(fc.lo), _mm_castps_si128(fc.hi)};
    d = {_mm_castps_si128(fd.lo), _mm_castps_si128(fd.hi)};
  }
};
#endif  // DETOPS_CPU_SSE2

#ifdef DETOPS_CPU_AVX2
inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}

struct Avx2Lanes {
  using F = __m256;
  using I = __m256i;
  // Channel blocks that step 1 of the argmax reads in one pass with channels inner: 2 blocks
  // at two columns keep 8 vectors of maxima and indices, half of AVX2's 16 registers; 4 would
  // keep 16, all of them, and spill the loads and index steps.
  static constexpr int kIndexBlocks = 2;

  DETOPS_AVX2_INLINE static F fill(float v) {
    return _mm256_set1_ps(v);
  }
  DETOPS_AVX2_INLINE static I fill(int32_t v) {
    return _mm256_set1_epi32(v);
  }
  DETOPS_AVX2_INLINE static I iota4() {
    return _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3);
  }
  DETOPS_AVX2_INLINE static I add(I a, I b) {
    return _mm256_add_epi32(a, b);
  }
  DETOPS_AVX2_INLINE static F load(const float* p) {
    return _mm256_loadu_ps(p);
  }
  DETOPS_AVX2_INLINE static I load(const int32_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  DETOPS_AVX2_INLINE static F load_halves(const float* lo, const float* hi) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(lo)), _mm_loadu_ps(hi), 1);
  }
  DETOPS_AVX2_INLINE static void store(float* p, F v) {
    _mm256_storeu_ps(p, v);
  }
  DETOPS_AVX2_INLINE static void store(int32_t* p, I v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
  }
  DETOPS_AVX2_INLINE static I blend(I b, I a, F mask) {  // mask ? a : b
    return _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(b), _mm256_castsi256_ps(a), mask));
  }
  DETOPS_AVX2_INLINE static void keep_greater(F v, F& m) {  // as Sse2Lanes'
    m = _mm256_max_ps(v, m);
  }
  DETOPS_AVX2_INLINE static int zero_lanes(F v) {
    return _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_EQ_OQ));
  }
  DETOPS_AVX2_INLINE static void keep_greater(F v, I idx, F& m, I& r) {  // as Sse2Lanes'
    const F greater = _mm256_cmp_ps(v, m, _CMP_GT_OQ);
    m = _mm256_max_ps(v, m);
    r = blend(r, idx, greater);
  }
  DETOPS_AVX2_INLINE static void keep_first_max(F v, I i, F& best, I& bi) {
    const F take = _mm256_or_ps(
        _mm256_cmp_ps(v, best, _CMP_GT_OQ),
        _mm256_and_ps(
            _mm256_cmp_ps(v, best, _CMP_EQ_OQ), _mm256_castsi256_ps(_mm256_cmpgt_epi32(bi, i))));
    best = _mm256_blendv_ps(best, v, take);
    bi = blend(bi, i, take);
  }
  DETOPS_AVX2_INLINE static void transpose4(F& a, F& b, F& c, F& d) {  // within each half
    const F t0 = _mm256_unpacklo_ps(a, b), t1 = _mm256_unpackhi_ps(a, b);
    const F t2 = _mm256_unpacklo_ps(c, d), t3 = _mm256_unpackhi_ps(c, d);
    a = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    b = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    c = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    d = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  }
  DETOPS_AVX2_INLINE static void transpose4(I& a, I& b, I& c, I& d) {
    F fa = _mm256_castsi256_ps(a), fb = _mm256_castsi256_ps(b);
    F fc = _mm256_castsi256_ps(c), fd = _mm256_castsi256_ps(d);
    transpose4(fa, fb, fc, fd);
    a = _mm256_castps_si256(fa);
    b = _mm256_castps_si256(fb);
    c = _mm256_castps_si256(fc);
    d = _mm256_castps_si256(fd);
  }
};

// AVX-512F and AVX-512VL, with the OS saving their registers (__builtin_cpu_supports checks).
inline bool cpu_has_avx512vl() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  return has;
}

inline bool cpu_is_intel() {
  static const bool is = __builtin_cpu_is("intel");
  return is;
}

// Avx2Lanes whose index-tracking steps compare into a mask register and move the index under
// it, where Avx2Lanes compares into a vector and selects by VBLENDVPS. Same results: the masks
// are the same comparisons. Used for the forward with argmax only.
struct Avx512Lanes : Avx2Lanes {
  using Avx2Lanes::keep_greater;
  // With AVX-512VL the compiler has 32 vector registers for these 256-bit vectors, room for
  // the 16 vectors of 4 blocks, which read whole 64-byte lines of a channels_last map.
  static constexpr int kIndexBlocks = 4;

  DETOPS_AVX512_INLINE static void keep_greater(F v, I idx, F& m, I& r) {  // as Sse2Lanes'
    const __mmask8 greater = _mm256_cmp_ps_mask(v, m, _CMP_GT_OQ);
    m = _mm256_max_ps(v, m);
    r = _mm256_mask_mov_epi32(r, greater, idx);
  }
  DETOPS_AVX512_INLINE static void keep_first_max(F v, I i, F& best, I& bi) {  // as Avx2Lanes'
    const __mmask8 equal = _mm256_cmp_ps_mask(v, best, _CMP_EQ_OQ);
    const __mmask8 take =
        _mm256_cmp_ps_mask(v, best, _CMP_GT_OQ) | _mm256_mask_cmpgt_epi32_mask(equal, bi, i);
    best = _mm256_mask_mov_ps(best, take, v);
    bi = _mm256_mask_mov_epi32(bi, take, i);
  }
};
#endif  // DETOPS_CPU_AVX2

}  // namespace cpu
}  // namespace detops
