// Kernel 1 for CUDA GPUs: fused Lennard-Jones energies, forces and per-atom virial, and the
// VJP of its energies, as XLA FFI handlers: the same handlers, names and formulas as
// lj_cpu.cc (read that file for the definitions), one thread per edge with atomic
// accumulation. Built by setup.py when nvcc is found and a CUDA build is wanted; registered
// for the CUDA platform by jaxdd/ffi/_library.py.
//
// Status: compiled with nvcc 13; not yet run on a GPU (none was available when written).

#include <cstdint>

#include <cuda_runtime.h>

#include "cuda_launch.h"
#include "kernels_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxdd::cuda::Blocks;
using jaxdd::cuda::InRange;
using jaxdd::cuda::kThreads;
using jaxdd::cuda::LastError;

namespace {

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

// ef / w: whether the energies and forces, and the virial, are wanted (lj_cpu.cc's
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

#define JAXDD_LJ_HANDLERS(SUFFIX, DT)                                                           \
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
                                    .Ret<ffi::Buffer<DT>>())

JAXDD_LJ_HANDLERS(f32, ffi::F32);
JAXDD_LJ_HANDLERS(f64, ffi::F64);
