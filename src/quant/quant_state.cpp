#include "mixprec/quant/quant_state.h"

namespace mixprec::quant {
namespace {

thread_local QuantScopeState t_autocast;
thread_local QuantScopeState t_model_init;
thread_local uint64_t t_writes = 0;

void write(QuantScopeState& slot, QuantScopeState value) {
  slot = value;
  ++t_writes;
}

QuantFormat param_format(const QuantConfig& config) {
  if (config.fp8_param())
    return config.fp8() == Fp8Recipe::kHybrid ? QuantFormat::kFp8Hybrid : QuantFormat::kFp8E4M3;
  if (config.fp4_param()) return QuantFormat::kNvFp4;
  return QuantFormat::kNone;
}

const QuantConfig& validated(const QuantConfig& config) {
  config.validate();
  return config;
}

}  // namespace

QuantScopeState autocast_state() { return t_autocast; }
QuantScopeState model_init_state() { return t_model_init; }

QuantAutocastGuard::QuantAutocastGuard(bool enabled, QuantFormat format) : previous_(t_autocast) {
  write(t_autocast, {enabled, format});
}

QuantAutocastGuard::QuantAutocastGuard(const QuantConfig& config)
    : QuantAutocastGuard(validated(config).quantizes_compute(), config.compute_format()) {}

QuantAutocastGuard::~QuantAutocastGuard() { write(t_autocast, previous_); }

QuantModelInitGuard::QuantModelInitGuard(bool enabled, QuantFormat format)
    : previous_(t_model_init) {
  write(t_model_init, {enabled, format});
}

QuantModelInitGuard::QuantModelInitGuard(const QuantConfig& config)
    : QuantModelInitGuard(validated(config).quantizes_params(), param_format(config)) {}

QuantModelInitGuard::~QuantModelInitGuard() { write(t_model_init, previous_); }

QuantDisabledGuard::QuantDisabledGuard(const QuantConfig& config, bool is_init) {
  config.validate();
  // Keep the format so code inside can still tell which recipe is being held off.
  if (is_init && config.quantizes_params()) {
    init_.emplace(false, param_format(config));
  } else if (!is_init && config.quantizes_compute()) {
    autocast_.emplace(false, config.compute_format());
  }
}

QuantDisabledGuard fp8_disabled_context(const QuantConfig& config, bool is_init) {
  return QuantDisabledGuard(config, is_init);
}

namespace detail {
uint64_t scope_state_writes() { return t_writes; }
}  // namespace detail

}  // namespace mixprec::quant
