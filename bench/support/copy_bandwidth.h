// The memory-bandwidth bound every benchmark compares against, measured one way for all of
// them, in the same run as the operation it bounds.
//
// register_copy_bandwidth_probes() adds three Google Benchmarks over two buffers of `bytes`
// each (allocated and touched on first use, so a bench that filters them out pays nothing):
//   BM_Memcpy          one std::memcpy of the whole buffer;
//   BM_ParallelMemcpy  the buffer split into one contiguous share per LibTorch thread
//                      (std::thread: at::parallel_for runs serially outside -fopenmp files);
//   BM_InPlaceScale    x *= a over the buffer, split the same way: a read-modify-write stream,
//                      whose stores hit lines it has just read, as an optimizer's do; a
//                      memcpy's stores go to other lines and pay a read-for-ownership (or slow
//                      non-temporal stores) that is not counted, so on some machines memcpy
//                      understates the usable bandwidth.
// copy_bandwidth(reporter) turns their fastest repetitions into rates. Bytes are counted read
// plus written (a memcpy of n bytes moves 2n), as the benches count their own traffic.
#pragma once

#include "support/ratio_reporter.h"

#include <ATen/Parallel.h>  // at::get_num_threads
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

namespace mixprec::bench {

struct CopyProbeOptions {
  std::size_t bytes = std::size_t{1} << 30;  // per buffer; far beyond any cache
  double min_seconds = 0.3;                  // per repetition
  int repetitions = 5;
};

struct CopyBandwidth {
  double copy_gbs = 0;      // best of BM_Memcpy and BM_ParallelMemcpy, GB/s read + written
  double in_place_gbs = 0;  // BM_InPlaceScale, GB/s read + written
};

namespace detail {

// Splits [0, n) into one contiguous share per LibTorch thread and runs fn(begin, end) on each.
template <class Fn>
void on_all_threads(std::int64_t n, const Fn& fn) {
  const std::int64_t threads = std::max(1, at::get_num_threads());
  const std::int64_t share = (n + threads - 1) / threads;
  std::vector<std::thread> pool;
  for (std::int64_t t = 1; t < threads; ++t) {
    pool.emplace_back([&, t] { fn(std::min(n, t * share), std::min(n, (t + 1) * share)); });
  }
  fn(0, std::min(n, share));
  for (auto& thread : pool) thread.join();
}

struct CopyBuffers {
  explicit CopyBuffers(std::size_t n) : bytes(n), src(new char[n]), dst(new char[n]) {
    std::memset(src.get(), 1, n);
    std::memset(dst.get(), 0, n);
  }
  std::size_t bytes;
  std::unique_ptr<char[]> src, dst;
};

inline CopyProbeOptions& probe_options() {
  static CopyProbeOptions options;
  return options;
}

inline CopyBuffers& copy_buffers() {
  static CopyBuffers buffers(probe_options().bytes);
  return buffers;
}

inline void memcpy_probe(benchmark::State& state) {
  CopyBuffers& b = copy_buffers();
  for (auto _ : state) {
    std::memcpy(b.dst.get(), b.src.get(), b.bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * 2 * static_cast<std::int64_t>(b.bytes));
}

inline void parallel_memcpy_probe(benchmark::State& state) {
  CopyBuffers& b = copy_buffers();
  const auto n = static_cast<std::int64_t>(b.bytes);
  for (auto _ : state) {
    on_all_threads(n, [&](std::int64_t begin, std::int64_t end) {
      std::memcpy(b.dst.get() + begin, b.src.get() + begin, end - begin);
    });
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * 2 * n);
}

inline void in_place_scale_probe(benchmark::State& state) {
  CopyBuffers& b = copy_buffers();
  auto* data = reinterpret_cast<float*>(b.dst.get());
  const auto n = static_cast<std::int64_t>(b.bytes / sizeof(float));
  float factor = 1.0f;
  benchmark::DoNotOptimize(factor);  // opaque: the compiler may not drop the multiply
  for (auto _ : state) {
    on_all_threads(n, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) data[i] *= factor;
    });
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * 2 * n * static_cast<std::int64_t>(sizeof(float)));
}

}  // namespace detail

// Registers BM_Memcpy, BM_ParallelMemcpy and BM_InPlaceScale (call once, before
// benchmark::RunSpecifiedBenchmarks).
inline void register_copy_bandwidth_probes(const CopyProbeOptions& options = {}) {
  detail::probe_options() = options;
  for (auto [name, fn] : {std::pair{"BM_Memcpy", &detail::memcpy_probe},
                          std::pair{"BM_ParallelMemcpy", &detail::parallel_memcpy_probe},
                          std::pair{"BM_InPlaceScale", &detail::in_place_scale_probe}}) {
    benchmark::RegisterBenchmark(name, fn)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->MinTime(options.min_seconds)
        ->Repetitions(options.repetitions);
  }
}

// The probes' rates from their fastest repetitions (0 for a probe that did not run).
inline CopyBandwidth copy_bandwidth(const RatioReporter& reporter) {
  const double moved = 2.0 * static_cast<double>(detail::probe_options().bytes);
  auto gbs = [&](const char* name) {
    const double s = reporter.seconds(name);
    return s > 0 ? moved / s / 1e9 : 0.0;
  };
  return {std::max(gbs("BM_Memcpy"), gbs("BM_ParallelMemcpy")), gbs("BM_InPlaceScale")};
}

}  // namespace mixprec::bench
