#include "summary.h"

#include "build_paths.h"
#include "flops.h"
#include "loop.h"
#include "progress.h"

#include "mixprec/quant/quant_linear.h"

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <map>
#include <sstream>

namespace train {
namespace {

// printf into a string of whatever length the text needs: a summary line holds paths and
// module names, which no fixed buffer bounds.
__attribute__((format(printf, 1, 2))) std::string printed(const char* format, ...) {
  va_list args, again;
  va_start(args, format);
  va_copy(again, args);
  const int n = std::vsnprintf(nullptr, 0, format, args);
  va_end(args);
  std::string out(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) std::vsnprintf(out.data(), out.size() + 1, format, again);
  va_end(again);
  return out;
}

std::string bytes_text(double b) {
  if (b >= 1 << 20) return printed("%.2f MiB", b / (1 << 20));
  if (b >= 1 << 10) return printed("%.1f KiB", b / (1 << 10));
  return printed("%.0f B", b);
}

// 1234567 → "1,234,567".
std::string count_text(int64_t n) {
  const std::string digits = std::to_string(n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0 && digits[i - 1] != '-') out += ',';
    out += digits[i];
  }
  return out;
}

std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return "bf16";
    case at::kHalf:
      return "fp16";
    case at::kFloat:
      return "fp32";
    case at::kFloat8_e4m3fn:
      return "fp8 e4m3";
    case at::kFloat8_e5m2:
      return "fp8 e5m2";
    case at::kLong:
      return "int64";
    default:
      return c10::toString(t);
  }
}

struct Tally {
  int64_t params = 0, param_bytes = 0, buffers = 0, buffer_bytes = 0;
};

// "SIGTERM" for the summary's stop line.
const char* signal_name(int s) {
  return s == SIGINT ? "SIGINT" : s == SIGTERM ? "SIGTERM" : "a signal";
}

// "step        51.2 ms: forward 15.0 (29%) · backward …": the mean step of the steady steps and
// where its time went (metrics.h, StepPhases).
std::string step_breakdown(const StepPhases& sum, double total_s, int64_t steps, int64_t from,
                           int64_t to) {
  const double n = static_cast<double>(steps);
  std::string out = printed("step        %.1f ms:", 1e3 * total_s / n);
  const std::pair<const char*, double> phases[] = {{"forward", sum.forward_s},
                                                   {"backward", sum.backward_s},
                                                   {"reduction exposed", sum.reduce_s},
                                                   {"optimizer", sum.optimizer_s},
                                                   {"checkpoint wait", sum.checkpoint_s},
                                                   {"other", sum.other_s}};
  bool first = true;
  for (const auto& [name, seconds] : phases) {
    out += printed("%s %s %.1f (%.0f%%)", first ? "" : " ·", name, 1e3 * seconds / n,
                   100 * seconds / total_s);
    first = false;
  }
  return out + printed(
                   "\n            (mean over steps %lld–%lld; backward includes the reduction it "
                   "overlaps)\n",
                   static_cast<long long>(from), static_cast<long long>(to));
}

// "compute     4.52 MFLOP per token …": model FLOPs utilisation (flops.h).
std::string compute_line(const RunReport& r, double tokens_per_s) {
  const double per_token = training_flops_per_token(r.config);
  const double achieved = per_token * tokens_per_s;
  std::string line = printed(
      "compute     %.2f MFLOP per token (6 x %.2fM active matmul parameters + attention): "
      "%.1f GFLOP/s",
      per_token / 1e6, active_matmul_params(r.config) / 1e6, achieved / 1e9);
  if (r.gemm_peak_flops > 0) {
    const double peak = r.gemm_peak_flops * static_cast<double>(r.config.world_size);
    line += printed(", MFU %.1f%% of the BF16 GEMM peak measured at start (%.1f GFLOP/s%s)",
                    100 * achieved / peak, peak / 1e9,
                    r.config.world_size > 1 ? " over all ranks" : "");
  }
  return line + "\n";
}

}  // namespace

std::string sparkline(const std::vector<double>& values, size_t width) {
  std::vector<double> finite;
  for (double v : values)
    if (std::isfinite(v)) finite.push_back(v);
  if (finite.empty()) return "";
  const size_t bins = std::min(width, finite.size());
  std::vector<double> means(bins, 0.0);
  for (size_t b = 0; b < bins; ++b) {
    const size_t begin = b * finite.size() / bins, end = (b + 1) * finite.size() / bins;
    for (size_t i = begin; i < end; ++i) means[b] += finite[i];
    means[b] /= static_cast<double>(end - begin);
  }
  const auto [lo, hi] = std::minmax_element(means.begin(), means.end());
  static const char* kLevels[] = {"▁", "▂", "▃", "▄", "▅", "▆", "▇", "█"};
  std::string out;
  for (double m : means) {
    const double t = *hi > *lo ? (m - *lo) / (*hi - *lo) : 0.0;
    out += kLevels[std::clamp(static_cast<int>(t * 7.999), 0, 7)];
  }
  return out;
}

std::string summary(const RunReport& r) {
  std::ostringstream s;
  auto& module = *r.model.module;
  s << "\n== summary ==\n";
  if (r.stopped_early) {
    s << "stopped     by " << (r.stop_signal != 0 ? signal_name(r.stop_signal) : "--stop-at")
      << " after step " << (r.history.empty() ? 0 : r.history.back().step) << " of "
      << r.config.steps << "; the checkpoint below resumes it\n";
  }

  // Parameters and buffers by dtype.
  std::map<std::string, Tally> by_dtype;
  int64_t total_params = 0;
  for (const auto& p : module.named_parameters()) {
    Tally& t = by_dtype[dtype_name(p.value().scalar_type())];
    t.params += p.value().numel();
    t.param_bytes += p.value().numel() * static_cast<int64_t>(p.value().element_size());
    total_params += p.value().numel();
  }
  for (const auto& b : module.named_buffers()) {
    Tally& t = by_dtype[dtype_name(b.value().scalar_type())];
    t.buffers += b.value().numel();
    t.buffer_bytes += b.value().numel() * static_cast<int64_t>(b.value().element_size());
  }
  s << "model       " << describe(r.config) << ", " << count_text(total_params) << " parameters\n";
  s << "            corpus " << (r.corpus.empty() ? "?" : r.corpus) << "\n";
  s << "precision   dtype        parameters          bytes   buffers\n";
  for (const auto& [name, t] : by_dtype) {
    s << printed("            %-10s %12s %14s   %s\n", name.c_str(), count_text(t.params).c_str(),
                 bytes_text(static_cast<double>(t.param_bytes)).c_str(),
                 t.buffers ? (count_text(t.buffers) + " (" +
                              bytes_text(static_cast<double>(t.buffer_bytes)) + ")")
                                 .c_str()
                           : "-");
  }

  // FP8: a compute format here — what the GEMMs of the last forward actually ran with.
  int64_t fp8_linears = 0, fp32_linears = 0, plain_linears = 0;
  std::string fp8_how;
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    const auto* q = item.value()->as<mixprec::quant::QuantLinearImpl>();
    if (q == nullptr) continue;
    const auto& c = q->last_compute();
    if (c.kept_fp32 || c.input_kept_fp32)
      ++fp32_linears;
    else if (c.operands != mixprec::quant::QuantFormat::kNone)
      ++fp8_linears, fp8_how = c.to_string();
    else
      ++plain_linears;
  }
  if (fp8_linears > 0) {
    s << "            fp8: " << fp8_linears << " expert GEMMs ran with FP8 operands (" << fp8_how
      << "); weights stay " << dtype_name(r.model.module->options().dtype())
      << ", FP8 is per step; simulated (fake-quantized operands, "
      << dtype_name(r.model.module->options().dtype()) << " GEMMs): --fp8 off is faster\n";
  } else {
    s << "            fp8: off (" << plain_linears << " expert GEMMs in "
      << dtype_name(r.model.module->options().dtype()) << ")\n";
  }
  s << "            router: " << fp32_linears << " linears computed in FP32, never quantized\n";

  // What stayed FP32, and why: straight from the conversion report.
  s << "kept fp32   (conversion report)\n";
  for (const auto& e : module.conversion_report().entries) {
    using mixprec::ConversionAction;
    if (e.action != ConversionAction::kKeptFp32 && e.action != ConversionAction::kUpcastFp32)
      continue;
    s << printed("            %-34s %-9s %s\n", e.name.c_str(), mixprec::to_string(e.kind),
                 e.why.c_str());
  }

  // Optimizer memory.
  const OptimizerMemory& m = r.optimizer;
  if (m.trainable_params > 0) {
    // ZeRO-1: each rank holds about 1/N of the state; rank 0's share is what is shown.
    const std::string where =
        r.config.world_size > 1
            ? " on rank 0 of " + std::to_string(r.config.world_size) + " (ZeRO-1 shards)"
            : "";
    s << printed(
        "optimizer   AdamW: %s of state%s, %.2f bytes per parameter (FP32 master + 2 "
        "moments for %s half params, moments only for %s FP32 params)\n",
        bytes_text(static_cast<double>(m.state_bytes)).c_str(), where.c_str(),
        static_cast<double>(m.state_bytes) / static_cast<double>(m.trainable_params),
        count_text(m.master_params).c_str(), count_text(m.native_fp32_params).c_str());
  }

  // Loss.
  std::vector<double> losses;
  std::optional<double> first_val, last_val;
  int64_t last_val_step = 0;
  for (const StepRecord& rec : r.history) {
    losses.push_back(rec.loss);
    if (rec.val_loss) {
      if (!first_val) first_val = rec.val_loss;
      last_val = rec.val_loss;
      last_val_step = rec.step;
    }
  }
  if (r.history.size() == 1) {
    s << printed("loss        %.4f at step %lld\n", r.history.front().loss,
                 static_cast<long long>(r.history.front().step));
  } else if (!r.history.empty()) {
    s << printed("loss        %.4f → %.4f over steps %lld–%lld  %s\n", r.history.front().loss,
                 r.history.back().loss, static_cast<long long>(r.history.front().step),
                 static_cast<long long>(r.history.back().step), sparkline(losses).c_str());
  }
  if (last_val) {
    s << printed("val loss    %.4f at step %lld (first measured %.4f)\n", *last_val,
                 static_cast<long long>(last_val_step), *first_val);
  }
  if (r.steps_this_process > 0 && r.train_s > 0) {
    const double tokens = static_cast<double>(r.steps_this_process * r.config.tokens_per_step());
    // The steady speed leaves out this process's first steps (a tenth, at most 10): they pay
    // for first-touch allocations and the thread pool's start, as a benchmark's warm-up does.
    const int64_t last = r.history.empty() ? 0 : r.history.back().step;
    const int64_t first = last - r.steps_this_process + 1;
    const int64_t warm_up = std::min<int64_t>(10, r.steps_this_process / 10);
    // Traced steps run under the profiler, which records every operator: not the run's speed.
    ProfileSteps traced;
    if (!r.config.profile_steps.empty()) traced = parse_profile_steps(r.config.profile_steps);
    const auto is_traced = [&](int64_t step) {
      return step >= traced.first && step <= traced.last && traced.first > 0;
    };
    std::string left_out;
    if (traced.first > 0 && traced.last >= first + warm_up && traced.first <= last) {
      left_out = "; traced steps " + std::to_string(std::max(traced.first, first + warm_up)) + "–" +
                 std::to_string(std::min(traced.last, last)) + " left out";
    }
    double steady_s = 0;
    int64_t steady_steps = 0;
    StepPhases phases;  // summed over the steady steps
    for (const StepRecord& rec : r.history) {
      if (rec.step < first + warm_up || is_traced(rec.step)) continue;
      steady_s += rec.step_s;
      ++steady_steps;
      phases += rec.phases;
    }
    if ((warm_up > 0 || !left_out.empty()) && steady_steps > 0 && steady_s > 0) {
      const double steady_tokens = static_cast<double>(steady_steps * r.config.tokens_per_step());
      s << printed(
          "speed       %s tokens/s over steps %lld–%lld (after %lld warm-up steps%s; "
          "%s tokens in %s of training steps in all)\n",
          human(steady_tokens / steady_s).c_str(), static_cast<long long>(first + warm_up),
          static_cast<long long>(last), static_cast<long long>(warm_up), left_out.c_str(),
          human(tokens).c_str(), human_seconds(r.train_s).c_str());
    } else {
      s << printed("speed       %s tokens/s (%s tokens in %s of training steps)\n",
                   human(tokens / r.train_s).c_str(), human(tokens).c_str(),
                   human_seconds(r.train_s).c_str());
    }
    if (steady_steps > 0 && steady_s > 0) {
      s << step_breakdown(phases, steady_s, steady_steps, first + warm_up, last);
      s << compute_line(r,
                        static_cast<double>(steady_steps * r.config.tokens_per_step()) / steady_s);
    }
    if (!r.history.empty() && r.history.back().skipped_total > 0) {
      s << "            " << r.history.back().skipped_total
        << " steps skipped on FP16 overflow (the loss scaler backed off)\n";
    }
  }
  if (r.memory.peak_rss > 0) {
    const RunReport::Memory& m = r.memory;
    const auto mib = [](int64_t bytes) { return bytes_text(static_cast<double>(bytes)); };
    s << "memory      peak RSS " << mib(m.peak_rss) << "; tensors between steps: parameters "
      << mib(m.parameters) << " · gradients " << mib(m.gradients) << " · optimizer state "
      << mib(m.optimizer_state) << "\n";
    if (m.step_extra >= 0) {
      s << "            a step's peak over parameters and optimizer state " << mib(m.step_extra)
        << ": activations kept for backward " << mib(m.activations)
        << " + gradients, temporaries and workspaces " << mib(m.step_extra - m.activations) << "\n";
    } else {
      s << "            a step's peak: not measured (the first " << LoopOutcome::kFirstStepsLeftOut
        << " steps, which create the optimizer's state, are left out)\n";
    }
    if (m.page_faults_median >= 0) {
      s << printed(
          "            page faults per step %.0f (median), %.1f (mean, with the steps in "
          "which the heap grew): pages the allocator got from the system (--malloc)\n",
          m.page_faults_median, m.page_faults_mean);
    }
  }
  if (r.saves.saves > 0) {
    std::string async_text;
    if (r.config.async_save) {
      async_text = " (async: written in the background";
      if (r.saves.waited_for_previous > 0) {
        async_text += printed("; %lld waited %.3f s in all for the one before",
                              static_cast<long long>(r.saves.waited_for_previous),
                              r.saves.waited_for_previous_s);
      }
      async_text += printed("; the run's end waited %.3f s for the last)", r.saves.end_wait_s);
    }
    const std::string warnings_text =
        r.saves.warnings == 0
            ? std::string()
            : printed(" (%lld warning%s, on stderr)", static_cast<long long>(r.saves.warnings),
                      r.saves.warnings == 1 ? "" : "s");
    s << printed("checkpoint  %s: %s on disk; %lld save%s%s, training blocked %.3f s per save%s\n",
                 r.saves.last_dir.string().c_str(),
                 bytes_text(static_cast<double>(directory_bytes(r.saves.last_dir))).c_str(),
                 static_cast<long long>(r.saves.saves), r.saves.saves == 1 ? "" : "s",
                 warnings_text.c_str(), r.saves.blocked_s / static_cast<double>(r.saves.saves),
                 async_text.c_str());
  }
  if (!r.metrics_path.empty()) {
    // The plotting script needs matplotlib, which set-up installs into the build's Python.
    // Both paths are shown relative to the working directory when they lie below it
    // (.venv/bin/python), absolute otherwise, so that the line works wherever it was run.
    const auto shown = [](const char* path) -> std::string {
      // Lexically: the venv's python is a link, which proximate() would resolve.
      std::error_code ec;
      const std::filesystem::path near =
          std::filesystem::path(path).lexically_proximate(std::filesystem::current_path(ec));
      return !ec && !near.empty() && *near.begin() != ".." ? near.string() : path;
    };
    const std::string python = *kBuildPython != '\0' ? shown(kBuildPython) : "python3";
    s << "metrics     " << r.metrics_path.string() << "  (plot: " << python << " "
      << shown(kPlotScript) << " " << r.metrics_path.string() << ")\n";
    if (!r.metrics_problem.empty()) s << "            INCOMPLETE: " << r.metrics_problem << "\n";
  }
  const std::string root = r.saves.last_dir.empty() ? "" : r.saves.last_dir.parent_path().string();
  if (!root.empty()) {
    // Any number of ranks that divides --batch resumes it: the same command alone, or under
    // torchrun.
    s << "resume      " << r.program << " --resume --ckpt-dir " << root;
    // An explicit --ckpt-dir puts metrics beside it unless told otherwise (run_paths.h).
    if (!r.metrics_path.empty() &&
        r.metrics_path.lexically_normal() !=
            (std::filesystem::path(root).parent_path() / "metrics.jsonl").lexically_normal()) {
      s << " --metrics " << r.metrics_path.string();
    }
    if (!r.stopped_early) s << " --steps " << r.config.steps * 2;
    s << "\n";
  }
  return s.str();
}

}  // namespace train
