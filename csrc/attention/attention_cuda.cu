// Kernel 2 for CUDA GPUs: a graph transformer's attention-weighted aggregation onto
// receivers, and its VJP, as XLA FFI handlers: the same handlers, names and formulas as
// attention_cpu.cc (read that file for the definitions), one thread per edge with atomic
// accumulation. Built by setup.py when nvcc is found and a CUDA build is wanted; registered
// for the CUDA platform by jaxdd/ffi/_library.py.
//
// Status: compiled with nvcc 13; not yet run on a GPU (none was available when written).

#include <cstdint>

#include <cuda_runtime.h>

#include "cuda_launch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxdd::cuda::Blocks;
using jaxdd::cuda::InRange;
using jaxdd::cuda::kThreads;
using jaxdd::cuda::LastError;

namespace {

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

#define JAXDD_ATTENTION_HANDLERS(SUFFIX, DT)                                                    \
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

JAXDD_ATTENTION_HANDLERS(f32, ffi::F32);
JAXDD_ATTENTION_HANDLERS(f64, ffi::F64);
