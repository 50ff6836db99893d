#include "profile.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdio>
#include <string>

namespace train {
namespace {

namespace profiler = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

ProfilerConfig cpu_trace_config() {
  return ProfilerConfig(ProfilerState::KINETO, /*report_input_shapes=*/true,
                        /*profile_memory=*/false, /*with_stack=*/false);
}

}  // namespace

StepProfiler::StepProfiler(const TrainConfig& config, std::filesystem::path out_dir) {
  if (config.profile_steps.empty()) return;
  enabled_ = true;
  steps_ = parse_profile_steps(config.profile_steps);
  path_ = std::move(out_dir) / ("trace-rank" + std::to_string(config.rank) + ".json");
  // Kineto's set-up takes a while; done now, not inside the first traced step.
  profiler::prepareProfiler(cpu_trace_config(), {ActivityType::CPU});
}

StepProfiler::~StepProfiler() {
  if (!recording_) return;
  try {
    stop_and_write();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mixprec-train: the trace %s was not written: %s\n",
                 path_.string().c_str(), e.what());
  }
}

void StepProfiler::before_step(int64_t step) {
  if (!enabled_ || recording_ || step != steps_.first) return;
  profiler::enableProfiler(cpu_trace_config(), {ActivityType::CPU});
  recording_ = true;
}

void StepProfiler::after_step(int64_t step) {
  if (recording_ && step >= steps_.last) stop_and_write();
}

void StepProfiler::stop_and_write() {
  recording_ = false;
  std::unique_ptr<profiler::ProfilerResult> result = profiler::disableProfiler();
  result->save(path_.string());
  written_ = path_;
}

}  // namespace train
