// Float16Optimizer keyed by fully qualified names: sharded_state_dict() and its load.
#include "mixprec/optim/float16_optimizer.h"

#include "detail/name_match.h"
#include "optim/optimizer_slot.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <set>

namespace mixprec::optim {

using detail::copy_of;
using detail::kAdamKeys;
using detail::kSgdKeys;
using detail::kStatePrefix;

ShardedStateDict Float16Optimizer::sharded_state_dict() const {
  ShardedStateDict out;
  int64_t common_step = 0;
  for (const auto& s : slots_) common_step = std::max(common_step, s->step);
  nlohmann::json groups = nlohmann::json::array();
  for (const auto& group : param_groups()) {  // every group, empty ones included
    groups.push_back(detail::group_hyper_params_json(group.options(), algorithm_));
    groups.back()["params"] = nlohmann::json::array();
  }
  nlohmann::json frozen = nlohmann::json::array();
  nlohmann::json without_state = nlohmann::json::array();
  nlohmann::json steps = nlohmann::json::object();
  for (size_t k = 0; k < slots_.size(); ++k) {
    const ParamInfo& info = info_[k];
    const Slot& s = *slots_[k];
    groups[info.group]["params"].push_back(info.fqn);
    if (info.role == ParamRole::kFrozen) frozen.push_back(info.fqn);
    if (s.master.defined()) {
      out.tensors.emplace(std::string(kStatePrefix) + "fp32_param." + info.fqn,
                          ShardedTensor::whole(copy_of(s.master)));
    }
    if (!s.has_state()) {
      if (info.role != ParamRole::kFrozen) without_state.push_back(info.fqn);
      continue;
    }
    if (s.step != common_step) steps[info.fqn] = s.step;
    for (const auto& [key, t] : std::map<std::string, const at::Tensor*>{
             {"exp_avg", &s.exp_avg}, {"exp_avg_sq", &s.exp_avg_sq},
             {"max_exp_avg_sq", &s.max_exp_avg_sq}, {"momentum_buffer", &s.momentum_buffer}}) {
      if (t->defined()) {
        out.tensors.emplace(std::string(kStatePrefix) + key + "." + info.fqn,
                            ShardedTensor::whole(copy_of(*t)));
      }
    }
  }
  out.common["optimizer"] = {{"algorithm", detail::algorithm_name(algorithm_)},
                             {"step", common_step},
                             {"steps", steps},
                             {"param_groups", groups},
                             {"frozen", frozen},
                             {"without_state", without_state},
                             {"scaler", scaler_.state()}};
  return out;
}

LoadReport Float16Optimizer::load_sharded_state_dict(const ShardedStateDict& state,
                                                     const LoadOptions& options) {
  Loaded saved;
  saved.params.resize(slots_.size());
  auto& problems = saved.problems;
  const std::string prefix = kStatePrefix;

  const nlohmann::json* common = nullptr;
  if (state.common.contains("optimizer") && state.common["optimizer"].is_object()) {
    common = &state.common["optimizer"];
  } else {
    problems.push_back("common state has no 'optimizer' object");
  }
  std::set<std::string> frozen_then, without_state_then;
  std::map<std::string, size_t> index_of;
  for (size_t k = 0; k < info_.size(); ++k) index_of.emplace(info_[k].fqn, k);

  if (common) {
    const auto& c = *common;
    if (!c.contains("algorithm") || c["algorithm"] != detail::algorithm_name(algorithm_)) {
      problems.push_back(std::string("the state is for algorithm ") +
                         (c.contains("algorithm") ? c["algorithm"].dump() : "(none)") +
                         ", the optimizer runs " + detail::algorithm_name(algorithm_));
    }
    const auto& groups = c.contains("param_groups") ? c["param_groups"] : nlohmann::json();
    // Each group must list the same parameters, by name, in the same order.
    detail::check_saved_groups(
        groups, param_groups(), algorithm_,
        [this](size_t, size_t, size_t k, const nlohmann::json& entry) -> std::string {
          if (entry == info_[k].fqn) return {};
          return "the state has " + entry.dump() + ", the optimizer has '" + info_[k].fqn + "'";
        },
        problems);
    if (groups.is_array() && groups.size() == param_groups().size()) saved.groups = groups;
    auto name_list = [&](const char* field, std::set<std::string>& out) {
      if (!c.contains(field)) return;
      const auto& list = c[field];
      bool ok = list.is_array();
      for (const auto& item : list) ok = ok && item.is_string();
      if (!ok) {
        problems.push_back(std::string("common state: '") + field + "' is not a list of names");
        return;
      }
      out = list.get<std::set<std::string>>();
    };
    name_list("frozen", frozen_then);
    name_list("without_state", without_state_then);
    const int64_t step = c.contains("step") && c["step"].is_number_integer() ? c["step"].get<int64_t>() : -1;
    if (step < 0) problems.push_back("common state: 'step' missing or not a non-negative integer");
    for (auto& p : saved.params) p.step = step;
    if (c.contains("steps") && c["steps"].is_object()) {
      for (const auto& [fqn, s] : c["steps"].items()) {
        auto it = index_of.find(fqn);
        if (it != index_of.end() && s.is_number_integer()) saved.params[it->second].step = s.get<int64_t>();
      }
    }
    saved.scaler = c.contains("scaler") ? c["scaler"] : nlohmann::json();
  }

  // Tensors: "optimizer.state.<kind>.<fqn>".
  const auto& moment_keys = algorithm_ == Algorithm::kSgd ? kSgdKeys : kAdamKeys;
  std::set<std::string> used;
  for (size_t k = 0; k < info_.size(); ++k) {
    const ParamInfo& info = info_[k];
    auto& p = saved.params[k];
    const bool frozen_now = info.role == ParamRole::kFrozen;
    p.fresh_ok = frozen_then.count(info.fqn) || without_state_then.count(info.fqn);
    for (const auto& kind : moment_keys) {
      const std::string key = prefix + kind + "." + info.fqn;
      if (!state.contains(key) || frozen_now) continue;  // frozen: left for the unexpected pass
      p.moments[kind] = state.at(key).local;
      used.insert(key);
    }
    if (frozen_now) continue;
    const std::string master_key = prefix + "fp32_param." + info.fqn;
    if (state.contains(master_key)) {
      p.fp32 = state.at(master_key).local;
      p.fp32_source = master_key;
      used.insert(master_key);
    } else if (info.role == ParamRole::kMaster) {
      // Saved as native FP32 (no main copy): the model tensor under its FQN is the FP32 value.
      if (state.contains(info.fqn) && state.at(info.fqn).local.scalar_type() == at::kFloat) {
        p.fp32 = state.at(info.fqn).local;
        p.fp32_source = info.fqn;
        saved.report.notes.push_back("'" + info.fqn + "' had no main copy in the state (saved as "
                                     "native FP32): main copy seeded from its FP32 model value");
      } else {
        saved.report.missing_keys.push_back(master_key);
      }
    }
  }
  for (const auto& [key, value] : state.tensors) {
    if (key.rfind(prefix, 0) == 0 && !used.count(key)) saved.report.unexpected_keys.push_back(key);
  }
  return apply_loaded(std::move(saved), options);
}

}  // namespace mixprec::optim
