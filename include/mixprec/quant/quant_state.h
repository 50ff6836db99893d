// Thread-local quantization scopes and the RAII guards that change them.
//
// Two scopes, each a per-thread {enabled, format}:
//   * autocast   — forward GEMMs of QuantLinear quantize their operands;
//   * model-init — QuantLinear creates its weight as a quantized primary weight.
// State changes only through the guards below; each restores exactly what it saw on entry
// (exceptions included), guards nest, and no other thread ever sees the change.
// Autograd runs backward on other threads: modules record in forward what they decided
// (QuantLinear saves the format in its autograd node) instead of re-reading the scope.
#pragma once

#include "mixprec/quant/quant_config.h"

#include <cstdint>
#include <optional>

namespace mixprec::quant {

struct QuantScopeState {
  bool enabled = false;
  QuantFormat format = QuantFormat::kNone;
  friend bool operator==(const QuantScopeState&, const QuantScopeState&) = default;
};

// This thread's current scopes.
QuantScopeState autocast_state();
QuantScopeState model_init_state();

// Sets this thread's autocast scope for its lifetime.
class [[nodiscard]] QuantAutocastGuard {
 public:
  QuantAutocastGuard(bool enabled, QuantFormat format);
  // Enabled with the config's compute format when the config quantizes compute, else disabled.
  // Throws c10::Error (before touching state) if the config is invalid.
  explicit QuantAutocastGuard(const QuantConfig& config);
  ~QuantAutocastGuard();
  QuantAutocastGuard(const QuantAutocastGuard&) = delete;
  QuantAutocastGuard& operator=(const QuantAutocastGuard&) = delete;
  QuantAutocastGuard(QuantAutocastGuard&&) = delete;
  QuantAutocastGuard& operator=(QuantAutocastGuard&&) = delete;

 private:
  QuantScopeState previous_;
};

// Sets this thread's model-init scope for its lifetime.
class [[nodiscard]] QuantModelInitGuard {
 public:
  QuantModelInitGuard(bool enabled, QuantFormat format);
  // Enabled when the config asks for quantized params: fp8_param → the fp8 recipe's format,
  // fp4_param → kNvFp4. Throws c10::Error (before touching state) if the config is invalid.
  explicit QuantModelInitGuard(const QuantConfig& config);
  ~QuantModelInitGuard();
  QuantModelInitGuard(const QuantModelInitGuard&) = delete;
  QuantModelInitGuard& operator=(const QuantModelInitGuard&) = delete;
  QuantModelInitGuard(QuantModelInitGuard&&) = delete;
  QuantModelInitGuard& operator=(QuantModelInitGuard&&) = delete;

 private:
  QuantScopeState previous_;
};

// Turns quantization off for its lifetime, or does nothing at all. Built by
// fp8_disabled_context; holds at most one of the two scope guards.
class [[nodiscard]] QuantDisabledGuard {
 public:
  QuantDisabledGuard(const QuantConfig& config, bool is_init);
  QuantDisabledGuard(const QuantDisabledGuard&) = delete;
  QuantDisabledGuard& operator=(const QuantDisabledGuard&) = delete;
  QuantDisabledGuard(QuantDisabledGuard&&) = delete;
  QuantDisabledGuard& operator=(QuantDisabledGuard&&) = delete;

  // False for the no-op guard: it neither read nor wrote any scope.
  bool active() const { return autocast_.has_value() || init_.has_value(); }
  // Which scope it disabled (meaningful only when active()).
  bool disables_init() const { return init_.has_value(); }

 private:
  std::optional<QuantAutocastGuard> autocast_;
  std::optional<QuantModelInitGuard> init_;
};

// A guard that disables quantization for the code in its scope, e.g. around an MoE router:
//   * is_init = true : disables the model-init scope, if the config has fp8_param/fp4_param;
//   * is_init = false: disables the autocast scope, if the config has fp8 or fp4 on (FP4-only
//     configs go through the same autocast scope);
//   * otherwise a no-op guard that touches no state.
// Throws c10::Error if the config is invalid (QuantConfig::validate), before touching state.
QuantDisabledGuard fp8_disabled_context(const QuantConfig& config, bool is_init);

namespace detail {
// Number of writes to this thread's scope state so far. Lets tests prove a guard is a no-op.
uint64_t scope_state_writes();
}  // namespace detail

}  // namespace mixprec::quant
