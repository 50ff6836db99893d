// FP8 fake quantization (fake_quantize_fp8) on CPU: the fused kernel against the ATen
// composition it replaced and against copying the same bytes.
//
// Sizes: 512K values (one expert activation or weight gradient of mixprec-train's default
// model: its buffers stay in cache) and 32M values (far beyond any cache: memory bound).
// Formats: BF16 in E4M3 (forward operands), BF16 in E5M2 (gradients of the hybrid recipe),
// FP32 in E4M3.
//   BM_Fused         fake_quantize_fp8: amax in one read, then one read and one write
//   BM_Aten          dequantize_fp8(quantize_fp8(x)): seven passes and six temporaries
//   BM_TensorCopy    a copy of the same tensor into a preallocated one (the bytes it must read
//                    and write, at LibTorch's copy speed)
// and, for the large size, copy_bandwidth.h's memcpy probes over the same number of bytes.
// The summary prints the speed-up over ATen and the fused kernel's time relative to copying
// the tensor once (its floor is ~1.5: it reads the input twice).
#include "mixprec/quant/fake_quant.h"
#include "support/copy_bandwidth.h"
#include "support/ratio_reporter.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <cstdio>
#include <map>
#include <string>
#include <utility>

namespace {

constexpr int64_t kSmall = 512 * 1024;
constexpr int64_t kLarge = 32 * 1024 * 1024;

struct Case {
  c10::ScalarType dtype;
  c10::ScalarType fp8;
  const char* name;
};
constexpr Case kCases[] = {{at::kBFloat16, at::kFloat8_e4m3fn, "bf16 -> e4m3"},
                           {at::kBFloat16, at::kFloat8_e5m2, "bf16 -> e5m2"},
                           {at::kFloat, at::kFloat8_e4m3fn, "fp32 -> e4m3"}};

// One input per (case, size), made once: normal values like activations.
const at::Tensor& input(int64_t c, int64_t n) {
  static std::map<std::pair<int64_t, int64_t>, at::Tensor> inputs;
  auto [it, inserted] = inputs.try_emplace({c, n});
  if (inserted) {
    at::manual_seed(0);
    it->second = at::randn({n}).to(kCases[c].dtype);
  }
  return it->second;
}

void set_bytes(benchmark::State& state, const at::Tensor& x) {
  // Bytes the operation must move at least: the input read once, the output written once.
  state.SetBytesProcessed(state.iterations() * 2 * x.nbytes());
}

void BM_Fused(benchmark::State& state) {
  const at::Tensor& x = input(state.range(0), state.range(1));
  const auto fp8 = kCases[state.range(0)].fp8;
  for (auto _ : state) benchmark::DoNotOptimize(mixprec::quant::fake_quantize_fp8(x, fp8));
  set_bytes(state, x);
}

void BM_Aten(benchmark::State& state) {
  const at::Tensor& x = input(state.range(0), state.range(1));
  const auto fp8 = kCases[state.range(0)].fp8;
  for (auto _ : state) {
    benchmark::DoNotOptimize(
        mixprec::quant::dequantize_fp8(mixprec::quant::quantize_fp8(x, fp8), x.scalar_type()));
  }
  set_bytes(state, x);
}

void BM_TensorCopy(benchmark::State& state) {
  const at::Tensor& x = input(state.range(0), state.range(1));
  at::Tensor y = at::empty_like(x);
  for (auto _ : state) y.copy_(x);
  set_bytes(state, x);
}

std::string key(const char* bm, int64_t c, int64_t n) {
  return std::string(bm) + "/" + std::to_string(c) + "/" + std::to_string(n);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  for (auto [name, fn] : {std::pair{"BM_Fused", &BM_Fused}, std::pair{"BM_Aten", &BM_Aten},
                          std::pair{"BM_TensorCopy", &BM_TensorCopy}}) {
    for (int64_t c = 0; c < 3; ++c) {
      for (int64_t n : {kSmall, kLarge}) {
        benchmark::RegisterBenchmark(key(name, c, n).c_str(), fn)
            ->Args({c, n})
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime()
            ->MinTime(0.2)
            ->Repetitions(3);
      }
    }
  }
  mixprec::bench::register_copy_bandwidth_probes(
      {static_cast<std::size_t>(kLarge * 2), 0.2, 3});  // the large BF16 tensor's bytes
  mixprec::bench::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);

  const auto bound = mixprec::bench::copy_bandwidth(reporter);
  std::printf(
      "\nfastest of 3 repetitions each, %d threads; memcpy bound %.2f GB/s (read+written)\n",
      at::get_num_threads(), bound.copy_gbs);
  std::printf("%-14s %10s %10s %10s %8s %10s %12s\n", "case", "values", "fused us", "aten us",
              "speedup", "copy us", "fused/copy");
  for (int64_t c = 0; c < 3; ++c) {
    for (int64_t n : {kSmall, kLarge}) {
      // RegisterBenchmark names carry the args already; the reporter keys by function name.
      const double fused = reporter.seconds(key("BM_Fused", c, n));
      const double aten = reporter.seconds(key("BM_Aten", c, n));
      const double copy = reporter.seconds(key("BM_TensorCopy", c, n));
      if (fused <= 0) continue;
      std::printf("%-14s %10lld %10.1f %10.1f %7.1fx %10.1f %12.2f\n", kCases[c].name,
                  static_cast<long long>(n), fused * 1e6, aten * 1e6, aten / fused, copy * 1e6,
                  copy > 0 ? fused / copy : 0.0);
    }
  }
  const double large_bytes = 2.0 * static_cast<double>(input(0, kLarge).nbytes());
  const double fused_large = reporter.seconds(key("BM_Fused", 0, kLarge));
  if (fused_large > 0 && bound.copy_gbs > 0) {
    std::printf(
        "bf16 -> e4m3, %lld values: %.2f GB/s of input read + output written, %.2f of "
        "the memcpy bound\n",
        static_cast<long long>(kLarge), large_bytes / fused_large / 1e9,
        large_bytes / fused_large / 1e9 / bound.copy_gbs);
  }
  return 0;
}
