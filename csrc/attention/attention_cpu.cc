// Kernel 2 for the CPU: a graph transformer's attention-weighted aggregation of neighbour
// values onto receivers, and its VJP, as XLA FFI handlers.
//
// Loaded with ctypes by jaxdd/ffi/_library.py and registered with
// jax.ffi.register_ffi_target; called through jax.ffi.ffi_call by the named op of
// jaxdd/ffi/attention.py, whose jnp reference defines what every handler computes. Each
// handler exists for float32 and float64 (suffix _f32/_f64).
//
// Edge conventions (jaxdd.neighbors): edge e points from its receiver r to its sender
// s; padding edges carry an index outside [0, n) and are skipped. The Python wrapper
// checks shapes and dtypes before calling; the checks here only keep a wrong call from
// reading outside its buffers.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "buffer_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxdd::Bad;
using jaxdd::Dim;
using jaxdd::HasShape;
using jaxdd::InRange;

namespace {

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

JAXDD_ATTENTION_FORWARD(jaxdd_attention_forward_f32, ffi::F32);
JAXDD_ATTENTION_FORWARD(jaxdd_attention_forward_f64, ffi::F64);
JAXDD_ATTENTION_BACKWARD(jaxdd_attention_backward_f32, ffi::F32);
JAXDD_ATTENTION_BACKWARD(jaxdd_attention_backward_f64, ffi::F64);
