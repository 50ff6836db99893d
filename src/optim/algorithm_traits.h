// Private: one table entry per inner algorithm of Float16Optimizer.
//
// Everything the optimizer does differently per algorithm lives behind AlgorithmTraits: the
// names of its per-parameter state (checkpoint/format/state_keys.h), how hyper-parameters are
// read from torch's option type, checked (with the step's own ranges), written to JSON and read
// back, which state a parameter holds under them, and the fused kernel that steps it. Adding an
// algorithm (Lion, Adafactor, ...) is one more entry in algorithm_traits.cpp and one more
// Algorithm enumerator.
#pragma once

#include "mixprec/optim/float16_optimizer.h"

#include <torch/optim/optimizer.h>
#include <nlohmann/json.hpp>

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mixprec::optim::detail {

// One step of one parameter, or of one contiguous slice of it: the kernels are elementwise,
// so a slice steps exactly as the same elements of the whole (see fused_kernels.h and
// master_remainder.h for the tensors' contracts).
struct StepArgs {
  const at::Tensor& target;       // FP32, updated: the main copy or the native FP32 parameter;
                                  // undefined when `remainder` holds the master
  const at::Tensor& grad;         // contiguous, read
  const at::Tensor& model_param;  // BF16/FP16 rewritten from `target`; with `remainder`, the
                                  // BF16 parameter holding the master's high half; or undefined
  int64_t steps_before;           // updates applied to this parameter before this one
  double grad_multiplier;         // loss-scale unscaling and clipping, folded in
  at::Tensor remainder = {};      // int16: the master's low half (master_remainder.h), or none
  // Parallel to `state`: tensors allocate_state() created for this step (zero-filled), which
  // the step treats as new, as if it had created them itself. Empty: none.
  std::vector<bool> fresh = {};
};

class AlgorithmTraits {
 public:
  virtual ~AlgorithmTraits() = default;

  virtual Algorithm algorithm() const = 0;
  // The name checkpoints record in common["optimizer"]["algorithm"].
  virtual std::string_view name() const = 0;
  // Per-parameter state tensors by state_keys.h kind, in the order a slot holds them.
  virtual std::span<const std::string_view> state_kinds() const = 0;
  // The option type's name, for messages ("AdamWOptions").
  virtual std::string_view options_name() const = 0;
  // True if `options` are exactly this algorithm's option type.
  virtual bool owns(const torch::optim::OptimizerOptions& options) const = 0;

  // Hyper-parameters as torch's param_groups name them (no "params").
  virtual nlohmann::json to_json(const torch::optim::OptimizerOptions& options) const = 0;
  // "" if the step accepts `options`; else the step's own message for the first bad value.
  virtual std::string range_problem(const torch::optim::OptimizerOptions& options) const = 0;
  // A copy of `current` holding a saved group's hyper-parameters, or null after appending what
  // is missing or mistyped to `problems` (each prefixed with `where`). Ranges are not checked
  // here: range_problem() on the result does that, as for any other options.
  virtual std::unique_ptr<torch::optim::OptimizerOptions> from_json(
      const torch::optim::OptimizerOptions& current, const nlohmann::json& saved,
      const std::string& where, std::vector<std::string>& problems) const = 0;
  // Copies every hyper-parameter of `from` into `to` (the same object stays in the group, so
  // references to it, e.g. a scheduler's, stay valid).
  virtual void assign(torch::optim::OptimizerOptions& to,
                      const torch::optim::OptimizerOptions& from) const = 0;

  // Which of state_kinds() a stepped parameter holds under `options` (e.g. max_exp_avg_sq
  // only with amsgrad; SGD's buffer only with momentum).
  virtual std::vector<bool> held_state(const torch::optim::OptimizerOptions& options) const = 0;
  // True if `state` lacks a tensor held_state() names (allocating nothing to find out).
  virtual bool lacks_state(const torch::optim::OptimizerOptions& options,
                           const std::vector<at::Tensor>& state) const = 0;
  // Which of state_kinds() a stepped parameter's loaded state must have when its options hold
  // them: the rest a step creates itself when missing, as an uninterrupted run does when the
  // option that needs them is switched on (amsgrad's max_exp_avg_sq, SGD's momentum buffer).
  virtual std::vector<bool> required_state() const = 0;
  // One fused step. `state` (parallel to state_kinds()) gains the tensors it lacks, and only
  // once the kernel has succeeded: a throwing kernel leaves no state behind.
  virtual void step(const torch::optim::OptimizerOptions& options, const StepArgs& args,
                    std::vector<at::Tensor>& state) const = 0;

  // Gives `state` every tensor a step under `options` holds and it lacks: FP32, zero-filled,
  // of `sizes`, on `device`. Returns which it created, for StepArgs::fresh. For callers that
  // step a parameter in slices (the offloading pipeline): each slice's step gets views of
  // whole state tensors.
  std::vector<bool> allocate_state(const torch::optim::OptimizerOptions& options,
                                   at::IntArrayRef sizes, c10::Device device,
                                   std::vector<at::Tensor>& state) const;
};

// The entry whose option type `options` has; throws c10::Error "[<who>] ..." naming the type
// otherwise. The one reader of torch's option types: Float16Optimizer and
// distributed::DistributedOptimizer both step, check and save hyper-parameters through it.
const AlgorithmTraits& traits_for(const torch::optim::OptimizerOptions& options,
                                  std::string_view who = "mixprec::Float16Optimizer");

}  // namespace mixprec::optim::detail
