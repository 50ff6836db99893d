// Loading a state in two typed steps. Both state-dict forms parse into one per-parameter
// picture (Float16Optimizer::Parsed); check_parsed() checks it completely against the roles
// the model asks for and turns it into a CheckedOptimizerState, which apply() installs
// without any further check of its content — so a failed load leaves the optimizer and the
// model exactly as they were.
#include "mixprec/optim/float16_optimizer.h"

#include "detail/name_match.h"
#include "mixprec/checkpoint/format/state_keys.h"
#include "optim/optimizer_slot.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <functional>
#include <optional>

namespace mixprec::optim {

namespace keys = mixprec::checkpoint::keys;

CheckedOptimizerState::CheckedOptimizerState(std::unique_ptr<Plan> plan) : plan_(std::move(plan)) {}
CheckedOptimizerState::CheckedOptimizerState(CheckedOptimizerState&&) noexcept = default;
CheckedOptimizerState& CheckedOptimizerState::operator=(CheckedOptimizerState&&) noexcept = default;
CheckedOptimizerState::~CheckedOptimizerState() = default;

const LoadReport& CheckedOptimizerState::report() const {
  TORCH_CHECK(plan_, "[mixprec::CheckedOptimizerState] the state was already applied");
  return plan_->report;
}

namespace detail {

void check_saved_groups(
    const nlohmann::json& groups, const std::vector<torch::optim::OptimizerParamGroup>& current,
    const std::function<std::string(size_t, const nlohmann::json&)>& entry_problem,
    std::vector<std::string>& problems) {
  if (!groups.is_array() || groups.size() != current.size()) {
    problems.push_back("the state has " + std::to_string(groups.is_array() ? groups.size() : 0) +
                       " param groups, the optimizer has " + std::to_string(current.size()));
    return;
  }
  size_t flat = 0;  // the optimizer's flat parameter index (torch's id) of the group's first
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string params(keys::kParams);
    const auto& listed =
        groups[g].is_object() && groups[g].contains(params) ? groups[g][params] : nlohmann::json();
    const size_t want = current[g].params().size();
    if (!listed.is_array() || listed.size() != want) {
      problems.push_back("param group " + std::to_string(g) + " has " +
                         std::to_string(listed.is_array() ? listed.size() : 0) +
                         " params in the state, " + std::to_string(want) + " in the optimizer");
    } else {
      for (size_t i = 0; i < want; ++i) {
        std::string problem = entry_problem(flat + i, listed[i]);
        if (!problem.empty()) {
          problems.push_back("param group " + std::to_string(g) + " position " + std::to_string(i) +
                             ": " + problem);
        }
      }
    }
    flat += want;
  }
}

std::string step_problem(const nlohmann::json& value) {
  const bool ok = value.is_number_unsigned()
                      ? value.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX)
                      : value.is_number_integer() && value.get<int64_t>() >= 0;
  return ok ? "" : value.dump() + " is not a non-negative integer within int64";
}

std::string step_problem(double value) {
  // 2^63 is the first double beyond int64; NaN fails every comparison.
  const bool ok = value >= 0 && value < 9223372036854775808.0 && value == std::floor(value);
  return ok ? "" : c10::str(value, " is not a non-negative integer within int64");
}

}  // namespace detail

namespace {

// Checks one saved tensor (whole, or a slice) against the parameter it belongs to.
void check_tensor(const ShardedTensor& t, const at::Tensor& param, const std::string& what,
                  bool must_be_fp32, std::vector<std::string>& problems) {
  if (!t.local.defined()) {
    problems.push_back(what + " is undefined");
    return;
  }
  if (c10::IntArrayRef(t.global_shape) != param.sizes()) {
    problems.push_back(what + ": shape " + c10::str(c10::IntArrayRef(t.global_shape)) +
                       ", the parameter has " + c10::str(param.sizes()));
  }
  const auto dtype = t.local.scalar_type();
  if (!at::isFloatingType(dtype) || (must_be_fp32 && dtype != at::kFloat)) {
    problems.push_back(what + ": dtype " + c10::toString(dtype) +
                       (must_be_fp32 ? ", expected Float (an FP32 value is never taken from a "
                                       "lower precision)"
                                     : ", expected a floating dtype"));
  }
}

}  // namespace

CheckedOptimizerState Float16Optimizer::check_parsed(Parsed&& saved,
                                                     const LoadOptions& options) const {
  auto plan = std::make_unique<CheckedOptimizerState::Plan>();
  plan->owner = this;
  auto& problems = saved.problems;
  auto& report = saved.report;
  const auto kinds = traits_->state_kinds();

  // Hyper-parameters: read into a copy of each group's options, checked as the step checks.
  if (saved.groups.is_array() && saved.groups.size() == param_groups().size()) {
    for (size_t g = 0; g < param_groups().size(); ++g) {
      const std::string where = "param group " + std::to_string(g) + ": ";
      auto group =
          traits_->from_json(param_groups()[g].options(), saved.groups[g], where, problems);
      if (group) {
        const std::string bad = traits_->range_problem(*group);
        if (!bad.empty()) problems.push_back(where + bad);
      }
      plan->groups.push_back(std::move(group));
    }
  }

  for (size_t k = 0; k < slots_.size(); ++k) {
    const ParamInfo& info = info_[k];
    const ParamRole role = saved.sync.slots[k].role;
    auto& p = saved.params[k];
    const Slot& slot = *slots_[k];
    const at::Tensor& param = slot.param;
    auto& out = plan->params.emplace_back();
    out.state.resize(kinds.size());
    // The values of this optimizer's piece (the whole parameter in one process), once the
    // tensor itself passed its check.
    auto piece_of = [&](const ShardedTensor& t, const std::string& what) -> at::Tensor {
      const size_t before = problems.size();
      check_tensor(t, param, what, /*must_be_fp32=*/&t == &p.fp32, problems);
      if (problems.size() != before) return {};
      try {
        return t.flat_elements(slot.begin, slot.end).view(slot.piece_sizes());
      } catch (const c10::Error& e) {
        problems.push_back(what + ": " + e.what_without_backtrace());
        return {};
      }
    };
    std::map<std::string, at::Tensor> moments;
    for (const auto& [kind, t] : p.moments) {
      moments[kind] = piece_of(t, "'" + info.fqn + "' " + kind);
    }
    at::Tensor fp32;
    if (p.fp32.local.defined()) fp32 = piece_of(p.fp32, p.fp32_source);
    if (role == ParamRole::kFrozen) continue;
    out.fp32 = fp32;
    if (role == ParamRole::kMaster && !p.fp32.local.defined()) {
      report.notes.push_back("'" + info.fqn + "': no main copy in the state; re-derived from the " +
                             c10::toString(param.scalar_type()) +
                             " model parameter if the load goes ahead");
    } else if (role == ParamRole::kNativeFp32 && p.fp32.local.defined()) {
      report.notes.push_back("'" + info.fqn + "' is now native FP32: took its value from " +
                             p.fp32_source);
    }
    // The state this parameter holds under the hyper-parameters being loaded (they replace
    // the current ones), e.g. max_exp_avg_sq only with amsgrad.
    const bool loaded_group = info.group < plan->groups.size() && plan->groups[info.group];
    const std::vector<bool> held = traits_->held_state(
        loaded_group ? *plan->groups[info.group] : param_groups()[info.group].options());
    const bool has_state = !p.moments.empty() || (p.step > 0 && !p.fresh_ok);
    if (!has_state) continue;
    // What a step cannot rebuild. Nothing, for a parameter without elements: its steps count
    // but never make a moment.
    const std::vector<bool> required = traits_->required_state();
    std::vector<std::string> missing;
    for (size_t i = 0; i < kinds.size(); ++i) {
      if (held[i] && required[i] && param.numel() > 0 && !moments.count(std::string(kinds[i])))
        missing.emplace_back(kinds[i]);
    }
    for (const auto& kind : missing) {
      report.missing_keys.push_back(keys::optimizer_state_key(kind, info.fqn));
    }
    if (!missing.empty()) {
      // Non-strict: a partial state is no state; the parameter starts fresh.
      report.notes.push_back("'" + info.fqn + "': incomplete optimizer state, starts fresh");
      continue;
    }
    if (p.step <= 0) {
      problems.push_back("'" + info.fqn + "' has optimizer state but step " +
                         std::to_string(p.step));
      continue;
    }
    out.install = true;
    out.step = p.step;
    for (size_t i = 0; i < kinds.size(); ++i) {
      auto it = moments.find(std::string(kinds[i]));
      if (it != moments.end()) out.state[i] = it->second;
    }
  }

  if (!saved.scaler.is_object()) {
    problems.push_back("no loss scaler state");
  } else if (saved.scaler.contains("dynamic") && saved.scaler["dynamic"] != scaler_.is_dynamic()) {
    // e.g. FP16 with a dynamic scale resumed as BF16: the saved scale means nothing here.
    report.notes.push_back(std::string("loss scaler: the state is ") +
                           (scaler_.is_dynamic() ? "constant" : "dynamic") +
                           ", this optimizer's is not; keeping the configured scaler");
  } else {
    try {
      LossScaler loaded = scaler_;
      loaded.load_state(saved.scaler);
      plan->scaler = loaded;
    } catch (const c10::Error& e) {
      problems.push_back(e.what_without_backtrace());
    }
  }
  if (options.strict()) {
    for (const auto& key : report.missing_keys) problems.push_back("missing " + key);
    for (const auto& key : report.unexpected_keys) problems.push_back("unexpected " + key);
  }
  // A refused load says what the notes know (why a key is unexpected, what was re-derived).
  if (!problems.empty()) {
    for (const auto& note : report.notes) problems.push_back("note: " + note);
  }
  mixprec::detail::check_no_problems(problems, "[" + who_ + "] cannot load the state");
  plan->sync = std::move(saved.sync);
  plan->report = std::move(report);
  return CheckedOptimizerState(std::move(plan));
}

namespace {

// `t`'s memory for the optimizer to hold as its own, or undefined where something else may see
// it. Nothing else sees it when the plan's is the only reference to `t` and, for a view, its base
// is referenced by the view alone (a checkpoint load's fresh tensor, whose reader's handles are
// gone by now), and `t` is FP32, contiguous, on `where` and covers all of that memory. Taken,
// `t` is left undefined. A state
// dict the caller still holds is never taken: the optimizer's in-place steps must not write into
// it. Taking the loaded moments and masters (all of the state, 12 of 14 bytes per BF16
// parameter of a checkpoint) instead of copying them took bench_dist_checkpoint's ZeRO-1 load
// on one rank from 60 to 33-35 ms.
at::Tensor take_if_unshared(at::Tensor& t, const c10::Device& where) {
  if (!t.defined()) return {};
  const at::TensorBase* base = t.is_view() ? &t._base() : nullptr;
  const bool unshared = t.use_count() == 1 && (base == nullptr || base->use_count() == 1) &&
                        t.has_storage() && t.storage().use_count() == (base == nullptr ? 1u : 2u) &&
                        !t.is_inference() && !t.requires_grad() && t.scalar_type() == at::kFloat &&
                        t.device() == where && t.is_contiguous() && t.storage_offset() == 0 &&
                        t.storage().nbytes() == t.nbytes();
  if (!unshared) return {};
  // A tensor of its own on that memory, without the view's tie to its base; `t` lets go.
  at::Tensor taken = at::empty({0}, t.options()).set_(t.storage(), 0, t.sizes(), t.strides());
  t = at::Tensor();
  return taken;
}

at::Tensor take_or_copy_fp32(at::Tensor& t, const c10::Device& where) {
  if (at::Tensor taken = take_if_unshared(t, where); taken.defined()) return taken;
  return t.detach().to(where, at::kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous();
}

}  // namespace

LoadReport Float16Optimizer::apply(CheckedOptimizerState&& checked) {
  TORCH_CHECK(checked.plan_ && checked.plan_->owner == this, "[", who_,
              "::apply] the state was checked by another optimizer, or was applied already");
  // Only what the check relied on can have moved: the parameters' roles or the groups.
  before_update();
  TORCH_CHECK(plan_sync(detail::SyncPurpose::kLoad) == checked.plan_->sync, "[", who_,
              "::apply] the model's parameters changed role since the state was checked; check "
              "it again");
  const std::unique_ptr<CheckedOptimizerState::Plan> plan = std::move(checked.plan_);
  apply_sync(plan->sync);
  at::NoGradGuard no_grad;
  for (size_t g = 0; g < plan->groups.size(); ++g) {
    traits_->assign(param_groups()[g].options(), *plan->groups[g]);
  }
  if (plan->scaler) scaler_ = *plan->scaler;
  for (size_t k = 0; k < slots_.size(); ++k) {
    Slot& slot = *slots_[k];
    auto& p = plan->params[k];
    const ParamRole role = info_[k].role;
    if (role == ParamRole::kFrozen) continue;
    // On the state's device (the parameter's, or the host when offloading): a checkpoint is
    // read to the host.
    const c10::Device where = master_policy().state_device(slot.param);
    slot.state.assign(slot.state.size(), at::Tensor());
    slot.step = p.install ? p.step : 0;
    for (size_t i = 0; p.install && i < p.state.size(); ++i) {
      if (p.state[i].defined()) slot.state[i] = take_or_copy_fp32(p.state[i], where);
    }
    if (role == ParamRole::kMaster) {
      // The saved master (split into the remainder form where that is held), or the
      // parameter's own value; the parameter is re-derived from it.
      at::Tensor taken;
      if (!master_policy().wants_remainder(slot.param) && p.fp32.defined() &&
          p.fp32.sizes() == slot.piece().sizes()) {
        taken = take_if_unshared(p.fp32, where);
      }
      if (taken.defined()) {
        slot.remainder = at::Tensor();
        slot.master = std::move(taken);
        slot.write_param_from_master();
      } else {
        slot.hold_master(p.fp32, master_policy());
      }
    } else if (p.fp32.defined()) {
      // Saved with a main copy, now native FP32: the parameter takes the main copy's value.
      slot.piece().copy_(p.fp32);
    }
  }
  publish_params();  // data parallel: every rank's parameters from the owners' pieces
  record_params();
  return std::move(plan->report);
}

void Float16Optimizer::agree_to_load(const std::exception_ptr& failed) {
  if (failed) std::rethrow_exception(failed);
}

LoadReport Float16Optimizer::check_agree_apply(
    const std::function<CheckedOptimizerState()>& check) {
  std::optional<CheckedOptimizerState> checked;
  std::exception_ptr failed;
  try {
    checked.emplace(check());
  } catch (...) {
    failed = std::current_exception();
  }
  agree_to_load(failed);
  return apply(std::move(*checked));
}

LoadReport Float16Optimizer::load_state_dict(const PositionalStateDict& state,
                                             const LoadOptions& options) {
  return check_agree_apply([&] { return check_state_dict(state, options); });
}

LoadReport Float16Optimizer::load_sharded_state_dict(const ShardedStateDict& state,
                                                     const LoadOptions& options) {
  return check_agree_apply([&] { return check_sharded_state_dict(state, options); });
}

}  // namespace mixprec::optim
