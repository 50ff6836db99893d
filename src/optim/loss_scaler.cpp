#include "mixprec/optim/loss_scaler.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <utility>

namespace mixprec::optim {

LossScalerOptions LossScalerOptions::fp16_dynamic() {
  return LossScalerOptions().dynamic(true).initial_scale(65536.0);
}

void LossScalerOptions::validate() const {
  // Positive, and with a finite inverse: gradients are unscaled by 1 / scale.
  auto positive = [](double v) { return std::isfinite(v) && v > 0 && std::isfinite(1.0 / v); };
  TORCH_CHECK(positive(initial_scale()),
              "[mixprec::LossScaler] initial_scale must be positive with a finite inverse, got ",
              initial_scale());
  TORCH_CHECK(positive(min_scale()) && positive(max_scale()) && min_scale() <= max_scale(),
              "[mixprec::LossScaler] need 0 < min_scale <= max_scale (each with a finite "
              "inverse), got ",
              min_scale(), " and ", max_scale());
  TORCH_CHECK(!dynamic() || (initial_scale() >= min_scale() && initial_scale() <= max_scale()),
              "[mixprec::LossScaler] initial_scale ", initial_scale(),
              " outside [min_scale, max_scale]");
  TORCH_CHECK(growth_factor() > 1, "[mixprec::LossScaler] growth_factor must be > 1, got ",
              growth_factor());
  TORCH_CHECK(backoff_factor() > 0 && backoff_factor() < 1,
              "[mixprec::LossScaler] backoff_factor must be in (0, 1), got ", backoff_factor());
  TORCH_CHECK(growth_interval() >= 1, "[mixprec::LossScaler] growth_interval must be >= 1, got ",
              growth_interval());
  TORCH_CHECK(hysteresis() >= 1, "[mixprec::LossScaler] hysteresis must be >= 1, got ",
              hysteresis());
}

LossScaler::LossScaler(LossScalerOptions options)
    : options_(options),
      scale_(options.initial_scale()),
      hysteresis_tracker_(options.hysteresis()) {
  options_.validate();
}

void LossScaler::update(bool found_inf) {
  if (!options_.dynamic()) return;
  if (found_inf) {
    growth_tracker_ = 0;
    // Floored at 0 (Megatron lets it run negative; the behaviour is the same, and a
    // non-negative tracker is what a saved state can be checked against).
    hysteresis_tracker_ = std::max<int64_t>(0, hysteresis_tracker_ - 1);
    if (hysteresis_tracker_ == 0) {
      scale_ = std::max(scale_ * options_.backoff_factor(), options_.min_scale());
    }
    return;
  }
  if (++growth_tracker_ == options_.growth_interval()) {
    growth_tracker_ = 0;
    hysteresis_tracker_ = options_.hysteresis();
    scale_ = std::min(scale_ * options_.growth_factor(), options_.max_scale());
  }
}

nlohmann::json LossScaler::state() const {
  return {{"dynamic", options_.dynamic()},
          {"scale", scale_},
          {"growth_tracker", growth_tracker_},
          {"hysteresis_tracker", hysteresis_tracker_}};
}

void LossScaler::load_state(const nlohmann::json& state) {
  auto field = [&](const char* name, bool integer) -> const nlohmann::json& {
    const bool ok = state.is_object() && state.contains(name) &&
                    (integer ? state.at(name).is_number_integer() : state.at(name).is_number());
    TORCH_CHECK(ok, "[mixprec::LossScaler::load_state] field '", name, "' missing or not ",
                integer ? "an integer" : "a number");
    return state.at(name);
  };
  const double scale = field("scale", false).get<double>();
  const int64_t growth = field("growth_tracker", true).get<int64_t>();
  const int64_t hysteresis = field("hysteresis_tracker", true).get<int64_t>();
  TORCH_CHECK(std::isfinite(scale) && scale > 0,
              "[mixprec::LossScaler::load_state] scale must be positive, got ", scale);
  for (const auto& [name, value] :
       {std::pair{"growth_tracker", growth}, {"hysteresis_tracker", hysteresis}}) {
    TORCH_CHECK(value >= 0, "[mixprec::LossScaler::load_state] field '", name,
                "' must not be negative, got ", value);
  }
  // Within this scaler's configured range: a state from a run with other limits is brought
  // inside them rather than trusted.
  scale_ = options_.dynamic() ? std::clamp(scale, options_.min_scale(), options_.max_scale())
                              : options_.initial_scale();  // a constant scale is configuration
  growth_tracker_ = std::min(growth, options_.growth_interval() - 1);
  hysteresis_tracker_ = std::min(hysteresis, options_.hysteresis());
}

}  // namespace mixprec::optim
