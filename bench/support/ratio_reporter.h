// A Google Benchmark console reporter that also remembers each benchmark's fastest real time
// per iteration over its repetitions, so a bench can print ratios between peers measured in
// the same run. The fastest run is the one least disturbed by a shared machine.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <map>
#include <string>

namespace mixprec::bench {

class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const auto& run : runs) {
      if (run.run_type == Run::RT_Iteration && !run.error_occurred) {
        const double s =
            run.GetAdjustedRealTime() / benchmark::GetTimeUnitMultiplier(run.time_unit);
        auto [it, inserted] = seconds_.emplace(run.run_name.function_name, s);
        if (!inserted) it->second = std::min(it->second, s);
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }
  // Seconds per iteration of the named benchmark (function name as registered); 0 if absent.
  double seconds(const std::string& name) const {
    auto it = seconds_.find(name);
    return it == seconds_.end() ? 0.0 : it->second;
  }

 private:
  std::map<std::string, double> seconds_;
};

}  // namespace mixprec::bench
