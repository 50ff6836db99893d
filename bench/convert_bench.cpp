// Selective conversion throughput against the memory-bandwidth bound and LibTorch's own cast.
//
// A module of ~200M floating elements (FP32) is converted to BF16 with a precision plan that
// keeps a few small tensors FP32. The conversion reads 4 and writes 2 bytes per cast element;
// its rate (bytes read + written per second) is compared with memcpy of the same number of
// bytes measured in the same run (single-threaded memcpy and memcpy split over LibTorch's
// threads, support/copy_bandwidth.h: the better is the "memcpy bound"), and with
// Module::to(kBFloat16)
// (which casts everything, integer buffers included). Goal: >= 0.8 of the memcpy bound.
#include "mixprec/precision/convert.h"
#include "mixprec/precision/keep_fp32.h"
#include "support/copy_bandwidth.h"
#include "support/ratio_reporter.h"

#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <torch/nn/module.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdio>
#include <vector>

namespace {

constexpr int64_t kLayers = 48;
constexpr int64_t kWidth = 2048;  // 48 × 2048² ≈ 201M elements

struct BigNetImpl : torch::nn::Module {
  BigNetImpl() {
    for (int64_t i = 0; i < kLayers; ++i) {
      register_parameter(c10::str("w", i), torch::randn({kWidth, kWidth}));
      register_parameter(c10::str("norm", i), mixprec::keep_in_fp32(torch::ones({kWidth})));
    }
    register_buffer("steps", torch::zeros({1024}, torch::kLong));
  }
};

struct Fixture {
  std::shared_ptr<BigNetImpl> net = std::make_shared<BigNetImpl>();
  std::vector<at::Tensor> pristine;  // the FP32 storage each run starts from
  int64_t cast_elements = 0;
  Fixture() {
    for (auto& p : net->parameters()) {
      pristine.push_back(p.detach());
      if (!mixprec::is_kept_in_fp32(p)) cast_elements += p.numel();
    }
  }
  // Points every parameter back at its FP32 storage: no copy, so not part of the measurement.
  void reset() {
    at::NoGradGuard no_grad;
    auto params = net->parameters();
    for (size_t i = 0; i < params.size(); ++i) params[i].set_data(pristine[i]);
  }
  int64_t bytes_moved() const { return cast_elements * (4 + 2); }
};

Fixture& fixture() {
  static Fixture f;
  return f;
}

void BM_SelectiveConvert(benchmark::State& state) {
  auto& f = fixture();
  for (auto _ : state) {
    state.PauseTiming();
    f.reset();
    state.ResumeTiming();
    auto report = mixprec::convert_module_to_dtype_except_fp32_marked(*f.net, at::kBFloat16);
    benchmark::DoNotOptimize(report.bytes_after);
  }
  state.SetBytesProcessed(state.iterations() * f.bytes_moved());
}

void BM_ModuleToBFloat16(benchmark::State& state) {
  auto& f = fixture();
  for (auto _ : state) {
    state.PauseTiming();
    f.reset();
    state.ResumeTiming();
    f.net->to(at::kBFloat16);
  }
  state.SetBytesProcessed(state.iterations() * f.bytes_moved());
}

// Five repetitions each; the ratios use the fastest (see ratio_reporter.h).
BENCHMARK(BM_SelectiveConvert)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(0.5)
    ->Repetitions(5);
BENCHMARK(BM_ModuleToBFloat16)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(0.5)
    ->Repetitions(5);

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  // The bound: copy bandwidth over buffers as large as the conversion's reads (copy_bandwidth.h).
  mixprec::bench::register_copy_bandwidth_probes(
      {static_cast<std::size_t>(fixture().bytes_moved() / 2), 0.3, 5});
  mixprec::bench::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  auto& f = fixture();
  const double moved = static_cast<double>(f.bytes_moved());
  auto rate = [&](const char* name) {
    const double s = reporter.seconds(name);
    return s > 0 ? moved / s / 1e9 : 0.0;
  };
  const double bound = mixprec::bench::copy_bandwidth(reporter).copy_gbs;
  const double ours = rate("BM_SelectiveConvert");
  const double torch_to = rate("BM_ModuleToBFloat16");
  std::printf(
      "\nfastest of 5 repetitions each\nconversion of %.1fM cast elements (%.2f GB read+written), "
      "%d threads\n",
      f.cast_elements / 1e6, moved / 1e9, at::get_num_threads());
  std::printf("  memcpy bound (best of memcpy/parallel memcpy):     %6.2f GB/s\n", bound);
  std::printf(
      "  selective conversion:                             %6.2f GB/s  ratio to bound %.2f"
      "  (goal >= 0.80)\n",
      ours, bound > 0 ? ours / bound : 0.0);
  std::printf("  Module::to(kBFloat16):                            %6.2f GB/s  ours / to() %.2f\n",
              torch_to, torch_to > 0 ? ours / torch_to : 0.0);
  return 0;
}
