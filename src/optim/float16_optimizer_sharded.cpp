// Float16Optimizer keyed by fully qualified names: sharded_state_dict() and its check.
// Key and field names come from checkpoint/format/state_keys.h.
#include "mixprec/optim/float16_optimizer.h"

#include "mixprec/checkpoint/format/state_keys.h"
#include "optim/optimizer_slot.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <map>
#include <set>

namespace mixprec::optim {

namespace keys = mixprec::checkpoint::keys;
using detail::copy_of;

namespace {
std::string str(std::string_view s) { return std::string(s); }
}  // namespace

ShardedStateDict Float16Optimizer::sharded_state_dict() const {
  sync_with_model();
  ShardedStateDict out;
  const auto kinds = traits_->state_kinds();
  int64_t common_step = 0;
  for (const auto& s : slots_) common_step = std::max(common_step, s->step);
  nlohmann::json groups = nlohmann::json::array();
  for (const auto& group : param_groups()) {  // every group, empty ones included
    groups.push_back(traits_->to_json(group.options()));
    groups.back()[str(keys::kParams)] = nlohmann::json::array();
  }
  nlohmann::json frozen = nlohmann::json::array();
  nlohmann::json without_state = nlohmann::json::array();
  nlohmann::json steps = nlohmann::json::object();
  for (size_t k = 0; k < slots_.size(); ++k) {
    const ParamInfo& info = info_[k];
    const Slot& s = *slots_[k];
    groups[info.group][str(keys::kParams)].push_back(info.fqn);
    if (info.role == ParamRole::kFrozen) frozen.push_back(info.fqn);
    if (!s.has_state()) {
      if (info.role != ParamRole::kFrozen) without_state.push_back(info.fqn);
    } else if (s.step != common_step) {
      steps[info.fqn] = s.step;
    }
    // A piece is a flat slice of the global tensor (aliasing the optimizer's own). A rank with
    // no piece of a parameter declares nothing; a parameter without elements has a piece
    // nowhere, so the declaring rank gives its keys, empty, as a single process would.
    const std::vector<int64_t> shape = s.param.sizes().vec();
    const bool declare =
        s.whole || s.begin != s.end || (s.param.numel() == 0 && sharding_.rank == 0);
    if (!declare) continue;
    auto entry = [&](const at::Tensor& t) {
      if (s.whole) return ShardedTensor::whole(copy_of(t));
      return ShardedTensor::flat(copy_of(t).view({-1}), shape, s.begin);
    };
    if (info.role == ParamRole::kMaster) {
      out.tensors.emplace(keys::optimizer_state_key(keys::kFp32Param, info.fqn),
                          entry(s.master_value()));
    }
    if (!s.has_state()) continue;
    const std::vector<bool> held = traits_->held_state(param_groups()[info.group].options());
    for (size_t i = 0; i < kinds.size(); ++i) {
      if (s.state[i].defined()) {
        out.tensors.emplace(keys::optimizer_state_key(kinds[i], info.fqn), entry(s.state[i]));
      } else if (!s.whole && s.begin == s.end && held[i]) {
        out.tensors.emplace(keys::optimizer_state_key(kinds[i], info.fqn),
                            entry(at::empty({0}, at::kFloat)));
      }
    }
  }
  out.common[str(keys::kCommonOptimizer)] = {{str(keys::kAlgorithm), str(traits_->name())},
                                             {str(keys::kStep), common_step},
                                             {str(keys::kSteps), steps},
                                             {str(keys::kParamGroups), groups},
                                             {str(keys::kFrozen), frozen},
                                             {str(keys::kWithoutState), without_state},
                                             {str(keys::kScaler), scaler_.state()}};
  return out;
}

CheckedOptimizerState Float16Optimizer::check_sharded_state_dict(const ShardedStateDict& state,
                                                                 const LoadOptions& options) const {
  Parsed saved;
  saved.sync = plan_sync(detail::SyncPurpose::kLoad);
  saved.params.resize(slots_.size());
  auto& problems = saved.problems;
  auto& report = saved.report;

  const std::string optimizer_field = str(keys::kCommonOptimizer);
  const nlohmann::json* common = nullptr;
  if (state.common.contains(optimizer_field) && state.common[optimizer_field].is_object()) {
    common = &state.common[optimizer_field];
  } else {
    problems.push_back("common state has no '" + optimizer_field + "' object");
  }
  std::set<std::string> frozen_then, without_state_then;
  std::map<std::string, size_t> index_of;
  for (size_t k = 0; k < info_.size(); ++k) index_of.emplace(info_[k].fqn, k);

  if (common) {
    const auto& c = *common;
    auto field = [&](std::string_view name) {
      return c.contains(str(name)) ? c[str(name)] : nlohmann::json();
    };
    const nlohmann::json algorithm = field(keys::kAlgorithm);
    if (algorithm != nlohmann::json(str(traits_->name()))) {
      problems.push_back("the state is for algorithm " +
                         (algorithm.is_null() ? std::string("(none)") : algorithm.dump()) +
                         ", the optimizer runs " + str(traits_->name()));
    }
    const nlohmann::json groups = field(keys::kParamGroups);
    // Each group must list the same parameters, by name, in the same order.
    detail::check_saved_groups(
        groups, param_groups(),
        [this](size_t k, const nlohmann::json& entry) -> std::string {
          if (entry == info_[k].fqn) return {};
          return "the state has " + entry.dump() + ", the optimizer has '" + info_[k].fqn + "'";
        },
        problems);
    if (groups.is_array() && groups.size() == param_groups().size()) saved.groups = groups;
    auto name_list = [&](std::string_view name, std::set<std::string>& out) {
      const nlohmann::json list = field(name);
      if (list.is_null()) return;
      bool ok = list.is_array();
      for (const auto& item : list) ok = ok && item.is_string();
      if (!ok) {
        problems.push_back("common state: '" + str(name) + "' is not a list of names");
        return;
      }
      out = list.get<std::set<std::string>>();
    };
    name_list(keys::kFrozen, frozen_then);
    name_list(keys::kWithoutState, without_state_then);
    // Steps are counts: anything but a non-negative integer within int64 is corrupt state.
    const nlohmann::json step = field(keys::kStep);
    if (const std::string bad = detail::step_problem(step); !bad.empty()) {
      problems.push_back("common state: 'step' " + bad);
    } else {
      for (auto& p : saved.params) p.step = step.get<int64_t>();
    }
    nlohmann::json steps = field(keys::kSteps);
    if (!steps.is_null() && !steps.is_object()) {
      problems.push_back("common state: 'steps' is not an object");
    }
    if (!steps.is_object()) steps = nlohmann::json::object();
    for (const auto& [fqn, s] : steps.items()) {  // nothing unless an object
      auto it = index_of.find(fqn);
      if (it == index_of.end()) {
        report.unexpected_keys.push_back("steps['" + fqn + "'] (no such parameter)");
      } else if (const std::string bad = detail::step_problem(s); !bad.empty()) {
        problems.push_back("common state: 'steps' of '" + fqn + "': " + bad);
      } else {
        saved.params[it->second].step = s.get<int64_t>();
      }
    }
    saved.scaler = field(keys::kScaler);
  }

  // Tensors: "optimizer.state.<kind>.<fqn>".
  const auto kinds = traits_->state_kinds();
  std::set<std::string> used;
  std::map<std::string, std::string> frozen_state;  // state key of a parameter frozen now → fqn
  std::set<std::string> explained;                  // parameters a note explains already
  for (size_t k = 0; k < info_.size(); ++k) {
    const ParamInfo& info = info_[k];
    const ParamRole role = saved.sync.slots[k].role;
    auto& p = saved.params[k];
    const bool frozen_now = role == ParamRole::kFrozen;
    p.fresh_ok = frozen_then.count(info.fqn) || without_state_then.count(info.fqn);
    if (frozen_now) {  // any state it has is left for the unexpected pass, which says why
      for (const auto& kind : kinds)
        frozen_state[keys::optimizer_state_key(kind, info.fqn)] = info.fqn;
      frozen_state[keys::optimizer_state_key(keys::kFp32Param, info.fqn)] = info.fqn;
      continue;
    }
    for (const auto& kind : kinds) {
      const std::string key = keys::optimizer_state_key(kind, info.fqn);
      if (!state.contains(key)) continue;
      p.moments[str(kind)] = state.at(key);
      used.insert(key);
    }
    const std::string master_key = keys::optimizer_state_key(keys::kFp32Param, info.fqn);
    if (state.contains(master_key)) {
      p.fp32 = state.at(master_key);
      p.fp32_source = master_key;
      used.insert(master_key);
    } else if (role == ParamRole::kMaster) {
      // Saved as native FP32 (no main copy): the model tensor under its FQN is the FP32 value.
      if (state.contains(info.fqn) && state.at(info.fqn).local.scalar_type() == at::kFloat) {
        p.fp32 = state.at(info.fqn);
        p.fp32_source = info.fqn;
        report.notes.push_back("'" + info.fqn +
                               "' had no main copy in the state (saved as "
                               "native FP32): main copy seeded from its FP32 model value");
      } else if (!frozen_then.count(info.fqn) && !slots_[k]->holds_no_piece()) {
        // (Frozen when saved, its model value is all there was: re-deriving loses nothing. A
        // rank that holds none of the parameter — data parallel — needs no main copy of it;
        // its own state dict declares none.)
        report.missing_keys.push_back(master_key);
      }
    }
  }
  // Every optimizer key not used is unexpected; the rest are the model's.
  for (const auto& [key, value] : state.tensors) {
    if (!keys::is_optimizer_key(key) || used.count(key)) continue;
    report.unexpected_keys.push_back(key);  // a key: callers look it up
    const auto frozen = frozen_state.find(key);
    if (frozen != frozen_state.end() && explained.insert(frozen->second).second) {
      report.notes.push_back("'" + frozen->second +
                             "' is frozen in this model but was trained when saved: its state is "
                             "unexpected here; unfreeze it before loading, or load non-strictly "
                             "to drop its state");
    }
  }
  return check_parsed(std::move(saved), options);
}

}  // namespace mixprec::optim
