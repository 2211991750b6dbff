// A neighbour-list builder for the CPU, as an XLA FFI handler: the open-boundary list
// that each rank builds over its own rows (owned atoms and ghost images) under domain
// decomposition. Called through jax.ffi.ffi_call by jaxdd/ffi/neighbors.py, whose
// docstring and jnp counterpart (jaxdd.neighbors.build_neighbor_list with no periodic
// axis) define the result.
//
// Atoms are binned per system in cubes of at least the cutoff (each system's own
// bounding box), counting-sorted by bin, and every receiver scans the 27 bins around its
// own (receivers in chunks on XLA's intra-op threads). Edges come out grouped by
// receiver, in receiver order, as jaxdd's lists are. There are no image shifts (the caller
// supplies zeros where it needs them).
// Nothing is ever dropped silently: edges past the capacity are counted, not written,
// and the count is returned so the caller can grow the capacity and build again.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "parallel.h"
#include "scan_row.h"
#include "stencil.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxdd::BinOf;
using jaxdd::kBinsPerCutoff;
using jaxdd::Candidates;
using jaxdd::kScanSlack;

namespace {

ffi::Error BadNl(const std::string& what) { return ffi::Error::InvalidArgument("jaxdd cell_list: " + what); }

// One system's bins: origin, bin edge, bins per axis and the first bin's global id.
struct Grid {
  double lo[3] = {0, 0, 0};
  double width = 1;
  int64_t nb[3] = {1, 1, 1};
  int64_t offset = 0;
};

template <ffi::DataType DT>
ffi::Error CellList(ffi::Buffer<DT> pos, ffi::Buffer<ffi::S32> system, ffi::Buffer<ffi::PRED> mask,
                    ffi::Buffer<ffi::S32> order_a, ffi::Buffer<ffi::S32> order_b, int64_t n_receivers, int64_t n_systems, double cutoff, bool half, ffi::ThreadPool pool,
                    ffi::ResultBuffer<ffi::S32> senders, ffi::ResultBuffer<ffi::S32> receivers,
                    ffi::ResultBuffer<ffi::S32> num_neighbors,
                    ffi::ResultBufferR0<ffi::S32> n_edges) {
  using T = ffi::NativeType<DT>;
  if (pos.dimensions().size() != 2 || pos.dimensions()[1] != 3) return BadNl("positions must be [n, 3]");
  const int64_t n = pos.dimensions()[0];
  if (system.dimensions().size() != 1 || int64_t(system.dimensions()[0]) != n) return BadNl("system must be [n]");
  if (mask.dimensions().size() != 1 || int64_t(mask.dimensions()[0]) != n) return BadNl("atom_mask must be [n]");
  if (order_a.dimensions().size() != 1 || int64_t(order_a.dimensions()[0]) != n ||
      order_b.dimensions().size() != 1 || int64_t(order_b.dimensions()[0]) != n)
    return BadNl("the half-list order keys must be [n] each");
  if (senders->dimensions().size() != 1 || receivers->dimensions().size() != 1 ||
      senders->dimensions()[0] != receivers->dimensions()[0])
    return BadNl("senders and receivers must be [max_edges]");
  if (num_neighbors->dimensions().size() != 1 || int64_t(num_neighbors->dimensions()[0]) != n)
    return BadNl("num_neighbors must be [n]");
  if (!(cutoff > 0) || !std::isfinite(cutoff)) return BadNl("cutoff must be positive and finite");
  if (n_systems < 1) return BadNl("n_systems must be >= 1");
  const int64_t cap = senders->dimensions()[0];
  const int64_t n_recv = std::clamp<int64_t>(n_receivers, 0, n);

  const T* x = pos.typed_data();
  const int32_t* sys = system.typed_data();
  const bool* m = mask.typed_data();
  const int32_t* ka = order_a.typed_data();
  const int32_t* kb = order_b.typed_data();
  int32_t* snd = senders->typed_data();
  int32_t* rcv = receivers->typed_data();
  int32_t* count = num_neighbors->typed_data();
  std::fill(count, count + n, 0);

  auto real = [&](int64_t i) { return m[i] && sys[i] >= 0 && sys[i] < n_systems; };

  // Per-system bounding boxes and grids; bins grow past the cutoff only where a sparse
  // system would otherwise need far more bins than it has atoms.
  std::vector<Grid> grid(n_systems);
  std::vector<double> hi(3 * n_systems, -std::numeric_limits<double>::infinity());
  std::vector<int64_t> atoms(n_systems, 0);
  for (auto& g : grid) std::fill(g.lo, g.lo + 3, std::numeric_limits<double>::infinity());
  for (int64_t i = 0; i < n; ++i) {
    if (!real(i)) continue;
    const int32_t s = sys[i];
    ++atoms[s];
    for (int a = 0; a < 3; ++a) {
      const double v = double(x[3 * i + a]);
      if (v < grid[s].lo[a]) grid[s].lo[a] = v;
      if (v > hi[3 * s + a]) hi[3 * s + a] = v;
    }
  }
  int64_t n_bins = 0;
  for (int64_t s = 0; s < n_systems; ++s) {
    Grid& g = grid[s];
    double extent[3];
    for (int a = 0; a < 3; ++a) {
      extent[a] = hi[3 * s + a] - g.lo[a];
      if (!(extent[a] >= 0) || !std::isfinite(extent[a])) g.lo[a] = 0, extent[a] = 0;  // empty or non-finite
    }
    const double budget = 2.0 * double(atoms[s]) + 8.0;
    g.width = cutoff / kBinsPerCutoff;
    for (;;) {
      double total = 1;
      for (int a = 0; a < 3; ++a) {
        g.nb[a] = int64_t(std::floor(extent[a] / g.width)) + 1;
        total *= double(g.nb[a]);
      }
      if (total <= budget) break;
      g.width *= 1.25;
    }
    if (!(g.width * kBinsPerCutoff >= cutoff))  // what the fixed-size stencil relies on
      return ffi::Error::Internal("jaxdd cell_list: bins narrower than cutoff / kBinsPerCutoff");
    g.offset = n_bins;
    n_bins += g.nb[0] * g.nb[1] * g.nb[2];
  }

  // Counting sort of the real atoms by bin; positions copied in bin order so that the
  // scan reads memory contiguously.
  std::vector<int64_t> bin(n, -1);
  std::vector<int64_t> start(n_bins + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (!real(i)) continue;
    const Grid& g = grid[sys[i]];
    int64_t b[3];
    for (int a = 0; a < 3; ++a) b[a] = BinOf(double(x[3 * i + a]), g.lo[a], g.width, g.nb[a]);
    bin[i] = g.offset + b[0] + g.nb[0] * (b[1] + g.nb[1] * b[2]);
    ++start[bin[i] + 1];
  }
  for (int64_t b = 0; b < n_bins; ++b) start[b + 1] += start[b];
  // kScanSlack zeros past the end: a vector pass may read a whole vector at a run's end
  // (the lanes past it are masked out).
  const size_t sorted = size_t(start[n_bins]) + kScanSlack;
  std::vector<int32_t> order(sorted, 0);
  std::vector<T> sx(sorted, T(0)), sy(sorted, T(0)), sz(sorted, T(0));
  std::vector<int32_t> sa(half ? sorted : 0, 0), sb(half ? sorted : 0, 0);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n; ++i) {
      if (bin[i] < 0) continue;
      const int64_t k = fill[bin[i]]++;
      order[k] = int32_t(i);
      sx[k] = x[3 * i], sy[k] = x[3 * i + 1], sz[k] = x[3 * i + 2];
      if (half) sa[k] = ka[i], sb[k] = kb[i];
    }
  }

  // Receivers are scanned in chunks, in parallel; each chunk keeps its senders in its own
  // buffer, and the buffers are copied out in receiver order.
  const T rc2 = T(cutoff) * T(cutoff);
  const int64_t chunks = jaxdd::ChunkCount(pool, n_recv, 2048);
  std::vector<std::vector<int32_t>> found(chunks);
  const Candidates cands{order.data(), sa.data(), sb.data()};
  jaxdd::ParallelFor(pool, chunks, [&](int64_t c) {
    // out[0, m) holds the chunk's senders; out grows geometrically ahead of m.
    std::vector<int32_t>& out = found[c];
    // Sized for the chunk's share of the capacity (which the caller sets near the need), so
    // that it rarely grows.
    const int64_t lo = n_recv * c / chunks, hi = n_recv * (c + 1) / chunks;
    out.resize(size_t(n_recv > 0 ? cap / n_recv * (hi - lo) : 0) + 1024);
    size_t m = 0;
    for (int64_t i = lo; i < hi; ++i) {
      if (bin[i] < 0) continue;
      const Grid& g = grid[sys[i]];
      const T xi = x[3 * i], yi = x[3 * i + 1], zi = x[3 * i + 2];
      const int32_t self = int32_t(i);
      const int32_t ai = ka[i], bi = kb[i];
      const size_t before = m;
      // The receiver's runs of bins first, then one scan over them all.
      int64_t run_b0[jaxdd::kStencil * jaxdd::kStencil], run_b1[jaxdd::kStencil * jaxdd::kStencil];
      int runs = 0;
      size_t cands_in_runs = 0;
      jaxdd::ForEachRun(g, bin[i] - g.offset, double(xi), double(yi), double(zi), cutoff, [&](int64_t b0, int64_t b1) {
        run_b0[runs] = b0, run_b1[runs] = b1, ++runs;
        cands_in_runs += size_t(start[b1 + 1] - start[b0]);
      });
      if (out.size() < m + cands_in_runs + kScanSlack) out.resize(2 * (m + cands_in_runs + kScanSlack));
      m += half ? jaxdd::ScanRuns<T, true>(sx.data(), sy.data(), sz.data(), cands, start.data(), run_b0, run_b1, runs,
                                           xi, yi, zi, rc2, self, ai, bi, out.data() + m)
                : jaxdd::ScanRuns<T, false>(sx.data(), sy.data(), sz.data(), cands, start.data(), run_b0, run_b1,
                                            runs, xi, yi, zi, rc2, self, ai, bi, out.data() + m);
      count[i] = int32_t(m - before);
    }
    out.resize(m);
  });
  std::vector<int64_t> offset(chunks + 1, 0);
  for (int64_t c = 0; c < chunks; ++c) offset[c + 1] = offset[c] + int64_t(found[c].size());
  const int64_t e = offset[chunks];
  jaxdd::ParallelFor(pool, chunks, [&](int64_t c) {
    // The chunk's senders in one copy, its receivers as runs of count[i]; both cut at cap.
    const int64_t begin = offset[c];
    if (begin >= cap) return;
    const std::vector<int32_t>& src = found[c];
    const int64_t end = std::min<int64_t>(begin + int64_t(src.size()), cap);
    std::copy(src.data(), src.data() + (end - begin), snd + begin);
    int64_t k = begin;
    for (int64_t i = n_recv * c / chunks; i < n_recv * (c + 1) / chunks && k < end; ++i) {
      const int64_t stop = std::min<int64_t>(k + count[i], end);
      std::fill(rcv + k, rcv + stop, int32_t(i));
      k = stop;
    }
  });
  for (int64_t k = std::min(e, cap); k < cap; ++k) snd[k] = rcv[k] = int32_t(n);
  n_edges->typed_data()[0] = int32_t(std::min<int64_t>(e, std::numeric_limits<int32_t>::max()));
  return ffi::Error::Success();
}

}  // namespace

#define JAXDD_CELL_LIST(SYM, DT)                                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(SYM, CellList<DT>,                                    \
                                ffi::Ffi::Bind()                                      \
                                    .Arg<ffi::Buffer<DT>>()          /* positions */  \
                                    .Arg<ffi::Buffer<ffi::S32>>()    /* system */     \
                                    .Arg<ffi::Buffer<ffi::PRED>>()   /* atom_mask */  \
                                    .Arg<ffi::Buffer<ffi::S32>>()    /* order key a */\
                                    .Arg<ffi::Buffer<ffi::S32>>()    /* order key b */\
                                    .Attr<int64_t>("n_receivers")                     \
                                    .Attr<int64_t>("n_systems")                       \
                                    .Attr<double>("cutoff")                           \
                                    .Attr<bool>("half")                               \
                                    .Ctx<ffi::ThreadPool>()                           \
                                    .Ret<ffi::Buffer<ffi::S32>>()    /* senders */    \
                                    .Ret<ffi::Buffer<ffi::S32>>()    /* receivers */  \
                                    .Ret<ffi::Buffer<ffi::S32>>()    /* per atom */   \
                                    .Ret<ffi::BufferR0<ffi::S32>>()) /* edges found */

JAXDD_CELL_LIST(jaxdd_cell_list_f32, ffi::F32);
JAXDD_CELL_LIST(jaxdd_cell_list_f64, ffi::F64);
