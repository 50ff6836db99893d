#include "loop.h"

#include "host_memory.h"
#include "memory.h"
#include "schedule.h"

#include "mixprec/precision/cross_entropy.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>

namespace train {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// In FP32 from the model's BF16/FP16 logits, without an FP32 copy of them.
at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets) {
  return mixprec::cross_entropy_in_fp32(logits.reshape({-1, logits.size(-1)}), targets.reshape(-1));
}

}  // namespace

nlohmann::json RunState::to_json(const TrainConfig& config, const std::filesystem::path& metrics,
                                 const std::filesystem::path& ckpt_root) const {
  namespace fs = std::filesystem;
  // Within the run's directory (the root's parent), the metrics file is also recorded from the
  // root: a run copied or moved elsewhere and resumed there finds its own file, not the
  // original's.
  const fs::path file = fs::absolute(metrics).lexically_normal();
  const fs::path root = fs::absolute(ckpt_root).lexically_normal();
  const fs::path from_run = file.lexically_relative(root.parent_path());
  const bool in_run = !from_run.empty() && *from_run.begin() != "..";
  return {{"program", "mixprec-train"},
          {"config", run_shape(config)},
          {"step", step},
          {"skipped_total", skipped_total},
          {"elapsed_s", elapsed_s},
          // Batch `step` is the next one drawn: batches are indexed by step (data.h).
          {"data_position", step},
          {"text", text},
          {"threads", threads},
          {"cpu_kernels", cpu_kernels},
          {"metrics", file.string()},
          {"metrics_from_root", in_run ? file.lexically_relative(root).string() : ""}};
}

RunState RunState::from_json(const nlohmann::json& user, const std::string& source) {
  RunState s;
  try {
    s.step = user.at("step").get<int64_t>();
    s.skipped_total = user.at("skipped_total").get<int64_t>();
    s.elapsed_s = user.at("elapsed_s").get<double>();
    if (user.contains("text")) s.text = user.at("text").get<std::string>();
    if (user.contains("threads")) s.threads = user.at("threads").get<int64_t>();
    if (user.contains("cpu_kernels")) s.cpu_kernels = user.at("cpu_kernels").get<std::string>();
  } catch (const nlohmann::json::exception&) {
    throw UsageError(source + " lacks the run state mixprec-train saves (step, skipped_total)");
  }
  return s;
}

double Loop::validation_loss() {
  torch::NoGradGuard no_grad;
  model.module->eval();
  // Batches of one micro-batch's global rows; rank r evaluates its equal share of them, so the
  // mean over ranks is the same validation loss for any number of ranks.
  const int64_t rows = config.batch / config.grad_accum;
  const int64_t rank_rows = rows / config.world_size;
  double total = 0;
  for (int64_t i = 0; i < config.eval_batches; ++i) {
    const Batch b = val_batches.batch(i, rows, config.rank * rank_rows, rank_rows);
    total += cross_entropy(std::get<0>(model.forward(b.inputs)), b.targets).item<double>();
  }
  model.module->train();
  return mean_over_ranks(ranks, total / static_cast<double>(config.eval_batches));
}

StepOutcome train_step(const TrainConfig& config, MixedModel& model, TrainingOptimizer& optimizer,
                       const BatchSampler& batches, int64_t index, double lr,
                       mixprec::distributed::Communicator* ranks, int stop_signal,
                       const std::function<void()>& before_update) {
  const auto start = Clock::now();
  const int64_t faults_at_start = minor_page_faults();
  const int64_t rank_rows = config.batch / config.world_size;
  const int64_t micro_rows = rank_rows / config.grad_accum;
  optimizer.set_lr(lr);
  optimizer.zero_grad();
  const double scale = optimizer.loss_scale();
  StepOutcome out;
  // Memory is counted from here, once the gradients are cleared: what lives now is the
  // parameters and the optimizer state (and, on several ranks, the reducer's gradient buffers,
  // which zero_grad keeps); the step adds activations, gradients and temporaries.
  LiveBytesAllocator* counted = LiveBytesAllocator::installed();
  const int64_t live_at_start = counted != nullptr ? counted->live_bytes() : 0;
  if (counted != nullptr) counted->reset_peak();
  for (int64_t m = 0; m < config.grad_accum; ++m) {
    const int64_t first_row = config.rank * rank_rows + m * micro_rows;
    const Batch b = batches.batch(index, config.batch, first_row, micro_rows);
    // Gradients are reduced across ranks once per step, in the last micro-batch's backward.
    const std::shared_ptr<void> accumulating =
        m + 1 < config.grad_accum ? optimizer.accumulate_only() : nullptr;
    auto phase = Clock::now();
    // Activations: what this forward leaves alive (earlier micro-batches' gradients excluded).
    const int64_t live_before_forward = counted != nullptr ? counted->live_bytes() : 0;
    at::Tensor loss, objective;
    {
      RECORD_USER_SCOPE("mixprec::forward");
      auto [logits, aux] = model.forward(b.inputs);
      loss = cross_entropy(logits, b.targets);
      objective = (loss + config.aux_loss_coef * aux) / static_cast<double>(config.grad_accum);
      out.aux_loss += aux.item<double>() / static_cast<double>(config.grad_accum);
      if (counted != nullptr) {
        out.activation_bytes =
            std::max(out.activation_bytes, counted->live_bytes() - live_before_forward);
      }
    }
    out.phases.forward_s += seconds_since(phase);
    phase = Clock::now();
    {
      RECORD_USER_SCOPE("mixprec::backward");
      (objective * scale).backward();
    }
    out.phases.backward_s += seconds_since(phase);
    out.loss += loss.item<double>() / static_cast<double>(config.grad_accum);
  }
  auto phase = Clock::now();
  {
    RECORD_USER_SCOPE("mixprec::reduction_wait");
    optimizer.finish_reduction();
  }
  out.phases.reduce_s = seconds_since(phase);
  // Aux-loss-free balancing uses the load of this step's tokens, whether or not it was skipped:
  // every rank's tokens, so the biases stay identical on every rank. A signal may reach the
  // ranks between different steps; they agree here, so all stop after the same one. This
  // comes before the update: the update starts the gather of the new parameters, and a small
  // collective behind it on the same connections would wait for all of it (on two Gloo ranks,
  // 2-3 ms of each step).
  const StepAgreement agreed =
      agree_on_step(ranks, {out.loss, out.aux_loss, stop_signal}, model.gpt->expert_loads());
  out.loss = agreed.loss;
  out.aux_loss = agreed.aux_loss;
  out.stop_signal = agreed.stop_signal;
  // Forward and backward only read the state; an async save's copy overlapped them.
  phase = Clock::now();
  if (before_update) {
    RECORD_USER_SCOPE("mixprec::checkpoint_wait");
    before_update();
  }
  out.phases.checkpoint_s = seconds_since(phase);
  phase = Clock::now();
  {
    RECORD_USER_SCOPE("mixprec::optimizer");
    out.result = optimizer.step();
  }
  out.phases.optimizer_s = seconds_since(phase);
  model.gpt->update_expert_biases(config.bias_update_rate);
  out.phases.other_s = std::max(0.0, seconds_since(start) - out.phases.timed_s());
  if (counted != nullptr) out.peak_bytes = counted->peak_bytes() - live_at_start;
  out.page_faults = minor_page_faults() - faults_at_start;
  return out;
}

LoopOutcome Loop::run(RunState& state) {
  LoopOutcome outcome;
  model.module->train();
  while (state.step < config.steps) {
    const double lr =
        learning_rate(state.step, config.steps, config.lr, config.warmup, config.min_lr_ratio);
    // The profiler's start, and the trace it writes after the last traced step, are not the
    // step's time (a trace takes seconds to write).
    if (profiler != nullptr) profiler->before_step(state.step + 1);
    const auto start = Clock::now();
    const StepOutcome done =
        train_step(config, model, optimizer, train_batches, state.step, lr, ranks,
                   stop.signal_number(), [this] { checkpointer.before_state_changes(); });
    const double step_s = seconds_since(start);
    if (profiler != nullptr) profiler->after_step(state.step + 1);
    if (outcome.records.size() >= LoopOutcome::kFirstStepsLeftOut) {
      // One step's pair, so that the split adds up: the activations of the step with the peak.
      // (They are within it unless another thread, an async save's, freed memory between the
      // two counts: then the peak bounds them.)
      if (done.peak_bytes > outcome.step_extra_peak_bytes) {
        outcome.step_extra_peak_bytes = done.peak_bytes;
        outcome.activation_peak_bytes = std::min(done.activation_bytes, done.peak_bytes);
      }
    }
    const mixprec::optim::StepResult& result = done.result;
    outcome.train_s += step_s;
    state.elapsed_s += step_s;
    state.step += 1;
    state.skipped_total += result.success ? 0 : 1;

    StepRecord r;
    r.step = state.step;
    r.loss = done.loss;
    r.aux_loss = done.aux_loss;
    r.lr = lr;
    r.grad_norm = result.grad_norm;
    r.loss_scale = result.loss_scale;
    r.skipped = !result.success;
    r.skipped_total = state.skipped_total;
    r.tokens = state.step * config.tokens_per_step();
    r.tokens_per_s = static_cast<double>(config.tokens_per_step()) / step_s;
    r.step_s = step_s;
    r.elapsed_s = state.elapsed_s;
    r.phases = done.phases;
    r.page_faults = done.page_faults;
    if (state.step % config.eval_every == 0 || state.step == config.steps) {
      r.val_loss = validation_loss();
    }
    outcome.records.push_back(r);
    if (metrics != nullptr) metrics->write(r);
    progress.step(r);

    const bool stopping = done.stop_signal != 0 || state.step == config.stop_at;
    if (state.step % config.ckpt_every == 0 || state.step == config.steps || stopping) {
      checkpointer.save(state.step, optimizer.training_state(
                                        state.to_json(config, metrics_path, checkpointer.root())));
    }
    if (stopping && state.step < config.steps) {
      outcome.stop_signal = done.stop_signal;
      outcome.stopped_early = true;
      break;
    }
  }
  return outcome;
}

}  // namespace train
