// The bins a cell-list receiver scans and the half-list rule it keeps pairs by, shared by the
// CPU and CUDA kernels (neighbors/neighbors_cpu.cc, neighbors/neighbors_cuda.cu) so that both
// visit the same candidates and keep the same pairs.
//
// Bins are cubes of edge `width` (at least the cutoff over kBinsPerCutoff) from a system's
// origin `lo`. A receiver scans the bins around its own whose box lies within the search
// reach: per row of bins (a run along x, contiguous in the sorted order) the x-bins from the
// first to the last that pass (the passing bins of a row are contiguous; a ball is convex).
// Near the stencil's edges that is a bin or two of a row's five, or none.
//
// The gaps are computed in double from the stored coordinates; the pair test itself runs in
// the positions' precision. The reach is the cutoff widened by 1e-5 (relative), more than the
// test's rounding (a few units in the last place of float32), so no pair the test would keep
// lies in a bin that is skipped: the candidates only shrink, the pairs found do not change.

#ifndef JAXDD_STENCIL_H_
#define JAXDD_STENCIL_H_

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define JAXDD_HD __host__ __device__ __forceinline__
#else
#define JAXDD_HD inline
#endif

namespace jaxdd {

// Bins per cutoff length: finer bins examine fewer atoms that are too far away (with two,
// about half as many as bins of the cutoff) at the price of more, shorter runs to scan.
constexpr int kBinsPerCutoff = 2;
// Bins along one axis of a receiver's stencil, at most (bins only grow past cutoff / 2).
constexpr int kStencil = 2 * kBinsPerCutoff + 1;

// Bin of coordinate x along one axis of nb bins (clamped; NaN goes to bin 0, where such an
// atom finds no neighbour anyway).
JAXDD_HD int64_t BinOf(double x, double lo, double width, int64_t nb) {
  const double f = (x - lo) / width;
  if (!(f >= 0)) return 0;
  const double b = floor(f);
  return b < double(nb) ? int64_t(b) : nb - 1;
}

// Squared search reach: the cutoff, widened past the pair test's rounding.
JAXDD_HD double SearchReach2(double cutoff) {
  const double r = cutoff * (1.0 + 1e-5);
  return r * r;
}

// Bins a receiver's stencil reaches out along each axis to cover the cutoff. Bins are at
// least cutoff / kBinsPerCutoff wide (the kernels check it when they size their grids), so
// kBinsPerCutoff always covers it and the stencil never has more than kStencil bins an axis.
JAXDD_HD int64_t StencilReach(double cutoff, double width) {
  const int64_t r = int64_t(ceil(cutoff / width));
  return r < kBinsPerCutoff ? r : kBinsPerCutoff;
}

// The stencil along one axis: bins [*b0, *b0 + n) around bin b, reach <= kBinsPerCutoff each
// side (clamped to the grid's nb), returned as n, and each one's squared distance from
// coordinate v in gap2[0, n).
JAXDD_HD int64_t AxisStencil(double v, double lo, double width, int64_t nb, int64_t b, int64_t reach, int64_t* b0,
                             double* gap2) {
  const int64_t first = b - reach > 0 ? b - reach : 0;
  const int64_t last = b + reach < nb - 1 ? b + reach : nb - 1;
  const int64_t n = last - first + 1;
  for (int64_t k = 0; k < n; ++k) {
    const double edge = lo + double(first + k) * width;
    const double below = edge - v, above = v - (edge + width);  // at most one is positive
    const double g = below > 0 ? below : (above > 0 ? above : 0.0);
    gap2[k] = g * g;
  }
  *b0 = first;
  return n;
}

// The x-bins [*first, *last] (indices into gx2) of a row at squared y-z distance g2 whose
// boxes lie within the reach; false: none.
JAXDD_HD bool RowSpan(const double* gx2, int64_t n, double g2, double reach2, int64_t* first, int64_t* last) {
  if (g2 >= reach2) return false;
  int64_t a = 0, b = n - 1;
  while (a <= b && gx2[a] + g2 >= reach2) ++a;
  while (b >= a && gx2[b] + g2 >= reach2) --b;
  *first = a, *last = b;
  return a <= b;
}

// Calls run(b0, b1) for each row of bins around a receiver at (x, y, z), in local bin
// `local` of grid g (a Grid of either kernel: lo[3], width, nb[3], offset), with the global
// ids [b0, b1] of the row's bins within the reach, contiguous in the sorted order; rows in
// z-major, y-minor order, as both kernels list a receiver's senders.
template <typename G, typename Run>
JAXDD_HD void ForEachRun(const G& g, int64_t local, double x, double y, double z, double cutoff, Run&& run) {
  const int64_t bx = local % g.nb[0];
  local /= g.nb[0];
  const int64_t by = local % g.nb[1], bz = local / g.nb[1];
  const int64_t reach = StencilReach(cutoff, g.width);
  const double reach2 = SearchReach2(cutoff);
  int64_t x0, y0, z0;
  double gx2[kStencil], gy2[kStencil], gz2[kStencil];
  const int64_t nx = AxisStencil(x, g.lo[0], g.width, g.nb[0], bx, reach, &x0, gx2);
  const int64_t ny = AxisStencil(y, g.lo[1], g.width, g.nb[1], by, reach, &y0, gy2);
  const int64_t nz = AxisStencil(z, g.lo[2], g.width, g.nb[2], bz, reach, &z0, gz2);
  for (int64_t kz = 0; kz < nz; ++kz) {
    for (int64_t ky = 0; ky < ny; ++ky) {
      int64_t a, b;
      if (!RowSpan(gx2, nx, gy2[ky] + gz2[kz], reach2, &a, &b)) continue;
      const int64_t row = g.offset + x0 + g.nb[0] * (y0 + ky + g.nb[1] * (z0 + kz));
      run(row + a, row + b);
    }
  }
}

// Half lists: whether the row with keys (ai, bi) lists its pair with the row (aj, bj): the
// row of lower (key a, key b) when the two keys a have the same parity, else the row of
// higher. Exactly one row of a pair lists it (keys differ), and the pairs between two sets
// of rows split about evenly (with the lower keys alone, the set holding the lower global
// ids, i.e. one rank, would list every pair it shares with another).
JAXDD_HD bool HalfKeeps(int32_t ai, int32_t bi, int32_t aj, int32_t bj) {
  const bool higher = (aj > ai) | ((aj == ai) & (bj > bi));
  return higher != bool((ai ^ aj) & 1);
}

}  // namespace jaxdd

#endif  // JAXDD_STENCIL_H_
