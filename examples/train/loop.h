// The training loop: steps, validation, metrics, progress, periodic checkpoints, stopping.
//
// One optimizer step:
//   lr ← schedule(step); zero the gradients
//   for each micro-batch (its rows of global batch `step`, this rank's share):
//       logits, aux ← model(inputs)                under the FP8 autocast scope
//       loss ← cross_entropy(logits, targets) + aux_loss_coef · aux
//       backward(loss · loss_scale / micro-batches)
//   optimizer step (unscale, skip on overflow, clip, AdamW), then aux-loss-free expert-bias
//   update from the tokens each expert received
// then, every --eval-every steps, the validation loss; a metrics line; every --ckpt-every
// steps (and at the last step, or when a stop was requested) a checkpoint. Data parallel, every
// rank runs this loop; the ranks agree on losses, expert loads and stopping (data_parallel.h).
#pragma once

#include "checkpointing.h"
#include "config.h"
#include "data.h"
#include "data_parallel.h"
#include "metrics.h"
#include "optimizer.h"
#include "plan.h"
#include "profile.h"
#include "progress.h"
#include "signals.h"

#include <functional>
#include <optional>
#include <vector>

namespace train {

// Where the run stands; saved in every checkpoint's user metadata and restored on resume.
struct RunState {
  int64_t step = 0;           // optimizer steps done (the next step is `step`, 0-based)
  int64_t skipped_total = 0;  // steps the optimizer skipped (FP16 overflow)
  double elapsed_s = 0;       // training wall time so far
  std::string text;           // the training text's fingerprint (data.h); "" in older checkpoints
  // Intra-op threads per rank: LibTorch's CPU kernels split their sums by thread, so a resume
  // with another count is not bit for bit the unstopped run. 0 in older checkpoints.
  int64_t threads = 0;
  // What picks the CPU kernels (cpu_kernels.h): on another CPU model, likewise not bit for bit.
  // "" in older checkpoints.
  std::string cpu_kernels;

  // The user metadata of a checkpoint (checkpointing.h lists its fields).
  nlohmann::json to_json(const TrainConfig& config, const std::filesystem::path& metrics,
                         const std::filesystem::path& ckpt_root) const;
  // Throws UsageError naming `source` if a field is missing.
  static RunState from_json(const nlohmann::json& user, const std::string& source);
};

struct LoopOutcome {
  std::vector<StepRecord> records;  // this process's steps
  int stop_signal = 0;              // SIGINT/SIGTERM that ended the run early, 0 if none
  bool stopped_early = false;       // by a signal or --stop-at, before --steps
  double train_s = 0;               // wall time of this process's steps (without saves/evals)
  // The most a step added to the parameters and optimizer state (activations kept for backward,
  // gradients, temporaries, workspaces: StepOutcome::peak_bytes) over this process's steps
  // after its first two (which also create the optimizer's state), and how much of that step's
  // peak was activations; 0 without a LiveBytesAllocator (memory.h).
  int64_t step_extra_peak_bytes = 0;
  int64_t activation_peak_bytes = 0;
  // How many of the first records those leave out (each record has its step's page faults).
  static constexpr size_t kFirstStepsLeftOut = 2;
};

// One optimizer step on global batch `index`: this rank's rows, in config.grad_accum
// micro-batches, at learning rate `lr` (the step described at the top of this file, without
// the bookkeeping around it). With `ranks` (data parallel) the losses returned are means over
// ranks and the expert loads are summed over ranks before the bias update. The benchmark
// times exactly this.
struct StepOutcome {
  double loss = 0;      // mean cross-entropy over the micro-batches (and ranks)
  double aux_loss = 0;  // mean load-balancing loss
  int stop_signal = 0;  // the signal that asked some rank to stop (`stop_signal` there), or 0
  mixprec::optim::StepResult result;
  StepPhases phases;  // where the step's time went
  // Tensor memory over the level once the gradients are cleared (parameters and optimizer
  // state), counted by the LiveBytesAllocator (memory.h; 0 without one): at the step's peak,
  // and what a forward left alive for its backward (the activations autograd keeps, logits and
  // loss; the most over micro-batches).
  int64_t peak_bytes = 0;
  int64_t activation_bytes = 0;
  // Pages the process touched for the first time during the step, all threads (an async
  // save's included): memory the allocator had to get from the system (host_memory.h).
  int64_t page_faults = 0;
};
// `before_update`, if set, runs between backward and the optimizer step: the last moment
// before the step writes the model and optimizer state (an async save's copy must be done).
StepOutcome train_step(const TrainConfig& config, MixedModel& model, TrainingOptimizer& optimizer,
                       const BatchSampler& batches, int64_t index, double lr,
                       mixprec::distributed::Communicator* ranks = nullptr, int stop_signal = 0,
                       const std::function<void()>& before_update = nullptr);

struct Loop {
  const TrainConfig& config;
  MixedModel& model;
  TrainingOptimizer& optimizer;
  const BatchSampler& train_batches;
  const BatchSampler& val_batches;
  Checkpointer& checkpointer;
  MetricsLog* metrics;                 // rank 0 only; null elsewhere
  std::filesystem::path metrics_path;  // recorded in checkpoints, so --resume finds it
  Progress& progress;
  const StopRequest& stop;
  mixprec::distributed::Communicator* ranks =
      nullptr;                       // data parallel: the ranks (data_parallel.h)
  StepProfiler* profiler = nullptr;  // --profile-steps (profile.h)

  // Trains from `state` to config.steps (or until a stop request), updating `state`.
  LoopOutcome run(RunState& state);

  // Mean cross-entropy over config.eval_batches validation batches (no gradients), the same
  // rows for any number of ranks (each rank evaluates its share).
  double validation_loss();
};

}  // namespace train
