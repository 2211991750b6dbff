// Launch helpers shared by the CUDA kernels (lj/, attention/): one thread per item in
// blocks of kThreads, and the error of the last launch as an XLA FFI error.
#ifndef JAXDD_CUDA_LAUNCH_H_
#define JAXDD_CUDA_LAUNCH_H_

#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace jaxdd::cuda {

constexpr int kThreads = 256;

inline int Blocks(int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

inline xla::ffi::Error LastError(const char* name) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return xla::ffi::Error::Internal(std::string(name) + ": " + cudaGetErrorString(err));
  return xla::ffi::Error::Success();
}

// An index in [0, n): padding edges carry one outside and are skipped.
__device__ __forceinline__ bool InRange(int32_t i, int64_t n) { return i >= 0 && i < n; }

}  // namespace jaxdd::cuda

#endif  // JAXDD_CUDA_LAUNCH_H_
