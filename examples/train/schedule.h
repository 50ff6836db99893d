// The learning-rate schedule: linear warm-up, then cosine decay to lr · min_lr_ratio.
//
// A pure function of the step, so a resumed run continues the schedule from the step counter
// alone.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>

namespace train {

// Learning rate for optimizer step `step` (0-based) of `total`: the first step after warm-up
// takes the peak, the last one (total − 1) exactly lr · min_lr_ratio when the decay has a
// step of its own (total − 1 > warmup).
inline double learning_rate(int64_t step, int64_t total, double lr, int64_t warmup,
                            double min_lr_ratio) {
  if (step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  const double span = static_cast<double>(std::max<int64_t>(total - 1 - warmup, 1));
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / span);
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cosine);
}

}  // namespace train
