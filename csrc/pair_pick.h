// Picking a block of a pair list's edges that lie within the cutoff (the first pass of
// lj/lj_cpu.cc's Lennard-Jones kernel, whose scalar loop picks a block's last edges, fewer
// than four): for each edge e of [e0, e1) (a length that is a multiple of four) that is not
// padding (mask set, receiver and sender in [0, n)) and whose vector d = x[s] - x[r] has
// |d|^2 < rc2, the receiver, sender, d and |d|^2 are written packed at the slot after the
// last one kept. A list whose edges carry no image shift (each rank's list under domain
// decomposition) takes this vector pass on x86-64 CPUs with AVX2 (chosen at run time):
// four edges at a time, each edge's two rows loaded whole and transposed, the kept lanes
// packed with a permutation table. It computes d and |d|^2 = (dx*dx + dy*dy) + dz*dz with
// the same IEEE operations as the scalar pass, without fused multiply-adds, so both keep
// exactly the same pairs and write the same bits.

#ifndef JAXDD_PAIR_PICK_H_
#define JAXDD_PAIR_PICK_H_

#include <cstdint>
#include <cstring>

#include "scan_row.h"

namespace jaxdd {

// Slots past the kept ones that the vector pass may write (it stores whole vectors).
constexpr int64_t kPickSlack = 4;

// Where a block's picked pairs go: receiver, sender, d (three arrays) and |d|^2. Each array
// needs room for the block's edges plus kPickSlack.
template <typename T>
struct Picks {
  int32_t* r;
  int32_t* s;
  T* d0;
  T* d1;
  T* d2;
  T* r2;
};

#ifdef JAXDD_SCAN_AVX2

// For each 4-bit mask, the 32-bit lane pairs (2l, 2l + 1) of its set lanes l first: packs
// 64-bit lanes with a 32-bit permutation.
struct PackTable64 {
  alignas(32) int32_t lanes[16][8];
  PackTable64() {
    for (int bits = 0; bits < 16; ++bits) {
      int n = 0;
      for (int l = 0; l < 4; ++l)
        if (bits & (1 << l)) lanes[bits][2 * n] = 2 * l, lanes[bits][2 * n + 1] = 2 * l + 1, ++n;
      for (; n < 4; ++n) lanes[bits][2 * n] = lanes[bits][2 * n + 1] = 0;
    }
  }
};

inline const PackTable64& Packing64() {
  static const PackTable64 table;
  return table;
}

// Lanes of four edges that are not padding: mask set, receiver and sender in [0, n).
__attribute__((target("avx2"))) inline int LiveEdges(const int32_t* rcv, const int32_t* snd, const bool* m,
                                                     int64_t e, __m128i vn, __m128i* r, __m128i* s) {
  *r = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rcv + e));
  *s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(snd + e));
  int32_t bytes;
  std::memcpy(&bytes, m + e, 4);
  const __m128i set = _mm_cmpgt_epi32(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(bytes)), _mm_setzero_si128());
  const __m128i minus1 = _mm_set1_epi32(-1);
  const __m128i in_r = _mm_and_si128(_mm_cmpgt_epi32(*r, minus1), _mm_cmpgt_epi32(vn, *r));
  const __m128i in_s = _mm_and_si128(_mm_cmpgt_epi32(*s, minus1), _mm_cmpgt_epi32(vn, *s));
  const __m128i ok = _mm_and_si128(set, _mm_and_si128(in_r, in_s));
  // Padding lanes read row 0 (there is one when any lane is live) and are dropped.
  *r = _mm_and_si128(*r, ok), *s = _mm_and_si128(*s, ok);
  return _mm_movemask_ps(_mm_castsi128_ps(ok));
}

// Packs the kept lanes (bits) of the four edges' receivers and senders at p.r + k, p.s + k.
__attribute__((target("avx2"))) inline void PackIndices(__m128i r, __m128i s, int bits, int32_t* pr, int32_t* ps) {
  const __m256i lanes = _mm256_load_si256(reinterpret_cast<const __m256i*>(Packing().lanes[bits]));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(pr),
                   _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(_mm256_castsi128_si256(r), lanes)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(ps),
                   _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(_mm256_castsi128_si256(s), lanes)));
}

// The kept lanes of v (by a permutation from Packing64 or Packing) stored packed at dst.
__attribute__((target("avx2"))) inline void PackValues(__m256d v, __m256i lanes, double* dst) {
  _mm256_storeu_pd(dst, _mm256_castps_pd(_mm256_permutevar8x32_ps(_mm256_castpd_ps(v), lanes)));
}

__attribute__((target("avx2"))) inline void PackValues(__m128 v, __m256i lanes, float* dst) {
  _mm_storeu_ps(dst, _mm256_castps256_ps128(_mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), lanes)));
}

// The kept lanes (bits; packed by the permutation `lanes`) of four edges stored after the
// `kept` picked so far; the new count.
template <typename V, typename T>
__attribute__((target("avx2"))) inline int64_t StorePicks(int bits, const int32_t* lanes, __m128i r, __m128i s, V dx,
                                                          V dy, V dz, V r2, const Picks<T>& p, int64_t kept) {
  PackIndices(r, s, bits, p.r + kept, p.s + kept);
  const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  PackValues(dx, perm, p.d0 + kept), PackValues(dy, perm, p.d1 + kept), PackValues(dz, perm, p.d2 + kept);
  PackValues(r2, perm, p.r2 + kept);
  return kept + __builtin_popcount(unsigned(bits));
}

__attribute__((target("avx2"))) inline int64_t PickAvx2(const double* x, const int32_t* rcv, const int32_t* snd,
                                                        const bool* m, int64_t n, int64_t e0, int64_t e1, double rc2,
                                                        const Picks<double>& p) {
  const __m256d vrc2 = _mm256_set1_pd(rc2);
  const __m128i vn = _mm_set1_epi32(int32_t(n));
  const __m256i xyz = _mm256_setr_epi64x(-1, -1, -1, 0);  // a row's three coordinates, not the next row's
  alignas(16) int32_t ri[4], si[4];
  int64_t kept = 0;
  for (int64_t e = e0; e < e1; e += 4) {
    __m128i r, s;
    const int live = LiveEdges(rcv, snd, m, e, vn, &r, &s);
    if (live == 0) continue;  // a padding run: skipped four at a time
    _mm_store_si128(reinterpret_cast<__m128i*>(ri), r);
    _mm_store_si128(reinterpret_cast<__m128i*>(si), s);
    __m256d d[4];
    for (int l = 0; l < 4; ++l)
      d[l] = _mm256_sub_pd(_mm256_maskload_pd(x + 3 * int64_t(si[l]), xyz),
                           _mm256_maskload_pd(x + 3 * int64_t(ri[l]), xyz));
    // Rows (dx, dy, dz, 0) of the four edges to columns dx, dy, dz.
    const __m256d lo01 = _mm256_unpacklo_pd(d[0], d[1]), hi01 = _mm256_unpackhi_pd(d[0], d[1]);
    const __m256d lo23 = _mm256_unpacklo_pd(d[2], d[3]), hi23 = _mm256_unpackhi_pd(d[2], d[3]);
    const __m256d dx = _mm256_permute2f128_pd(lo01, lo23, 0x20), dz = _mm256_permute2f128_pd(lo01, lo23, 0x31);
    const __m256d dy = _mm256_permute2f128_pd(hi01, hi23, 0x20);
    const __m256d r2 = _mm256_add_pd(_mm256_add_pd(_mm256_mul_pd(dx, dx), _mm256_mul_pd(dy, dy)), _mm256_mul_pd(dz, dz));
    const int bits = _mm256_movemask_pd(_mm256_cmp_pd(r2, vrc2, _CMP_LT_OQ)) & live;
    if (bits == 0) continue;
    kept = StorePicks(bits, Packing64().lanes[bits], r, s, dx, dy, dz, r2, p, kept);
  }
  return kept;
}

__attribute__((target("avx2"))) inline int64_t PickAvx2(const float* x, const int32_t* rcv, const int32_t* snd,
                                                        const bool* m, int64_t n, int64_t e0, int64_t e1, float rc2,
                                                        const Picks<float>& p) {
  const __m128 vrc2 = _mm_set1_ps(rc2);
  const __m128i vn = _mm_set1_epi32(int32_t(n));
  const __m128i xyz = _mm_setr_epi32(-1, -1, -1, 0);
  alignas(16) int32_t ri[4], si[4];
  int64_t kept = 0;
  for (int64_t e = e0; e < e1; e += 4) {
    __m128i r, s;
    const int live = LiveEdges(rcv, snd, m, e, vn, &r, &s);
    if (live == 0) continue;
    _mm_store_si128(reinterpret_cast<__m128i*>(ri), r);
    _mm_store_si128(reinterpret_cast<__m128i*>(si), s);
    __m128 d0 = _mm_sub_ps(_mm_maskload_ps(x + 3 * int64_t(si[0]), xyz), _mm_maskload_ps(x + 3 * int64_t(ri[0]), xyz));
    __m128 d1 = _mm_sub_ps(_mm_maskload_ps(x + 3 * int64_t(si[1]), xyz), _mm_maskload_ps(x + 3 * int64_t(ri[1]), xyz));
    __m128 d2 = _mm_sub_ps(_mm_maskload_ps(x + 3 * int64_t(si[2]), xyz), _mm_maskload_ps(x + 3 * int64_t(ri[2]), xyz));
    __m128 d3 = _mm_sub_ps(_mm_maskload_ps(x + 3 * int64_t(si[3]), xyz), _mm_maskload_ps(x + 3 * int64_t(ri[3]), xyz));
    _MM_TRANSPOSE4_PS(d0, d1, d2, d3);  // rows (dx, dy, dz, 0) to columns: d0 = dx, d1 = dy, d2 = dz
    const __m128 r2 = _mm_add_ps(_mm_add_ps(_mm_mul_ps(d0, d0), _mm_mul_ps(d1, d1)), _mm_mul_ps(d2, d2));
    const int bits = _mm_movemask_ps(_mm_cmp_ps(r2, vrc2, _CMP_LT_OQ)) & live;
    if (bits == 0) continue;
    kept = StorePicks(bits, Packing().lanes[bits], r, s, d0, d1, d2, r2, p, kept);
  }
  return kept;
}

#endif  // JAXDD_SCAN_AVX2

// Whether this CPU takes the vector pass.
inline bool PickVectorised() {
#ifdef JAXDD_SCAN_AVX2
  return HasAvx2();
#else
  return false;
#endif
}

}  // namespace jaxdd

#endif  // JAXDD_PAIR_PICK_H_
