// jaxdd's fused kernels for the CPU, as XLA FFI handlers.
//
// Loaded with ctypes by jaxdd/ffi/_library.py and registered with
// jax.ffi.register_ffi_target; called through jax.ffi.ffi_call by the named ops of
// jaxdd/ffi/lj.py and jaxdd/ffi/attention.py, whose jnp references define what every
// handler computes. Each handler exists for float32 and float64 (suffix _f32/_f64).
//
// Edge conventions (jaxdd.neighbors): edge e points from its receiver r to its sender
// s, d_e = x[s] - x[r] + shift_e; padding edges carry an index outside [0, n) and are
// skipped. The Python wrappers check shapes and dtypes before calling; the checks
// here only keep a wrong call from reading outside its buffers.

// Python.h first, as Python asks; only the module stub at the end uses it.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

template <typename Buf>
int64_t Dim(const Buf& b, int i) {
  return static_cast<int64_t>(b.dimensions()[i]);
}

template <typename Buf>
bool HasShape(const Buf& b, std::initializer_list<int64_t> shape) {
  auto dims = b.dimensions();
  if (dims.size() != shape.size()) return false;
  size_t i = 0;
  for (int64_t s : shape) {
    if (static_cast<int64_t>(dims[i++]) != s) return false;
  }
  return true;
}

ffi::Error Bad(const std::string& kernel, const std::string& what) {
  return ffi::Error::InvalidArgument(kernel + ": " + what);
}

inline bool InRange(int32_t i, int64_t n) { return i >= 0 && i < n; }

// ----------------------------------------------------------------------------- LJ

// Shapes common to the forward and backward Lennard-Jones kernels.
template <ffi::DataType DT>
ffi::Error CheckLj(const char* name, ffi::Buffer<DT>& pos, ffi::Buffer<DT>& shifts,
                   ffi::Buffer<ffi::S32>& senders, ffi::Buffer<ffi::S32>& receivers,
                   ffi::Buffer<ffi::PRED>& mask, ffi::Buffer<ffi::S32>& types,
                   ffi::Buffer<DT>& sigma, ffi::Buffer<DT>& epsilon, ffi::Buffer<DT>& v_shift) {
  if (pos.dimensions().size() != 2 || Dim(pos, 1) != 3) return Bad(name, "positions must be [n, 3]");
  const int64_t n = Dim(pos, 0);
  if (senders.dimensions().size() != 1) return Bad(name, "senders must be [E]");
  const int64_t e = Dim(senders, 0);
  if (!HasShape(shifts, {e, 3})) return Bad(name, "shifts must be [E, 3]");
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

// Energy per atom, forces and per-atom virial of the LJ pairs of a COO list.
//   energy [n]:     half of each pair's energy to each of its atoms (a full list holds
//                   every pair twice, once per receiver, and credits the receiver only)
//   forces [n, 3]:  -dE/dx with E = sum(energy)
//   virial [n, 3, 3]: -sum d (x) dE/dd, credited like the energy
template <ffi::DataType DT>
ffi::Error LjForward(ffi::Buffer<DT> pos, ffi::Buffer<DT> shifts, ffi::Buffer<ffi::S32> senders,
                     ffi::Buffer<ffi::S32> receivers, ffi::Buffer<ffi::PRED> mask,
                     ffi::Buffer<ffi::S32> types, ffi::Buffer<DT> sigma, ffi::Buffer<DT> epsilon,
                     ffi::Buffer<DT> v_shift, ffi::BufferR0<DT> cutoff, ffi::BufferR0<ffi::PRED> half_list,
                     ffi::ResultBuffer<DT> energy,
                     ffi::ResultBuffer<DT> forces, ffi::ResultBuffer<DT> virial) {
  using T = ffi::NativeType<DT>;
  const char* name = "jaxdd lj_forward";
  if (auto err = CheckLj<DT>(name, pos, shifts, senders, receivers, mask, types, sigma, epsilon, v_shift);
      !err.success())
    return err;
  const int64_t n = Dim(pos, 0), ne = Dim(senders, 0), k = Dim(sigma, 0);
  if (!HasShape(*energy, {n}) || !HasShape(*forces, {n, 3}) || !HasShape(*virial, {n, 3, 3}))
    return Bad(name, "results must be energy [n], forces [n, 3], virial [n, 3, 3]");
  const T* x = pos.typed_data();
  const T* sh = shifts.typed_data();
  const int32_t* snd = senders.typed_data();
  const int32_t* rcv = receivers.typed_data();
  const bool* m = mask.typed_data();
  const int32_t* ty = types.typed_data();
  const T* sig = sigma.typed_data();
  const T* eps = epsilon.typed_data();
  T* en = energy->typed_data();
  T* f = forces->typed_data();
  T* w = virial->typed_data();
  std::fill(en, en + n, T(0));
  std::fill(f, f + 3 * n, T(0));
  std::fill(w, w + 9 * n, T(0));
  const T* vs = v_shift.typed_data();
  const T rc2 = cutoff.typed_data()[0] * cutoff.typed_data()[0];
  const bool half = half_list.typed_data()[0];
  const T c = half ? T(1) : T(0.5);  // weight of one edge's pair energy in E
  for (int64_t e = 0; e < ne; ++e) {
    const int32_t r = rcv[e], s = snd[e];
    if (!m[e] || !InRange(r, n) || !InRange(s, n)) continue;
    const T d0 = x[3 * s] - x[3 * r] + sh[3 * e];
    const T d1 = x[3 * s + 1] - x[3 * r + 1] + sh[3 * e + 1];
    const T d2 = x[3 * s + 2] - x[3 * r + 2] + sh[3 * e + 2];
    const T r2 = d0 * d0 + d1 * d1 + d2 * d2;
    if (!(r2 < rc2)) continue;
    const int64_t ab = int64_t(ty[r]) * k + ty[s];
    T v, dv;
    jaxdd::lj_pair<T>(r2, sig[ab], eps[ab], vs[ab], &v, &dv);
    const T g = T(2) * c * dv;  // dE/dd = g d
    const T g0 = g * d0, g1 = g * d1, g2 = g * d2;
    // d = x[s] - x[r] + shift: the receiver is pushed along +dE/dd, the sender against it.
    f[3 * r] += g0, f[3 * r + 1] += g1, f[3 * r + 2] += g2;
    f[3 * s] -= g0, f[3 * s + 1] -= g1, f[3 * s + 2] -= g2;
    const T dd[3] = {d0, d1, d2};
    const T gg[3] = {g0, g1, g2};
    if (half) {
      en[r] += T(0.5) * v, en[s] += T(0.5) * v;
      for (int a = 0; a < 3; ++a)
        for (int b = 0; b < 3; ++b) {
          const T t = T(-0.5) * dd[a] * gg[b];
          w[9 * r + 3 * a + b] += t;
          w[9 * s + 3 * a + b] += t;
        }
    } else {
      en[r] += T(0.5) * v;
      for (int a = 0; a < 3; ++a)
        for (int b = 0; b < 3; ++b) w[9 * r + 3 * a + b] -= dd[a] * gg[b];
    }
  }
  return ffi::Error::Success();
}

// Vector-Jacobian product of LjForward's energy output: given ct [n] (the cotangent of
// the per-atom energies), dL/dx [n, 3] and dL/dshifts [E, 3].
template <ffi::DataType DT>
ffi::Error LjBackward(ffi::Buffer<DT> pos, ffi::Buffer<DT> shifts, ffi::Buffer<ffi::S32> senders,
                      ffi::Buffer<ffi::S32> receivers, ffi::Buffer<ffi::PRED> mask,
                      ffi::Buffer<ffi::S32> types, ffi::Buffer<DT> sigma, ffi::Buffer<DT> epsilon,
                      ffi::Buffer<DT> v_shift, ffi::BufferR0<DT> cutoff, ffi::BufferR0<ffi::PRED> half_list,
                      ffi::Buffer<DT> ct, ffi::ResultBuffer<DT> ct_pos, ffi::ResultBuffer<DT> ct_shifts) {
  using T = ffi::NativeType<DT>;
  const char* name = "jaxdd lj_backward";
  if (auto err = CheckLj<DT>(name, pos, shifts, senders, receivers, mask, types, sigma, epsilon, v_shift);
      !err.success())
    return err;
  const int64_t n = Dim(pos, 0), ne = Dim(senders, 0), k = Dim(sigma, 0);
  if (!HasShape(ct, {n})) return Bad(name, "the energy cotangent must be [n]");
  if (!HasShape(*ct_pos, {n, 3}) || !HasShape(*ct_shifts, {ne, 3}))
    return Bad(name, "results must be [n, 3] and [E, 3]");
  const T* x = pos.typed_data();
  const T* sh = shifts.typed_data();
  const int32_t* snd = senders.typed_data();
  const int32_t* rcv = receivers.typed_data();
  const bool* m = mask.typed_data();
  const int32_t* ty = types.typed_data();
  const T* sig = sigma.typed_data();
  const T* eps = epsilon.typed_data();
  const T* cte = ct.typed_data();
  T* gx = ct_pos->typed_data();
  T* gs = ct_shifts->typed_data();
  std::fill(gx, gx + 3 * n, T(0));
  std::fill(gs, gs + 3 * ne, T(0));
  const T* vs = v_shift.typed_data();
  const T rc2 = cutoff.typed_data()[0] * cutoff.typed_data()[0];
  const bool half = half_list.typed_data()[0];
  for (int64_t e = 0; e < ne; ++e) {
    const int32_t r = rcv[e], s = snd[e];
    if (!m[e] || !InRange(r, n) || !InRange(s, n)) continue;
    const T d0 = x[3 * s] - x[3 * r] + sh[3 * e];
    const T d1 = x[3 * s + 1] - x[3 * r + 1] + sh[3 * e + 1];
    const T d2 = x[3 * s + 2] - x[3 * r + 2] + sh[3 * e + 2];
    const T r2 = d0 * d0 + d1 * d1 + d2 * d2;
    if (!(r2 < rc2)) continue;
    const int64_t ab = int64_t(ty[r]) * k + ty[s];
    T v, dv;
    jaxdd::lj_pair<T>(r2, sig[ab], eps[ab], vs[ab], &v, &dv);
    // This edge adds v/2 to energy[r] (and v/2 to energy[s] in a half list).
    const T wv = T(0.5) * (half ? cte[r] + cte[s] : cte[r]);
    const T g = T(2) * wv * dv;
    const T g0 = g * d0, g1 = g * d1, g2 = g * d2;
    gs[3 * e] = g0, gs[3 * e + 1] = g1, gs[3 * e + 2] = g2;
    gx[3 * s] += g0, gx[3 * s + 1] += g1, gx[3 * s + 2] += g2;
    gx[3 * r] -= g0, gx[3 * r + 1] -= g1, gx[3 * r + 2] -= g2;
  }
  return ffi::Error::Success();
}

// ------------------------------------------------------------------- attention messages

// Shapes common to the attention kernels; n and F are read from q.
template <ffi::DataType DT>
ffi::Error CheckAttention(const char* name, ffi::Buffer<DT>& q, ffi::Buffer<DT>& k, ffi::Buffer<DT>& v,
                          ffi::Buffer<DT>& w, ffi::Buffer<ffi::S32>& senders,
                          ffi::Buffer<ffi::S32>& receivers) {
  if (q.dimensions().size() != 2) return Bad(name, "q must be [n, F]");
  const int64_t n = Dim(q, 0), nf = Dim(q, 1);
  if (!HasShape(k, {n, nf}) || !HasShape(v, {n, nf})) return Bad(name, "k and v must be [n, F] like q");
  if (w.dimensions().size() != 1) return Bad(name, "edge weights must be [E]");
  const int64_t ne = Dim(w, 0);
  if (!HasShape(senders, {ne}) || !HasShape(receivers, {ne})) return Bad(name, "senders and receivers must be [E]");
  return ffi::Error::Success();
}

// Attention-weighted aggregation onto receivers, with a softmax "sink" of weight 1:
//   u_e = w_e exp(q[r].k[s] / sqrt(F)),  z[r] = 1 + sum_e u_e,  m[r] = sum_e u_e v[s] / z[r]
// Results: m [n, F], z [n] (kept for the backward kernel).
template <ffi::DataType DT>
ffi::Error AttentionForward(ffi::Buffer<DT> q, ffi::Buffer<DT> k, ffi::Buffer<DT> v, ffi::Buffer<DT> w,
                            ffi::Buffer<ffi::S32> senders, ffi::Buffer<ffi::S32> receivers,
                            ffi::ResultBuffer<DT> msg, ffi::ResultBuffer<DT> norm) {
  using T = ffi::NativeType<DT>;
  const char* name = "jaxdd attention_forward";
  if (auto err = CheckAttention<DT>(name, q, k, v, w, senders, receivers); !err.success()) return err;
  const int64_t n = Dim(q, 0), nf = Dim(q, 1), ne = Dim(w, 0);
  if (!HasShape(*msg, {n, nf}) || !HasShape(*norm, {n})) return Bad(name, "results must be [n, F] and [n]");
  const T* qd = q.typed_data();
  const T* kd = k.typed_data();
  const T* vd = v.typed_data();
  const T* wd = w.typed_data();
  const int32_t* snd = senders.typed_data();
  const int32_t* rcv = receivers.typed_data();
  T* md = msg->typed_data();
  T* zd = norm->typed_data();
  std::fill(md, md + n * nf, T(0));
  std::fill(zd, zd + n, T(1));
  const T scale = T(1) / std::sqrt(T(nf));
  for (int64_t e = 0; e < ne; ++e) {
    const int32_t r = rcv[e], s = snd[e];
    if (!InRange(r, n) || !InRange(s, n)) continue;
    T score = 0;
    for (int64_t f = 0; f < nf; ++f) score += qd[r * nf + f] * kd[s * nf + f];
    const T u = wd[e] * std::exp(score * scale);
    zd[r] += u;
    for (int64_t f = 0; f < nf; ++f) md[r * nf + f] += u * vd[s * nf + f];
  }
  for (int64_t i = 0; i < n; ++i) {
    const T inv = T(1) / zd[i];
    for (int64_t f = 0; f < nf; ++f) md[i * nf + f] *= inv;
  }
  return ffi::Error::Success();
}

// VJP of AttentionForward's m: given ct [n, F], dL/dq, dL/dk, dL/dv [n, F] and dL/dw [E].
//   dL/du_e = ct[r].(v[s] - m[r]) / z[r]
template <ffi::DataType DT>
ffi::Error AttentionBackward(ffi::Buffer<DT> q, ffi::Buffer<DT> k, ffi::Buffer<DT> v, ffi::Buffer<DT> w,
                             ffi::Buffer<ffi::S32> senders, ffi::Buffer<ffi::S32> receivers,
                             ffi::Buffer<DT> msg, ffi::Buffer<DT> norm, ffi::Buffer<DT> ct,
                             ffi::ResultBuffer<DT> ct_q, ffi::ResultBuffer<DT> ct_k,
                             ffi::ResultBuffer<DT> ct_v, ffi::ResultBuffer<DT> ct_w) {
  using T = ffi::NativeType<DT>;
  const char* name = "jaxdd attention_backward";
  if (auto err = CheckAttention<DT>(name, q, k, v, w, senders, receivers); !err.success()) return err;
  const int64_t n = Dim(q, 0), nf = Dim(q, 1), ne = Dim(w, 0);
  if (!HasShape(msg, {n, nf}) || !HasShape(norm, {n}) || !HasShape(ct, {n, nf}))
    return Bad(name, "m and its cotangent must be [n, F], z must be [n]");
  if (!HasShape(*ct_q, {n, nf}) || !HasShape(*ct_k, {n, nf}) || !HasShape(*ct_v, {n, nf}) ||
      !HasShape(*ct_w, {ne}))
    return Bad(name, "results must be [n, F] three times and [E]");
  const T* qd = q.typed_data();
  const T* kd = k.typed_data();
  const T* vd = v.typed_data();
  const T* wd = w.typed_data();
  const int32_t* snd = senders.typed_data();
  const int32_t* rcv = receivers.typed_data();
  const T* md = msg.typed_data();
  const T* zd = norm.typed_data();
  const T* cd = ct.typed_data();
  T* gq = ct_q->typed_data();
  T* gk = ct_k->typed_data();
  T* gv = ct_v->typed_data();
  T* gw = ct_w->typed_data();
  std::fill(gq, gq + n * nf, T(0));
  std::fill(gk, gk + n * nf, T(0));
  std::fill(gv, gv + n * nf, T(0));
  std::fill(gw, gw + ne, T(0));
  std::vector<T> ct_dot_m(n);  // ct[r].m[r], once per receiver
  for (int64_t i = 0; i < n; ++i) {
    T acc = 0;
    for (int64_t f = 0; f < nf; ++f) acc += cd[i * nf + f] * md[i * nf + f];
    ct_dot_m[i] = acc;
  }
  const T scale = T(1) / std::sqrt(T(nf));
  for (int64_t e = 0; e < ne; ++e) {
    const int32_t r = rcv[e], s = snd[e];
    if (!InRange(r, n) || !InRange(s, n)) continue;
    T score = 0, ct_dot_v = 0;
    for (int64_t f = 0; f < nf; ++f) {
      score += qd[r * nf + f] * kd[s * nf + f];
      ct_dot_v += cd[r * nf + f] * vd[s * nf + f];
    }
    const T ex = std::exp(score * scale);
    const T u = wd[e] * ex;
    const T inv_z = T(1) / zd[r];
    const T gu = (ct_dot_v - ct_dot_m[r]) * inv_z;
    gw[e] = gu * ex;
    const T gscore = gu * u * scale;
    const T a = u * inv_z;
    for (int64_t f = 0; f < nf; ++f) {
      gv[s * nf + f] += a * cd[r * nf + f];
      gq[r * nf + f] += gscore * kd[s * nf + f];
      gk[s * nf + f] += gscore * qd[r * nf + f];
    }
  }
  return ffi::Error::Success();
}

}  // namespace

// ------------------------------------------------------------------- exported symbols

#define JAXDD_LJ_FORWARD(SYM, DT)                                                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(SYM, LjForward<DT>,                                          \
                                ffi::Ffi::Bind()                                             \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::Buffer<ffi::S32>>()                            \
                                    .Arg<ffi::Buffer<ffi::S32>>()                            \
                                    .Arg<ffi::Buffer<ffi::PRED>>()                           \
                                    .Arg<ffi::Buffer<ffi::S32>>()                            \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::BufferR0<DT>>()                                \
                                    .Arg<ffi::BufferR0<ffi::PRED>>()                         \
                                    .Ret<ffi::Buffer<DT>>()                                  \
                                    .Ret<ffi::Buffer<DT>>()                                  \
                                    .Ret<ffi::Buffer<DT>>())

#define JAXDD_LJ_BACKWARD(SYM, DT)                                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(SYM, LjBackward<DT>,                                         \
                                ffi::Ffi::Bind()                                             \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::Buffer<ffi::S32>>()                            \
                                    .Arg<ffi::Buffer<ffi::S32>>()                            \
                                    .Arg<ffi::Buffer<ffi::PRED>>()                           \
                                    .Arg<ffi::Buffer<ffi::S32>>()                            \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::BufferR0<DT>>()                                \
                                    .Arg<ffi::BufferR0<ffi::PRED>>()                         \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Ret<ffi::Buffer<DT>>()                                  \
                                    .Ret<ffi::Buffer<DT>>())

#define JAXDD_ATTENTION_FORWARD(SYM, DT)                                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(SYM, AttentionForward<DT>,                                   \
                                ffi::Ffi::Bind()                                             \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::Buffer<ffi::S32>>()                            \
                                    .Arg<ffi::Buffer<ffi::S32>>()                            \
                                    .Ret<ffi::Buffer<DT>>()                                  \
                                    .Ret<ffi::Buffer<DT>>())

#define JAXDD_ATTENTION_BACKWARD(SYM, DT)                                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(SYM, AttentionBackward<DT>,                                  \
                                ffi::Ffi::Bind()                                             \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::Buffer<ffi::S32>>()                            \
                                    .Arg<ffi::Buffer<ffi::S32>>()                            \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Arg<ffi::Buffer<DT>>()                                  \
                                    .Ret<ffi::Buffer<DT>>()                                  \
                                    .Ret<ffi::Buffer<DT>>()                                  \
                                    .Ret<ffi::Buffer<DT>>()                                  \
                                    .Ret<ffi::Buffer<DT>>())

JAXDD_LJ_FORWARD(jaxdd_lj_forward_f32, ffi::F32);
JAXDD_LJ_FORWARD(jaxdd_lj_forward_f64, ffi::F64);
JAXDD_LJ_BACKWARD(jaxdd_lj_backward_f32, ffi::F32);
JAXDD_LJ_BACKWARD(jaxdd_lj_backward_f64, ffi::F64);
JAXDD_ATTENTION_FORWARD(jaxdd_attention_forward_f32, ffi::F32);
JAXDD_ATTENTION_FORWARD(jaxdd_attention_forward_f64, ffi::F64);
JAXDD_ATTENTION_BACKWARD(jaxdd_attention_backward_f32, ffi::F32);
JAXDD_ATTENTION_BACKWARD(jaxdd_attention_backward_f64, ffi::F64);

// The library is built as a Python extension module (setuptools knows how to build
// and install those, editable installs included). Importing it gives an empty module;
// jaxdd only uses its file path, to load it with ctypes.
static struct PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_kernels",
                                     "jaxdd's XLA FFI kernels for the CPU (loaded with ctypes).", -1,
                                     nullptr};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kModule); }
