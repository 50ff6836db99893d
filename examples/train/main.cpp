// mixprec-train: trains a small GPT with mixture-of-experts blocks, end to end, in mixed
// precision — the library's main job.
//
//   config → data → model → precision plan → optimizer → (resume) → loop → checkpoint
//   → sample → summary
//
// Every step of that story is one file: config.cpp (flags), data.cpp (bytes of text, batches),
// gpt.cpp and moe.cpp (the model), plan.cpp (what stays FP32), optimizer.cpp (AdamW with FP32
// masters), loop.cpp (the steps), checkpointing.cpp (durable saves), sample.cpp, summary.cpp.
//
// Exit status: 0 when training finished or was stopped by SIGINT/SIGTERM (after saving);
// 2 for bad input (one line on stderr naming the problem); 1 for any other failure.
#include "checkpointing.h"
#include "config.h"
#include "cpu_kernels.h"
#include "data.h"
#include "data_parallel.h"
#include "flops.h"
#include "gemm_cache.h"
#include "gpt.h"
#include "host_memory.h"
#include "init_from.h"
#include "loop.h"
#include "memory.h"
#include "optimizer.h"
#include "plan.h"
#include "progress.h"
#include "run_paths.h"
#include "sample.h"
#include "schedule.h"
#include "signals.h"
#include "summary.h"

#include "mixprec/checkpoint/format/error.h"
#include "mixprec/distributed/communicator.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace {

using namespace train;

// Rank and world size from the launcher's ranks (torchrun sets RANK and WORLD_SIZE); 0 and 1
// without. The batch must split evenly over them: checked again now that their number is known.
void adopt_ranks(TrainConfig& config, const mixprec::distributed::Communicator* ranks) {
  config.world_size = ranks != nullptr ? ranks->size() : 1;
  config.rank = ranks != nullptr ? ranks->rank() : 0;
  validate(config);
}

// The launcher gives every rank the same command line, so what the flags alone decide (a flag
// error, --help) is the same on every rank: rank 0 prints it and the others exit with the same
// status in silence, so that the terminal torchrun shares shows it once, not once per rank.
// torchrun sets RANK before the ranks have met; without a launcher there is one process.
bool launched_as_rank_zero() {
  const char* rank = std::getenv("RANK");
  return rank == nullptr || std::string_view(rank) == "0";
}

// Rank 0's memory for the summary: the tensors of the model, its gradients and the optimizer,
// and what a step added on top of them (loop.h).
RunReport::Memory memory_report(const torch::nn::Module& model, const OptimizerMemory& optimizer,
                                const LoopOutcome& outcome) {
  RunReport::Memory m;
  std::set<const void*> seen;  // tied tensors once
  for (const at::Tensor& p : model.parameters()) {
    if (!seen.insert(p.data_ptr()).second) continue;
    m.parameters += static_cast<int64_t>(p.nbytes());
    if (p.grad().defined()) m.gradients += static_cast<int64_t>(p.grad().nbytes());
  }
  for (const at::Tensor& b : model.buffers()) m.parameters += static_cast<int64_t>(b.nbytes());
  m.optimizer_state = optimizer.state_bytes;
  // No step past the first ones (loop.h): nothing measured, which is not a peak of 0 bytes.
  const bool measured = outcome.records.size() > LoopOutcome::kFirstStepsLeftOut;
  m.step_extra = measured ? outcome.step_extra_peak_bytes : -1;
  m.activations = measured ? outcome.activation_peak_bytes : -1;
  if (measured) {
    std::vector<int64_t> faults;
    for (size_t i = LoopOutcome::kFirstStepsLeftOut; i < outcome.records.size(); ++i)
      faults.push_back(outcome.records[i].page_faults);
    const auto middle = faults.begin() + static_cast<std::ptrdiff_t>(faults.size() / 2);
    std::nth_element(faults.begin(), middle, faults.end());
    m.page_faults_median = static_cast<double>(*middle);
    m.page_faults_mean = static_cast<double>(std::accumulate(faults.begin(), faults.end(), 0L)) /
                         static_cast<double>(faults.size());
  }
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) m.peak_rss = std::stoll(line.substr(6)) * 1024;
  }
  return m;
}

// What a resumed run does differently from the run it continues: the settings given anew, and
// where the learning-rate schedule jumps because of them (a longer --steps stretches the
// cosine decay, so the lr rises again).
void print_resume_changes(const TrainConfig& config, const RunPaths& paths) {
  for (const ResumeChange& c : paths.changes) {
    std::printf("changed      %s (was %s)\n", c.now.c_str(), c.saved.c_str());
  }
  if (paths.changes.empty()) return;
  const int64_t step = paths.resume_step;
  double saved_before = 0, saved_after = 0;  // the saved run's lr for steps `step` and `step + 1`
  try {
    const nlohmann::json& saved = paths.saved_shape;
    const auto saved_lr = [&](int64_t index) {
      return learning_rate(index, saved.at("steps").get<int64_t>(), saved.at("lr").get<double>(),
                           saved.at("warmup").get<int64_t>(),
                           saved.at("min_lr_ratio").get<double>());
    };
    saved_before = saved_lr(step - 1);
    saved_after = saved_lr(step);
  } catch (const nlohmann::json::exception&) {
    return;  // a checkpoint from before the schedule was saved
  }
  const double now =
      learning_rate(step, config.steps, config.lr, config.warmup, config.min_lr_ratio);
  if (step > 0 && now != saved_after) {
    std::printf("             the learning rate goes from %.2e at step %lld to %.2e at step %lld\n",
                saved_before, static_cast<long long>(step), now, static_cast<long long>(step + 1));
  }
}

// A resumed run trains on the text it was started with, whatever path names it now (--data
// may be given again as another path, or resolve from another directory): the same bytes, by
// their fingerprint. Checkpoints from before the fingerprint was saved are not checked.
void check_same_text(const Corpus& corpus, const RunPaths& paths) {
  if (!paths.resume_from || paths.saved_text.empty()) return;
  const std::string& now = corpus.fingerprint;
  if (now == paths.saved_text) return;
  throw UsageError("--data: " + corpus.source + " is not the text checkpoint " +
                   paths.resume_from->string() + " was trained on (" + paths.saved_text +
                   "; this one: " + now + ")");
}

// The first line of an error message: the one line the user gets.
std::string first_line(const std::string& message) { return message.substr(0, message.find('\n')); }

// What went wrong, without LibTorch's backtrace.
std::string message_without_backtrace(const std::exception& e) {
  const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
  return torch_error != nullptr ? torch_error->what_without_backtrace() : e.what();
}

// `malloc_policy`, `gemm_cache`: what set_malloc_policy and limit_gemm_descriptor_cache put in
// force, for the start-up lines.
int run(int argc, char** argv, const std::string& malloc_policy, const std::string& gemm_cache) {
  // Every tensor allocated from here on is counted, for the summary's memory line (memory.h).
  LiveBytesAllocator::install();
  // 1. Configuration: flags, the launcher's rank, and where the run lives. With --resume the
  //    checkpoint's saved configuration is read (and checked) before anything else happens.
  ParsedArgs args;
  try {
    args = parse_args(argc, argv);
  } catch (const UsageError&) {
    if (!launched_as_rank_zero()) return 2;
    throw;
  }
  if (args.help) {
    if (launched_as_rank_zero()) std::printf("%s", usage().c_str());
    return 0;
  }
  TrainConfig config = args.config;
  const std::shared_ptr<mixprec::distributed::Communicator> ranks = join_ranks();
  try {
    adopt_ranks(config, ranks.get());
  } catch (const UsageError&) {
    // The batch does not split over these ranks: on every rank alike.
    if (!launched_as_rank_zero()) return 2;
    throw;
  }
  // A fresh run's directory is named by the time it starts: rank 0's time, for every rank.
  const bool names_its_dir = config.out.empty() && config.ckpt_dir.empty() && !config.resume;
  if (ranks && names_its_dir) {
    config.out = ranks->all_gather_strings(new_run_dir().string()).front();
  }
  RunPaths paths = resolve_run_paths(config);
  paths.new_run_dir = names_its_dir;
  // Checked before anything is written, so that a bad flag, a bad data file or a bad --resume
  // changes nothing — unless another run holds the checkpoint directory: then what it holds may
  // change while this one waits for it, and the holder, not its checkpoints, is the answer.
  const bool held_elsewhere = held_by_another_run(paths.ckpt_root);
  std::optional<Corpus> checked_corpus;
  if (!held_elsewhere) {
    find_resume_point(config, paths);
    checked_corpus = load_corpus(config.data, config.val_fraction, config.seq_len);
    check_same_text(*checked_corpus, paths);
  }
  // One run per checkpoint directory, for the whole run (rank 0 commits every save), taken
  // before the directory is read for good: a run that waited for another one's end sees what it
  // left. And every rank must see the directory rank 0 writes, before the first step rather
  // than at the first save.
  const HeldRun held = hold_run(config, paths, ranks.get());
  if (paths.resume_from && paths.resume_step == config.steps) {
    if (config.rank == 0) {
      std::printf(
          "mixprec-train: %s is at step %lld of --steps %lld: the run is complete, "
          "nothing to train (a larger --steps continues it)\n",
          paths.resume_from->string().c_str(), static_cast<long long>(config.steps),
          static_cast<long long>(config.steps));
    }
    return 0;
  }
  if (config.threads > 0) at::set_num_threads(static_cast<int>(config.threads));
  const bool rank0 = config.rank == 0;
  // MFU's denominator: what a BF16 GEMM reaches here with these threads (every rank at once,
  // as they will train), about 0.1 s.
  const double gemm_peak_flops = measure_bf16_gemm_flops();

  // 2. Data: bytes of text, split into training and validation; batches drawn by index.
  const Corpus corpus = checked_corpus
                            ? std::move(*checked_corpus)
                            : load_corpus(config.data, config.val_fraction, config.seq_len);
  check_same_text(corpus, paths);
  const BatchSampler train_batches(corpus.train, config.seq_len, config.seed, /*stream=*/0);
  const BatchSampler val_batches(corpus.val, config.seq_len, config.seed, /*stream=*/1);

  // 3. Model: a GPT with MoE blocks, built in FP32 from the seed.
  at::manual_seed(static_cast<uint64_t>(config.seed));
  const Precision precision = precision_from(config);
  Gpt gpt(gpt_config(config, precision.quant));

  // 4. Precision plan: BF16 (or FP16) everywhere except the router weights (marked), the
  //    expert biases (by name) and the norms (by pattern), which stay FP32.
  MixedModel model = apply_precision(gpt, precision);
  // --init-from: exported weights replace the random ones, before the optimizer takes its FP32
  // masters from them.
  std::optional<InitFromResult> initial;
  if (!config.init_from.empty()) initial = init_from(*model.module, config.init_from);

  // 5. Optimizer: AdamW with FP32 masters for the half parameters only; with several ranks,
  //    ZeRO-1 (each rank holds and steps 1/N of masters and moments).
  std::unique_ptr<TrainingOptimizer> optimizer =
      ranks ? make_data_parallel_optimizer(model, config, precision, ranks)
            : make_single_process_optimizer(*model.module, config, precision);

  // 6. Resume: model, optimizer, RNG and the run's position, all from one checkpoint.
  RunState state;
  if (paths.resume_from) {
    nlohmann::json user;
    try {
      user = optimizer->load(*paths.resume_from);
    } catch (const std::exception& e) {
      // Any error (a chunk's checksum, a truncated file; on several ranks the group's error)
      // says how to resume past the checkpoint if it is damaged (checkpointing.h).
      const std::string advice = advice_if_damaged(*paths.resume_from);
      if (advice.empty()) throw;
      throw mixprec::checkpoint::FormatError(first_line(message_without_backtrace(e)) + advice);
    }
    state = RunState::from_json(user, paths.resume_from->string());
  }
  state.text = corpus.fingerprint;
  const int64_t saved_threads = state.threads;
  state.threads = at::get_num_threads();
  const std::string saved_cpu_kernels = state.cpu_kernels;
  state.cpu_kernels = cpu_kernel_identity();

  // 7. The loop, with progress on the terminal and one JSON line per step.
  std::optional<MetricsLog> metrics;
  if (rank0) {
    metrics.emplace(paths.metrics,
                    paths.resume_from ? std::optional<int64_t>(state.step) : std::nullopt);
    std::printf("mixprec-train: %s\n", describe(config).c_str());
    std::printf("data         %s: %lld training bytes, %lld validation bytes\n",
                corpus.source.c_str(), static_cast<long long>(corpus.train.numel()),
                static_cast<long long>(corpus.val.numel()));
    std::printf(
        "run          %lld steps of %lld sequences x %lld bytes; checkpoints every %lld in %s\n",
        static_cast<long long>(config.steps), static_cast<long long>(config.batch),
        static_cast<long long>(config.seq_len), static_cast<long long>(config.ckpt_every),
        paths.ckpt_root.string().c_str());
    const char* wait_policy = std::getenv("OMP_WAIT_POLICY");
    std::printf("threads      %d intra-op per rank, OpenMP waits %s (--omp-wait %s)\n",
                at::get_num_threads(), wait_policy != nullptr ? wait_policy : "(libgomp default)",
                config.omp_wait.c_str());
    std::printf("malloc       %s\n", malloc_policy.c_str());
    std::printf("gemm cache   %s\n", gemm_cache.c_str());
    if (initial)
      std::printf("weights      %zu tensors from %s\n", initial->tensors, initial->source.c_str());
    if (paths.resume_from) {
      std::printf("resumed      from %s at step %lld\n", paths.resume_from->string().c_str(),
                  static_cast<long long>(state.step));
      if (!paths.resume_note.empty()) std::printf("             (%s)\n", paths.resume_note.c_str());
      for (const std::string& flag : paths.passed) {
        std::printf("             %s ignored: the run is past that step\n", flag.c_str());
      }
      if (saved_threads > 0 && saved_threads != state.threads) {
        std::printf(
            "             %lld intra-op threads per rank where the checkpoint's run had %lld: the "
            "run goes on, but not bit for bit as it would have unstopped (--threads %lld keeps "
            "it)\n",
            static_cast<long long>(state.threads), static_cast<long long>(saved_threads),
            static_cast<long long>(saved_threads));
      }
      if (!saved_cpu_kernels.empty() && saved_cpu_kernels != state.cpu_kernels) {
        std::printf(
            "             CPU kernels chosen for %s where the checkpoint's run had %s: LibTorch "
            "picks them per CPU (oneDNN's BF16 GEMMs above all), so the run goes on, but not "
            "bit for bit as it would have unstopped\n",
            state.cpu_kernels.c_str(), saved_cpu_kernels.c_str());
      }
      print_resume_changes(config, paths);
      for (const std::string& moved : held.set_aside) {
        std::printf("set aside    %s (it does not verify; kept for inspection)\n", moved.c_str());
      }
    }
    std::fflush(stdout);
  }
  CheckpointerOptions saving;
  saving.async = config.async_save;
  saving.keep_last = config.keep_last;
  saving.staging_budget_bytes = static_cast<std::size_t>(config.staging_budget_mb) << 20;
  saving.collective_timeout = std::chrono::seconds(config.ckpt_timeout);
  Checkpointer checkpointer(paths.ckpt_root, saving, ranks);
  checkpointer.prepare(optimizer->checkpoint_bytes());  // a save that cannot fit says so now
  Progress progress(rank0 ? progress_mode(config.progress) : ProgressMode::kNone, config.steps,
                    config.log_every);
  Loop loop{config,
            model,
            *optimizer,
            train_batches,
            val_batches,
            checkpointer,
            metrics ? &*metrics : nullptr,
            paths.metrics,
            progress,
            *held.stop,
            ranks.get()};
  StepProfiler profiler(config, paths.metrics.parent_path());
  loop.profiler = &profiler;
  const LoopOutcome outcome = loop.run(state);

  // 8. Checkpoint: the last save may still be writing in the background.
  checkpointer.finish();
  progress.finish();
  if (!rank0) return 0;

  // 9. Sample and summary.
  if (!outcome.stopped_early && config.sample_tokens > 0) {
    const std::string text = generate(model, config.prompt, config.sample_tokens,
                                      config.temperature, static_cast<uint64_t>(config.seed));
    char how[64] = "greedy";
    if (config.temperature > 0)
      std::snprintf(how, sizeof how, "temperature %g", config.temperature);
    std::printf("\n== sample (%s) ==\n%s\n", how, printable(config.prompt + text).c_str());
  }
  std::vector<StepRecord> history = metrics->history();
  history.insert(history.end(), outcome.records.begin(), outcome.records.end());
  const RunReport report{config,
                         model,
                         optimizer->memory(),
                         history,
                         static_cast<int64_t>(outcome.records.size()),
                         outcome.train_s,
                         checkpointer.stats(),
                         paths.metrics,
                         metrics->problem(),
                         corpus.source,
                         outcome.stopped_early,
                         outcome.stop_signal,
                         gemm_peak_flops,
                         memory_report(*model.module, optimizer->memory(), outcome),
                         argv[0]};
  std::printf("%s", summary(report).c_str());
  if (!profiler.written().empty()) {
    std::printf("trace       %s, one per rank (open in ui.perfetto.dev or chrome://tracing)\n",
                profiler.written().string().c_str());
  }
  std::fflush(stdout);  // the summary is out before anything can end the process
  return 0;
}

}  // namespace

// A flag's value in argv ("--flag X" or "--flag=X"); nullptr if not given. Read before the
// flags are parsed, because OpenMP's wait policy must be set before OpenMP starts; parse_args
// checks the values later.
const char* flag_value(int argc, char** argv, std::string_view flag) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == flag) return i + 1 < argc ? argv[i + 1] : nullptr;
    if (arg.starts_with(flag) && arg.size() > flag.size() && arg[flag.size()] == '=')
      return argv[i] + flag.size() + 1;
  }
  return nullptr;
}

// The CPUs this process may run on.
long usable_cpus() {
  cpu_set_t set;
  if (::sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  return std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN));
}

// LibTorch's OpenMP threads either spin while they wait for work (ACTIVE) or sleep (PASSIVE).
// Measured on the 2-core development machine, default model, 200 steps: active 29–33k
// tokens/s, passive 19–21k — but where threads outnumber cores (several ranks on one machine,
// other jobs), a spinning thread holds a core another one needs and a step becomes up to 10x
// slower. So --omp-wait auto (the default) spins only when every thread has a core of its own:
// local ranks x threads <= usable CPUs. An OMP_WAIT_POLICY in the environment wins unless the
// flag is given. libgomp reads the variable once, when it is loaded: the program sets it and
// starts itself again.
void set_openmp_wait_policy(int argc, char** argv) {
  const char* flag = flag_value(argc, argv, "--omp-wait");
  const std::string_view choice = flag != nullptr ? flag : "auto";
  const char* current = std::getenv("OMP_WAIT_POLICY");
  std::string wanted;
  if (choice == "active") {
    wanted = "ACTIVE";
  } else if (choice == "passive") {
    wanted = "PASSIVE";
  } else if (choice == "auto") {
    if (flag == nullptr && current != nullptr) return;    // the environment's choice stands
    const char* local = std::getenv("LOCAL_WORLD_SIZE");  // torchrun's ranks on this machine
    const char* threads_flag = flag_value(argc, argv, "--threads");
    const long cpus = usable_cpus();
    const long ranks = local != nullptr ? std::max(1L, std::atol(local)) : 1;
    const char* omp_threads = std::getenv("OMP_NUM_THREADS");  // torchrun sets 1 per rank
    long threads = cpus;                                       // LibTorch's default: one per CPU
    if (omp_threads != nullptr && std::atol(omp_threads) > 0) threads = std::atol(omp_threads);
    if (threads_flag != nullptr && std::atol(threads_flag) > 0) threads = std::atol(threads_flag);
    wanted = ranks * threads <= cpus ? "ACTIVE" : "PASSIVE";
  } else {
    return;  // not a valid value: parse_args says so
  }
  if (current != nullptr && wanted == current) return;
  ::setenv("OMP_WAIT_POLICY", wanted.c_str(), 1);
  ::execv("/proc/self/exe", argv);  // only returns on failure: then run as we are
}

int main(int argc, char** argv) {
  set_openmp_wait_policy(argc, argv);
  const std::string malloc_policy = set_malloc_policy(flag_value(argc, argv, "--malloc"));
  const std::string gemm_cache = limit_gemm_descriptor_cache();
  try {
    return run(argc, argv, malloc_policy, gemm_cache);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "mixprec-train: %s\n", first_line(e.what()).c_str());
    return 2;
  } catch (const mixprec::checkpoint::FormatError& e) {
    std::fprintf(stderr, "mixprec-train: %s\n", first_line(e.what()).c_str());
    return 2;
  } catch (const c10::Error& e) {
    // A failure while running: the whole message, whose later lines list every problem found
    // (a save that names three bad tensors names all three), without LibTorch's backtrace.
    std::string message = e.what_without_backtrace();
    while (!message.empty() && message.back() == '\n') message.pop_back();
    std::fprintf(stderr, "mixprec-train: %s\n", message.c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mixprec-train: %s\n", first_line(e.what()).c_str());
    return 1;
  }
}
