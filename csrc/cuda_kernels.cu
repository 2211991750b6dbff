// jaxdd's fused kernels for CUDA GPUs, as XLA FFI handlers: the same handlers, names
// and formulas as cpu_kernels.cc (read that file for the definitions), one thread per
// edge with atomic accumulation. Built by setup.py when nvcc is found and a CUDA build is
// wanted; registered for the CUDA platform by jaxdd/ffi/_library.py.
//
// Status: compiled with nvcc 13; not yet run on a GPU (none was available when written).

#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "kernels_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kThreads = 256;

inline int Blocks(int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

ffi::Error LastError(const char* name) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string(name) + ": " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

__device__ __forceinline__ bool InRange(int32_t i, int64_t n) { return i >= 0 && i < n; }

// ----------------------------------------------------------------------------- LJ

template <typename T>
__device__ __forceinline__ const T* EdgeVector(const T* x, const int32_t* sh, const T* cells, const int32_t* system,
                                               int64_t n_cells, int64_t e, int32_t r, int32_t s, T* d) {
  d[0] = x[3 * s] - x[3 * r];
  d[1] = x[3 * s + 1] - x[3 * r + 1];
  d[2] = x[3 * s + 2] - x[3 * r + 2];
  if (sh == nullptr) return nullptr;  // a list without shifts ([0, 3])
  const int32_t n0 = sh[3 * e], n1 = sh[3 * e + 1], n2 = sh[3 * e + 2];
  if ((n0 | n1 | n2) == 0) return nullptr;
  int64_t c = system[r];
  c = c < 0 ? 0 : (c >= n_cells ? n_cells - 1 : c);
  const T* h = cells + 9 * c;
  for (int j = 0; j < 3; ++j) d[j] += T(n0) * h[j] + T(n1) * h[3 + j] + T(n2) * h[6 + j];
  return h;
}

// ef / w: whether the energies and forces, and the virial, are wanted (cpu_kernels.cc's
// ``parts``); a part not wanted has a null output.
template <typename T>
__global__ void LjForwardKernel(int64_t n, int64_t ne, int64_t k, int64_t nc, const T* x, const int32_t* sh,
                                const T* cells, const int32_t* sys, const int32_t* snd, const int32_t* rcv,
                                const bool* m, const int32_t* ty, const T* sig, const T* eps, const T* vs,
                                const T* cutoff, const bool* half_list, T* en, T* f, T* w) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= ne) return;
  const int32_t r = rcv[e], s = snd[e];
  if (!m[e] || !InRange(r, n) || !InRange(s, n)) return;
  T d[3];
  EdgeVector(x, sh, cells, sys, nc, e, r, s, d);
  const T r2 = d[0] * d[0] + d[1] * d[1] + d[2] * d[2];
  if (!(r2 < cutoff[0] * cutoff[0])) return;
  const int64_t ab = int64_t(ty[r]) * k + ty[s];
  T v, dv;
  jaxdd::lj_pair<T>(r2, sig[ab], eps[ab], vs[ab], &v, &dv);
  const T g = T(2) * dv;
  const bool half = half_list[0];
  if (en != nullptr) {
    atomicAdd(en + r, T(0.5) * v);
    if (half) atomicAdd(en + s, T(0.5) * v);
    for (int a = 0; a < 3; ++a) {
      atomicAdd(f + 3 * r + a, g * d[a]);
      if (half) atomicAdd(f + 3 * s + a, -g * d[a]);
    }
  }
  if (w != nullptr) {
    for (int a = 0; a < 3; ++a) {
      for (int b = 0; b < 3; ++b) {
        atomicAdd(w + 9 * r + 3 * a + b, -dv * d[a] * d[b]);
        if (half) atomicAdd(w + 9 * s + 3 * a + b, -dv * d[a] * d[b]);
      }
    }
  }
}

template <typename T>
__global__ void LjBackwardKernel(int64_t n, int64_t ne, int64_t k, int64_t nc, const T* x, const int32_t* sh,
                                 const T* cells, const int32_t* sys, const int32_t* snd, const int32_t* rcv,
                                 const bool* m, const int32_t* ty, const T* sig, const T* eps, const T* vs,
                                 const T* cutoff, const bool* half_list, const T* cte, T* gx, T* gh) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= ne) return;
  const int32_t r = rcv[e], s = snd[e];
  if (!m[e] || !InRange(r, n) || !InRange(s, n)) return;
  T d[3];
  const T* cell = EdgeVector(x, sh, cells, sys, nc, e, r, s, d);
  const T r2 = d[0] * d[0] + d[1] * d[1] + d[2] * d[2];
  if (!(r2 < cutoff[0] * cutoff[0])) return;
  const int64_t ab = int64_t(ty[r]) * k + ty[s];
  T v, dv;
  jaxdd::lj_pair<T>(r2, sig[ab], eps[ab], vs[ab], &v, &dv);
  const T wv = T(0.5) * (half_list[0] ? cte[r] + cte[s] : cte[r]);
  const T g = T(2) * wv * dv;
  for (int a = 0; a < 3; ++a) {
    atomicAdd(gx + 3 * s + a, g * d[a]);
    atomicAdd(gx + 3 * r + a, -g * d[a]);
  }
  if (cell != nullptr) {
    T* gc = gh + (cell - cells);
    for (int a = 0; a < 3; ++a)
      for (int j = 0; j < 3; ++j) atomicAdd(gc + 3 * a + j, T(sh[3 * e + a]) * g * d[j]);
  }
}

template <ffi::DataType DT>
ffi::Error LjForward(cudaStream_t stream, ffi::Buffer<DT> pos, ffi::Buffer<ffi::S32> shifts, ffi::Buffer<DT> cells,
                     ffi::Buffer<ffi::S32> system, ffi::Buffer<ffi::S32> senders, ffi::Buffer<ffi::S32> receivers,
                     ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> types, ffi::Buffer<DT> sigma,
                     ffi::Buffer<DT> epsilon, ffi::Buffer<DT> v_shift, ffi::BufferR0<DT> cutoff,
                     ffi::BufferR0<ffi::PRED> half_list, int64_t parts, ffi::ResultBuffer<DT> energy,
                     ffi::ResultBuffer<DT> forces, ffi::ResultBuffer<DT> virial) {
  using T = ffi::NativeType<DT>;
  const int64_t n = pos.dimensions()[0], ne = senders.dimensions()[0], k = sigma.dimensions()[0];
  const int64_t nc = cells.dimensions()[0];
  // parts: 1 energies and forces, 2 virial, 3 both; a part not asked for has 0 rows.
  if (parts < 1 || parts > 3) return ffi::Error::InvalidArgument("jaxdd lj_forward (CUDA): parts must be 1, 2 or 3");
  const bool want_ef = parts & 1, want_w = parts & 2;
  const int64_t ne_rows = want_ef ? n : 0, nw_rows = want_w ? n : 0;
  if (int64_t(energy->element_count()) != ne_rows || int64_t(forces->element_count()) != 3 * ne_rows ||
      int64_t(virial->element_count()) != 9 * nw_rows)
    return ffi::Error::InvalidArgument(
        "jaxdd lj_forward (CUDA): results must be energy [n], forces [n, 3], virial [n, 3, 3] (0 rows for a part "
        "not asked for)");
  if (want_ef) {
    cudaMemsetAsync(energy->typed_data(), 0, sizeof(T) * n, stream);
    cudaMemsetAsync(forces->typed_data(), 0, sizeof(T) * 3 * n, stream);
  }
  if (want_w) cudaMemsetAsync(virial->typed_data(), 0, sizeof(T) * 9 * n, stream);
  if (ne > 0)
    LjForwardKernel<T><<<Blocks(ne), kThreads, 0, stream>>>(
        n, ne, k, nc, pos.typed_data(), shifts.dimensions()[0] == 0 ? nullptr : shifts.typed_data(), cells.typed_data(), system.typed_data(),
        senders.typed_data(), receivers.typed_data(), mask.typed_data(), types.typed_data(), sigma.typed_data(),
        epsilon.typed_data(), v_shift.typed_data(), cutoff.typed_data(), half_list.typed_data(),
        want_ef ? energy->typed_data() : nullptr, want_ef ? forces->typed_data() : nullptr,
        want_w ? virial->typed_data() : nullptr);
  return LastError("jaxdd lj_forward (CUDA)");
}

template <ffi::DataType DT>
ffi::Error LjBackward(cudaStream_t stream, ffi::Buffer<DT> pos, ffi::Buffer<ffi::S32> shifts, ffi::Buffer<DT> cells,
                      ffi::Buffer<ffi::S32> system, ffi::Buffer<ffi::S32> senders, ffi::Buffer<ffi::S32> receivers,
                      ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> types, ffi::Buffer<DT> sigma,
                      ffi::Buffer<DT> epsilon, ffi::Buffer<DT> v_shift, ffi::BufferR0<DT> cutoff,
                      ffi::BufferR0<ffi::PRED> half_list, ffi::Buffer<DT> ct, ffi::ResultBuffer<DT> ct_pos,
                      ffi::ResultBuffer<DT> ct_cells) {
  using T = ffi::NativeType<DT>;
  const int64_t n = pos.dimensions()[0], ne = senders.dimensions()[0], k = sigma.dimensions()[0];
  const int64_t nc = cells.dimensions()[0];
  cudaMemsetAsync(ct_pos->typed_data(), 0, sizeof(T) * 3 * n, stream);
  cudaMemsetAsync(ct_cells->typed_data(), 0, sizeof(T) * 9 * nc, stream);
  if (ne > 0)
    LjBackwardKernel<T><<<Blocks(ne), kThreads, 0, stream>>>(
        n, ne, k, nc, pos.typed_data(), shifts.dimensions()[0] == 0 ? nullptr : shifts.typed_data(), cells.typed_data(), system.typed_data(),
        senders.typed_data(), receivers.typed_data(), mask.typed_data(), types.typed_data(), sigma.typed_data(),
        epsilon.typed_data(), v_shift.typed_data(), cutoff.typed_data(), half_list.typed_data(), ct.typed_data(),
        ct_pos->typed_data(), ct_cells->typed_data());
  return LastError("jaxdd lj_backward (CUDA)");
}

// ------------------------------------------------------------------- attention messages

template <typename T>
__global__ void Fill(int64_t n, T value, T* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = value;
}

template <typename T>
__global__ void AttentionEdges(int64_t n, int64_t nf, int64_t ne, const T* q, const T* k, const T* v, const T* w,
                               const int32_t* snd, const int32_t* rcv, T* acc, T* z) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= ne) return;
  const int32_t r = rcv[e], s = snd[e];
  if (!InRange(r, n) || !InRange(s, n)) return;
  T score = 0;
  for (int64_t f = 0; f < nf; ++f) score += q[r * nf + f] * k[s * nf + f];
  const T u = w[e] * exp(score / sqrt(T(nf)));
  atomicAdd(z + r, u);
  for (int64_t f = 0; f < nf; ++f) atomicAdd(acc + r * nf + f, u * v[s * nf + f]);
}

template <typename T>
__global__ void Normalise(int64_t n, int64_t nf, const T* z, T* m) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n * nf) return;
  m[i] /= z[i / nf];
}

template <typename T>
__global__ void RowDot(int64_t n, int64_t nf, const T* a, const T* b, T* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  T acc = 0;
  for (int64_t f = 0; f < nf; ++f) acc += a[i * nf + f] * b[i * nf + f];
  out[i] = acc;
}

template <typename T>
__global__ void AttentionBackwardEdges(int64_t n, int64_t nf, int64_t ne, const T* q, const T* k, const T* v,
                                       const T* w, const int32_t* snd, const int32_t* rcv, const T* z, const T* ct,
                                       const T* ct_dot_m, T* gq, T* gk, T* gv, T* gw) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= ne) return;
  const int32_t r = rcv[e], s = snd[e];
  if (!InRange(r, n) || !InRange(s, n)) {
    gw[e] = 0;
    return;
  }
  const T scale = T(1) / sqrt(T(nf));
  T score = 0, ct_dot_v = 0;
  for (int64_t f = 0; f < nf; ++f) {
    score += q[r * nf + f] * k[s * nf + f];
    ct_dot_v += ct[r * nf + f] * v[s * nf + f];
  }
  const T ex = exp(score * scale);
  const T u = w[e] * ex;
  const T inv_z = T(1) / z[r];
  const T gu = (ct_dot_v - ct_dot_m[r]) * inv_z;
  gw[e] = gu * ex;
  const T gscore = gu * u * scale;
  const T a = u * inv_z;
  for (int64_t f = 0; f < nf; ++f) {
    atomicAdd(gv + s * nf + f, a * ct[r * nf + f]);
    atomicAdd(gq + r * nf + f, gscore * k[s * nf + f]);
    atomicAdd(gk + s * nf + f, gscore * q[r * nf + f]);
  }
}

template <ffi::DataType DT>
ffi::Error AttentionForward(cudaStream_t stream, ffi::Buffer<DT> q, ffi::Buffer<DT> k, ffi::Buffer<DT> v,
                            ffi::Buffer<DT> w, ffi::Buffer<ffi::S32> senders, ffi::Buffer<ffi::S32> receivers,
                            ffi::ResultBuffer<DT> msg, ffi::ResultBuffer<DT> norm) {
  using T = ffi::NativeType<DT>;
  const int64_t n = q.dimensions()[0], nf = q.dimensions()[1], ne = w.dimensions()[0];
  cudaMemsetAsync(msg->typed_data(), 0, sizeof(T) * n * nf, stream);
  if (n > 0) Fill<T><<<Blocks(n), kThreads, 0, stream>>>(n, T(1), norm->typed_data());
  if (ne > 0)
    AttentionEdges<T><<<Blocks(ne), kThreads, 0, stream>>>(n, nf, ne, q.typed_data(), k.typed_data(), v.typed_data(),
                                                           w.typed_data(), senders.typed_data(),
                                                           receivers.typed_data(), msg->typed_data(),
                                                           norm->typed_data());
  if (n * nf > 0)
    Normalise<T><<<Blocks(n * nf), kThreads, 0, stream>>>(n, nf, norm->typed_data(), msg->typed_data());
  return LastError("jaxdd attention_forward (CUDA)");
}

template <ffi::DataType DT>
ffi::Error AttentionBackward(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::Buffer<DT> q,
                             ffi::Buffer<DT> k, ffi::Buffer<DT> v, ffi::Buffer<DT> w, ffi::Buffer<ffi::S32> senders,
                             ffi::Buffer<ffi::S32> receivers, ffi::Buffer<DT> msg, ffi::Buffer<DT> norm,
                             ffi::Buffer<DT> ct, ffi::ResultBuffer<DT> ct_q, ffi::ResultBuffer<DT> ct_k,
                             ffi::ResultBuffer<DT> ct_v, ffi::ResultBuffer<DT> ct_w) {
  using T = ffi::NativeType<DT>;
  const int64_t n = q.dimensions()[0], nf = q.dimensions()[1], ne = w.dimensions()[0];
  cudaMemsetAsync(ct_q->typed_data(), 0, sizeof(T) * n * nf, stream);
  cudaMemsetAsync(ct_k->typed_data(), 0, sizeof(T) * n * nf, stream);
  cudaMemsetAsync(ct_v->typed_data(), 0, sizeof(T) * n * nf, stream);
  auto buffer = scratch.Allocate(sizeof(T) * (n > 0 ? n : 1));
  if (!buffer.has_value()) return ffi::Error::Internal("jaxdd attention_backward (CUDA): no scratch memory");
  T* ct_dot_m = static_cast<T*>(*buffer);
  if (n > 0) RowDot<T><<<Blocks(n), kThreads, 0, stream>>>(n, nf, ct.typed_data(), msg.typed_data(), ct_dot_m);
  if (ne > 0)
    AttentionBackwardEdges<T><<<Blocks(ne), kThreads, 0, stream>>>(
        n, nf, ne, q.typed_data(), k.typed_data(), v.typed_data(), w.typed_data(), senders.typed_data(),
        receivers.typed_data(), norm.typed_data(), ct.typed_data(), ct_dot_m, ct_q->typed_data(),
        ct_k->typed_data(), ct_v->typed_data(), ct_w->typed_data());
  return LastError("jaxdd attention_backward (CUDA)");
}

}  // namespace

#define JAXDD_LJ_ARGS(DT)                                                                       \
  .Ctx<ffi::PlatformStream<cudaStream_t>>()                                                     \
      .Arg<ffi::Buffer<DT>>()                                                                   \
      .Arg<ffi::Buffer<ffi::S32>>()                                                             \
      .Arg<ffi::Buffer<DT>>()                                                                   \
      .Arg<ffi::Buffer<ffi::S32>>()                                                             \
      .Arg<ffi::Buffer<ffi::S32>>()                                                             \
      .Arg<ffi::Buffer<ffi::S32>>()                                                             \
      .Arg<ffi::Buffer<ffi::PRED>>()                                                            \
      .Arg<ffi::Buffer<ffi::S32>>()                                                             \
      .Arg<ffi::Buffer<DT>>()                                                                   \
      .Arg<ffi::Buffer<DT>>()                                                                   \
      .Arg<ffi::Buffer<DT>>()                                                                   \
      .Arg<ffi::BufferR0<DT>>()                                                                 \
      .Arg<ffi::BufferR0<ffi::PRED>>()

#define JAXDD_CUDA_HANDLERS(SUFFIX, DT)                                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdd_lj_forward_##SUFFIX, LjForward<DT>,                       \
                                ffi::Ffi::Bind() JAXDD_LJ_ARGS(DT)                              \
                                    .Attr<int64_t>("parts")                                     \
                                    .Ret<ffi::Buffer<DT>>()                                     \
                                    .Ret<ffi::Buffer<DT>>()                                     \
                                    .Ret<ffi::Buffer<DT>>());                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdd_lj_backward_##SUFFIX, LjBackward<DT>,                     \
                                ffi::Ffi::Bind() JAXDD_LJ_ARGS(DT)                              \
                                    .Arg<ffi::Buffer<DT>>()                                     \
                                    .Ret<ffi::Buffer<DT>>()                                     \
                                    .Ret<ffi::Buffer<DT>>());                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdd_attention_forward_##SUFFIX, AttentionForward<DT>,         \
                                ffi::Ffi::Bind()                                                \
                                    .Ctx<ffi::PlatformStream<cudaStream_t>>()                   \
                                    .Arg<ffi::Buffer<DT>>()                                     \
                                    .Arg<ffi::Buffer<DT>>()                                     \
                                    .Arg<ffi::Buffer<DT>>()                                     \
                                    .Arg<ffi::Buffer<DT>>()                                     \
                                    .Arg<ffi::Buffer<ffi::S32>>()                               \
                                    .Arg<ffi::Buffer<ffi::S32>>()                               \
                                    .Ret<ffi::Buffer<DT>>()                                     \
                                    .Ret<ffi::Buffer<DT>>());                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdd_attention_backward_##SUFFIX, AttentionBackward<DT>,       \
                                ffi::Ffi::Bind()                                                \
                                    .Ctx<ffi::PlatformStream<cudaStream_t>>()                   \
                                    .Ctx<ffi::ScratchAllocator>()                               \
                                    .Arg<ffi::Buffer<DT>>()                                     \
                                    .Arg<ffi::Buffer<DT>>()                                     \
                                    .Arg<ffi::Buffer<DT>>()                                     \
                                    .Arg<ffi::Buffer<DT>>()                                     \
                                    .Arg<ffi::Buffer<ffi::S32>>()                               \
                                    .Arg<ffi::Buffer<ffi::S32>>()                               \
                                    .Arg<ffi::Buffer<DT>>()                                     \
                                    .Arg<ffi::Buffer<DT>>()                                     \
                                    .Arg<ffi::Buffer<DT>>()                                     \
                                    .Ret<ffi::Buffer<DT>>()                                     \
                                    .Ret<ffi::Buffer<DT>>()                                     \
                                    .Ret<ffi::Buffer<DT>>()                                     \
                                    .Ret<ffi::Buffer<DT>>())

JAXDD_CUDA_HANDLERS(f32, ffi::F32);
JAXDD_CUDA_HANDLERS(f64, ffi::F64);
