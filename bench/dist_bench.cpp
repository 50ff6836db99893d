// Data-parallel benchmark: ZeRO-1 (GradReducer reduce-scatter + DistributedOptimizer) against
// plain DP (GradReducer all-reduce + a Float16Optimizer per rank) on a BF16 MLP with FP32 gates.
//
//   bench_dist                  launcher mode: runs itself under torchrun for N = 1, 2, 4 and
//                               prints the figures side by side (torchrun from MIXPREC_TORCHRUN
//                               or --torchrun PATH)
//   torchrun --standalone --nproc-per-node N --no-python bench_dist --worker
//                               one measurement at world size N (rank 0 prints)
//
// Figures per configuration: per-rank optimizer state bytes (owned masters + moments), step
// time (backward + reduction + optimizer, max over ranks, median of the timed steps), bytes
// each rank hands to collectives per step against the ZeRO-1 minimum 2(N-1)/N of the
// parameter bytes, and how much of the gradient reduction backward hides: 1 - (finish() time
// with overlap) / (finish() time without overlap), fastest step of each.
#include "mixprec/distributed/distributed_optimizer.h"
#include "mixprec/distributed/init.h"
#include "mixprec/precision/convert.h"
#include "mixprec/precision/keep_fp32.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

namespace {

using namespace mixprec;
using Clock = std::chrono::steady_clock;

constexpr int64_t kWidth = 384, kLayers = 4, kBatch = 64;
constexpr int kWarmup = 3, kSteps = 16;

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    at::manual_seed(3);
    for (int64_t i = 0; i < kLayers; ++i) {
      layers.push_back(
          register_module("fc" + std::to_string(i), torch::nn::Linear(kWidth, kWidth)));
      gates.push_back(
          register_parameter("gate" + std::to_string(i), keep_in_fp32(at::ones({kWidth}))));
    }
    convert_module_to_dtype_except_fp32_marked(*this, at::kBFloat16);
  }
  at::Tensor loss(const at::Tensor& x) {
    at::Tensor h = x.to(at::kBFloat16);
    for (int64_t i = 0; i < kLayers; ++i) {
      h = (at::tanh(layers[i](h)).to(at::kFloat) * gates[i]).to(at::kBFloat16);
    }
    return h.to(at::kFloat).pow(2).mean();
  }
  std::vector<torch::nn::Linear> layers;
  std::vector<at::Tensor> gates;
};
TORCH_MODULE(Mlp);

struct Figures {
  double state_bytes = 0;     // max over ranks
  double step_seconds = 0;    // median over steps of the max over ranks
  double finish_seconds = 0;  // finish() alone: fastest step (least disturbed by other load)
  double sent_bytes = 0;      // ring-model bytes per rank per step
  double payload_bytes = 0;   // bytes handed to collectives per rank per step
  double scatter_bytes = 0;   // the reduce-scatter part of sent_bytes
  int64_t launched = 0, buckets = 0;
};

double max_over_ranks(distributed::Communicator& comm, double value) {
  at::Tensor t = at::tensor({value}, at::kDouble);
  comm.all_reduce_max(t).wait();
  return t.item<double>();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

Figures measure(const std::shared_ptr<distributed::Communicator>& comm, bool zero, bool overlap,
                bool fp32_reduce) {
  Mlp model;
  const auto reduce = distributed::GradReducerOptions()
                          .mode(zero ? distributed::ReduceMode::kReduceScatter
                                     : distributed::ReduceMode::kAllReduce)
                          .overlap(overlap)
                          .grad_reduce_in_fp32(fp32_reduce)
                          .bucket_numel(kWidth * kWidth / 2);
  distributed::GradReducer reducer(comm, *model, reduce);
  const auto adamw = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);
  std::unique_ptr<distributed::DistributedOptimizer> zero_opt;
  std::unique_ptr<optim::Float16Optimizer> dp_opt;
  if (zero) {
    zero_opt = std::make_unique<distributed::DistributedOptimizer>(reducer, *model, adamw);
  } else {
    dp_opt = std::make_unique<optim::Float16Optimizer>(*model, adamw);
  }
  std::vector<double> steps, finishes;
  Figures f;
  for (int i = 0; i < kWarmup + kSteps; ++i) {
    at::manual_seed(100 + i + 1000 * comm->rank());
    const at::Tensor x = at::randn({kBatch, kWidth});
    comm->barrier();
    if (i == kWarmup) comm->reset_traffic();
    const auto t0 = Clock::now();
    reducer.zero_grad();
    model->loss(x).backward();
    if (zero) {
      zero_opt->update();
    } else {
      reducer.finish();
      dp_opt->update();
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    const double finish = reducer.last_timing().finish_seconds;
    if (i >= kWarmup) {
      steps.push_back(max_over_ranks(*comm, seconds));
      finishes.push_back(max_over_ranks(*comm, finish));
    }
  }
  using distributed::Collective;
  for (Collective c :
       {Collective::kAllReduce, Collective::kReduceScatter, Collective::kAllGather}) {
    // kSteps steps, plus the timing all-reduces of 8 bytes (2 per step) and barriers (1 per step)
    f.sent_bytes += comm->traffic(c).bytes_sent;
    f.payload_bytes += comm->traffic(c).payload_bytes;
  }
  const double n = comm->size();
  const double bookkeeping =
      kSteps * (2 * 8 + 8) * 2 * (n - 1) / n;  // timing + barrier all-reduces
  f.sent_bytes = (f.sent_bytes - bookkeeping) / kSteps;
  f.payload_bytes = (f.payload_bytes - kSteps * (2 * 8 + 8)) / kSteps;
  f.scatter_bytes =
      static_cast<double>(comm->traffic(Collective::kReduceScatter).bytes_sent) / kSteps;
  const double state = zero ? zero_opt->state_bytes(optim::ParamRole::kMaster) +
                                  zero_opt->state_bytes(optim::ParamRole::kNativeFp32)
                            : dp_opt->state_bytes(optim::ParamRole::kMaster) +
                                  dp_opt->state_bytes(optim::ParamRole::kNativeFp32);
  f.state_bytes = max_over_ranks(*comm, state);
  f.step_seconds = median(steps);
  f.finish_seconds = *std::min_element(finishes.begin(), finishes.end());
  f.launched = reducer.last_timing().launched_during_backward;
  f.buckets = reducer.last_timing().buckets;
  return f;
}

int worker() {
  auto comm = distributed::init_from_env();
  const int n = comm->size();
  Mlp probe;
  double param_bytes = 0;
  for (const auto& p : probe->parameters()) param_bytes += static_cast<double>(p.nbytes());
  const double minimum = 2.0 * (n - 1) / n * param_bytes;

  const Figures dp = measure(comm, false, true, true);
  const Figures zero = measure(comm, true, true, true);
  const Figures zero_bf16 = measure(comm, true, true, false);
  const Figures dp_serial = measure(comm, false, false, true);
  const Figures zero_serial = measure(comm, true, false, true);
  if (comm->rank() != 0) return 0;
  auto hidden = [](const Figures& overlapped, const Figures& serial) {
    return serial.finish_seconds > 0 ? 1.0 - overlapped.finish_seconds / serial.finish_seconds
                                     : 0.0;
  };
  std::printf("== N=%d  params %.0f bytes (BF16 weights, FP32 gates); %d-step medians\n", n,
              param_bytes, kSteps);
  std::printf("optimizer state per rank: plain DP %.0f B, ZeRO-1 %.0f B (ratio %.3f, ideal %.3f)\n",
              dp.state_bytes, zero.state_bytes, zero.state_bytes / dp.state_bytes, 1.0 / n);
  std::printf("step time (max over ranks): plain DP %.2f ms, ZeRO-1 %.2f ms (ratio %.2f)\n",
              dp.step_seconds * 1e3, zero.step_seconds * 1e3, zero.step_seconds / dp.step_seconds);
  std::printf(
      "bytes sent per rank per step (ring model): plain DP %.0f, ZeRO-1 %.0f, ZeRO-1 "
      "with BF16 reduction %.0f; ZeRO-1 minimum 2(N-1)/N x params = %.0f (ratios %.2f, "
      "%.2f, %.2f)\n",
      dp.sent_bytes, zero.sent_bytes, zero_bf16.sent_bytes, minimum,
      minimum > 0 ? dp.sent_bytes / minimum : 0.0, minimum > 0 ? zero.sent_bytes / minimum : 0.0,
      minimum > 0 ? zero_bf16.sent_bytes / minimum : 0.0);
  // Gloo's reduce-scatter is an all-reduce of the whole bucket plus a copy: twice the ring
  // reduce-scatter's bytes on the wire.
  const double gloo_zero = zero.sent_bytes + zero.scatter_bytes;
  std::printf(
      "on Gloo, whose reduce-scatter runs a whole all-reduce, ZeRO-1 puts about %.0f "
      "bytes on the wire (ratio %.2f)\n",
      gloo_zero, minimum > 0 ? gloo_zero / minimum : 0.0);
  std::printf(
      "gradient reduction hidden behind backward: plain DP %.0f%% (%lld of %lld buckets "
      "started in backward), ZeRO-1 %.0f%% (finish() %.2f ms overlapped vs %.2f ms not)\n",
      100 * hidden(dp, dp_serial), static_cast<long long>(dp.launched),
      static_cast<long long>(dp.buckets), 100 * hidden(zero, zero_serial),
      zero.finish_seconds * 1e3, zero_serial.finish_seconds * 1e3);
  std::printf(
      "{\"n\":%d,\"dp_state\":%.0f,\"zero_state\":%.0f,\"dp_step_ms\":%.3f,"
      "\"zero_step_ms\":%.3f,\"dp_sent\":%.0f,\"zero_sent\":%.0f,\"zero_bf16_sent\":%.0f,"
      "\"minimum\":%.0f,\"dp_hidden\":%.3f,\"zero_hidden\":%.3f}\n",
      n, dp.state_bytes, zero.state_bytes, dp.step_seconds * 1e3, zero.step_seconds * 1e3,
      dp.sent_bytes, zero.sent_bytes, zero_bf16.sent_bytes, minimum, hidden(dp, dp_serial),
      hidden(zero, zero_serial));
  std::fflush(stdout);
  return 0;
}

int launcher(const std::string& self, std::string torchrun) {
  if (torchrun.empty()) {
#ifdef MIXPREC_TORCHRUN
    torchrun = MIXPREC_TORCHRUN;
#endif
  }
  if (torchrun.empty()) {
    std::cerr << "bench_dist: pass --torchrun PATH, or run it under torchrun with --worker\n";
    return 2;
  }
  std::cout << "bench_dist: ZeRO-1 vs plain DP on Gloo, " << kLayers << " x " << kWidth
            << " MLP, batch " << kBatch << "; N = 1, 2, 4 processes on this machine's cores "
            << "(oversubscribed beyond the core count: compare ratios, not absolute times)\n";
  for (int n : {1, 2, 4}) {
    // One OpenMP thread per rank for every N (torchrun sets it only for N > 1), so the
    // ratios compare like with like.
    const std::string command = "OMP_NUM_THREADS=1 " + torchrun +
                                " --standalone --nproc-per-node " + std::to_string(n) +
                                " --no-python " + self + " --worker 2>/dev/null";
    std::cout.flush();
    if (std::system(command.c_str()) != 0) {
      std::cerr << "bench_dist: N=" << n << " failed: " << command << "\n";
      return 1;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string torchrun;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--worker") == 0) return worker();
    if (std::strcmp(argv[i], "--torchrun") == 0 && i + 1 < argc) torchrun = argv[++i];
  }
  if (std::getenv("RANK") != nullptr) return worker();
  return launcher(argv[0], torchrun);
}
