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
// It follows the model as the model is now. update(), state_dict(), sharded_state_dict(),
// save(), the loads and reload_model_params() first compare every parameter with what the
// optimizer recorded after its own last write to it (construction, step, load), all before
// any parameter or state is touched:
//   * value written from outside (a model-only load, `copy_`, torch::load) to a parameter with
//     a main copy: by `on_external_param_change`, the main copy is re-seeded from the new value
//     (moments and step stay), or the call throws naming every such parameter. A write that
//     leaves the value the main copy rounds to is no change. Loads ignore such writes: they
//     replace every main copy anyway.
//   * frozen at construction, trainable now: it takes the role its dtype gives (a BF16/FP16
//     one gains a main copy from its value); its id does not change. A parameter frozen after
//     construction keeps its role and state (it is not stepped while it has no gradient).
//   * dtype changed (a conversion run after construction), trainable parameters: FP32 →
//     BF16/FP16 gains a main copy from its value; BF16/FP16 → FP32 takes its main copy's value
//     and drops the copy; BF16 ↔ FP16 keeps the main copy and rewrites the parameter from it —
//     when the parameter holds its old value converted (a conversion). A new value that came
//     with the new dtype (set_data of another tensor) is kept instead, and seeds the main copy.
//     (With master_remainders the old value is gone with the old parameter: a new value that a
//     BF16 parameter could have held is taken for a conversion.)
//     With ExternalParamChange::kError each of these is an error instead (loads excepted).
//   * an error naming the parameter: a trainable dtype other than FP32/BF16/FP16, a new shape,
//     device or layout of a trainable parameter, a group's options replaced by another type,
//     and param_groups() changed other than through Float16Optimizer::add_param_group.
// params_info(), main_param() and state_bytes() describe the optimizer as of that last check.
//
// State is keyed by the model's fully qualified names (sharded_state_dict) or by torch's
// positional ids (state_dict). The id ↔ FQN map is built from tensor identity against the
// model, never by zipping lists. A tensor registered under two names (tied weights) is one
// parameter, under its first name (as model_sharded_state_dict keys it).
//
// Loading is two typed steps: check_state_dict() / check_sharded_state_dict() validate
// everything and return a CheckedOptimizerState; apply() installs it and cannot fail on the
// state's content. load_state_dict() / load_sharded_state_dict() do both.
//
// Lossless master remainders (Float16OptimizerOptions::master_remainders, SPEC §3): each
// trainable BF16 parameter holds its FP32 master as the parameter itself (the high 16 bits)
// plus an int16 remainder (optim/master_remainder.h, Transformer Engine's format): optimizer
// state drops from 12 to 10 bytes per parameter (state_bytes() counts 2 for the remainder).
//   * Exact: given the same gradients, masters and moments are bitwise those of the
//     FP32-master path at every step; the master is the FP32 value the step computed.
//   * Not RNE: no 16-bit remainder can be lossless and keep the parameter = RNE(master). The
//     split rounds to nearest with ties AWAY FROM ZERO: the BF16 parameter equals the
//     FP32-master path's (RNE) except when the master lies exactly on a tie above an even
//     BF16 value (low 16 bits 0x8000, bit 16 clear); then it is one BF16 ulp further from
//     zero. For random updates that is about 2^-17 of the elements per step. (A training loop
//     whose forward reads such a parameter computes different gradients from then on.)
//   * FP16 parameters keep FP32 masters (FP16 is not the high half of an FP32); native FP32
//     and frozen parameters are unaffected.
//   * The parameter is half of the master, so a write from outside cannot be told from one
//     that keeps the value: any outside write (version counter bumped, storage swapped)
//     re-seeds the master as the parameter exactly (remainder 0), where the FP32-master path
//     ignores a write of the value the master rounds to. Re-typed from outside: BF16 → FP32
//     takes the joined master (exact: the conversion keeps the BF16 value); BF16 → FP16
//     rebuilds an FP32 master from the FP16 value's BF16 rounding and the remainder (exact
//     when the FP16 value holds the BF16 value: magnitudes in [2^-17, 2^16) or zero);
//     FP16 → BF16 splits its master.
//   * State dicts and checkpoints still hold a plain FP32 fp32_param (joined when the dict is
//     built: a fresh tensor, not an alias, whose version counter is the remainder's, so a step
//     taken after building the dict is still refused by checkpoint savers); loads split it.
//     Files do not depend on the option, and it may differ between save and load.
//
// CPU offloading (Float16OptimizerOptions::offload, optim/offload.h): masters, remainders and
// moments live on the host; each step copies gradients down and parameters up in overlapped
// chunks. Results, state dicts and checkpoints are those of the optimizer on the CPU without
// offloading, bit for bit (a CUDA device's own Adam step rounds a few elements differently).
//
// Not thread-safe: like torch's optimizers, use one from one thread at a time (the checks
// above update internal records even from const members).
#pragma once

#include "mixprec/optim/fused_kernels.h"
#include "mixprec/optim/loss_scaler.h"
#include "mixprec/optim/offload.h"
#include "mixprec/optim/optimizer_state.h"
#include "mixprec/sharded_state_dict.h"

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
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

// What to do when the model changed a parameter the optimizer holds a main copy for (see the
// header comment: a value written from outside, or a dtype changed).
enum class ExternalParamChange {
  kReseedMaster,  // follow the model: re-seed the main copy (moments and step stay)
  kError,         // throw c10::Error naming every changed parameter; nothing is touched
};

struct Float16OptimizerOptions {
  // Loss scaling: constant 1 by default (BF16); LossScalerOptions::fp16_dynamic() for FP16.
  TORCH_ARG(LossScalerOptions, loss_scaler) = {};
  // Clip gradients to this global L2 norm; 0 disables clipping.
  TORCH_ARG(double, clip_grad) = 0.0;
  TORCH_ARG(NonFiniteGrads, non_finite_grads) = NonFiniteGrads::kSkipStep;
  TORCH_ARG(ExternalParamChange, on_external_param_change) = ExternalParamChange::kReseedMaster;
  // Hold each trainable BF16 parameter's master as the parameter plus an int16 remainder (see
  // the header comment: exact masters and moments, the parameter rounded ties-away).
  TORCH_ARG(bool, master_remainders) = false;
  // Keep masters and moments on the host and step them there (optim/offload.h); none: all
  // state on the parameters' devices.
  TORCH_ARG(std::optional<OffloadOptions>, offload) = std::nullopt;
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

class Float16Optimizer;

// A state checked against one Float16Optimizer (and its model's parameters as they were then)
// by check_state_dict / check_sharded_state_dict. Only that optimizer's apply() takes it.
class CheckedOptimizerState {
 public:
  CheckedOptimizerState(CheckedOptimizerState&&) noexcept;
  CheckedOptimizerState& operator=(CheckedOptimizerState&&) noexcept;
  ~CheckedOptimizerState();
  // What apply() will report: keys missing or unexpected (non-strict), notes.
  const LoadReport& report() const;

 private:
  friend class Float16Optimizer;
  struct Plan;
  explicit CheckedOptimizerState(std::unique_ptr<Plan> plan);
  std::unique_ptr<Plan> plan_;
};

namespace detail {
class AlgorithmTraits;
class OffloadPipeline;
struct MasterPolicy;
struct SyncPlan;
enum class SyncPurpose;
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
  // options take `defaults`), with values the step accepts. Throws c10::Error naming the
  // parameter if one is not in the model, appears twice, is trainable with a dtype other than
  // FP32/BF16/FP16, or is sparse or not contiguous; naming the group and hyper-parameter for a
  // bad value. Its state lives in the optimizer's own slots, not in torch::optim::Optimizer's
  // state(), which stays empty: use state_dict() / sharded_state_dict().
  // The optimizer keeps handles to the model's parameters (not to the module): a parameter
  // given later to add_param_group must be one the model had at construction.
  Float16Optimizer(const torch::nn::Module& model,
                   std::vector<torch::optim::OptimizerParamGroup> groups,
                   std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                   Float16OptimizerOptions options = {});
  // One group with every parameter of `model` (frozen ones included, tied ones once), in
  // named order; `defaults` is AdamWOptions, AdamOptions or SGDOptions.
  Float16Optimizer(const torch::nn::Module& model, const torch::optim::OptimizerOptions& defaults,
                   Float16OptimizerOptions options = {});
  ~Float16Optimizer() override;

  // torch::optim::Optimizer::step: evaluates `closure` (if any), then update().
  at::Tensor step(LossClosure closure = nullptr) override;
  // One optimizer step over the current gradients (see the header comment). Everything is
  // checked (model changes, hyper-parameters, gradient shapes and devices) before any
  // parameter or state changes.
  StepResult update();
  const StepResult& last_result() const { return last_result_; }

  // Adds a group of model parameters (hides torch::optim::Optimizer::add_param_group, which is
  // not virtual: a call through the base class is detected at the next use and refused). The
  // new parameters take the next ids and roles as at construction. Throws c10::Error, leaving
  // the optimizer as it was, if a parameter was not the model's at construction, is already
  // in a group, or the group's options are of another type or out of range.
  void add_param_group(const torch::optim::OptimizerParamGroup& group);

  // Re-seeds every main copy from its model parameter as it is now (Megatron's name); moments
  // and steps stay. For use after changing weights from outside, whatever the option says.
  void reload_model_params();

  // Multiply the loss by this before backward (1 unless a loss scaler is active).
  double loss_scale() const { return scaler_.scale(); }
  const LossScaler& loss_scaler() const { return scaler_; }

  Algorithm algorithm() const;
  const std::vector<ParamInfo>& params_info() const { return info_; }
  // Whether this optimizer holds only this rank's piece of each parameter (a
  // distributed::DistributedOptimizer): its training state is saved and loaded by every rank
  // together (distributed/collective_checkpoint.h), never by checkpoint::'s single-process
  // functions.
  bool sharded() const { return static_cast<bool>(sharding_.piece_of); }
  // The FP32 main copy of the parameter named `fqn`; undefined unless its role is kMaster.
  // The optimizer's own tensor, or with a remainder a fresh FP32 tensor joined from the
  // parameter and its remainder (writing to it changes nothing). A tied parameter answers to
  // each of the names it had when the optimizer was built. Throws c10::Error naming `fqn` (and
  // close matches) if the optimizer holds no such param.
  at::Tensor main_param(const std::string& fqn) const;
  // Bytes of optimizer-owned tensors (masters or remainders, and moments) for parameters of
  // `role`; with offloading they are host memory.
  int64_t state_bytes(ParamRole role) const;
  // Those bytes over every role once every trainable parameter has been stepped under the
  // groups' current hyper-parameters (moments are made at a parameter's first step): what a
  // checkpoint of the optimizer will hold, known before training starts.
  int64_t state_bytes_when_stepped() const;
  // The bytes of each state tensor that stepping every trainable parameter will still create
  // (one entry per tensor, FP32, of the parameter's or this rank's piece's elements; empty once
  // all are stepped): what a checkpoint will hold beyond today's, tensor by tensor, as a
  // staging arena lays it out (checkpoint/training_state.h: staging_bytes_when_stepped).
  std::vector<int64_t> state_tensor_bytes_to_come() const;
  // What the last update() that stepped did with offloading on (all zero without it).
  const OffloadStats& offload_stats() const { return offload_stats_; }

  // torch's positional form. Tensors alias the optimizer's own (as torch's state_dict does):
  // a later step changes them; clone what must outlive it. A load installs new ones (as torch's
  // load_state_dict does; apply() may take the loaded tensors themselves): take the dict again
  // after a load. (With master_remainders a BF16
  // parameter's FP32 main copy is joined into a fresh tensor: see the header comment.)
  PositionalStateDict state_dict() const;
  // Validates everything (group count and sizes, ids, shapes, dtypes, hyper-parameters with
  // the step's own ranges, steps: non-negative integers) and returns it checked; changes
  // nothing. Strict: missing or unexpected state is an error listing all of it; non-strict:
  // what fits is loaded and the rest reported. Throws c10::Error listing every problem.
  CheckedOptimizerState check_state_dict(const PositionalStateDict& state,
                                         const LoadOptions& options = {}) const;

  // FQN-keyed form: tensors "optimizer.state.<kind>.<fqn>" (checkpoint/format/state_keys.h:
  // the algorithm's moments for parameters with state, fp32_param for parameters with a main
  // copy); common["optimizer"] = {algorithm, step, param_groups (with FQN lists and
  // hyper-parameters), scaler, per-parameter steps that differ from `step`, frozen,
  // without_state}. Tensors alias the optimizer's own (no copy: a checkpoint streams them
  // straight to disk), but for fp32_param of a parameter held with a remainder (joined).
  ShardedStateDict sharded_state_dict() const;
  // Checks the FQN-keyed form as check_state_dict does. Works across a changed precision plan:
  // a parameter saved with a main copy that is now native FP32 takes the saved main copy's
  // value; one saved as native FP32 that now needs a main copy seeds it from the model tensor
  // under its FQN in `state` (an FP32 value; a checkpoint holds both), else — in a non-strict
  // load; a strict one reports the key missing — from the model parameter as it is when
  // applied; one frozen when saved and trainable now takes its main copy
  // from the model parameter (no key is missing: it had none). Keys that do not start with
  // "optimizer." are the model's and are not reported as unexpected.
  CheckedOptimizerState check_sharded_state_dict(const ShardedStateDict& state,
                                                 const LoadOptions& options = {}) const;

  // Installs a checked state: group hyper-parameters, scaler, moments, steps and masters, then
  // re-derives half-precision model params from masters. Returns the report of the check.
  // Throws c10::Error, changing nothing, only if `checked` was made by another optimizer or
  // this optimizer's parameters changed role or structure since (check again then). Sharded,
  // apply() is collective (it gathers the parameters from their owners) and assumes every
  // rank's check passed: a rank whose check threw never calls it, and the others fail with the
  // group's timeout. load_*_state_dict below and distributed::load_training_state agree on the
  // checks first; use them there.
  LoadReport apply(CheckedOptimizerState&& checked);

  // apply(check_state_dict(...)) and apply(check_sharded_state_dict(...)). Data parallel, every
  // rank checks its part and the ranks agree before any applies (apply() is collective): one
  // rank's refusal is every rank's error, nothing changed anywhere.
  LoadReport load_state_dict(const PositionalStateDict& state, const LoadOptions& options = {});
  LoadReport load_sharded_state_dict(const ShardedStateDict& state,
                                     const LoadOptions& options = {});

  // Optimizer::save/load use torch's pickled archives keyed by pointer; mixprec keeps state
  // by name. These write and read the positional state dict through the archive instead.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 protected:
  // Data parallelism (distributed::DistributedOptimizer, ZeRO-1) is this optimizer's rules
  // applied to each rank's piece of every parameter: the same roles, following of the model,
  // checks, loads and state dicts, through the same code. A sharded optimizer steps, for each
  // parameter, the flat range [begin, end) of its row-major elements that `piece_of` gives
  // (possibly empty); its main copies and state are 1-D pieces, its state dicts flat slices
  // (rank `rank` declares the keys of parameters with no elements), and torch's positional
  // forms are refused. `who` names it in messages.
  struct Sharding {
    std::function<FlatRange(const at::Tensor& param)> piece_of;
    int rank = 0;
  };
  Float16Optimizer(const torch::nn::Module& model,
                   std::vector<torch::optim::OptimizerParamGroup> groups,
                   std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                   Float16OptimizerOptions options, Sharding sharding, std::string who);

  // What every rank must agree on before a step: per parameter (params_info() order), the
  // sum of squares of its gradient piece, whether a gradient arrived and whether it held a
  // non-finite value. agree() turns this rank's values into the sums over every rank.
  struct GradientAgreement {
    std::vector<double> sum_of_squares;
    std::vector<uint8_t> has_gradient;
    std::vector<uint8_t> non_finite;
  };
  // The points where a data-parallel optimizer adds its collectives; a single process uses
  // the defaults: nothing, and each parameter's own .grad. update() calls them in this order;
  // apply() calls publish_params() once a loaded state is installed.
  virtual void before_update() {}     // before anything is checked (local)
  virtual void reduce_gradients() {}  // collective
  // The gradient of the piece of params_info()[index], contiguous, or undefined if there is
  // none to read; `arrived`: whether a gradient arrived for the parameter on this rank.
  virtual at::Tensor piece_gradient(size_t index, bool& arrived) const;
  virtual void agree(GradientAgreement& agreement) {}  // collective
  virtual void publish_params() {}                     // collective: the stepped pieces
  // Collective: whether every rank's check of a state to load passed (`failed`: this rank's
  // error, or null). Rethrows this rank's error; throws if another rank's check failed.
  virtual void agree_to_load(const std::exception_ptr& failed);
  const std::string& who() const { return who_; }

  struct Slot;  // optim/optimizer_slot.h
  // Parallel to params_info().
  std::vector<std::shared_ptr<Slot>> slots_;

 private:
  struct Parsed;

  std::vector<std::string> new_param_problems(size_t first_group) const;
  void build_slots(size_t first_group);
  void check_group_options(size_t group) const;
  // What the model asks for (see the header comment), checked for every parameter; throws.
  detail::SyncPlan plan_sync(detail::SyncPurpose purpose) const;
  void apply_sync(const detail::SyncPlan& plan) const;
  void sync_with_model() const;  // plan and apply, for the state dicts
  CheckedOptimizerState check_parsed(Parsed&& parsed, const LoadOptions& options) const;
  // The loads: check(), every rank's agreement on it (agree_to_load), then apply().
  LoadReport check_agree_apply(const std::function<CheckedOptimizerState()>& check);
  // Creates in step_state_ what slot `index`'s step will hold and its state lacks.
  void create_step_state(size_t index);
  void step_slot(size_t index, double grad_multiplier);
  // Steps the `active` slots through the offloading pipelines (float16_optimizer_offload.cpp).
  void step_offloaded(const std::vector<size_t>& active, double grad_multiplier);
  detail::MasterPolicy master_policy() const;
  void record_params() const;

  Float16OptimizerOptions options_;
  Sharding sharding_;  // none: one process, every slot whole
  std::string who_;
  const detail::AlgorithmTraits* traits_;
  LossScaler scaler_;
  // The model's parameters at construction, by identity: FQN (first name) and a handle.
  std::vector<std::pair<std::string, at::Tensor>> model_params_;
  // The model's tied names at construction: each later name with its parameter's first name.
  std::map<std::string, std::string> tied_names_;
  // Kept in step with the model lazily (plan_sync/apply_sync), also from const members.
  mutable std::vector<ParamInfo> info_;
  std::vector<size_t> group_sizes_;  // params per group, as adopted
  StepResult last_result_;
  // update()'s working lists, kept so that a steady-state step allocates nothing.
  GradientAgreement agreement_;
  std::vector<at::Tensor> step_grads_;  // parallel to slots_: this step's gradient pieces
  // Parallel to slots_: a slot's state with what its step creates already created (first
  // steps only; else empty), and which of it is new (StepArgs::fresh).
  std::vector<std::vector<at::Tensor>> step_state_;
  std::vector<std::vector<bool>> step_fresh_;
  std::vector<size_t> active_;  // the slots stepped
  // With offloading: one pipeline per device that parameters live on, made on first use.
  std::vector<std::unique_ptr<detail::OffloadPipeline>> offload_;
  OffloadStats offload_stats_;
};

}  // namespace mixprec::optim
