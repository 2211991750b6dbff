// One receiver's passes over its contiguous runs of binned candidates (neighbors_cpu.cc): the
// candidates within the cutoff, not the receiver itself and, for a half list, those whose pair
// this row lists (HalfKeeps), written packed to dst. A scalar loop and, on x86-64 CPUs with AVX2 (chosen
// at run time; the library is built for plain x86-64), the same test 8 (float) or 4 (double)
// candidates at a time, packed with a permutation table; a run's last, partial vector is
// read whole with its lanes past the run masked off, so the candidate arrays need
// kScanSlack readable entries past their end. Both compute the squared distance
// as (dx*dx + dy*dy) + dz*dz without fused multiply-adds, so they keep exactly the same
// candidates, in the same order.

#ifndef JAXDD_SCAN_ROW_H_
#define JAXDD_SCAN_ROW_H_

#include <cstddef>
#include <cstdint>

#include "stencil.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define JAXDD_SCAN_AVX2 1
#endif

namespace jaxdd {

// The slots past the kept ones that a pass may write, and past the candidate arrays' end that
// it may read (the vector pass loads and stores whole vectors).
constexpr size_t kScanSlack = 8;

struct Candidates {
  const int32_t* order;  // atom index of each binned candidate
  const int32_t* sa;     // half lists: key a of each candidate (else unused)
  const int32_t* sb;     // half lists: key b
};

template <typename T, bool Half>
inline size_t ScanRowScalar(const T* sx, const T* sy, const T* sz, const Candidates& c, int64_t first, int64_t last,
                            T xi, T yi, T zi, T rc2, int32_t self, int32_t ai, int32_t bi, int32_t* dst) {
  size_t m = 0;
  for (int64_t k = first; k < last; ++k) {  // branch-free: written, kept by advancing past it
    const int32_t j = c.order[k];
    const T dx = sx[k] - xi, dy = sy[k] - yi, dz = sz[k] - zi;
    dst[m] = j;
    bool keep = (dx * dx + dy * dy + dz * dz < rc2) & (j != self);
    if constexpr (Half) keep &= HalfKeeps(ai, bi, c.sa[k], c.sb[k]);
    m += keep;
  }
  return m;
}

#ifdef JAXDD_SCAN_AVX2

// For each 8-bit mask, the lanes of its set bits first (the rest: don't care).
struct PackTable {
  alignas(32) int32_t lanes[256][8];
  PackTable() {
    for (int bits = 0; bits < 256; ++bits) {
      int n = 0;
      for (int l = 0; l < 8; ++l)
        if (bits & (1 << l)) lanes[bits][n++] = l;
      for (; n < 8; ++n) lanes[bits][n] = 0;
    }
  }
};

inline const PackTable& Packing() {
  static const PackTable table;
  return table;
}

// N (8 or 4) int32 values from p; with 4, the high half is zero (its lanes are never kept).
template <int N>
__attribute__((target("avx2"))) inline __m256i LoadIndices(const int32_t* p) {
  if constexpr (N == 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The candidates [k, k + N): their atom indices (*j) and a lane mask of those that are not
// the receiver and, for a half list, have the higher (key a, key b).
template <bool Half, int N>
__attribute__((target("avx2"))) inline __m256i IndexMask(const Candidates& c, int64_t k, __m256i vself, __m256i vai,
                                                         __m256i vbi, __m256i* j) {
  *j = LoadIndices<N>(c.order + k);
  const __m256i other = _mm256_andnot_si256(_mm256_cmpeq_epi32(*j, vself), _mm256_set1_epi32(-1));
  if constexpr (!Half) return other;
  const __m256i a = LoadIndices<N>(c.sa + k), b = LoadIndices<N>(c.sb + k);
  const __m256i higher = _mm256_or_si256(_mm256_cmpgt_epi32(a, vai),
                                         _mm256_and_si256(_mm256_cmpeq_epi32(a, vai), _mm256_cmpgt_epi32(b, vbi)));
  // All ones where the keys a differ in parity (bit 0 of a ^ ai, spread over the lane).
  const __m256i odd = _mm256_srai_epi32(_mm256_slli_epi32(_mm256_xor_si256(a, vai), 31), 31);
  return _mm256_and_si256(other, _mm256_xor_si256(higher, odd));
}

// Writes the kept lanes of j (bit l of bits: lane l) packed at dst; returns how many.
__attribute__((target("avx2"))) inline size_t Pack(__m256i j, int bits, int32_t* dst) {
  const __m256i lanes = _mm256_load_si256(reinterpret_cast<const __m256i*>(Packing().lanes[bits]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permutevar8x32_epi32(j, lanes));
  return size_t(__builtin_popcount(unsigned(bits)));
}

template <bool Half>
__attribute__((target("avx2"))) inline size_t ScanRowAvx2(const float* sx, const float* sy, const float* sz,
                                                   const Candidates& c, int64_t first, int64_t last, float xi,
                                                   float yi, float zi, float rc2, int32_t self, int32_t ai, int32_t bi,
                                                   int32_t* dst) {
  const __m256 vx = _mm256_set1_ps(xi), vy = _mm256_set1_ps(yi), vz = _mm256_set1_ps(zi), vr = _mm256_set1_ps(rc2);
  const __m256i vself = _mm256_set1_epi32(self), vai = _mm256_set1_epi32(ai), vbi = _mm256_set1_epi32(bi);
  size_t m = 0;
  int64_t k = first;
  for (; k < last; k += 8) {  // the last vector may be partial: lanes at or past `last` are masked off
    const int live = last - k >= 8 ? 0xFF : (1 << int(last - k)) - 1;
    const __m256 dx = _mm256_sub_ps(_mm256_loadu_ps(sx + k), vx);
    const __m256 dy = _mm256_sub_ps(_mm256_loadu_ps(sy + k), vy);
    const __m256 dz = _mm256_sub_ps(_mm256_loadu_ps(sz + k), vz);
    const __m256 r2 = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(dx, dx), _mm256_mul_ps(dy, dy)), _mm256_mul_ps(dz, dz));
    __m256i j;
    const __m256i ok = IndexMask<Half, 8>(c, k, vself, vai, vbi, &j);
    const int bits = _mm256_movemask_ps(_mm256_cmp_ps(r2, vr, _CMP_LT_OQ)) & _mm256_movemask_ps(_mm256_castsi256_ps(ok));
    m += Pack(j, bits & live, dst + m);
  }
  return m;
}

template <bool Half>
__attribute__((target("avx2"))) inline size_t ScanRowAvx2(const double* sx, const double* sy, const double* sz,
                                                   const Candidates& c, int64_t first, int64_t last, double xi,
                                                   double yi, double zi, double rc2, int32_t self, int32_t ai,
                                                   int32_t bi, int32_t* dst) {
  const __m256d vx = _mm256_set1_pd(xi), vy = _mm256_set1_pd(yi), vz = _mm256_set1_pd(zi), vr = _mm256_set1_pd(rc2);
  const __m256i vself = _mm256_set1_epi32(self), vai = _mm256_set1_epi32(ai), vbi = _mm256_set1_epi32(bi);
  size_t m = 0;
  int64_t k = first;
  for (; k < last; k += 4) {  // the last vector may be partial, as for float
    const int live = last - k >= 4 ? 0xF : (1 << int(last - k)) - 1;
    const __m256d dx = _mm256_sub_pd(_mm256_loadu_pd(sx + k), vx);
    const __m256d dy = _mm256_sub_pd(_mm256_loadu_pd(sy + k), vy);
    const __m256d dz = _mm256_sub_pd(_mm256_loadu_pd(sz + k), vz);
    const __m256d r2 = _mm256_add_pd(_mm256_add_pd(_mm256_mul_pd(dx, dx), _mm256_mul_pd(dy, dy)), _mm256_mul_pd(dz, dz));
    __m256i j;
    const __m256i ok = IndexMask<Half, 4>(c, k, vself, vai, vbi, &j);
    const int bits = _mm256_movemask_pd(_mm256_cmp_pd(r2, vr, _CMP_LT_OQ)) & _mm256_movemask_ps(_mm256_castsi256_ps(ok));
    m += Pack(j, bits & live, dst + m);
  }
  return m;
}

// ScanRowAvx2 over several runs [start[b0[q]], start[b1[q] + 1]) of one receiver in turn, in
// one call (the receiver's broadcasts made once); the candidates kept, packed at dst.
template <typename T, bool Half>
__attribute__((target("avx2"))) size_t ScanRunsAvx2(const T* sx, const T* sy, const T* sz, const Candidates& c,
                                                    const int64_t* start, const int64_t* b0, const int64_t* b1,
                                                    int runs, T xi, T yi, T zi, T rc2, int32_t self, int32_t ai,
                                                    int32_t bi, int32_t* dst) {
  size_t m = 0;
  for (int q = 0; q < runs; ++q)
    m += ScanRowAvx2<Half>(sx, sy, sz, c, start[b0[q]], start[b1[q] + 1], xi, yi, zi, rc2, self, ai, bi, dst + m);
  return m;
}

inline bool HasAvx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

#endif  // JAXDD_SCAN_AVX2

// The passes over a receiver's runs (see ScanRunsAvx2), by the fastest path this CPU has. dst
// needs room for all their candidates + kScanSlack.
template <typename T, bool Half>
inline size_t ScanRuns(const T* sx, const T* sy, const T* sz, const Candidates& c, const int64_t* start,
                       const int64_t* b0, const int64_t* b1, int runs, T xi, T yi, T zi, T rc2, int32_t self,
                       int32_t ai, int32_t bi, int32_t* dst) {
#ifdef JAXDD_SCAN_AVX2
  if (HasAvx2()) return ScanRunsAvx2<T, Half>(sx, sy, sz, c, start, b0, b1, runs, xi, yi, zi, rc2, self, ai, bi, dst);
#endif
  size_t m = 0;
  for (int q = 0; q < runs; ++q)
    m += ScanRowScalar<T, Half>(sx, sy, sz, c, start[b0[q]], start[b1[q] + 1], xi, yi, zi, rc2, self, ai, bi, dst + m);
  return m;
}

}  // namespace jaxdd

#endif  // JAXDD_SCAN_ROW_H_
