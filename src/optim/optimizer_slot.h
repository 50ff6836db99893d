// Private: what Float16Optimizer keeps per parameter, and the values its checks hand on.
#pragma once

#include "mixprec/optim/float16_optimizer.h"
#include "optim/algorithm_traits.h"

#include <c10/core/Device.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace mixprec::optim {

namespace detail {

// How main copies and state are held, from Float16OptimizerOptions (fixed at construction).
struct MasterPolicy {
  bool remainders = false;  // BF16 parameters: the parameter + an int16 remainder
  bool offload = false;     // masters and state on the host
  bool wants_remainder(const at::Tensor& param) const {
    return remainders && param.scalar_type() == at::kBFloat16;
  }
  // Where masters, remainders and moments of `param` live.
  c10::Device state_device(const at::Tensor& param) const {
    return offload ? c10::Device(c10::kCPU) : param.device();
  }
};

}  // namespace detail

struct Float16Optimizer::Slot {
  at::Tensor param;  // the model's parameter (same TensorImpl)
  // The elements this optimizer steps: all of them (`whole`: the main copy and the state have
  // the parameter's shape), or a data-parallel rank's piece [begin, end) of its row-major
  // flattening (1-D main copy and state; possibly empty).
  bool whole = true;
  int64_t begin = 0, end = 0;
  // Those elements of the parameter, detached: the parameter itself, or a 1-D view.
  at::Tensor piece() const;
  std::vector<int64_t> piece_sizes() const;
  // The main copy (kMaster only), in one of two forms (float16_optimizer_master.cpp):
  at::Tensor master;              // FP32 master; or
  at::Tensor remainder;           // int16 low half of the master, whose high half is `param` (BF16)
  int64_t step = 0;               // updates applied so far (torch's per-parameter "step")
  std::vector<at::Tensor> state;  // parallel to the traits' state_kinds(); undefined if not held

  bool has_master() const { return master.defined() || remainder.defined(); }
  // The master's FP32 value: `master` itself (an alias), or param + remainder joined into a
  // fresh tensor on the state device whose version counter is the remainder's (so a step
  // after it was taken shows, as on an alias). Undefined without a main copy.
  at::Tensor master_value() const;
  // Makes the slot hold a main copy in the form `policy` gives its parameter, valued `value`
  // (FP32, any device) or, if undefined, the parameter's own value exactly (remainder 0); the
  // parameter is rewritten from it (RNE; the remainder split's rounding). Existing tensors of
  // the same form are written in place, so state dicts that alias them stay valid.
  void hold_master(const at::Tensor& value, const detail::MasterPolicy& policy);
  void drop_master();
  // The parameter written from an FP32 master (RNE), across devices (offload). Nothing to do
  // for a remainder: the parameter is the master's high half.
  void write_param_from_master() const;

  // The parameter as the optimizer last wrote or adopted it: what tells an outside change.
  struct Seen {
    c10::ScalarType dtype = at::kFloat;
    std::vector<int64_t> sizes;
    c10::Device device = c10::kCPU;
    int64_t version = 0;         // the version counter (bumped by in-place writes)
    const void* data = nullptr;  // set_data swaps the storage without a bump
  } seen;
  void record();
  // True if something other than the optimizer may have written the parameter since record().
  bool maybe_written() const;
  // After maybe_written(), for a parameter with a main copy: true unless the parameter holds
  // the value the master rounds to (with a remainder: always true, see the definition).
  bool param_differs_from_master() const;

  bool has_state() const { return step > 0; }
  // Data parallel: this rank steps none of the parameter's elements (it has some).
  bool holds_no_piece() const { return !whole && begin == end && param.numel() > 0; }
};

namespace detail {

enum class SyncPurpose {
  kUse,   // a step or a state dict: outside writes re-seed masters or throw, by the option
  kLoad,  // a load replaces masters: outside writes are no change; role changes always follow
};

// What plan_sync found the model asks for, per slot (see float16_optimizer.h).
struct SyncPlan {
  struct Change {
    ParamRole role;                  // the role from now on
    bool master_from_param = false;  // (re)seed the main copy from the parameter's value
    bool param_from_master = false;  // rewrite the parameter from the main copy (before a drop)
  };
  std::vector<Change> slots;  // parallel to slots_
  bool operator==(const SyncPlan& other) const;
};

}  // namespace detail

// A state dict parsed against the optimizer's parameters (either form), before any check of
// tensors against parameters.
struct Float16Optimizer::Parsed {
  struct Param {
    int64_t step = 0;
    // By state kind, the algorithm's kinds only: whole tensors, or flat slices holding this
    // optimizer's piece (a data-parallel load reads only its pieces).
    std::map<std::string, ShardedTensor> moments;
    // FP32 value for the parameter: a saved main copy, or the model's FP32 tensor across a
    // plan change (`local` undefined: none); and the key it came from.
    ShardedTensor fp32;
    std::string fp32_source;
    bool fresh_ok = false;  // saved without state (frozen or never stepped): may start fresh
  };
  detail::SyncPlan sync;      // the roles the model asks for: the state is checked against them
  std::vector<Param> params;  // parallel to slots_
  nlohmann::json groups;      // the saved param groups, if their number matched
  nlohmann::json scaler;
  LoadReport report;
  std::vector<std::string> problems;  // errors in either mode
};

// Everything apply() installs, checked.
struct CheckedOptimizerState::Plan {
  const Float16Optimizer* owner = nullptr;
  detail::SyncPlan sync;
  struct Param {
    bool install = false;  // replace step and state (else the parameter starts fresh)
    int64_t step = 0;
    std::vector<at::Tensor> state;  // parallel to state_kinds()
    at::Tensor fp32;                // value for the main copy / native FP32 parameter, or none
    std::string fp32_source;
  };
  std::vector<Param> params;
  // Checked hyper-parameters per group; empty when the state had none to give.
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> groups;
  std::optional<LossScaler> scaler;  // none: keep the configured one
  LoadReport report;
};

namespace detail {

// State dicts alias the optimizer's tensors, as torch's do: no copy of the whole state.
inline at::Tensor copy_of(const at::Tensor& t) { return t.detach(); }

// The role a trainable parameter of this dtype takes; none for dtypes that cannot be optimized.
std::optional<ParamRole> trainable_role(const at::Tensor& param);

// Checks a saved "param_groups" array against the optimizer's groups: the same number of
// groups, each with a "params" list as long as the optimizer's. `entry_problem(position,
// flat_index, entry)` judges each listed parameter (an id or a name) and returns "" when it
// matches. Appends every problem found to `problems`. Hyper-parameters are read by the traits.
void check_saved_groups(
    const nlohmann::json& groups, const std::vector<torch::optim::OptimizerParamGroup>& current,
    const std::function<std::string(size_t flat_index, const nlohmann::json& entry)>& entry_problem,
    std::vector<std::string>& problems);

// A saved step count: a non-negative integer within int64. "" if fine, else the problem.
std::string step_problem(const nlohmann::json& value);
std::string step_problem(double value);

}  // namespace detail
}  // namespace mixprec::optim
