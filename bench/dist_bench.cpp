// Data-parallel benchmark: ZeRO-1 (GradReducer + DistributedOptimizer) against plain data
// parallelism (GradReducer all-reduce + a Float16Optimizer per rank) and against PyTorch DDP
// (gloo) + ZeroRedundancyOptimizer (bench/dist_peer.py), on two models: the main job's GPT with
// MoE blocks (examples/train, BF16 with FP32 norms, routers and expert biases) and a synthetic
// BF16 MLP with FP32 gates.
//
//   bench_dist [--steps N] [--torchrun PATH] [--python PATH]
//       launcher: for each model and N = 2, 4, runs itself and the peer under torchrun and
//       prints the figures side by side
//   torchrun --standalone --nproc-per-node N --no-python bench_dist --worker --model gpt|mlp
//       one measurement of mixprec at world size N (rank 0 prints a JSON line)
//
// Figures, per configuration (one OpenMP thread per rank):
//   step ms      zero_grad + forward + backward + reduction + optimizer step + parameter
//                gather, the slowest rank's, median over the timed steps. The four
//                configurations take turns of four steps (interleaved rounds, so that a busy
//                stretch of the machine slows all of them alike); a turn's steps run back to
//                back, as in a run of that configuration alone: the turn's data is made before
//                it (as the peer makes its data before its clock), one barrier starts it, and
//                no collective or other untimed work runs between its steps (each rank records
//                its step times, the maximum over ranks is taken after the turn). A lead step
//                opens the turn untimed, so that every timed step of "gather overlapped" finds
//                its predecessor's gather in flight and pays what its forward does not hide of
//                it: n timed steps pay n gathers (the last one's is waited for after the turn,
//                in place of the lead step's, which the first timed step pays)
//   peak MiB     growth of each process's resident memory from just before the model is built
//                to the peak (VmHWM), the largest over ranks: model, gradients, optimizer
//                state, activations, communication buffers (mixprec's first configuration, as
//                the peak only grows, and the peer's)
//   sent         bytes each rank sends per step under the backend's algorithms
//                (distributed/communicator.h), counted over the timed steps alone (no
//                benchmark collective runs among them), against the ZeRO-1 minimum: a
//                reduce-scatter plus an all-gather of the BF16/FP32 parameter bytes, 2(N-1)/N
//                of them
//   hidden       the share of ZeRO-1's gradient reduction that backward hides: 1 - finish()
//                time with overlap / finish() time of ZeRO-1 with every bucket started after
//                backward ("-" for plain DP: its all-reduce has no serial configuration here)
//   allocs       tensor allocations (a counting CPU allocator, every thread) per steady-state
//                step inside zero_grad() and the optimizer's update()
// Ranks share this machine's cores (oversubscribed beyond 2): compare ratios, not absolute
// times.
#include "data.h"
#include "gpt.h"
#include "plan.h"
#include "support/bench_paths.h"
#include "support/counting_allocator.h"

#include "mixprec/distributed/distributed_optimizer.h"
#include "mixprec/distributed/init.h"
#include "mixprec/precision/convert.h"
#include "mixprec/precision/cross_entropy.h"
#include "mixprec/precision/keep_fp32.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

namespace {

using namespace mixprec;
using Clock = std::chrono::steady_clock;

constexpr int64_t kWidth = 384, kLayers = 4, kMlpRows = 64;  // the MLP: 64 rows per rank
constexpr int64_t kGptBatch = 16;                            // the GPT: global batch
constexpr int kWarmup = 3;

// One of the two models, with its loss for a step's batch. The batch is made apart from the
// loss, so that the timed step holds what the peer's does (bench/dist_peer.py makes its data
// before its clock starts).
struct Workload {
  virtual ~Workload() = default;
  virtual torch::nn::Module& module() = 0;
  // The batch of `step` on `rank` of `world`, for loss().
  virtual at::Tensor make_batch(int64_t step, int rank, int world) = 0;
  virtual at::Tensor loss(const at::Tensor& batch) = 0;
  // Before each part of the model is read in forward (overlapped parameter gathers).
  virtual void set_before_use(std::function<void(const torch::nn::Module&)> fn) = 0;
};

// A BF16 linear layer with tanh, scaled by an FP32 gate.
struct GatedImpl : torch::nn::Module {
  GatedImpl() {
    fc = register_module("fc", torch::nn::Linear(kWidth, kWidth));
    gate = register_parameter("gate", keep_in_fp32(at::ones({kWidth})));
  }
  at::Tensor forward(const at::Tensor& h) {
    return (at::tanh(fc(h)).to(at::kFloat) * gate).to(at::kBFloat16);
  }
  torch::nn::Linear fc{nullptr};
  at::Tensor gate;
};
TORCH_MODULE(Gated);

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    at::manual_seed(3);
    for (int64_t i = 0; i < kLayers; ++i) {
      layers.push_back(register_module("layer" + std::to_string(i), Gated()));
    }
    convert_module_to_dtype_except_fp32_marked(*this, at::kBFloat16);
  }
  std::vector<Gated> layers;
};
TORCH_MODULE(Mlp);

struct MlpWorkload : Workload {
  Mlp mlp;
  std::function<void(const torch::nn::Module&)> before_use;
  torch::nn::Module& module() override { return *mlp; }
  at::Tensor make_batch(int64_t step, int rank, int /*world*/) override {
    at::manual_seed(100 + step + 1000 * rank);
    return at::randn({kMlpRows, kWidth});
  }
  at::Tensor loss(const at::Tensor& input) override {
    // The cast to BF16 is the model's, as autocast's is in the peer's forward.
    at::Tensor h = input.to(at::kBFloat16);
    for (int64_t i = 0; i < kLayers; ++i) {
      if (before_use) before_use(*mlp->layers[i]);
      h = mlp->layers[i](h);
    }
    return h.to(at::kFloat).pow(2).mean();
  }
  void set_before_use(std::function<void(const torch::nn::Module&)> fn) override {
    before_use = std::move(fn);
  }
};

// The main job's model as mixprec-train builds it with --fp8 off (BF16, FP32 norms, routers
// and expert biases), fed random bytes.
struct GptWorkload : Workload {
  train::MixedModel model;
  GptWorkload() : model(make()) {}
  static train::MixedModel make() {
    at::manual_seed(3);
    train::GptConfig config;
    train::Precision precision;
    return train::apply_precision(train::Gpt(config), precision);
  }
  torch::nn::Module& module() override { return *model.gpt; }
  at::Tensor make_batch(int64_t step, int rank, int world) override {
    at::manual_seed(100 + step + 1000 * rank);
    const train::GptConfig& c = model.gpt->config;
    return at::randint(0, c.vocab, {kGptBatch / world, c.seq_len + 1}, at::kLong);
  }
  at::Tensor loss(const at::Tensor& tokens) override {
    const train::GptConfig& c = model.gpt->config;
    auto [logits, aux] = model.forward(tokens.narrow(1, 0, c.seq_len));
    const at::Tensor targets = tokens.narrow(1, 1, c.seq_len);
    return mixprec::cross_entropy_in_fp32(logits.reshape({-1, c.vocab}), targets.reshape({-1})) +
           0.01 * aux;
  }
  void set_before_use(std::function<void(const torch::nn::Module&)> fn) override {
    model.gpt->before_use = std::move(fn);
  }
};

std::unique_ptr<Workload> make_workload(const std::string& name) {
  if (name == "gpt") return std::make_unique<GptWorkload>();
  return std::make_unique<MlpWorkload>();
}

double status_mib(const char* field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(std::string(field) + ":", 0) == 0) {
      return std::strtod(line.c_str() + std::strlen(field) + 1, nullptr) / 1024.0;
    }
  }
  return 0.0;
}

double reduce_max(distributed::Communicator& comm, double value) {
  at::Tensor t = at::tensor({value}, at::kDouble);
  comm.all_reduce_max(t).wait();
  return t.item<double>();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Config {
  const char* name;
  bool zero;
  bool overlap;         // buckets start during backward
  bool overlap_gather;  // ZeRO-1: parameter gathers overlap the next forward
};

struct Figures {
  double step_ms = 0, backward_ms = 0, finish_ms = 0, sent_bytes = 0, allocs_per_step = 0,
         peak_mib = 0;
  int64_t launched = 0, buckets = 0;
};

// Bytes this rank has sent so far, every collective.
double sent_so_far(const distributed::Communicator& comm) {
  double sent = 0;
  using distributed::Collective;
  for (Collective c : {Collective::kAllReduce, Collective::kReduceScatter, Collective::kAllGather,
                       Collective::kBroadcast}) {
    sent += static_cast<double>(comm.traffic(c).bytes_sent);
  }
  return sent;
}

// One configuration's model, reducer and optimizer. The configurations take turns, a few steps
// each (interleaved rounds): a busy stretch of a shared machine then slows some steps of every
// configuration rather than every step of one, and their ratios hold from run to run.
class ConfigRun {
 public:
  ConfigRun(std::shared_ptr<distributed::Communicator> comm, const std::string& model,
            const Config& config)
      : comm_(std::move(comm)), config_(config), work_(make_workload(model)) {
    reducer_ = std::make_unique<distributed::GradReducer>(
        comm_, work_->module(),
        distributed::GradReducerOptions()
            .mode(config.zero ? distributed::ReduceMode::kReduceScatter
                              : distributed::ReduceMode::kAllReduce)
            .overlap(config.overlap)
            .overlap_param_gather(config.overlap_gather)
            .bucket_numel(model == "gpt" ? int64_t{1} << 17 : kWidth * kWidth / 2));
    if (config.overlap_gather) {
      distributed::GradReducer* reducer = reducer_.get();
      work_->set_before_use([reducer](const torch::nn::Module& m) { reducer->wait_for_params(m); });
    }
    const auto adamw = torch::optim::AdamWOptions(1e-3).weight_decay(0.01);
    if (config.zero) {
      optimizer_ =
          std::make_unique<distributed::DistributedOptimizer>(*reducer_, work_->module(), adamw);
    } else {
      optimizer_ = std::make_unique<optim::Float16Optimizer>(work_->module(), adamw);
    }
  }
  ~ConfigRun() {
    try {
      reducer_->wait_param_gather();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_dist: %s\n", e.what());
    }
  }

  // One turn: a lead step, then `steps` timed ones, back to back. The batches are made and the
  // ranks meet at a barrier before the lead step; between steps each rank only notes its own
  // times, so that nothing untimed runs behind which an overlapped parameter gather could
  // finish. The lead step leaves its gather in flight for the first timed step, as each timed
  // step does for the next: every timed step waits for what its forward does not hide of its
  // predecessor's gather, as in a run of this configuration alone. The last step's gather is
  // waited for after the turn (in place of the lead step's, which the first timed step paid).
  void turn(int steps, const testing::CountingAllocatorGuard& counting) {
    std::vector<at::Tensor> batches;
    for (int i = 0; i <= steps; ++i) {
      batches.push_back(work_->make_batch(index_++, comm_->rank(), comm_->size()));
    }
    // Per timed step, this rank's step, backward and finish() times, in ms.
    at::Tensor times = at::zeros({3, steps}, at::kDouble);
    auto t = times.accessor<double, 2>();
    int64_t allocations = 0;
    comm_->barrier();
    step(batches[0], counting);
    const double sent_before = sent_so_far(*comm_);
    for (int i = 0; i < steps; ++i) {
      const StepTimes s = step(batches[i + 1], counting);
      t[0][i] = s.step_ms;
      t[1][i] = s.backward_ms;
      t[2][i] = s.finish_ms;
      allocations += s.allocations;
    }
    sent_ += sent_so_far(*comm_) - sent_before;
    reducer_->wait_param_gather();
    comm_->all_reduce_max(times).wait();  // the slowest rank's, step by step
    for (int i = 0; i < steps; ++i) {
      step_ms_.push_back(t[0][i]);
      backward_ms_.push_back(t[1][i]);
      finish_ms_.push_back(t[2][i]);
    }
    allocations_ += allocations;
  }
  void untimed(int steps, const testing::CountingAllocatorGuard& counting) {
    for (int i = 0; i < steps; ++i) {
      step(work_->make_batch(index_++, comm_->rank(), comm_->size()), counting);
    }
    reducer_->wait_param_gather();
  }

  Figures figures() const {
    Figures f;
    const double steps = static_cast<double>(step_ms_.size());
    f.sent_bytes = sent_ / steps;
    f.step_ms = median(step_ms_);
    f.backward_ms = median(backward_ms_);
    f.finish_ms = *std::min_element(finish_ms_.begin(), finish_ms_.end());
    f.allocs_per_step = reduce_max(*comm_, static_cast<double>(allocations_) / steps);
    f.launched = reducer_->last_timing().launched_during_backward;
    f.buckets = reducer_->last_timing().buckets;
    return f;
  }

 private:
  struct StepTimes {
    double step_ms, backward_ms, finish_ms;
    int64_t allocations;  // tensors allocated inside zero_grad() and update()
  };

  // One step on this rank, timed from zero_grad() to the optimizer's return.
  StepTimes step(const at::Tensor& batch, const testing::CountingAllocatorGuard& counting) {
    const auto t0 = Clock::now();
    int64_t mark = counting.allocations();
    reducer_->zero_grad();
    int64_t ours = counting.allocations() - mark;
    const at::Tensor loss = work_->loss(batch);
    const auto backward_start = Clock::now();
    loss.backward();
    const double backward =
        std::chrono::duration<double, std::milli>(Clock::now() - backward_start).count();
    mark = counting.allocations();
    if (!config_.zero) reducer_->finish();
    optimizer_->update();
    ours += counting.allocations() - mark;
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    return {ms, backward, reducer_->last_timing().finish_seconds * 1e3, ours};
  }

  std::shared_ptr<distributed::Communicator> comm_;
  Config config_;
  std::unique_ptr<Workload> work_;
  std::unique_ptr<distributed::GradReducer> reducer_;
  std::unique_ptr<optim::Float16Optimizer> optimizer_;
  int64_t index_ = 0;  // the data's step
  std::vector<double> step_ms_, backward_ms_, finish_ms_;
  int64_t allocations_ = 0;
  double sent_ = 0;
};

int worker(const std::string& model, int steps) {
  auto comm = distributed::init_from_env();
  const double baseline_mib = status_mib("VmRSS");
  const int n = comm->size();
  const Config configs[] = {{"zero1", true, true, false},
                            {"zero1_gather", true, true, true},
                            {"dp", false, true, false},
                            {"zero1_serial", true, false, false}};
  const testing::CountingAllocatorGuard counting;
  std::vector<std::unique_ptr<ConfigRun>> runs;
  // The first configuration's peak is its own: measured after as many steps as are timed,
  // before the others exist.
  runs.push_back(std::make_unique<ConfigRun>(comm, model, configs[0]));
  runs.back()->untimed(kWarmup + steps, counting);
  const double zero1_peak_mib = reduce_max(*comm, status_mib("VmHWM") - baseline_mib);
  for (std::size_t c = 1; c < std::size(configs); ++c) {
    runs.push_back(std::make_unique<ConfigRun>(comm, model, configs[c]));
    runs.back()->untimed(kWarmup, counting);
  }
  constexpr int kStepsPerTurn = 4;
  for (int done = 0; done < steps; done += kStepsPerTurn) {
    for (const auto& run : runs) run->turn(std::min(kStepsPerTurn, steps - done), counting);
  }
  Figures fz = runs[0]->figures();
  fz.peak_mib = zero1_peak_mib;
  const Figures fg = runs[1]->figures(), fd = runs[2]->figures(), fs = runs[3]->figures();
  if (comm->rank() != 0) return 0;
  std::unique_ptr<Workload> probe = make_workload(model);
  double param_bytes = 0, params = 0;
  for (const auto& p : probe->module().parameters()) {
    param_bytes += static_cast<double>(p.nbytes());
    params += static_cast<double>(p.numel());
  }
  auto figures = [](const Figures& f) {
    return nlohmann::json{{"step_ms", f.step_ms},        {"backward_ms", f.backward_ms},
                          {"finish_ms", f.finish_ms},    {"sent", f.sent_bytes},
                          {"allocs", f.allocs_per_step}, {"peak_mib", f.peak_mib},
                          {"launched", f.launched},      {"buckets", f.buckets}};
  };
  const nlohmann::json out = {
      {"model", model},
      {"n", n},
      {"params", params},
      {"param_bytes", param_bytes},
      {"minimum_sent", 2.0 * (n - 1) / n * param_bytes},
      {"zero1", figures(fz)},
      {"zero1_gather", figures(fg)},
      {"dp", figures(fd)},
      {"zero1_serial", figures(fs)},
  };
  std::printf("%s\n", out.dump().c_str());
  std::fflush(stdout);
  return 0;
}

// The last line of a command's output that parses as a JSON object.
nlohmann::json run_json(const std::string& command) {
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return {};
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
  const int status = ::pclose(pipe);
  nlohmann::json last;
  size_t begin = 0;
  while (begin < out.size()) {
    const size_t end = out.find('\n', begin);
    const std::string line = out.substr(begin, end == std::string::npos ? end : end - begin);
    if (!line.empty() && line[0] == '{') {
      auto parsed = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (parsed.is_object()) last = parsed;
    }
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  if (status != 0 || last.is_null()) std::cerr << "bench_dist: failed: " << command << "\n" << out;
  return last;
}

int launcher(const std::string& self, std::string torchrun, std::string python, int steps) {
  if (torchrun.empty()) torchrun = bench::kTorchrun;
  if (python.empty()) python = bench::kPython;
  if (torchrun.empty()) {
    std::cerr << "bench_dist: pass --torchrun PATH, or run it under torchrun with --worker\n";
    return 2;
  }
  const std::string peer = std::string(bench::kSourceDir) + "/bench/dist_peer.py";
  std::printf(
      "bench_dist: ZeRO-1 on Gloo vs plain DP vs PyTorch DDP(gloo) + ZeroRedundancyOptimizer, "
      "%d timed steps, 1 thread per rank on this machine's cores (oversubscribed beyond them: "
      "compare ratios)\n",
      steps);
  for (const char* model : {"gpt", "mlp"}) {
    for (int n : {2, 4}) {
      const std::string launch =
          "OMP_NUM_THREADS=1 " + torchrun + " --standalone --nproc-per-node " + std::to_string(n);
      const nlohmann::json ours = run_json(launch + " --no-python " + self + " --worker --model " +
                                           model + " --steps " + std::to_string(steps) + " 2>&1");
      nlohmann::json theirs;
      if (!python.empty()) {
        theirs = run_json(launch + " " + peer + " --model " + model + " --steps " +
                          std::to_string(steps) + " 2>&1");
      }
      if (ours.is_null()) return 1;
      const double minimum = ours["minimum_sent"].get<double>();
      const double dp_ms = ours["dp"]["step_ms"].get<double>();
      const double peer_ms = theirs.is_null() ? 0.0 : theirs["step_ms"].get<double>();
      std::printf(
          "\n== %s, N=%d: %.0f parameters (%.2f MiB), ZeRO-1 minimum %.0f bytes sent "
          "per rank per step\n",
          model, n, ours["params"].get<double>(), ours["param_bytes"].get<double>() / (1 << 20),
          minimum);
      std::printf("  %-34s %9s %7s %8s %9s %12s %7s %7s %7s\n", "configuration", "step ms", "vs DP",
                  "vs peer", "peak MiB", "sent/step", "x min", "hidden", "allocs");
      const auto serial_finish = ours["zero1_serial"]["finish_ms"].get<double>();
      for (const auto& [key, label] : std::vector<std::pair<std::string, std::string>>{
               {"zero1", "mixprec ZeRO-1"},
               {"zero1_gather", "mixprec ZeRO-1, gather overlapped"},
               {"dp", "mixprec plain DP"},
               {"zero1_serial", "mixprec ZeRO-1, reduction after bwd"}}) {
        const nlohmann::json& f = ours[key];
        const double ms = f["step_ms"].get<double>();
        // Only ZeRO-1's overlapped rows have a serial reference of the same reduction.
        char hidden[16] = "-";
        if ((key == "zero1" || key == "zero1_gather") && serial_finish > 0) {
          std::snprintf(hidden, sizeof hidden, "%.0f%%",
                        100 * (1.0 - f["finish_ms"].get<double>() / serial_finish));
        }
        char peak[32] = "-";
        if (key == "zero1") std::snprintf(peak, sizeof peak, "%.1f", f["peak_mib"].get<double>());
        std::printf("  %-34s %9.2f %7.2f %8s %9s %12.0f %7.2f %7s %7.1f\n", label.c_str(), ms,
                    ms / dp_ms,
                    peer_ms > 0 ? (std::to_string(ms / peer_ms).substr(0, 4)).c_str() : "-", peak,
                    f["sent"].get<double>(), f["sent"].get<double>() / minimum, hidden,
                    f["allocs"].get<double>());
      }
      std::printf(
          "  backward %.2f ms; the reduction, started after backward, waits %.2f ms (finish(), "
          "fastest step): %s\n",
          ours["zero1_serial"]["backward_ms"].get<double>(), serial_finish,
          ours["zero1_serial"]["backward_ms"].get<double>() > serial_finish
              ? "backward is the longer, so overlap can hide all of it"
              : "the reduction is the longer: overlap can hide at most backward's length");
      if (!theirs.is_null()) {
        std::printf("  %-34s %9.2f %7.2f %8s %9.1f %12.0f %7.2f %7s %7s\n",
                    "PyTorch DDP + ZeroRedundancyOpt.", peer_ms, peer_ms / dp_ms, "1.00",
                    theirs["peak_growth_mib"].get<double>(),
                    theirs["modeled_sent_bytes"].get<double>(),
                    theirs["modeled_sent_bytes"].get<double>() / minimum, "-", "-");
      }
      std::printf("  JSON %s\n  JSON %s\n", ours.dump().c_str(), theirs.dump().c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string torchrun, python, model = "mlp";
  int steps = 16;
  bool is_worker = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--worker") == 0) is_worker = true;
    if (std::strcmp(argv[i], "--model") == 0 && i + 1 < argc) model = argv[++i];
    if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) steps = std::atoi(argv[++i]);
    if (std::strcmp(argv[i], "--torchrun") == 0 && i + 1 < argc) torchrun = argv[++i];
    if (std::strcmp(argv[i], "--python") == 0 && i + 1 < argc) python = argv[++i];
  }
  if (is_worker || std::getenv("RANK") != nullptr) return worker(model, steps);
  return launcher(argv[0], torchrun, python, steps);
}
