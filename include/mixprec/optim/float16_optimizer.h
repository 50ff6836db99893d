// Float16Optimizer: mixed-precision Adam/AdamW/SGD with FP32 main copies only where needed.
//
// Per parameter, in group order (Megatron's Float16OptimizerWithFloat16Params, fixed):
//   * trainable BF16/FP16 → an FP32 main copy ("master"), stepped; the model parameter is
//     rewritten from it (round-to-nearest-even) in the same fused pass;
//   * trainable FP32      → stepped in place: no copy at all;
//   * frozen (requires_grad false) → no state, no copy, but it keeps its id.
// A step: model grads are read directly by the fused kernel (no main-grad buffers); FP16 with
// a dynamic loss scaler unscales on the fly, checks for Inf/NaN and skips the step (backing
// off the scale) on overflow; gradients are clipped by their global L2 norm over every
// trainable parameter, native FP32 included; then the inner algorithm runs.
//
// It is a torch::optim::Optimizer: param_groups() hold the model's own parameters with
// torch's option types (AdamWOptions, AdamOptions, SGDOptions), so zero_grad(), LR schedulers
// and `group.options().set_lr()` work as usual; hyper-parameters are read at every step.
//
// State is keyed by the model's fully qualified names (sharded_state_dict) or by torch's
// positional ids (state_dict). The id ↔ FQN map is built from tensor identity against the
// model, never by zipping lists.
#pragma once

#include "mixprec/optim/fused_kernels.h"
#include "mixprec/optim/loss_scaler.h"
#include "mixprec/optim/optimizer_state.h"
#include "mixprec/sharded_state_dict.h"

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace mixprec::optim {

enum class ParamRole {
  kMaster,      // trainable BF16/FP16 with an FP32 main copy
  kNativeFp32,  // trainable FP32, stepped in place
  kFrozen,      // requires_grad false: no state
};
const char* to_string(ParamRole role);

enum class Algorithm { kAdam, kAdamW, kSgd };

// What to do when gradients contain Inf/NaN and no dynamic loss scaler expects it (BF16/FP32).
enum class NonFiniteGrads {
  kSkipStep,  // skip the step, report success = false (the default)
  kError,     // throw c10::Error naming the first parameter with a non-finite gradient
};

struct Float16OptimizerOptions {
  // Loss scaling: constant 1 by default (BF16); LossScalerOptions::fp16_dynamic() for FP16.
  TORCH_ARG(LossScalerOptions, loss_scaler) = {};
  // Clip gradients to this global L2 norm; 0 disables clipping.
  TORCH_ARG(double, clip_grad) = 0.0;
  TORCH_ARG(NonFiniteGrads, non_finite_grads) = NonFiniteGrads::kSkipStep;
};

struct StepResult {
  bool success = false;     // false: the step was skipped (overflow), nothing changed
  double grad_norm = 0.0;   // global L2 norm of the unscaled gradients, before clipping
  double loss_scale = 1.0;  // the scale in effect for this step (before the scaler updated)
  int64_t params_stepped = 0;
};

// How the optimizer holds one parameter.
struct ParamInfo {
  std::string fqn;
  size_t group;
  int64_t id;  // torch positional id
  ParamRole role;
};

namespace detail {
// Checks, before torch::optim::Optimizer's constructor sees them, that every group's options
// have the same type as the defaults: that constructor silently replaces options of another
// type with the defaults, which would drop a group's hyper-parameters without a word.
struct GroupOptionsCheck {
  GroupOptionsCheck(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                    const torch::optim::OptimizerOptions* defaults);
};
}  // namespace detail

// Base order matters: the check runs before torch::optim::Optimizer is built.
class Float16Optimizer : private detail::GroupOptionsCheck, public torch::optim::Optimizer {
 public:
  // `groups` hold parameters of `model` (each must be one of its parameters, by identity);
  // their options must all be AdamWOptions, all AdamOptions or all SGDOptions (groups without
  // options take `defaults`). Throws c10::Error naming the parameter if one is not in the
  // model, appears twice, is trainable with a dtype other than FP32/BF16/FP16, or is sparse.
  Float16Optimizer(const torch::nn::Module& model,
                   std::vector<torch::optim::OptimizerParamGroup> groups,
                   std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                   Float16OptimizerOptions options = {});
  // One group with every parameter of `model` (frozen ones included), in named order;
  // `defaults` is AdamWOptions, AdamOptions or SGDOptions.
  Float16Optimizer(const torch::nn::Module& model, const torch::optim::OptimizerOptions& defaults,
                   Float16OptimizerOptions options = {});

  // torch::optim::Optimizer::step: evaluates `closure` (if any), then update().
  at::Tensor step(LossClosure closure = nullptr) override;
  // One optimizer step over the current gradients (see the header comment).
  StepResult update();
  const StepResult& last_result() const { return last_result_; }

  // Multiply the loss by this before backward (1 unless a loss scaler is active).
  double loss_scale() const { return scaler_.scale(); }
  const LossScaler& loss_scaler() const { return scaler_; }

  Algorithm algorithm() const { return algorithm_; }
  const std::vector<ParamInfo>& params_info() const { return info_; }
  // The FP32 main copy of parameter `id`; undefined unless its role is kMaster.
  const at::Tensor& main_param(int64_t id) const;
  // Bytes of optimizer-owned tensors (masters and moments) for parameters of `role`.
  int64_t state_bytes(ParamRole role) const;

  // torch's positional form. Tensors alias the optimizer's own (as torch's state_dict does):
  // a later step changes them; clone what must outlive it.
  PositionalStateDict state_dict() const;
  // Validates everything (group count and sizes, ids, shapes, dtypes) before changing
  // anything; restores moments, steps, masters, scaler and group hyper-parameters, then
  // re-derives half-precision model params from masters. Strict: missing or unexpected state
  // is an error listing all of it; non-strict: loads what fits and reports the rest.
  LoadReport load_state_dict(const PositionalStateDict& state, const LoadOptions& options = {});

  // FQN-keyed form: tensors "optimizer.state.{exp_avg,exp_avg_sq,max_exp_avg_sq,
  // momentum_buffer}.<fqn>" for parameters with state, "optimizer.state.fp32_param.<fqn>" for
  // parameters with a main copy; common["optimizer"] = {algorithm, step, param_groups (with
  // FQN lists and hyper-parameters), scaler, per-parameter steps that differ from `step`}.
  // Tensors alias the optimizer's own (no copy: a checkpoint streams them straight to disk).
  ShardedStateDict sharded_state_dict() const;
  // Loads the FQN-keyed form, validating first (see load_state_dict). Works across a changed
  // precision plan: a parameter saved with a main copy that is now native FP32 takes the saved
  // main copy's value; one saved as native FP32 that now needs a main copy seeds it from the
  // model tensor under its FQN in `state` (an FP32 value; a checkpoint holds both), else from
  // the model parameter as loaded. Keys that do not start with "optimizer." are model keys and
  // are not reported as unexpected.
  LoadReport load_sharded_state_dict(const ShardedStateDict& state, const LoadOptions& options = {});

  // Optimizer::save/load use torch's pickled archives keyed by pointer; mixprec keeps state
  // by name. These write and read the positional state dict through the archive instead.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  struct Slot;
  struct Loaded;
  // Checks `loaded` completely, then applies it; nothing changes if a check fails.
  LoadReport apply_loaded(Loaded&& loaded, const LoadOptions& options);
  void build_slots(const torch::nn::Module& model);
  void step_slot(size_t index, double grad_multiplier);
  void copy_masters_to_model();

  Float16OptimizerOptions options_;
  Algorithm algorithm_;
  LossScaler scaler_;
  std::vector<ParamInfo> info_;
  std::vector<std::shared_ptr<Slot>> slots_;  // parallel to info_
  StepResult last_result_;
};

}  // namespace mixprec::optim
