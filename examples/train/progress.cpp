#include "progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>

namespace train {

ProgressMode progress_mode(const std::string& flag) {
  if (flag == "bar") return ProgressMode::kBar;
  if (flag == "lines") return ProgressMode::kLines;
  if (flag == "none") return ProgressMode::kNone;
  return ::isatty(STDOUT_FILENO) ? ProgressMode::kBar : ProgressMode::kLines;
}

std::string human(double v) {
  char buf[32];
  if (std::abs(v) >= 1e6)
    std::snprintf(buf, sizeof buf, "%.1fM", v / 1e6);
  else if (std::abs(v) >= 1e3)
    std::snprintf(buf, sizeof buf, "%.1fk", v / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.0f", v);
  return buf;
}

std::string human_seconds(double s) {
  char buf[32];
  if (!std::isfinite(s) || s < 0) return "?";
  const auto total = static_cast<int64_t>(std::llround(s));
  if (total >= 3600)
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", (long long)(total / 3600),
                  (long long)(total % 3600 / 60));
  else if (total >= 60)
    std::snprintf(buf, sizeof buf, "%lldm%02llds", (long long)(total / 60),
                  (long long)(total % 60));
  else
    std::snprintf(buf, sizeof buf, "%.1fs", s);
  return buf;
}

Progress::Progress(ProgressMode mode, int64_t total_steps, int64_t log_every)
    : mode_(mode), total_(total_steps), log_every_(log_every) {}

void Progress::step(const StepRecord& r) {
  if (mode_ == ProgressMode::kNone) return;
  if (first_step_ < 0) {
    first_step_ = r.step - 1;
    start_ = std::chrono::steady_clock::now() -
             std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                 std::chrono::duration<double>(r.step_s));
  }
  if (r.val_loss) last_val_ = *r.val_loss;
  char val[32] = "-";
  if (last_val_ >= 0) std::snprintf(val, sizeof val, "%.4f", last_val_);
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double per_step = elapsed / static_cast<double>(r.step - first_step_);
  const double eta = per_step * static_cast<double>(total_ - r.step);

  if (mode_ == ProgressMode::kBar) {
    constexpr int kWidth = 24;
    const double frac = static_cast<double>(r.step) / static_cast<double>(total_);
    const int eighths = static_cast<int>(frac * kWidth * 8);
    static const char* kParts[] = {"", "▏", "▎", "▍", "▌", "▋", "▊", "▉"};
    std::string bar;
    for (int i = 0; i < kWidth; ++i) {
      const int fill = eighths - i * 8;
      bar += fill >= 8 ? "█" : fill > 0 ? kParts[fill] : " ";
    }
    std::printf(
        "\r\x1b[K%5lld/%lld |%s| loss %.4f  val %s  %s tok/s  gnorm %.2f  scale %g  "
        "skipped %lld  eta %s",
        (long long)r.step, (long long)total_, bar.c_str(), r.loss, val,
        human(r.tokens_per_s).c_str(), r.grad_norm, r.loss_scale, (long long)r.skipped_total,
        human_seconds(eta).c_str());
    std::fflush(stdout);
    bar_drawn_ = true;
    return;
  }
  const bool show = r.step == first_step_ + 1 || r.step == total_ || r.step % log_every_ == 0 ||
                    r.val_loss.has_value();
  if (!show) return;
  std::printf(
      "step %5lld/%lld | loss %.4f | val %s | %s tok/s | grad norm %.3f | loss scale %g "
      "| skipped %lld | lr %.2e\n",
      (long long)r.step, (long long)total_, r.loss, val, human(r.tokens_per_s).c_str(), r.grad_norm,
      r.loss_scale, (long long)r.skipped_total, r.lr);
  std::fflush(stdout);
}

void Progress::note(const std::string& line) {
  if (mode_ == ProgressMode::kNone) return;
  if (bar_drawn_) std::printf("\r\x1b[K");
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

void Progress::finish() {
  if (bar_drawn_) std::printf("\n");
  bar_drawn_ = false;
  std::fflush(stdout);
}

}  // namespace train
