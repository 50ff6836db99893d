// Float16Optimizer::update() on one model (~17M parameters: a 16M-element BF16 weight and a
// 1M-element native FP32 one), AdamW, the three ways it can hold its state:
//
//   fp32_masters   FP32 master per BF16 parameter, state on the parameters' device;
//   remainders     master_remainders: the BF16 parameter + an int16 remainder (10 instead of
//                  12 optimizer bytes per BF16 parameter, 26 instead of 28 moved per step);
//   offload/C/D    offload(chunk_bytes = C MiB, chunks_in_flight = D): state on the host,
//                  gradients down and parameters up through staging buffers in chunks. Here the
//                  "device" is the CPU, so the copies are pure overhead; what matters is how
//                  much of them runs hidden behind the host step (OffloadStats). On a GPU the
//                  same copies cross PCIe and the host step replaces a device step.
//
// Reported: time per step (fastest repetition), optimizer bytes per parameter (state_bytes),
// the ratios to the fp32_masters step, and for the offloaded steps the copy time, how much of
// it was hidden (copy + host step − wall) and the pipeline's share of the step.
#include "mixprec/optim/float16_optimizer.h"

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>

#include "support/ratio_reporter.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr int64_t kBf16 = int64_t{16} << 20;
constexpr int64_t kFp32 = int64_t{1} << 20;
constexpr int kRepetitions = 3;
constexpr double kMinSeconds = 0.5;

struct Model : torch::nn::Module {
  Model() {
    at::manual_seed(0);
    w = register_parameter("w", (at::randn({kBf16}) * 0.02).to(at::kBFloat16));
    f = register_parameter("f", at::randn({kFp32}) * 0.02);
    w.mutable_grad() = (at::randn({kBf16}) * 1e-3).to(at::kBFloat16);
    f.mutable_grad() = at::randn({kFp32}) * 1e-3;
  }
  at::Tensor w, f;
};

struct Setup {
  std::shared_ptr<Model> model = std::make_shared<Model>();
  std::unique_ptr<mixprec::optim::Float16Optimizer> optimizer;
  mixprec::optim::OffloadStats total;  // summed over the timed steps
  double update_seconds = 0.0;         // update() wall time, summed over the same steps
  int64_t steps = 0;
};

struct Config {
  std::string name;
  mixprec::optim::Float16OptimizerOptions options;
};

std::vector<Config> configs() {
  using mixprec::optim::Float16OptimizerOptions;
  using mixprec::optim::OffloadOptions;
  std::vector<Config> out = {{"fp32_masters", {}},
                             {"remainders", Float16OptimizerOptions().master_remainders(true)}};
  for (int64_t mib : {4, 16, 64}) {
    for (int64_t depth : {1, 2}) {
      out.push_back({"offload/" + std::to_string(mib) + "MiB/" + std::to_string(depth),
                     Float16OptimizerOptions().offload(
                         OffloadOptions().chunk_bytes(mib << 20).chunks_in_flight(depth))});
    }
  }
  out.push_back(
      {"offload/16MiB/3", Float16OptimizerOptions().offload(
                              OffloadOptions().chunk_bytes(16 << 20).chunks_in_flight(3))});
  out.push_back({"offload+remainders/16MiB/2",
                 Float16OptimizerOptions().master_remainders(true).offload(
                     OffloadOptions().chunk_bytes(16 << 20).chunks_in_flight(2))});
  return out;
}

std::map<std::string, std::unique_ptr<Setup>>& setups() {
  static std::map<std::string, std::unique_ptr<Setup>> s;
  return s;
}

void BM_Update(benchmark::State& state, const Config& config) {
  auto& slot = setups()[config.name];
  if (!slot) {
    slot = std::make_unique<Setup>();
    slot->optimizer = std::make_unique<mixprec::optim::Float16Optimizer>(
        *slot->model, torch::optim::AdamWOptions(1e-5).weight_decay(0.01), config.options);
    slot->optimizer->update();  // state allocated before timing
  }
  Setup& s = *slot;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    s.optimizer->update();
    s.update_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const auto& st = s.optimizer->offload_stats();
    s.total.chunks += st.chunks;
    s.total.wall_seconds += st.wall_seconds;
    s.total.step_seconds += st.step_seconds;
    s.total.copy_seconds += st.copy_seconds;
    s.total.bytes_down += st.bytes_down;
    s.total.bytes_up += st.bytes_up;
    ++s.steps;
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args(argv, argv + argc);
  char interleave[] = "--benchmark_enable_random_interleaving=true";
  args.insert(args.begin() + 1, interleave);
  int args_count = static_cast<int>(args.size());
  benchmark::Initialize(&args_count, args.data());
  const std::vector<Config> all = configs();
  for (const Config& c : all) {
    benchmark::RegisterBenchmark(c.name.c_str(), [&c](benchmark::State& st) { BM_Update(st, c); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->MinTime(kMinSeconds)
        ->Repetitions(kRepetitions);
  }
  mixprec::bench::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();

  const double params = static_cast<double>(kBf16 + kFp32);
  const double base = reporter.seconds("fp32_masters");
  std::printf("\nFloat16Optimizer::update, %.1fM params (%.0fM BF16 + %.0fM FP32), AdamW\n",
              params / 1e6, kBf16 / 1e6, kFp32 / 1e6);
  std::printf("  %-27s %8s %7s %15s | %8s %8s %8s %8s %7s\n", "holding", "ms/step", "vs fp32",
              "opt B/param", "mean ms", "pipe ms", "copy ms", "hidden", "hidden%");
  for (const Config& c : all) {
    auto it = setups().find(c.name);
    if (it == setups().end() || !it->second) continue;
    const Setup& s = *it->second;
    const double ms = reporter.seconds(c.name) * 1e3;
    using mixprec::optim::ParamRole;
    const double bytes = static_cast<double>(s.optimizer->state_bytes(ParamRole::kMaster) +
                                             s.optimizer->state_bytes(ParamRole::kNativeFp32));
    const double bf16_bytes =
        static_cast<double>(s.optimizer->state_bytes(ParamRole::kMaster)) / kBf16;
    char per_param[32];
    std::snprintf(per_param, sizeof per_param, "%.2f (%.0f BF16)", bytes / params, bf16_bytes);
    const double n = static_cast<double>(std::max<int64_t>(s.steps, 1));
    std::printf("  %-27s %8.1f %7.3f %15s | %8.1f", c.name.c_str(), ms,
                base > 0 ? ms / (base * 1e3) : 0.0, per_param, s.update_seconds / n * 1e3);
    if (s.total.chunks > 0) {
      const double copy = s.total.copy_seconds, hidden = s.total.hidden_copy_seconds();
      std::printf(" %8.1f %8.1f %8.1f %6.0f%%\n", s.total.wall_seconds / n * 1e3, copy / n * 1e3,
                  hidden / n * 1e3, copy > 0 ? 100.0 * hidden / copy : 0.0);
    } else {
      std::printf(" %8s %8s %8s %7s\n", "-", "-", "-", "-");
    }
  }
  std::printf(
      "  ms/step: fastest repetition; vs fp32: its ratio to fp32_masters. Right of |: means over\n"
      "  every timed step: update(), the offloading pipeline in it, the copy engine's busy time,\n"
      "  and the copy time that ran while the host stepped (copy + host step - pipeline wall).\n");
  return 0;
}
