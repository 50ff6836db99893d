// Float16Optimizer following its model: outside writes, unfrozen and re-typed parameters, and
// param groups changed behind its back (the rules are in float16_optimizer.h).
//
// Each slot records the parameter as the optimizer last wrote or adopted it (dtype, shape,
// device, version counter, data pointer). plan_sync() compares every parameter with that
// record and decides, for all of them, before anything is touched; apply_sync() carries the
// plan out and records again.
#include "mixprec/optim/float16_optimizer.h"

#include "detail/name_match.h"
#include "optim/optimizer_slot.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

namespace mixprec::optim {

void Float16Optimizer::Slot::record() {
  seen.dtype = param.scalar_type();
  seen.sizes.assign(param.sizes().begin(), param.sizes().end());
  seen.device = param.device();
  // Inference tensors keep no version counter (and cannot be trained anyway).
  seen.version = param.is_inference() ? 0 : param._version();
  seen.data = param.const_data_ptr();
}

bool Float16Optimizer::Slot::maybe_written() const {
  const int64_t version = param.is_inference() ? 0 : param._version();
  return version != seen.version || param.const_data_ptr() != seen.data;
}

bool Float16Optimizer::Slot::param_differs_from_master() const {
  // A remainder's parameter is the master's high half: what it held before the write is gone,
  // so any write counts.
  if (!master.defined()) return true;
  const at::Tensor p = piece();
  return !at::equal(p, master.to(p.device(), p.scalar_type()));
}

namespace detail {

bool SyncPlan::operator==(const SyncPlan& other) const {
  if (slots.size() != other.slots.size()) return false;
  for (size_t k = 0; k < slots.size(); ++k) {
    const Change &a = slots[k], &b = other.slots[k];
    if (a.role != b.role || a.master_from_param != b.master_from_param ||
        a.param_from_master != b.param_from_master) {
      return false;
    }
  }
  return true;
}

}  // namespace detail

detail::SyncPlan Float16Optimizer::plan_sync(detail::SyncPurpose purpose) const {
  const std::string where = "[" + who_ + "] ";
  // The groups must be the ones the optimizer adopted: torch's add_param_group is not virtual,
  // and param_groups() hands out a mutable vector.
  std::vector<std::string> problems;
  const auto& groups = param_groups();
  if (groups.size() != group_sizes_.size()) {
    problems.push_back("there are " + std::to_string(groups.size()) +
                       " param groups, the optimizer "
                       "adopted " +
                       std::to_string(group_sizes_.size()));
  } else {
    size_t k = 0;
    for (size_t g = 0; g < groups.size(); k += group_sizes_[g], ++g) {
      const auto& params = groups[g].params();
      if (params.size() != group_sizes_[g]) {
        problems.push_back("param group " + std::to_string(g) + " has " +
                           std::to_string(params.size()) + " params, the optimizer adopted " +
                           std::to_string(group_sizes_[g]));
        continue;
      }
      for (size_t i = 0; i < params.size(); ++i) {
        if (!params[i].is_same(slots_[k + i]->param)) {
          problems.push_back("param group " + std::to_string(g) + " position " + std::to_string(i) +
                             " is no longer '" + info_[k + i].fqn + "'");
        }
      }
      if (!traits_->owns(groups[g].options())) {
        problems.push_back("param group " + std::to_string(g) + "'s options are no longer " +
                           std::string(traits_->options_name()));
      }
    }
  }
  mixprec::detail::check_no_problems(
      problems, where +
                    "param groups changed outside the optimizer (add groups with "
                    "Float16Optimizer::add_param_group)");

  const bool refuse_changes = purpose == detail::SyncPurpose::kUse &&
                              options_.on_external_param_change() == ExternalParamChange::kError;
  std::vector<std::string> changed;  // refused by the option
  detail::SyncPlan plan;
  plan.slots.resize(slots_.size());
  for (size_t k = 0; k < slots_.size(); ++k) {
    const Slot& s = *slots_[k];
    const ParamInfo& info = info_[k];
    const at::Tensor& p = s.param;
    auto& change = plan.slots[k];
    change.role = info.role;
    // Trainable once, trainable for good: a parameter frozen later keeps its role and state.
    if (info.role == ParamRole::kFrozen && !p.requires_grad()) continue;
    // Messages are built only for what goes wrong: this runs for every parameter at every step.
    auto name = [&info] { return "'" + info.fqn + "'"; };
    const std::optional<ParamRole> role = detail::trainable_role(p);
    if (!role) {
      problems.push_back(name() + " is now a trainable " + c10::toString(p.scalar_type()) +
                         " parameter; only Float, BFloat16 and Half can be optimized");
      continue;
    }
    if (p.is_sparse() || !p.is_contiguous()) {
      problems.push_back(name() + " must be dense and contiguous");
    }
    if (info.role == ParamRole::kFrozen) {  // unfrozen: takes the role its dtype gives
      change.role = *role;
      change.master_from_param = *role == ParamRole::kMaster;
      continue;
    }
    if (p.sizes() != c10::IntArrayRef(s.seen.sizes) || p.device() != s.seen.device) {
      problems.push_back(name() + " changed from " + c10::str(c10::IntArrayRef(s.seen.sizes)) +
                         " on " + s.seen.device.str() + " to " + c10::str(p.sizes()) + " on " +
                         p.device().str() + " after the optimizer was built");
      continue;
    }
    const bool retyped = p.scalar_type() != s.seen.dtype;
    if (retyped && sharded()) {
      // The data-parallel buffers hold each dtype apart, laid out when they were built.
      problems.push_back(name() + " changed dtype from " + c10::toString(s.seen.dtype) + " to " +
                         c10::toString(p.scalar_type()) +
                         " after the data-parallel optimizer was built; convert the model first");
      continue;
    }
    auto retype = [&] {
      return name() + " changed dtype from " + c10::toString(s.seen.dtype) + " to " +
             c10::toString(p.scalar_type());
    };
    // A conversion leaves the value the old parameter held — its master rounded — in the new
    // dtype: then the master is the better value. Anything else is a new value written with the
    // change (set_data, a load into a converted model): it is the truth, as an outside write is.
    // A remainder's parameter was the master's high half, gone with its old dtype: a value no
    // BF16 parameter could have held is new; one it could have is taken for a conversion.
    auto converted_from_master = [&] {
      if (purpose != detail::SyncPurpose::kUse) return true;
      const at::Tensor piece = s.piece();
      if (!s.master.defined()) {
        return at::equal(piece, piece.to(at::kBFloat16).to(piece.scalar_type()));
      }
      return at::equal(piece, s.master.to(s.seen.dtype).to(piece.device(), piece.scalar_type()));
    };
    if (*role != info.role) {  // FP32 <-> BF16/FP16
      change.role = *role;
      change.master_from_param = *role == ParamRole::kMaster;
      change.param_from_master = *role == ParamRole::kNativeFp32 && converted_from_master();
      if (refuse_changes) changed.push_back(retype());
    } else if (info.role == ParamRole::kMaster && retyped) {  // BF16 <-> FP16
      change.param_from_master = converted_from_master();
      change.master_from_param = !change.param_from_master;
      if (refuse_changes) changed.push_back(retype());
    } else if (info.role == ParamRole::kMaster && purpose == detail::SyncPurpose::kUse &&
               s.maybe_written() && s.param_differs_from_master()) {
      change.master_from_param = true;
      if (refuse_changes) changed.push_back(name() + " was written from outside the optimizer");
    }
  }
  mixprec::detail::check_no_problems(problems, where + "cannot follow the model's parameters");
  mixprec::detail::check_no_problems(
      changed, where +
                   "parameters changed outside the optimizer (on_external_param_change is "
                   "kError; call reload_model_params() to adopt them)");
  return plan;
}

void Float16Optimizer::apply_sync(const detail::SyncPlan& plan) const {
  TORCH_INTERNAL_ASSERT(plan.slots.size() == slots_.size());
  at::NoGradGuard no_grad;
  const detail::MasterPolicy policy = master_policy();
  for (size_t k = 0; k < slots_.size(); ++k) {
    Slot& s = *slots_[k];
    const auto& change = plan.slots[k];
    if (change.param_from_master) {
      // Taken before anything changes: a remainder needs the parameter's bits as they are.
      const at::Tensor value = s.master_value();
      if (change.role == ParamRole::kNativeFp32) {
        s.piece().copy_(value);
      } else {  // BF16 <-> FP16: the form may change with the dtype (remainders are BF16's)
        s.hold_master(value, policy);
      }
    }
    if (change.role != ParamRole::kMaster) {
      s.drop_master();
    } else if (!s.has_master() || change.master_from_param) {
      s.hold_master(at::Tensor(), policy);  // in place where it exists: state dicts alias it
    }
    info_[k].role = change.role;
    s.record();
  }
}

void Float16Optimizer::sync_with_model() const { apply_sync(plan_sync(detail::SyncPurpose::kUse)); }

void Float16Optimizer::record_params() const {
  for (const auto& slot : slots_) slot->record();
}

void Float16Optimizer::reload_model_params() {
  // Roles follow the model as in a load; then the model's values are the truth everywhere.
  detail::SyncPlan plan = plan_sync(detail::SyncPurpose::kLoad);
  for (auto& change : plan.slots) {
    change.param_from_master = false;
    change.master_from_param = change.role == ParamRole::kMaster;
  }
  apply_sync(plan);
}

}  // namespace mixprec::optim
