// Kernel 1 for the CPU: fused Lennard-Jones energies, forces and per-atom virial on a COO
// neighbour list, and the VJP of its energies, as XLA FFI handlers.
//
// Loaded with ctypes by jaxdd/ffi/_library.py and registered with
// jax.ffi.register_ffi_target; called through jax.ffi.ffi_call by the named op of
// jaxdd/ffi/lj.py, whose jnp reference defines what every handler computes. Each handler
// exists for float32 and float64 (suffix _f32/_f64).
//
// Edge conventions (jaxdd.neighbors): edge e points from its receiver r to its sender
// s, d_e = x[s] - x[r] + shift_e; padding edges carry an index outside [0, n) and are
// skipped. The Python wrapper checks shapes and dtypes before calling; the checks
// here only keep a wrong call from reading outside its buffers.

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "buffer_checks.h"
#include "kernels_math.h"
#include "pair_pick.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxdd::Bad;
using jaxdd::Dim;
using jaxdd::HasShape;
using jaxdd::InRange;

namespace {

// Pair terms of a block of n pairs (lj_pair on each): v[q], dv[q] from r2[q] and the pair's
// sigma, epsilon and shift (one of each for every pair: k == 1, or per pair). A loop
// with nothing but arithmetic, which the compiler vectorises; the AVX2 build (chosen at
// run time, like the neighbour scan's) does four doubles or eight floats at a time. IEEE
// operations round the same in a vector lane as in scalar code, and neither build fuses
// multiply-adds, so both give exactly the scalar formula's bits.
template <typename T, bool Uniform>
inline void PairTermsBody(const T* __restrict r2, const T* __restrict sig, const T* __restrict eps,
                          const T* __restrict vs, int64_t n, T* __restrict v, T* __restrict dv) {
  for (int64_t q = 0; q < n; ++q) {
    const int64_t p = Uniform ? 0 : q;
    jaxdd::lj_pair<T>(r2[q], sig[p], eps[p], vs[p], v + q, dv + q);
  }
}

#ifdef JAXDD_SCAN_AVX2
template <typename T, bool Uniform>
__attribute__((target("avx2"))) void PairTermsAvx2(const T* r2, const T* sig, const T* eps, const T* vs, int64_t n,
                                                   T* v, T* dv) {
  PairTermsBody<T, Uniform>(r2, sig, eps, vs, n, v, dv);
}
#endif

template <typename T, bool Uniform>
void PairTerms(const T* r2, const T* sig, const T* eps, const T* vs, int64_t n, T* v, T* dv) {
#ifdef JAXDD_SCAN_AVX2
  if (jaxdd::HasAvx2()) return PairTermsAvx2<T, Uniform>(r2, sig, eps, vs, n, v, dv);
#endif
  PairTermsBody<T, Uniform>(r2, sig, eps, vs, n, v, dv);
}

// Shapes common to the forward and backward Lennard-Jones kernels.
template <ffi::DataType DT>
ffi::Error CheckLj(const char* name, ffi::Buffer<DT>& pos, ffi::Buffer<ffi::S32>& shifts, ffi::Buffer<DT>& cells,
                   ffi::Buffer<ffi::S32>& system, ffi::Buffer<ffi::S32>& senders, ffi::Buffer<ffi::S32>& receivers,
                   ffi::Buffer<ffi::PRED>& mask, ffi::Buffer<ffi::S32>& types, ffi::Buffer<DT>& sigma,
                   ffi::Buffer<DT>& epsilon, ffi::Buffer<DT>& v_shift) {
  if (pos.dimensions().size() != 2 || Dim(pos, 1) != 3) return Bad(name, "positions must be [n, 3]");
  const int64_t n = Dim(pos, 0);
  if (senders.dimensions().size() != 1) return Bad(name, "senders must be [E]");
  const int64_t e = Dim(senders, 0);
  if (!HasShape(shifts, {e, 3}) && !HasShape(shifts, {0, 3}))
    return Bad(name, "shifts must be [E, 3] (or [0, 3]: no edge has an image shift)");
  if (cells.dimensions().size() != 3 || Dim(cells, 0) < 1 || Dim(cells, 1) != 3 || Dim(cells, 2) != 3)
    return Bad(name, "cells must be [S, 3, 3]");
  if (!HasShape(system, {n})) return Bad(name, "system must be [n]");
  if (!HasShape(receivers, {e}) || !HasShape(mask, {e})) return Bad(name, "receivers and mask must be [E]");
  if (!HasShape(types, {n})) return Bad(name, "types must be [n]");
  if (sigma.dimensions().size() != 2 || Dim(sigma, 0) != Dim(sigma, 1) || Dim(sigma, 0) < 1)
    return Bad(name, "sigma must be [K, K]");
  const int64_t k = Dim(sigma, 0);
  if (!HasShape(epsilon, {k, k}) || !HasShape(v_shift, {k, k}))
    return Bad(name, "epsilon and v_shift must be [K, K] like sigma");
  const int32_t* t = types.typed_data();
  for (int64_t i = 0; i < n; ++i) {
    if (!InRange(t[i], k)) return Bad(name, "types must lie in [0, K)");
  }
  return ffi::Error::Success();
}

// The shifts, or null when the list has none ([0, 3]: every edge within the rows, as each
// rank's list under decomposition). Not reading 12 zero bytes per edge is a good part of
// a pass over such a list.
inline const int32_t* ShiftsOrNull(ffi::Buffer<ffi::S32>& shifts) {
  return Dim(shifts, 0) == 0 ? nullptr : shifts.typed_data();
}

// Edge vector d = x[s] - x[r] + shift . cell (cell of the receiver's system); the cell row
// used is returned through *cell (null when the edge has no image shift, or sh is null).
template <typename T>
inline void EdgeVector(const T* x, const int32_t* sh, const T* cells, const int32_t* system, int64_t n_cells,
                       int64_t e, int32_t r, int32_t s, T* d, const T** cell) {
  d[0] = x[3 * s] - x[3 * r];
  d[1] = x[3 * s + 1] - x[3 * r + 1];
  d[2] = x[3 * s + 2] - x[3 * r + 2];
  *cell = nullptr;
  if (sh == nullptr) return;
  const int32_t n0 = sh[3 * e], n1 = sh[3 * e + 1], n2 = sh[3 * e + 2];
  if ((n0 | n1 | n2) == 0) return;  // most edges: no image shift, no cell read
  int64_t c = system[r];
  c = c < 0 ? 0 : (c >= n_cells ? n_cells - 1 : c);
  const T* h = cells + 9 * c;
  for (int j = 0; j < 3; ++j) d[j] += T(n0) * h[j] + T(n1) * h[3 + j] + T(n2) * h[6 + j];
  *cell = h;
}

// True when the receivers never decrease along the list, padding included (jaxdd's
// lists are sorted so, padding last): each receiver's edges are then one run.
inline bool SortedByReceiver(const int32_t* rcv, int64_t ne) {
  for (int64_t e = 1; e < ne; ++e) {
    if (rcv[e] < rcv[e - 1]) return false;
  }
  return true;
}

// The first edge at or after e that starts a new receiver's run (or ne).
inline int64_t RunStart(const int32_t* rcv, int64_t ne, int64_t e) {
  while (e > 0 && e < ne && rcv[e] == rcv[e - 1]) ++e;
  return e;
}

// Energy per atom, forces and per-atom virial of the LJ pairs of a COO list.
//   energy [n]:       half of each pair's energy to each of its atoms (a full list holds
//                     every pair twice, once per receiver, and credits the receiver only)
//   forces [n, 3]:    half list: -dE/dx, E = sum(energy) (each pair pushes both atoms);
//                     full list: each receiver gets the whole force of each of its pairs
//                     (LAMMPS's "newton off"), which is -dE/dx for every atom that
//                     receives all its pairs -- all atoms of a symmetric list, all owned
//                     atoms under decomposition -- and zero on rows receiving no edge.
//   virial [n, 3, 3]: -d (x) dV/dd of each pair, credited like the energy.
// Edges are visited in order and sums for the current receiver kept in registers, so a
// list grouped by receiver (jaxdd's lists are) writes each receiver row once. Pairs beyond
// the cutoff (a list with a skin holds them) are dropped block by block before computing
// (see the loop).
template <ffi::DataType DT>
ffi::Error LjForward(ffi::Buffer<DT> pos, ffi::Buffer<ffi::S32> shifts, ffi::Buffer<DT> cells,
                     ffi::Buffer<ffi::S32> system, ffi::Buffer<ffi::S32> senders, ffi::Buffer<ffi::S32> receivers,
                     ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> types, ffi::Buffer<DT> sigma,
                     ffi::Buffer<DT> epsilon, ffi::Buffer<DT> v_shift, ffi::BufferR0<DT> cutoff,
                     ffi::BufferR0<ffi::PRED> half_list, int64_t parts, ffi::ThreadPool pool,
                     ffi::ResultBuffer<DT> energy, ffi::ResultBuffer<DT> forces, ffi::ResultBuffer<DT> virial) {
  using T = ffi::NativeType<DT>;
  const char* name = "jaxdd lj_forward";
  if (auto err = CheckLj<DT>(name, pos, shifts, cells, system, senders, receivers, mask, types, sigma, epsilon,
                             v_shift);
      !err.success())
    return err;
  const int64_t n = Dim(pos, 0), ne = Dim(senders, 0), k = Dim(sigma, 0), nc = Dim(cells, 0);
  // parts: 1 energies and forces, 2 virial, 3 both; a part not asked for has 0 rows. The
  // two are separate calls when both are wanted, so XLA drops the virial's when unused.
  const bool want_ef = parts & 1, want_w = parts & 2;
  if (parts < 1 || parts > 3) return Bad(name, "parts must be 1, 2 or 3");
  const int64_t ne_rows = want_ef ? n : 0, nw_rows = want_w ? n : 0;
  if (!HasShape(*energy, {ne_rows}) || !HasShape(*forces, {ne_rows, 3}) || !HasShape(*virial, {nw_rows, 3, 3}))
    return Bad(name, "results must be energy [n], forces [n, 3], virial [n, 3, 3] (0 rows for a part not asked for)");
  const T* x = pos.typed_data();
  const int32_t* sh = ShiftsOrNull(shifts);
  const T* h = cells.typed_data();
  const int32_t* sys = system.typed_data();
  const int32_t* snd = senders.typed_data();
  const int32_t* rcv = receivers.typed_data();
  const bool* m = mask.typed_data();
  const int32_t* ty = types.typed_data();
  const T* sig = sigma.typed_data();
  const T* eps = epsilon.typed_data();
  const T* vs = v_shift.typed_data();
  const T rc2 = cutoff.typed_data()[0] * cutoff.typed_data()[0];
  const bool half = half_list.typed_data()[0];
  T* en = energy->typed_data();
  T* f = forces->typed_data();
  T* w = virial->typed_data();
  std::fill(en, en + ne_rows, T(0));
  std::fill(f, f + 3 * ne_rows, T(0));
  std::fill(w, w + 9 * nw_rows, T(0));
  // One pass over the edges [e0, e1), with running sums of the current receiver: energy,
  // force, virial (symmetric: 6 entries). EF and W (compile-time) select the parts.
  const bool vector_pick = jaxdd::PickVectorised();
  auto run = [&](auto ef_part, auto w_part, int64_t e0, int64_t e1) {
    constexpr bool EF = decltype(ef_part)::value, W = decltype(w_part)::value;
    int64_t cur = -1;
    T ae = 0, f0 = 0, f1 = 0, f2 = 0, w00 = 0, w01 = 0, w02 = 0, w11 = 0, w12 = 0, w22 = 0;
    auto flush = [&]() {
      if (cur < 0) return;
      if constexpr (EF) {
        en[cur] += ae;
        f[3 * cur] += f0, f[3 * cur + 1] += f1, f[3 * cur + 2] += f2;
      }
      if constexpr (W) {
        T* wr = w + 9 * cur;
        wr[0] += w00, wr[1] += w01, wr[2] += w02;
        wr[3] += w01, wr[4] += w11, wr[5] += w12;
        wr[6] += w02, wr[7] += w12, wr[8] += w22;
      }
      ae = f0 = f1 = f2 = w00 = w01 = w02 = w11 = w12 = w22 = 0;
    };
    // Edges in blocks: first the block's pairs within the cutoff are picked out without a
    // branch (a list built with a skin holds pairs beyond it too, at random once the atoms
    // are disordered, and a branch on the cutoff would be mispredicted about as often as it
    // is taken), then their pair terms are computed together (a vector loop), then summed.
    constexpr int64_t kBlock = 256, kRoom = kBlock + jaxdd::kPickSlack;
    alignas(32) int32_t pick_r[kRoom], pick_s[kRoom];
    alignas(32) T pick_d0[kRoom], pick_d1[kRoom], pick_d2[kRoom], pick_r2[kRoom], pick_sig[kRoom],
        pick_eps[kRoom], pick_vs[kRoom], pick_v[kRoom], pick_dv[kRoom];
    const jaxdd::Picks<T> picks{pick_r, pick_s, pick_d0, pick_d1, pick_d2, pick_r2};
    for (int64_t b0 = e0; b0 < e1; b0 += kBlock) {
      const int64_t b1 = std::min(b0 + kBlock, e1);
      int64_t kept = 0, e = b0;
#ifdef JAXDD_SCAN_AVX2
      if (sh == nullptr && vector_pick) {  // whole groups of four; the rest below
        e = b0 + (b1 - b0) / 4 * 4;
        kept = jaxdd::PickAvx2(x, rcv, snd, m, n, b0, e, rc2, picks);
      }
#endif
      for (; e < b1; ++e) {
        const int32_t r = rcv[e], s = snd[e];
        if (!m[e] || !InRange(r, n) || !InRange(s, n)) continue;  // padding: predictable
        T d[3];
        const T* cell;
        EdgeVector(x, sh, h, sys, nc, e, r, s, d, &cell);
        const T r2 = d[0] * d[0] + d[1] * d[1] + d[2] * d[2];
        pick_r[kept] = r, pick_s[kept] = s, pick_r2[kept] = r2;
        pick_d0[kept] = d[0], pick_d1[kept] = d[1], pick_d2[kept] = d[2];
        kept += (r2 < rc2);
      }
      if (k > 1) {
        for (int64_t q = 0; q < kept; ++q) {
          const int64_t ab = int64_t(ty[pick_r[q]]) * k + ty[pick_s[q]];
          pick_sig[q] = sig[ab], pick_eps[q] = eps[ab], pick_vs[q] = vs[ab];
        }
        PairTerms<T, false>(pick_r2, pick_sig, pick_eps, pick_vs, kept, pick_v, pick_dv);
      } else {
        PairTerms<T, true>(pick_r2, sig, eps, vs, kept, pick_v, pick_dv);
      }
      for (int64_t q = 0; q < kept; ++q) {
        const int32_t r = pick_r[q], s = pick_s[q];
        const T d[3] = {pick_d0[q], pick_d1[q], pick_d2[q]};
        if (r != cur) {
          flush();
          cur = r;
        }
        const T v = pick_v[q], dv = pick_dv[q];
        // The pair's force on the receiver, +dV/dd = 2 dv d, and the virial share
        // -dv d (x) d of each atom it is credited to.
        if constexpr (EF) {
          const T g = T(2) * dv;
          const T g0 = g * d[0], g1 = g * d[1], g2 = g * d[2];
          ae += T(0.5) * v;
          f0 += g0, f1 += g1, f2 += g2;
          if (half) {  // the sender's half: energy and the opposite force
            en[s] += T(0.5) * v;
            f[3 * s] -= g0, f[3 * s + 1] -= g1, f[3 * s + 2] -= g2;
          }
        }
        if constexpr (W) {
          const T v00 = -dv * d[0] * d[0], v01 = -dv * d[0] * d[1], v02 = -dv * d[0] * d[2];
          const T v11 = -dv * d[1] * d[1], v12 = -dv * d[1] * d[2], v22 = -dv * d[2] * d[2];
          w00 += v00, w01 += v01, w02 += v02, w11 += v11, w12 += v12, w22 += v22;
          if (half) {  // the sender's virial share
            T* ws = w + 9 * s;
            ws[0] += v00, ws[1] += v01, ws[2] += v02;
            ws[3] += v01, ws[4] += v11, ws[5] += v12;
            ws[6] += v02, ws[7] += v12, ws[8] += v22;
          }
        }
      }
    }
    flush();
  };
  auto pass = [&](int64_t e0, int64_t e1) {
    using Yes = std::true_type;
    using No = std::false_type;
    if (want_ef && want_w) run(Yes{}, Yes{}, e0, e1);
    else if (want_ef) run(Yes{}, No{}, e0, e1);
    else run(No{}, Yes{}, e0, e1);
  };
  // A full list sorted by receiver writes only receiver rows, each from one run of edges:
  // chunks cut between runs never write the same row, so they can run in parallel. Half
  // lists (which write senders' rows too) and unsorted lists take one pass.
  const int64_t chunks = half || !SortedByReceiver(rcv, ne) ? 1 : jaxdd::ChunkCount(pool, ne, 1 << 15);
  if (chunks == 1) {
    pass(0, ne);
  } else {
    jaxdd::ParallelFor(pool, chunks, [&](int64_t c) {
      pass(RunStart(rcv, ne, ne * c / chunks), RunStart(rcv, ne, ne * (c + 1) / chunks));
    });
  }
  return ffi::Error::Success();
}

// Vector-Jacobian product of LjForward's energy output: given ct [n] (the cotangent of
// the per-atom energies), dL/dx [n, 3] and dL/dcells [S, 3, 3].
template <ffi::DataType DT>
ffi::Error LjBackward(ffi::Buffer<DT> pos, ffi::Buffer<ffi::S32> shifts, ffi::Buffer<DT> cells,
                      ffi::Buffer<ffi::S32> system, ffi::Buffer<ffi::S32> senders, ffi::Buffer<ffi::S32> receivers,
                      ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> types, ffi::Buffer<DT> sigma,
                      ffi::Buffer<DT> epsilon, ffi::Buffer<DT> v_shift, ffi::BufferR0<DT> cutoff,
                      ffi::BufferR0<ffi::PRED> half_list, ffi::Buffer<DT> ct, ffi::ResultBuffer<DT> ct_pos,
                      ffi::ResultBuffer<DT> ct_cells) {
  using T = ffi::NativeType<DT>;
  const char* name = "jaxdd lj_backward";
  if (auto err = CheckLj<DT>(name, pos, shifts, cells, system, senders, receivers, mask, types, sigma, epsilon,
                             v_shift);
      !err.success())
    return err;
  const int64_t n = Dim(pos, 0), ne = Dim(senders, 0), k = Dim(sigma, 0), nc = Dim(cells, 0);
  if (!HasShape(ct, {n})) return Bad(name, "the energy cotangent must be [n]");
  if (!HasShape(*ct_pos, {n, 3}) || !HasShape(*ct_cells, {nc, 3, 3}))
    return Bad(name, "results must be [n, 3] and [S, 3, 3]");
  const T* x = pos.typed_data();
  const int32_t* sh = ShiftsOrNull(shifts);
  const T* h = cells.typed_data();
  const int32_t* sys = system.typed_data();
  const int32_t* snd = senders.typed_data();
  const int32_t* rcv = receivers.typed_data();
  const bool* m = mask.typed_data();
  const int32_t* ty = types.typed_data();
  const T* sig = sigma.typed_data();
  const T* eps = epsilon.typed_data();
  const T* vs = v_shift.typed_data();
  const T rc2 = cutoff.typed_data()[0] * cutoff.typed_data()[0];
  const bool half = half_list.typed_data()[0];
  const T* cte = ct.typed_data();
  T* gx = ct_pos->typed_data();
  T* gh = ct_cells->typed_data();
  std::fill(gx, gx + 3 * n, T(0));
  std::fill(gh, gh + 9 * nc, T(0));
  for (int64_t e = 0; e < ne; ++e) {
    const int32_t r = rcv[e], s = snd[e];
    if (!m[e] || !InRange(r, n) || !InRange(s, n)) continue;
    T d[3];
    const T* cell;
    EdgeVector(x, sh, h, sys, nc, e, r, s, d, &cell);
    const T r2 = d[0] * d[0] + d[1] * d[1] + d[2] * d[2];
    if (!(r2 < rc2)) continue;
    const int64_t ab = int64_t(ty[r]) * k + ty[s];
    T v, dv;
    jaxdd::lj_pair<T>(r2, sig[ab], eps[ab], vs[ab], &v, &dv);
    // This edge adds v/2 to energy[r] (and v/2 to energy[s] in a half list).
    const T wv = T(0.5) * (half ? cte[r] + cte[s] : cte[r]);
    const T g = T(2) * wv * dv;
    const T g0 = g * d[0], g1 = g * d[1], g2 = g * d[2];
    gx[3 * s] += g0, gx[3 * s + 1] += g1, gx[3 * s + 2] += g2;
    gx[3 * r] -= g0, gx[3 * r + 1] -= g1, gx[3 * r + 2] -= g2;
    if (cell != nullptr) {  // d depends on the cell through the image shift
      T* gc = gh + (cell - h);
      const T gg[3] = {g0, g1, g2};
      for (int a = 0; a < 3; ++a) {
        const T na = T(sh[3 * e + a]);
        for (int j = 0; j < 3; ++j) gc[3 * a + j] += na * gg[j];
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

// ------------------------------------------------------------------- exported symbols

#define JAXDD_LJ_ARGS(DT)                        \
  .Arg<ffi::Buffer<DT>>()             /* positions */ \
      .Arg<ffi::Buffer<ffi::S32>>()   /* shifts */    \
      .Arg<ffi::Buffer<DT>>()         /* cells */     \
      .Arg<ffi::Buffer<ffi::S32>>()   /* system */    \
      .Arg<ffi::Buffer<ffi::S32>>()   /* senders */   \
      .Arg<ffi::Buffer<ffi::S32>>()   /* receivers */ \
      .Arg<ffi::Buffer<ffi::PRED>>()  /* mask */      \
      .Arg<ffi::Buffer<ffi::S32>>()   /* types */     \
      .Arg<ffi::Buffer<DT>>()         /* sigma */     \
      .Arg<ffi::Buffer<DT>>()         /* epsilon */   \
      .Arg<ffi::Buffer<DT>>()         /* v_shift */   \
      .Arg<ffi::BufferR0<DT>>()       /* cutoff */    \
      .Arg<ffi::BufferR0<ffi::PRED>>() /* half_list */

#define JAXDD_LJ_FORWARD(SYM, DT)                                                      \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(SYM, LjForward<DT>,                                    \
                                ffi::Ffi::Bind() JAXDD_LJ_ARGS(DT)                     \
                                    .Attr<int64_t>("parts")                            \
                                    .Ctx<ffi::ThreadPool>()                            \
                                    .Ret<ffi::Buffer<DT>>()  /* energy */              \
                                    .Ret<ffi::Buffer<DT>>()  /* forces */              \
                                    .Ret<ffi::Buffer<DT>>()) /* virial */

#define JAXDD_LJ_BACKWARD(SYM, DT)                                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(SYM, LjBackward<DT>,                                   \
                                ffi::Ffi::Bind() JAXDD_LJ_ARGS(DT)                     \
                                    .Arg<ffi::Buffer<DT>>()  /* energy cotangent */    \
                                    .Ret<ffi::Buffer<DT>>()  /* d/dpositions */        \
                                    .Ret<ffi::Buffer<DT>>()) /* d/dcells */

JAXDD_LJ_FORWARD(jaxdd_lj_forward_f32, ffi::F32);
JAXDD_LJ_FORWARD(jaxdd_lj_forward_f64, ffi::F64);
JAXDD_LJ_BACKWARD(jaxdd_lj_backward_f32, ffi::F32);
JAXDD_LJ_BACKWARD(jaxdd_lj_backward_f64, ffi::F64);
