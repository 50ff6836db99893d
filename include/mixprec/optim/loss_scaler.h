// Loss scaling for FP16 training (and the trivial constant scale for BF16).
//
// Dynamic scaling follows Megatron's DynamicGradScaler: on an overflow the growth count
// resets and the hysteresis budget shrinks; when it is spent the scale backs off (never
// below min_scale). After growth_interval clean steps in a row the scale grows and the
// hysteresis budget refills.
#pragma once

#include <torch/arg.h>
#include <nlohmann/json_fwd.hpp>

#include <cstdint>

namespace mixprec::optim {

struct LossScalerOptions {
  // FP16 defaults: dynamic, 2^16 initial scale.
  static LossScalerOptions fp16_dynamic();
  // Throws c10::Error naming the field: scales not positive or out of order, growth_factor
  // <= 1, backoff_factor outside (0, 1), growth_interval or hysteresis < 1. LossScaler's
  // constructor runs it.
  void validate() const;

  // false: constant scale (BF16 needs none: scale 1).
  TORCH_ARG(bool, dynamic) = false;
  // The scale before the first step, e.g. 65536 for FP16 with dynamic(true).
  TORCH_ARG(double, initial_scale) = 1.0;
  // A dynamic scale stays within [min_scale, max_scale].
  TORCH_ARG(double, min_scale) = 1.0;
  TORCH_ARG(double, max_scale) = 16777216.0;  // 2^24
  // Multiplies the scale after growth_interval clean steps in a row.
  TORCH_ARG(double, growth_factor) = 2.0;
  // Multiplies the scale on an overflow once the hysteresis budget is spent.
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 1000;
  // The scale backs off at the hysteresis-th overflow since it last grew (Megatron's rule):
  // 1 backs off at every overflow, 2 (the default) tolerates one.
  TORCH_ARG(int64_t, hysteresis) = 2;
};

class LossScaler {
 public:
  explicit LossScaler(LossScalerOptions options = {});

  double scale() const { return scale_; }
  double inv_scale() const { return 1.0 / scale_; }
  bool is_dynamic() const { return options_.dynamic(); }
  const LossScalerOptions& options() const { return options_; }

  // Records the outcome of one step. A constant scaler ignores it.
  void update(bool found_inf);

  // {"scale", "growth_tracker", "hysteresis_tracker"} (and "dynamic", for inspection).
  nlohmann::json state() const;
  // Restores state() within this scaler's configuration: a saved scale outside [min_scale,
  // max_scale] is clamped into it, a constant scaler keeps its initial_scale, and the trackers
  // are capped at growth_interval - 1 and hysteresis. Throws c10::Error naming the missing or
  // invalid field (a non-positive or non-finite scale, a negative tracker), unchanged then.
  void load_state(const nlohmann::json& state);

 private:
  LossScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t hysteresis_tracker_;
};

}  // namespace mixprec::optim
