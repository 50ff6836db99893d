// The summary printed at the end of a run: what was trained, in which precision, how the loss
// went, how fast, and where the results are.
#pragma once

#include "checkpointing.h"
#include "config.h"
#include "metrics.h"
#include "optimizer.h"
#include "plan.h"

#include <string>
#include <vector>

namespace train {

struct RunReport {
  const TrainConfig& config;
  MixedModel& model;
  OptimizerMemory optimizer;
  std::vector<StepRecord> history;  // every step of the run, earlier processes' included
  int64_t steps_this_process = 0;
  double train_s = 0;  // this process's training wall time
  SaveStats saves;
  std::filesystem::path metrics_path;
  std::string metrics_problem;  // MetricsLog::problem(): "" if every record was written
  std::string corpus;
  bool stopped_early = false;  // by a signal (stop_signal) or --stop-at
  int stop_signal = 0;
  double gemm_peak_flops = 0;  // this rank's BF16 GEMM rate, measured at start (flops.h); 0: none
  // Rank 0's memory at the end, in bytes: counted from the tensors (memory.h).
  struct Memory {
    int64_t parameters = 0;       // the model's parameters and buffers
    int64_t gradients = 0;        // their .grad tensors
    int64_t optimizer_state = 0;  // masters and moments (this rank's shard)
    int64_t step_extra = 0;       // the most a step added to parameters and optimizer state
    int64_t activations = 0;      // of which activations kept for backward (LoopOutcome)
    // -1 in both: no step was measured (the run had only the first steps, which LoopOutcome
    // leaves out: they create the optimizer's state).
    int64_t peak_rss = 0;  // the process's peak resident set (VmHWM)
    // Minor page faults per step, over the steps step_extra is: the median (a steady step) and
    // the mean (with the steps in which the heap still grew); -1: none.
    double page_faults_median = -1;
    double page_faults_mean = -1;
  } memory;
  // How this program was invoked (argv[0]): the resume hint's command, runnable as printed.
  std::string program = "mixprec-train";
};

// A line of block characters (▁▂▃▄▅▆▇█) tracing `values`, averaged into at most `width` bins.
std::string sparkline(const std::vector<double>& values, size_t width = 48);

// The summary, as printed.
std::string summary(const RunReport& report);

}  // namespace train
