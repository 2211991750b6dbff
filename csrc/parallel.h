// Splitting a kernel's work over XLA's intra-op thread pool (CPU).
#ifndef JAXDD_PARALLEL_H_
#define JAXDD_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxdd {

// Runs body(c) for every chunk c in [0, n_chunks), on the calling thread and on the
// pool's threads. Chunks are claimed from a shared counter, so the caller never waits
// for a task that has not started (the pool's threads may all be busy, e.g. running
// other devices' kernels): it only waits for chunks already being worked on. Tasks that
// start after every chunk is claimed find nothing to do; they hold the counter, never
// the caller's data.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n_chunks, const F& body) {
  if (n_chunks <= 0) return;
  struct Counter {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto counter = std::make_shared<Counter>();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n_chunks) - 1;
  const F* shared_body = &body;
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([counter, n_chunks, shared_body]() {
      for (int64_t c; (c = counter->next.fetch_add(1)) < n_chunks;) {
        (*shared_body)(c);
        counter->done.fetch_add(1, std::memory_order_release);
      }
    });
  }
  for (int64_t c; (c = counter->next.fetch_add(1)) < n_chunks;) {
    body(c);
    counter->done.fetch_add(1, std::memory_order_release);
  }
  while (counter->done.load(std::memory_order_acquire) < n_chunks) std::this_thread::yield();
}

// Chunks of at least `grain` items for a pool: a few per thread, to even out the load.
inline int64_t ChunkCount(xla::ffi::ThreadPool& pool, int64_t items, int64_t grain) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  return std::clamp<int64_t>(items / std::max<int64_t>(grain, 1), 1, 4 * threads);
}

}  // namespace jaxdd

#endif  // JAXDD_PARALLEL_H_
