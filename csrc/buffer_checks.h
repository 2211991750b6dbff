// Checks of an XLA FFI handler's buffers, shared by the CPU kernels (lj/, attention/).
//
// The Python wrappers check shapes and dtypes before calling; these checks only keep a
// wrong call from reading outside its buffers, and say which argument was wrong.
#ifndef JAXDD_BUFFER_CHECKS_H_
#define JAXDD_BUFFER_CHECKS_H_

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxdd {

// Size of dimension i of a buffer.
template <typename Buf>
int64_t Dim(const Buf& b, int i) {
  return static_cast<int64_t>(b.dimensions()[i]);
}

// True when the buffer has exactly this shape.
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

// An InvalidArgument error naming the kernel.
inline xla::ffi::Error Bad(const std::string& kernel, const std::string& what) {
  return xla::ffi::Error::InvalidArgument(kernel + ": " + what);
}

// An index in [0, n): padding edges carry one outside and are skipped.
inline bool InRange(int32_t i, int64_t n) { return i >= 0 && i < n; }

}  // namespace jaxdd

#endif  // JAXDD_BUFFER_CHECKS_H_
