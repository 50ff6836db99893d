// The main job's training step against its peers: tokens/s and peak memory.
//
//   bench_train [--steps N] [--warmup N] [--repeats N] [--threads N] [--omp-wait active|passive]
//               [--ranks N] [mixprec-train model flags]
//
// Model flags (--layers, --d-model, --heads, --experts, --top-k, --seq-len, --batch) change the
// model of every configuration, the Python peer's included; without them it is mixprec-train's
// default model.
//
// Measures, each in a process of its own so that memory peaks do not mix:
//   mixprec bf16 + fp8     mixprec-train's step as it runs by default (train_step: BF16 weights,
//                          FP32 router/bias/norms, FP8 fake-quantized expert GEMMs, AdamW with
//                          FP32 masters through Float16Optimizer)
//   mixprec bf16           the same with --fp8 off
//   libtorch fp32          the same model, FP32 parameters, torch::optim::AdamW
//   pytorch autocast bf16  bench/train_bench.py: the same model in PyTorch, torch.autocast
//                          (bfloat16) and AdamW(fused=True) — what a Python user would write
// and, with --ranks N (N >= 2), data parallel on N ranks under torchrun, one thread each:
//   mixprec ZeRO-1         mixprec-train's step on N ranks (make_data_parallel_optimizer: BF16
//                          + FP8 as by default, gradients reduced in buckets during backward,
//                          the FP32 masters and moments sharded)
//   pytorch DDP + ZeRO     bench/train_bench.py on N ranks: DistributedDataParallel (gloo) and
//                          ZeroRedundancyOptimizer over AdamW(fused=True), autocast BF16, the
//                          same expert padding and dispatch
// and prints one table: tokens/s from the median step time, a forward/backward/optimizer
// split, resident memory once everything is built ("setup": runtime, data, model, optimizer),
// its peak over training (VmHWM), and the difference ("training": activations, gradients,
// optimizer state created on the first step, kernel caches), and page faults per timed step
// (pages malloc got from the system; a mean, with the steps in which the heap still grows).
// Every row times the same region, the whole step as train_step runs it: the batch made from
// the corpus, zero_grad, forward, backward, (reduction,) clipping, the optimizer step and the
// expert-bias update. "optim ms" is the step less forward and backward: the optimizer and the
// rest (batch, zero_grad, reduction wait, bookkeeping), as train_step's phases split it.
// The model is mixprec-train's default
// (2 layers, d_model 128, 4 experts top-2, batch 16 x 128 bytes of Python's pydoc topics).
//
// The peers run twice: as their users run them (glibc's malloc defaults, ideep's GEMM
// descriptor cache at its default) and with the host settings mixprec-train makes by default —
// the malloc thresholds of --malloc keep (host_memory.h, given to them through GLIBC_TUNABLES)
// and a one-entry descriptor cache (gemm_cache.h, LRU_CACHE_CAPACITY=1): the rows named
// "mixprec's env" — so that what those settings alone give shows as such; mixprec's rows run
// with them.
//
// Every child runs with the same OMP_WAIT_POLICY: --omp-wait, default active — what
// mixprec-train's --omp-wait auto picks on a machine with a core per thread, and close to what
// a PyTorch user gets by default (libgomp spins a while before it sleeps). Measured on the
// 2-core development machine, passive costs mixprec-train about a third of its speed; on a
// busy machine use passive, or spinning workers make every step time meaningless.
#include "config.h"
#include "data.h"
#include "data_parallel.h"
#include "gemm_cache.h"
#include "gpt.h"
#include "host_memory.h"
#include "loop.h"
#include "optimizer.h"
#include "plan.h"
#include "support/bench_paths.h"

#include "mixprec/distributed/communicator.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using train::TrainConfig;

struct Options {
  int64_t steps = 30;
  int64_t warmup = 5;
  int64_t threads = 0;
  int64_t repeats = 3;              // runs of each configuration; the fastest counts
  std::string omp_wait = "active";  // OMP_WAIT_POLICY of every child
  int64_t ranks = 0;                // > 1: also the data-parallel comparison on this many ranks
  std::string child;                // the configuration this process measures; empty: the parent
  std::vector<std::string> model;   // mixprec-train flags for the model (--batch 64, …)
  TrainConfig config;               // the default configuration with those flags applied
};

// A field of /proc/self/status in MiB: VmHWM (peak resident set) or VmRSS (current).
double status_mib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024.0;
  }
  return 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Times of one step's three phases; the step's total is their sum.
struct PhaseTimes {
  std::vector<double> forward, backward, optimizer, total;
  void add(double f, double b, double o) {
    forward.push_back(f), backward.push_back(b), optimizer.push_back(o), total.push_back(f + b + o);
  }
};

// Runs warmup + steps of `step` and reports the medians as one JSON line on stdout. `step` runs
// exactly one training step and records its phases: the page faults counted are the steps'.
void measure(const Options& o, const std::string& name, const TrainConfig& config,
             const std::function<void(int64_t, PhaseTimes&)>& step) {
  // Data parallel: every rank steps, rank 0 reports (its memory is one rank's).
  PhaseTimes warm, timed;
  // Recording a step's times allocates nothing, so its faults are not counted as the step's.
  for (auto* v : {&timed.forward, &timed.backward, &timed.optimizer, &timed.total}) {
    v->reserve(static_cast<size_t>(o.steps));
  }
  const double before_mib = status_mib("VmRSS");  // runtime, data, model and optimizer built
  for (int64_t i = 0; i < o.warmup; ++i) step(i, warm);
  const int64_t faults_before = train::minor_page_faults();
  for (int64_t i = 0; i < o.steps; ++i) step(o.warmup + i, timed);
  const double faults_per_step = static_cast<double>(train::minor_page_faults() - faults_before) /
                                 static_cast<double>(std::max<int64_t>(1, o.steps));
  const double step_s = median(timed.total);
  const nlohmann::json out = {
      {"config", name},
      {"tokens_per_s", static_cast<double>(config.tokens_per_step()) / step_s},
      {"step_ms", step_s * 1e3},
      {"forward_ms", median(timed.forward) * 1e3},
      {"backward_ms", median(timed.backward) * 1e3},
      {"optimizer_ms", median(timed.optimizer) * 1e3},
      {"peak_rss_mib", status_mib("VmHWM")},
      {"setup_rss_mib", before_mib},
      {"faults_per_step", faults_per_step},
      {"threads", at::get_num_threads()}};
  if (config.rank == 0) std::printf("%s\n", out.dump().c_str());
}

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets) {
  return at::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape(-1));
}

// mixprec-train's data, precision and model for `config`, built as mixprec-train builds them
// (the weights from config.seed), in training mode.
struct MixprecSetup {
  explicit MixprecSetup(const TrainConfig& config)
      : corpus(train::load_corpus("", config.val_fraction, config.seq_len)),
        batches(corpus.train, config.seq_len, config.seed, 0),
        precision(train::precision_from(config)),
        model(seeded_model(config, precision)) {
    model.module->train();
  }
  static train::MixedModel seeded_model(const TrainConfig& config,
                                        const train::Precision& precision) {
    at::manual_seed(config.seed);
    return train::apply_precision(train::Gpt(train::gpt_config(config, precision.quant)),
                                  precision);
  }

  train::Corpus corpus;
  train::BatchSampler batches;
  train::Precision precision;
  train::MixedModel model;
};

// train_step's phases as the table's three columns: everything but forward and backward (the
// reduction wait, checkpoint wait (none), optimizer, batch, zero_grad, bookkeeping) counts with
// the optimizer; their sum is train_step's wall time.
void add_phases(const train::StepPhases& p, PhaseTimes& times) {
  times.add(p.forward_s, p.backward_s, p.reduce_s + p.checkpoint_s + p.optimizer_s + p.other_s);
}

// mixprec-train's own step, one train_step per step; the split is its own phase timing.
void run_mixprec(const Options& o, const std::string& fp8) {
  TrainConfig config = o.config;
  config.fp8 = fp8;
  MixprecSetup setup(config);
  const train::BatchSampler& batches = setup.batches;
  train::MixedModel& model = setup.model;
  auto optimizer = train::make_single_process_optimizer(*model.module, config, setup.precision);
  measure(o, fp8 == "off" ? "mixprec bf16" : "mixprec bf16 + fp8 " + fp8, config,
          [&](int64_t i, PhaseTimes& times) {
            add_phases(train::train_step(config, model, *optimizer, batches, i, config.lr).phases,
                       times);
          });
}

// mixprec-train's step on the launcher's ranks, as `torchrun ... mixprec-train` runs it: each
// rank its rows of every global batch, ZeRO-1 (the split is train_step's own phase timing).
void run_mixprec_data_parallel(const Options& o) {
  TrainConfig config = o.config;
  const std::shared_ptr<mixprec::distributed::Communicator> ranks = train::join_ranks();
  TORCH_CHECK(ranks != nullptr, "bench_train --child mixprec-dp runs under torchrun");
  config.world_size = ranks->size();
  config.rank = ranks->rank();
  MixprecSetup setup(config);
  const train::BatchSampler& batches = setup.batches;
  train::MixedModel& model = setup.model;
  auto optimizer = train::make_data_parallel_optimizer(model, config, setup.precision, ranks);
  measure(
      o, "mixprec ZeRO-1, " + std::to_string(config.world_size) + " ranks", config,
      [&](int64_t i, PhaseTimes& times) {
        add_phases(
            train::train_step(config, model, *optimizer, batches, i, config.lr, ranks.get()).phases,
            times);
      });
}

// The same model in FP32 with LibTorch's own AdamW: what a LibTorch user has without mixprec.
void run_fp32(const Options& o) {
  TrainConfig config = o.config;
  config.fp8 = "off";
  const train::Corpus corpus = train::load_corpus("", config.val_fraction, config.seq_len);
  const train::BatchSampler batches(corpus.train, config.seq_len, config.seed, 0);
  at::manual_seed(config.seed);
  train::Gpt gpt(train::gpt_config(config, {}));
  gpt->train();
  std::vector<at::Tensor> decay, no_decay, all;
  for (const auto& p : gpt->named_parameters()) {
    const bool d = p.value().dim() >= 2 && p.key().find("router") == std::string::npos;
    (d ? decay : no_decay).push_back(p.value());
    all.push_back(p.value());
  }
  const auto adamw = torch::optim::AdamWOptions(config.lr).betas({0.9, 0.95}).eps(1e-8);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay,
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(adamw).weight_decay(config.weight_decay)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(adamw).weight_decay(0)));
  torch::optim::AdamW optimizer(std::move(groups), adamw);
  // The same region as train_step's: the batch and zero_grad are inside the step's time, in
  // the optimizer column as train_step's "other".
  measure(o, "libtorch fp32 + torch::optim::AdamW", config, [&](int64_t i, PhaseTimes& times) {
    const auto start = Clock::now();
    const train::Batch b = batches.batch(i, config.batch, 0, config.batch);
    optimizer.zero_grad();
    const double before = since(start);
    auto t = Clock::now();
    auto [logits, aux] = gpt->forward(b.inputs);
    const at::Tensor loss = cross_entropy(logits, b.targets) + config.aux_loss_coef * aux;
    const double f = since(t);
    t = Clock::now();
    loss.backward();
    const double bw = since(t);
    t = Clock::now();
    torch::nn::utils::clip_grad_norm_(all, config.clip_grad);
    optimizer.step();
    gpt->update_expert_biases(config.bias_update_rate);
    times.add(f, bw, since(t) + before);
  });
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs `command`, returns the last line of its stdout that parses as a JSON object.
std::optional<nlohmann::json> run_child(const std::string& command) {
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(::popen(command.c_str(), "r"), ::pclose);
  if (!pipe) return std::nullopt;
  std::optional<nlohmann::json> result;
  char buffer[4096];
  while (std::fgets(buffer, sizeof buffer, pipe.get()) != nullptr) {
    try {
      nlohmann::json j = nlohmann::json::parse(buffer);
      if (j.is_object() && j.contains("tokens_per_s")) result = j;
    } catch (const nlohmann::json::exception&) {
    }
  }
  return result;
}

// Runs each child `repeats` times, round robin, keeps each one's fastest run (the one least
// disturbed by whatever else the machine was doing, as the other benchmarks here), and prints
// their table; then the first `ours` rows' ratios to every later row.
void compare(const Options& o, const std::vector<std::pair<std::string, std::string>>& children,
             size_t ours) {
  std::printf("%-52s %9s %8s %7s %7s %8s %10s %10s %10s %7s\n", "configuration", "tokens/s",
              "step ms", "fwd ms", "bwd ms", "optim ms", "setup RSS", "peak RSS", "training",
              "faults");
  std::vector<std::optional<nlohmann::json>> best(children.size());
  for (int64_t rep = 0; rep < o.repeats; ++rep) {
    for (size_t c = 0; c < children.size(); ++c) {
      const auto r = run_child(children[c].second + " 2>/dev/null");
      if (r && (!best[c] ||
                r->at("tokens_per_s").get<double>() > best[c]->at("tokens_per_s").get<double>())) {
        best[c] = r;
      }
    }
  }
  std::vector<nlohmann::json> results;
  for (size_t c = 0; c < children.size(); ++c) {
    if (!best[c]) {
      std::printf("%-52s failed: %s\n", children[c].first.c_str(), children[c].second.c_str());
      continue;
    }
    nlohmann::json r = *best[c];
    r["config"] = children[c].first;  // the row's name: the same program runs several rows
    const double setup = r.at("setup_rss_mib").get<double>(),
                 peak = r.at("peak_rss_mib").get<double>();
    std::printf("%-52s %9.0f %8.1f %7.1f %7.1f %8.1f %6.0f MiB %6.0f MiB %6.0f MiB %7.0f\n",
                children[c].first.c_str(), r.at("tokens_per_s").get<double>(),
                r.at("step_ms").get<double>(), r.at("forward_ms").get<double>(),
                r.at("backward_ms").get<double>(), r.at("optimizer_ms").get<double>(), setup, peak,
                peak - setup, r.at("faults_per_step").get<double>());
    results.push_back(r);
  }
  if (results.size() <= ours) return;
  std::printf("\n");
  const auto training = [](const nlohmann::json& j) {
    return j.at("peak_rss_mib").get<double>() - j.at("setup_rss_mib").get<double>();
  };
  for (size_t j = 0; j < ours; ++j) {
    for (size_t i = ours; i < results.size(); ++i) {
      std::printf(
          "%s vs %s: speed x%.2f, peak RSS x%.2f, training memory x%.2f\n",
          results[j].at("config").get<std::string>().c_str(),
          results[i].at("config").get<std::string>().c_str(),
          results[j].at("tokens_per_s").get<double>() / results[i].at("tokens_per_s").get<double>(),
          results[j].at("peak_rss_mib").get<double>() / results[i].at("peak_rss_mib").get<double>(),
          training(results[j]) / training(results[i]));
    }
  }
}

int parent(const Options& o, const char* self) {
  std::string common = " --steps " + std::to_string(o.steps) + " --warmup " +
                       std::to_string(o.warmup) + " --threads " + std::to_string(o.threads);
  for (const std::string& flag : o.model) {
    common += ' ';  // appended, not " " + ...: GCC 12 warns falsely (-Wstringop-overflow) there
    common += shell_quote(flag);
  }
  std::string policy = o.omp_wait;
  for (char& c : policy) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  const std::string env = "OMP_WAIT_POLICY=" + policy + " ";
  // The peers once as their users run them and once with the host settings mixprec-train
  // makes (--malloc keep, the descriptor cache), so that what they give is not counted as
  // mixprec's.
  const std::string kept = env + "GLIBC_TUNABLES=" + train::keep_malloc_tunables() + " " +
                           train::kGemmDescriptorCacheEnv + " ";
  const std::string peer_script =
      shell_quote(std::string(mixprec::bench::kSourceDir) + "/bench/train_bench.py");
  const std::string peer = std::string(mixprec::bench::kPython).empty()
                               ? ""
                               : shell_quote(mixprec::bench::kPython) + " " + peer_script;
  std::vector<std::pair<std::string, std::string>> children = {
      {"mixprec bf16 + fp8 hybrid", env + shell_quote(self) + " --child mixprec-fp8" + common},
      {"mixprec bf16", env + shell_quote(self) + " --child mixprec" + common},
      {"libtorch fp32 + AdamW", env + shell_quote(self) + " --child fp32" + common},
      {"libtorch fp32 + AdamW, mixprec's env", kept + shell_quote(self) + " --child fp32" + common},
  };
  if (!peer.empty()) {
    children.emplace_back("pytorch autocast bf16 + AdamW(fused)", env + peer + common);
    children.emplace_back("pytorch autocast bf16 + AdamW(fused), mixprec's env",
                          kept + peer + common);
  }
  const TrainConfig& defaults = o.config;
  std::printf(
      "training step of mixprec-train's model: %s, batch %lld x %lld tokens; "
      "median of %lld steps after %lld warm-up, fastest of %lld runs; each run in its own "
      "process, OMP_WAIT_POLICY=%s; mixprec's env: GLIBC_TUNABLES=%s %s\n\n",
      train::describe(defaults).c_str(), static_cast<long long>(defaults.batch),
      static_cast<long long>(defaults.seq_len), static_cast<long long>(o.steps),
      static_cast<long long>(o.warmup), static_cast<long long>(o.repeats), policy.c_str(),
      train::keep_malloc_tunables().c_str(), train::kGemmDescriptorCacheEnv);
  compare(o, children, 2);

  if (o.ranks < 2) return 0;
  if (defaults.batch % o.ranks != 0) {
    std::printf("\n--ranks %lld: --batch %lld does not split evenly; skipped\n",
                static_cast<long long>(o.ranks), static_cast<long long>(defaults.batch));
    return 0;
  }
  const std::string torchrun = mixprec::bench::kTorchrun;
  if (torchrun.empty() || peer.empty()) {
    std::printf("\n--ranks %lld: no torchrun or Python beside the build; skipped\n",
                static_cast<long long>(o.ranks));
    return 0;
  }
  // One thread per rank, as ranks x threads must fit the cores; memory is rank 0's.
  const std::string launcher = "OMP_NUM_THREADS=1 " + shell_quote(torchrun) +
                               " --standalone --nproc-per-node " + std::to_string(o.ranks) + " ";
  const std::string launch = env + launcher, launch_kept = kept + launcher;
  std::string dp_common = " --steps " + std::to_string(o.steps) + " --warmup " +
                          std::to_string(o.warmup) + " --threads 1";
  for (const std::string& flag : o.model) dp_common += " " + shell_quote(flag);
  std::printf(
      "\ndata parallel on %lld ranks, 1 thread each (the same global batch; memory: "
      "rank 0's)\n\n",
      static_cast<long long>(o.ranks));
  compare(o,
          {{"mixprec ZeRO-1",
            launch + "--no-python " + shell_quote(self) + " --child mixprec-dp" + dp_common},
           {"pytorch DDP + ZeroRedundancyOptimizer", launch + peer_script + " --ddp" + dp_common},
           {"pytorch DDP + ZeroRedundancyOptimizer, mixprec's env",
            launch_kept + peer_script + " --ddp" + dp_common}},
          1);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h") {
      std::printf(
          "usage: bench_train [--steps N] [--warmup N] [--repeats N] [--threads N]\n"
          "                   [--omp-wait active|passive] [--ranks N] [mixprec-train model "
          "flags]\n"
          "The main job's training step against LibTorch FP32 and PyTorch autocast BF16 (and,\n"
          "with --ranks N, ZeRO-1 against DDP + ZeroRedundancyOptimizer): bench/train_bench.cpp\n"
          "says what each row runs.\n");
      return 0;
    }
    if (arg == "--steps")
      o.steps = std::stoll(value());
    else if (arg == "--warmup")
      o.warmup = std::stoll(value());
    else if (arg == "--repeats")
      o.repeats = std::stoll(value());
    else if (arg == "--threads")
      o.threads = std::stoll(value());
    else if (arg == "--omp-wait")
      o.omp_wait = value();
    else if (arg == "--ranks")
      o.ranks = std::stoll(value());
    else if (arg == "--child")
      o.child = value();
    else
      o.model.push_back(arg);
  }
  std::vector<const char*> model_argv = {"bench_train"};
  for (const std::string& flag : o.model) model_argv.push_back(flag.c_str());
  try {
    o.config = train::parse_args(static_cast<int>(model_argv.size()), model_argv.data()).config;
  } catch (const train::UsageError& e) {
    std::fprintf(stderr, "bench_train: %s\n", e.what());
    return 2;
  }
  if (o.threads > 0) at::set_num_threads(static_cast<int>(o.threads));
  // mixprec's rows run as mixprec-train does by default.
  if (o.child.starts_with("mixprec")) {
    train::set_malloc_policy("keep");
    train::limit_gemm_descriptor_cache();
  }
  if (o.child.empty()) return parent(o, std::filesystem::read_symlink("/proc/self/exe").c_str());
  if (o.child == "mixprec-fp8")
    run_mixprec(o, "hybrid");
  else if (o.child == "mixprec")
    run_mixprec(o, "off");
  else if (o.child == "fp32")
    run_fp32(o);
  else if (o.child == "mixprec-dp")
    run_mixprec_data_parallel(o);
  else
    return 2;
  return 0;
}
