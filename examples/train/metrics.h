// Machine-readable metrics: one JSON object per optimizer step, one per line (JSON Lines),
// flushed as it is written, so a killed run leaves only whole lines.
//
// Fields of every line (scripts/plot_metrics.py reads them):
//   step           int          optimizer steps done, 1 for the first step
//   loss           float        training cross-entropy in nats per byte, mean over the
//                               step's micro-batches (without the auxiliary loss)
//   aux_loss       float        MoE load-balancing loss, mean over blocks and micro-batches
//   val_loss       float|null   validation cross-entropy after this step; null if not evaluated
//   lr             float        learning rate this step used
//   grad_norm      float        global L2 norm of the unscaled gradients, before clipping
//   loss_scale     float        loss scale this step used (1 for BF16)
//   skipped        bool         the optimizer skipped this step (FP16 overflow)
//   skipped_total  int          steps skipped so far
//   tokens         int          tokens trained on so far, all ranks
//   tokens_per_s   float        this step's throughput, all ranks
//   step_s         float        wall time of this step: forward, backward, optimizer
//   elapsed_s      float        training wall time so far (continues across --resume)
//   forward_s, backward_s, reduce_s, optimizer_s, checkpoint_s, other_s
//                  float        where step_s went (StepPhases below)
//   page_faults    int          minor page faults of this rank's process during the step: pages
//                               the allocator got from the system (--malloc, host_memory.h)
// Non-finite floats are written as null (JSON has no NaN).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace train {

// Where one step's wall time went, in seconds. forward and backward are summed over the
// micro-batches (backward includes the gradient reduction it overlaps); reduce is the
// reduction's exposed part (waiting for it after backward, several ranks only); optimizer the
// update (unscale, clip, AdamW, and with several ranks the parameters' all-gather that is not
// overlapped); checkpoint the wait for an async save's copy before the update; other the rest
// (batches, the ranks' agreement on the loss, expert-bias updates).
struct StepPhases {
  double forward_s = 0;
  double backward_s = 0;
  double reduce_s = 0;
  double optimizer_s = 0;
  double checkpoint_s = 0;
  double other_s = 0;

  // The phases timed apart from "other".
  double timed_s() const { return forward_s + backward_s + reduce_s + optimizer_s + checkpoint_s; }
  StepPhases& operator+=(const StepPhases& o) {
    forward_s += o.forward_s;
    backward_s += o.backward_s;
    reduce_s += o.reduce_s;
    optimizer_s += o.optimizer_s;
    checkpoint_s += o.checkpoint_s;
    other_s += o.other_s;
    return *this;
  }
};

struct StepRecord {
  int64_t step = 0;
  double loss = 0;
  double aux_loss = 0;
  std::optional<double> val_loss;
  double lr = 0;
  double grad_norm = 0;
  double loss_scale = 1;
  bool skipped = false;
  int64_t skipped_total = 0;
  int64_t tokens = 0;
  double tokens_per_s = 0;
  double step_s = 0;
  double elapsed_s = 0;
  StepPhases phases;
  int64_t page_faults = 0;

  nlohmann::json to_json() const;
  // Throws nlohmann::json::exception if a field is missing or has the wrong type.
  static StepRecord from_json(const nlohmann::json& j);
};

class MetricsLog {
 public:
  // A fresh run (resume_step nullopt) starts `path` empty. A resumed run keeps the records of
  // steps ≤ *resume_step and drops later ones (a stopped run may have logged steps past its
  // last checkpoint); they are rewritten through a temporary file and an atomic rename.
  // Throws UsageError naming the file if it cannot be written.
  MetricsLog(std::filesystem::path path, std::optional<int64_t> resume_step);

  // The records kept from before the resume (empty for a fresh run), in step order.
  const std::vector<StepRecord>& history() const { return history_; }

  // Appends `record`. A write that fails (a full disk) is reported once, on stderr and by
  // problem(), and ends the file there: the run goes on without metrics.
  void write(const StepRecord& record);
  const std::filesystem::path& path() const { return path_; }
  // Why the file lacks records from some step on; "" if every record was written.
  const std::string& problem() const { return problem_; }

 private:
  std::filesystem::path path_;
  std::ofstream out_;
  std::vector<StepRecord> history_;
  std::string problem_;
};

}  // namespace train
