// --profile-steps A:B: a trace of steps A to B that Perfetto (ui.perfetto.dev) and
// chrome://tracing open, written by LibTorch's own profiler (Kineto) from C++: every ATen
// operator with its thread and duration, and the ranges mixprec names itself — the step's
// phases here (mixprec::forward, ::backward, ::reduction_wait, ::checkpoint_wait,
// ::optimizer) and, inside the library, mixprec::convert, ::fake_quant, ::bucket_start and
// ::bucket_finish (gradient reduction) and ::optimizer_update (RECORD_USER_SCOPE: a flag test
// when no profiler is on). An async save's staging copy runs on its own thread, which the
// profiler does not follow; its wait shows as mixprec::checkpoint_wait. Every rank writes its
// own file beside metrics.jsonl (<out>/ by default): trace-rank<R>.json.
#pragma once

#include "config.h"

#include <filesystem>

namespace train {

class StepProfiler {
 public:
  // Inactive (every call does nothing) unless config.profile_steps is set.
  StepProfiler(const TrainConfig& config, std::filesystem::path out_dir);
  // Writes the trace if steps are still being recorded (a run stopped early).
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Around step `step` (1-based): starts recording before the first traced step, stops and
  // writes the file after the last.
  void before_step(int64_t step);
  void after_step(int64_t step);

  // The trace file once written; empty before.
  const std::filesystem::path& written() const { return written_; }

 private:
  void stop_and_write();

  bool enabled_ = false;
  bool recording_ = false;
  ProfileSteps steps_;
  std::filesystem::path path_;
  std::filesystem::path written_;
};

}  // namespace train
