// Per-edge arithmetic shared by the CPU (lj/lj_cpu.cc) and CUDA (lj/lj_cuda.cu)
// builds of jaxdd's FFI kernels, so both compute exactly the same formulas.
#ifndef JAXDD_KERNELS_MATH_H_
#define JAXDD_KERNELS_MATH_H_

#if defined(__CUDACC__)
#define JAXDD_HD __host__ __device__ __forceinline__
#else
#define JAXDD_HD inline
#endif

namespace jaxdd {

// Lennard-Jones pair term at squared distance r2 (< cutoff^2):
//   v     = 4 eps [(sig/r)^12 - (sig/r)^6] - v_shift        (energy)
//   dv_r2 = dv / d(r2)                                       (so dv/d(d) = 2 d dv_r2)
// v_shift is V(r_c) for a shifted potential and 0 otherwise.
template <typename T>
JAXDD_HD void lj_pair(T r2, T sig, T eps, T v_shift, T* v, T* dv_r2) {
  const T inv_r2 = T(1) / r2;
  const T q = sig * sig * inv_r2;
  const T s6 = q * q * q;
  *v = T(4) * eps * (s6 * s6 - s6) - v_shift;
  // d s6 / d r2 = -3 s6 / r2
  *dv_r2 = T(-12) * eps * s6 * (T(2) * s6 - T(1)) * inv_r2;
}

}  // namespace jaxdd

#endif  // JAXDD_KERNELS_MATH_H_
