// Progress a person can watch: a bar redrawn in place on a terminal, plain lines otherwise
// (a log file, CI, a pipe). Only rank 0 shows progress.
#pragma once

#include "metrics.h"

#include <chrono>
#include <string>

namespace train {

enum class ProgressMode { kBar, kLines, kNone };

// "auto" → a bar when stdout is a terminal, else lines; "bar", "lines", "none" as named.
ProgressMode progress_mode(const std::string& flag);

class Progress {
 public:
  Progress(ProgressMode mode, int64_t total_steps, int64_t log_every);

  // Shows a finished step: redraws the bar, or prints a line on the first and last step,
  // every log_every steps, and whenever a validation loss was measured.
  void step(const StepRecord& record);
  // Prints a line of its own (above the bar, which is redrawn on the next step).
  void note(const std::string& line);
  // Ends the bar's line.
  void finish();

 private:
  ProgressMode mode_;
  int64_t total_;
  int64_t log_every_;
  bool bar_drawn_ = false;
  double last_val_ = -1;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  int64_t first_step_ = -1;
};

// "12.3k" style: 1234 → "1.2k", 1234567 → "1.2M".
std::string human(double value);
// "1m05s" style.
std::string human_seconds(double seconds);

}  // namespace train
