// Splits an elementwise pass over [0, n) into chunks run on all of LibTorch's threads.
//
// at::parallel_for is an inline template that runs in parallel only in translation units
// compiled with OpenMP: include this only from files optim.cmake compiles with it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace mixprec::optim::detail {

// Elements per unit of work: 32K elements stream ~1 MB over all buffers, enough to amortize
// claiming a chunk while leaving every thread work on mid-sized parameters.
inline constexpr int64_t kGrainSize = 32 * 1024;

// Calls fn(begin, end) on consecutive chunks of `grain` units of [0, n) (the last one shorter),
// on all threads. Chunks are claimed from a shared counter rather than split into equal static
// shares, so that a thread whose core is busy with other work (a shared machine, a straggler)
// does fewer chunks instead of making the whole step wait for it. Chunk boundaries do not
// depend on the number of threads; kernels that treat each unit alike give the same results
// for any split.
template <class Fn>
void for_each_chunk(int64_t n, int64_t grain, const Fn& fn) {
  const int64_t chunks = (n + grain - 1) / grain;
  if (chunks <= 1) {
    if (n > 0) fn(int64_t{0}, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(chunks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t k = next++; k < chunks; k = next++) {
      fn(k * grain, std::min(n, (k + 1) * grain));
    }
  });
}

// The same over elements, kGrainSize at a time.
template <class Fn>
void for_each_chunk(int64_t n, const Fn& fn) {
  for_each_chunk(n, kGrainSize, fn);
}

}  // namespace mixprec::optim::detail
