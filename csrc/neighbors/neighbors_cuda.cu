// The open-boundary cell list for CUDA GPUs, as an XLA FFI handler: the GPU twin of
// neighbors_cpu.cc (read that file and jaxdd/ffi/neighbors.py for the definition). The
// same bins (per system, cubes of cutoff / 2 that grow only where a sparse system would
// need more bins than twice its atoms), the same capacity contract (edges past max_edges
// are counted, not written) and the same order keys for half lists; the result is the
// CPU kernel's, edge for edge, since both sort each bin by atom index and scan the bins
// in the same order.
//
// Passes, all on the handler's stream, no host synchronisation:
//   1. per-system bounding boxes and atom counts (atomics on order-preserving integers);
//   2. each system's grid, one thread (systems are few; bins are bounded by 2 n + 8 per
//      system, so every buffer is sized before the launch);
//   3. counting sort: per-bin counts, a prefix sum for the bin starts, an atomic drop into
//      the bins and each atom's rank by index within its bin (so the order is deterministic);
//   4. one thread per receiver counts its pairs over the 27-bin stencil; a scan of the
//      counts gives each receiver's first slot; the same thread scans again and writes.

#include <cmath>
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "stencil.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kThreads = 256;
constexpr int kScanBlock = 1024;  // elements (and threads) per block of the prefix sum
using jaxdd::BinOf;
using jaxdd::kBinsPerCutoff;

inline int Blocks(int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

ffi::Error Bad(const std::string& what) { return ffi::Error::InvalidArgument("jaxdd cell_list (CUDA): " + what); }

ffi::Error LastError() {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return ffi::Error::Internal(std::string("jaxdd cell_list (CUDA): ") + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// One system's bins: origin, bin edge, bins per axis and the first bin's global id.
struct Grid {
  double lo[3];
  double width;
  int64_t nb[3];
  int64_t offset;
};

// Doubles as int64 keys whose signed order is the doubles' order (NaN excluded), so that
// atomicMin / atomicMax give bounding boxes.
__device__ __forceinline__ long long OrderKey(double v) {
  const long long b = __double_as_longlong(v);
  return b >= 0 ? b : b ^ 0x7FFFFFFFFFFFFFFFLL;
}
__device__ __forceinline__ double FromOrderKey(long long k) {
  return __longlong_as_double(k >= 0 ? k : k ^ 0x7FFFFFFFFFFFFFFFLL);
}

__device__ __forceinline__ bool Real(const bool* m, const int32_t* sys, int64_t i, int64_t ns) {
  return m[i] && sys[i] >= 0 && sys[i] < ns;
}

__global__ void InitBoxes(int64_t ns, long long* lo, long long* hi, int64_t* atoms) {
  const int64_t s = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (s >= ns) return;
  for (int a = 0; a < 3; ++a) lo[3 * s + a] = OrderKey(__longlong_as_double(0x7FF0000000000000LL));  // +inf
  for (int a = 0; a < 3; ++a) hi[3 * s + a] = OrderKey(__longlong_as_double(0xFFF0000000000000LL));  // -inf
  atoms[s] = 0;
}

template <typename T>
__global__ void Boxes(int64_t n, int64_t ns, const T* x, const int32_t* sys, const bool* m, long long* lo,
                      long long* hi, int64_t* atoms) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n || !Real(m, sys, i, ns)) return;
  const int32_t s = sys[i];
  atomicAdd(reinterpret_cast<unsigned long long*>(atoms + s), 1ULL);
  for (int a = 0; a < 3; ++a) {
    const double v = double(x[3 * i + a]);
    if (v != v) continue;  // NaN takes no part in the box (as the CPU kernel's comparisons)
    atomicMin(lo + 3 * s + a, OrderKey(v));
    atomicMax(hi + 3 * s + a, OrderKey(v));
  }
}

// Single thread: the grids of all systems, in order, and the total bin count.
__global__ void Grids(int64_t ns, double cutoff, const long long* lo, const long long* hi, const int64_t* atoms,
                      Grid* grid, int64_t* n_bins) {
  int64_t total_bins = 0;
  for (int64_t s = 0; s < ns; ++s) {
    Grid g;
    double extent[3];
    for (int a = 0; a < 3; ++a) {
      g.lo[a] = FromOrderKey(lo[3 * s + a]);
      extent[a] = FromOrderKey(hi[3 * s + a]) - g.lo[a];
      if (!(extent[a] >= 0) || !isfinite(extent[a])) g.lo[a] = 0, extent[a] = 0;  // empty or non-finite
    }
    const double budget = 2.0 * double(atoms[s]) + 8.0;
    g.width = cutoff / kBinsPerCutoff;
    for (;;) {
      double total = 1;
      for (int a = 0; a < 3; ++a) {
        g.nb[a] = int64_t(floor(extent[a] / g.width)) + 1;
        total *= double(g.nb[a]);
      }
      if (total <= budget) break;
      g.width *= 1.25;
    }
    g.offset = total_bins;
    total_bins += g.nb[0] * g.nb[1] * g.nb[2];
    grid[s] = g;
  }
  *n_bins = total_bins;
}

// Each real atom's bin (else -1) and the per-bin counts, at start[bin + 1].
template <typename T>
__global__ void Bin(int64_t n, int64_t ns, const T* x, const int32_t* sys, const bool* m, const Grid* grid,
                    int64_t* bin, int64_t* start) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  if (!Real(m, sys, i, ns)) {
    bin[i] = -1;
    return;
  }
  const Grid& g = grid[sys[i]];
  int64_t b[3];
  for (int a = 0; a < 3; ++a) b[a] = BinOf(double(x[3 * i + a]), g.lo[a], g.width, g.nb[a]);
  bin[i] = g.offset + b[0] + g.nb[0] * (b[1] + g.nb[1] * b[2]);
  atomicAdd(reinterpret_cast<unsigned long long*>(start + bin[i] + 1), 1ULL);
}

// Inclusive prefix sum of each block of kScanBlock elements in place; the block's total
// goes to sums[block].
__global__ void ScanBlocks(int64_t n, int64_t* data, int64_t* sums) {
  __shared__ int64_t buf[2][kScanBlock];
  const int t = threadIdx.x;
  const int64_t i = blockIdx.x * int64_t(kScanBlock) + t;
  int cur = 0;
  buf[0][t] = i < n ? data[i] : 0;
  __syncthreads();
  for (int step = 1; step < kScanBlock; step <<= 1) {
    buf[1 - cur][t] = buf[cur][t] + (t >= step ? buf[cur][t - step] : 0);
    cur = 1 - cur;
    __syncthreads();
  }
  if (i < n) data[i] = buf[cur][t];
  if (t == kScanBlock - 1) sums[blockIdx.x] = buf[cur][t];
}

__global__ void AddBlockOffsets(int64_t n, int64_t* data, const int64_t* scanned_sums) {
  const int64_t i = blockIdx.x * int64_t(kScanBlock) + threadIdx.x;
  if (i < n && blockIdx.x > 0) data[i] += scanned_sums[blockIdx.x - 1];
}

// Inclusive prefix sum of data[0, n) in place (recursive over block totals).
bool InclusiveScan(cudaStream_t stream, ffi::ScratchAllocator& scratch, int64_t* data, int64_t n) {
  if (n <= 0) return true;
  const int64_t blocks = (n + kScanBlock - 1) / kScanBlock;
  auto sums = scratch.Allocate(sizeof(int64_t) * blocks, alignof(int64_t));
  if (!sums.has_value()) return false;
  int64_t* s = static_cast<int64_t*>(*sums);
  ScanBlocks<<<static_cast<unsigned>(blocks), kScanBlock, 0, stream>>>(n, data, s);
  if (blocks == 1) return true;
  if (!InclusiveScan(stream, scratch, s, blocks)) return false;
  AddBlockOffsets<<<static_cast<unsigned>(blocks), kScanBlock, 0, stream>>>(n, data, s);
  return true;
}

// Counting sort, in two steps so that it is deterministic: atoms drop into their bin's
// slots in any order (atomic cursor), then each takes the slot of its rank among the bin's
// atoms by index, the order of the CPU kernel's sequential fill. Ranking scans the bin once
// per member: no more work than the stencil scan that follows.
__global__ void Drop(int64_t n, const int64_t* bin, const int64_t* start, unsigned long long* cursor,
                     int32_t* unordered) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n || bin[i] < 0) return;
  unordered[start[bin[i]] + int64_t(atomicAdd(cursor + bin[i], 1ULL))] = int32_t(i);
}

template <typename T>
__global__ void Place(int64_t n, const int64_t* bin, const int64_t* start, const int32_t* unordered, const T* x,
                      const int32_t* ka, const int32_t* kb, int32_t* order, T* sx, int32_t* sa, int32_t* sb) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n || bin[i] < 0) return;
  const int64_t b = bin[i];
  int64_t k = start[b];
  for (int64_t q = start[b]; q < start[b + 1]; ++q) k += (unordered[q] < i);
  order[k] = int32_t(i);
  sx[3 * k] = x[3 * i], sx[3 * k + 1] = x[3 * i + 1], sx[3 * k + 2] = x[3 * i + 2];
  sa[k] = ka[i], sb[k] = kb[i];
}

// One receiver's stencil scan: counts its pairs (out == nullptr) or writes them from
// out[0]. The bins are visited as the CPU kernel visits them.
template <typename T>
__device__ int64_t Scan(int64_t i, const T* x, const int32_t* sys, const int64_t* bin, const Grid* grid,
                        const int64_t* start, const int32_t* order, const T* sx, const int32_t* sa, const int32_t* sb,
                        const int32_t* ka, const int32_t* kb, double cutoff, bool half, int32_t* out, int64_t room) {
  const Grid g = grid[sys[i]];
  const T xi = x[3 * i], yi = x[3 * i + 1], zi = x[3 * i + 2];
  const T rc2 = T(cutoff) * T(cutoff);
  const int32_t self = int32_t(i), ai = ka[i], bi = kb[i];
  int64_t m = 0;
  jaxdd::ForEachRun(g, bin[i] - g.offset, double(xi), double(yi), double(zi), cutoff, [&](int64_t b0, int64_t b1) {
    for (int64_t k = start[b0]; k < start[b1 + 1]; ++k) {
      const int32_t j = order[k];
      const T dx = sx[3 * k] - xi, dy = sx[3 * k + 1] - yi, dz = sx[3 * k + 2] - zi;
      bool keep = (dx * dx + dy * dy + dz * dz < rc2) && j != self;
      if (half) keep = keep && jaxdd::HalfKeeps(ai, bi, sa[k], sb[k]);
      if (keep) {
        if (out != nullptr && m < room) out[m] = j;
        ++m;
      }
    }
  });
  return m;
}

template <typename T>
__global__ void CountPairs(int64_t n_recv, const T* x, const int32_t* sys, const int64_t* bin, const Grid* grid,
                           const int64_t* start, const int32_t* order, const T* sx, const int32_t* sa,
                           const int32_t* sb, const int32_t* ka, const int32_t* kb, double cutoff, bool half,
                           int64_t* counts) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n_recv) return;
  counts[i] = bin[i] < 0 ? 0 : Scan(i, x, sys, bin, grid, start, order, sx, sa, sb, ka, kb, cutoff, half, nullptr, 0);
}

// ends: inclusive scan of the counts (receiver i's edges are [ends[i] - count, ends[i])).
template <typename T>
__global__ void WritePairs(int64_t n, int64_t n_recv, int64_t cap, const T* x, const int32_t* sys, const int64_t* bin,
                           const Grid* grid, const int64_t* start, const int32_t* order, const T* sx,
                           const int32_t* sa, const int32_t* sb, const int32_t* ka, const int32_t* kb, double cutoff,
                           bool half, const int64_t* ends, int32_t* snd, int32_t* rcv, int32_t* num) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  if (i >= n_recv || bin[i] < 0) {
    num[i] = 0;
    return;
  }
  const int64_t end = ends[i], begin = i > 0 ? ends[i - 1] : 0;
  num[i] = int32_t(end - begin);
  if (begin >= cap || end == begin) return;
  const int64_t room = min(end, cap) - begin;
  Scan(i, x, sys, bin, grid, start, order, sx, sa, sb, ka, kb, cutoff, half, snd + begin, room);
  for (int64_t k = begin; k < begin + room; ++k) rcv[k] = int32_t(i);
}

__global__ void PadAndTotal(int64_t n, int64_t n_recv, int64_t cap, const int64_t* ends, int32_t* snd, int32_t* rcv,
                            int32_t* n_edges) {
  const int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t total = n_recv > 0 ? ends[n_recv - 1] : 0;
  if (k == 0) *n_edges = int32_t(total < 2147483647LL ? total : 2147483647LL);
  if (k < cap && k >= total) snd[k] = rcv[k] = int32_t(n);
}

template <typename P>
P* Take(ffi::ScratchAllocator& scratch, int64_t count, bool& ok) {
  auto p = scratch.Allocate(sizeof(P) * static_cast<size_t>(count > 0 ? count : 1), 16);
  ok = ok && p.has_value();
  return p.has_value() ? static_cast<P*>(*p) : nullptr;
}

template <ffi::DataType DT>
ffi::Error CellList(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::Buffer<DT> pos,
                    ffi::Buffer<ffi::S32> system, ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> order_a,
                    ffi::Buffer<ffi::S32> order_b, int64_t n_receivers, int64_t n_systems, double cutoff, bool half,
                    ffi::ResultBuffer<ffi::S32> senders, ffi::ResultBuffer<ffi::S32> receivers,
                    ffi::ResultBuffer<ffi::S32> num_neighbors,
                    ffi::ResultBufferR0<ffi::S32> n_edges) {
  using T = ffi::NativeType<DT>;
  if (pos.dimensions().size() != 2 || pos.dimensions()[1] != 3) return Bad("positions must be [n, 3]");
  const int64_t n = pos.dimensions()[0];
  if (system.dimensions().size() != 1 || int64_t(system.dimensions()[0]) != n) return Bad("system must be [n]");
  if (mask.dimensions().size() != 1 || int64_t(mask.dimensions()[0]) != n) return Bad("atom_mask must be [n]");
  if (int64_t(order_a.dimensions()[0]) != n || int64_t(order_b.dimensions()[0]) != n)
    return Bad("the half-list order keys must be [n] each");
  if (!(cutoff > 0) || !std::isfinite(cutoff)) return Bad("cutoff must be positive and finite");
  if (n_systems < 1) return Bad("n_systems must be >= 1");
  const int64_t cap = senders->dimensions()[0];
  const int64_t n_recv = n_receivers < 0 ? 0 : (n_receivers > n ? n : n_receivers);
  int32_t* snd = senders->typed_data();
  int32_t* rcv = receivers->typed_data();
  if (n == 0) {
    PadAndTotal<<<Blocks(cap), kThreads, 0, stream>>>(n, 0, cap, nullptr, snd, rcv, n_edges->typed_data());
    return LastError();
  }
  // Every system has at most 2 atoms + 8 bins, so this bounds the bins before they are known.
  const int64_t max_bins = 2 * n + 8 * n_systems;
  bool ok = true;
  long long* lo = Take<long long>(scratch, 3 * n_systems, ok);
  long long* hi = Take<long long>(scratch, 3 * n_systems, ok);
  int64_t* atoms = Take<int64_t>(scratch, n_systems, ok);
  Grid* grid = Take<Grid>(scratch, n_systems, ok);
  int64_t* n_bins = Take<int64_t>(scratch, 1, ok);
  int64_t* bin = Take<int64_t>(scratch, n, ok);
  int64_t* start = Take<int64_t>(scratch, max_bins + 1, ok);
  unsigned long long* cursor = Take<unsigned long long>(scratch, max_bins, ok);
  int32_t* unordered = Take<int32_t>(scratch, n, ok);
  int32_t* order = Take<int32_t>(scratch, n, ok);
  T* sx = Take<T>(scratch, 3 * n, ok);
  int32_t* sa = Take<int32_t>(scratch, n, ok);
  int32_t* sb = Take<int32_t>(scratch, n, ok);
  int64_t* ends = Take<int64_t>(scratch, n_recv, ok);
  if (!ok) return ffi::Error(ffi::ErrorCode::kResourceExhausted, "jaxdd cell_list (CUDA): out of device memory for the bins");

  const T* x = pos.typed_data();
  const int32_t* sys = system.typed_data();
  const bool* m = mask.typed_data();
  const int32_t* ka = order_a.typed_data();
  const int32_t* kb = order_b.typed_data();
  InitBoxes<<<Blocks(n_systems), kThreads, 0, stream>>>(n_systems, lo, hi, atoms);
  Boxes<T><<<Blocks(n), kThreads, 0, stream>>>(n, n_systems, x, sys, m, lo, hi, atoms);
  Grids<<<1, 1, 0, stream>>>(n_systems, cutoff, lo, hi, atoms, grid, n_bins);
  cudaMemsetAsync(start, 0, sizeof(int64_t) * (max_bins + 1), stream);
  cudaMemsetAsync(cursor, 0, sizeof(unsigned long long) * max_bins, stream);
  Bin<T><<<Blocks(n), kThreads, 0, stream>>>(n, n_systems, x, sys, m, grid, bin, start);
  // start[b + 1] held bin b's count: the inclusive scan makes start[b] bin b's first slot.
  if (!InclusiveScan(stream, scratch, start + 1, max_bins))
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "jaxdd cell_list (CUDA): out of device memory for the scan");
  Drop<<<Blocks(n), kThreads, 0, stream>>>(n, bin, start, cursor, unordered);
  Place<T><<<Blocks(n), kThreads, 0, stream>>>(n, bin, start, unordered, x, ka, kb, order, sx, sa, sb);
  if (n_recv > 0) {
    CountPairs<T><<<Blocks(n_recv), kThreads, 0, stream>>>(n_recv, x, sys, bin, grid, start, order, sx, sa, sb, ka, kb,
                                                           cutoff, half, ends);
    if (!InclusiveScan(stream, scratch, ends, n_recv))
      return ffi::Error(ffi::ErrorCode::kResourceExhausted, "jaxdd cell_list (CUDA): out of device memory for the scan");
  }
  WritePairs<T><<<Blocks(n), kThreads, 0, stream>>>(n, n_recv, cap, x, sys, bin, grid, start, order, sx, sa, sb, ka,
                                                    kb, cutoff, half, ends, snd, rcv, num_neighbors->typed_data());
  PadAndTotal<<<Blocks(cap > 0 ? cap : 1), kThreads, 0, stream>>>(n, n_recv, cap, ends, snd, rcv,
                                                                 n_edges->typed_data());
  return LastError();
}

}  // namespace

#define JAXDD_CUDA_CELL_LIST(SYM, DT)                                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(SYM, CellList<DT>,                                     \
                                ffi::Ffi::Bind()                                       \
                                    .Ctx<ffi::PlatformStream<cudaStream_t>>()          \
                                    .Ctx<ffi::ScratchAllocator>()                      \
                                    .Arg<ffi::Buffer<DT>>()          /* positions */   \
                                    .Arg<ffi::Buffer<ffi::S32>>()    /* system */      \
                                    .Arg<ffi::Buffer<ffi::PRED>>()   /* atom_mask */   \
                                    .Arg<ffi::Buffer<ffi::S32>>()    /* order key a */ \
                                    .Arg<ffi::Buffer<ffi::S32>>()    /* order key b */ \
                                    .Attr<int64_t>("n_receivers")                      \
                                    .Attr<int64_t>("n_systems")                        \
                                    .Attr<double>("cutoff")                            \
                                    .Attr<bool>("half")                                \
                                    .Ret<ffi::Buffer<ffi::S32>>()    /* senders */     \
                                    .Ret<ffi::Buffer<ffi::S32>>()    /* receivers */   \
                                    .Ret<ffi::Buffer<ffi::S32>>()    /* per atom */    \
                                    .Ret<ffi::BufferR0<ffi::S32>>()) /* edges found */

JAXDD_CUDA_CELL_LIST(jaxdd_cell_list_f32, ffi::F32);
JAXDD_CUDA_CELL_LIST(jaxdd_cell_list_f64, ffi::F64);
