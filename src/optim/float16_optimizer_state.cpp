// State dicts of Float16Optimizer: positional (torch's form) and FQN-keyed (sharded).
//
// Both loads parse into one per-parameter picture (SavedParam, indexed like the optimizer's
// own slots), check all of it, and only then write — so a failed load leaves the optimizer
// and the model exactly as they were.
#include "mixprec/optim/float16_optimizer.h"

#include "detail/name_match.h"
#include "optim/optimizer_slot.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <set>

namespace mixprec::optim {
namespace {

constexpr const char* kStatePrefix = "optimizer.state.";
const std::vector<std::string> kAdamKeys = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
const std::vector<std::string> kSgdKeys = {"momentum_buffer"};

// State dicts alias the optimizer's tensors, as torch's do: no copy of the whole state.
at::Tensor copy_of(const at::Tensor& t) { return t.detach(); }

}  // namespace

PositionalStateDict Float16Optimizer::state_dict() const {
  PositionalStateDict out;
  int64_t id = 0;
  for (size_t g = 0; g < param_groups().size(); ++g) {
    nlohmann::json group = detail::group_hyper_params_json(param_groups()[g].options(), algorithm_);
    group["params"] = nlohmann::json::array();
    for (size_t i = 0; i < param_groups()[g].params().size(); ++i, ++id) {
      group["params"].push_back(id);
      const Slot& s = *slots_[id];
      if (s.master.defined()) out.fp32_params[id] = copy_of(s.master);
      if (!s.has_state()) continue;
      auto& entry = out.state[id];
      entry["step"] = at::scalar_tensor(static_cast<double>(s.step), at::kFloat);
      for (const auto& [key, t] : std::map<std::string, const at::Tensor*>{
               {"exp_avg", &s.exp_avg}, {"exp_avg_sq", &s.exp_avg_sq},
               {"max_exp_avg_sq", &s.max_exp_avg_sq}, {"momentum_buffer", &s.momentum_buffer}}) {
        if (t->defined()) entry[key] = copy_of(*t);
      }
    }
    out.param_groups.push_back(std::move(group));
  }
  out.scaler = scaler_.state();
  return out;
}

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

// ---------------------------------------------------------------------------------------------
// Loading: parse (two forms) → check → apply.

namespace {

// Checks one saved tensor against the parameter it belongs to.
void check_tensor(const at::Tensor& t, const at::Tensor& param, const std::string& what,
                  bool must_be_fp32, std::vector<std::string>& problems) {
  if (!t.defined()) {
    problems.push_back(what + " is undefined");
    return;
  }
  if (t.sizes() != param.sizes()) {
    problems.push_back(what + ": shape " + c10::str(t.sizes()) + ", the parameter has " +
                       c10::str(param.sizes()));
  }
  if (!at::isFloatingType(t.scalar_type()) || (must_be_fp32 && t.scalar_type() != at::kFloat)) {
    problems.push_back(what + ": dtype " + c10::toString(t.scalar_type()) +
                       (must_be_fp32 ? ", expected Float (an FP32 value is never taken from a "
                                       "lower precision)"
                                     : ", expected a floating dtype"));
  }
}

}  // namespace

LoadReport Float16Optimizer::load_state_dict(const PositionalStateDict& state,
                                             const LoadOptions& options) {
  Loaded saved;
  saved.params.resize(slots_.size());
  auto& problems = saved.problems;
  auto name = [&](int64_t id) { return "id " + std::to_string(id) + " ('" + info_[id].fqn + "')"; };

  // Groups must match one to one, in order and size: ids are positions.
  const auto& groups = state.param_groups;
  if (!groups.is_array() || groups.size() != param_groups().size()) {
    problems.push_back("the state has " + std::to_string(groups.is_array() ? groups.size() : 0) +
                       " param groups, the optimizer has " + std::to_string(param_groups().size()));
  } else {
    int64_t id = 0;
    for (size_t g = 0; g < groups.size(); ++g) {
      const auto& ids = groups[g].contains("params") ? groups[g]["params"] : nlohmann::json();
      const size_t want = param_groups()[g].params().size();
      if (!ids.is_array() || ids.size() != want) {
        problems.push_back("param group " + std::to_string(g) + " has " +
                           std::to_string(ids.is_array() ? ids.size() : 0) +
                           " params in the state, " + std::to_string(want) + " in the optimizer");
      } else {
        for (size_t i = 0; i < want; ++i, ++id) {
          if (!ids[i].is_number_integer() || ids[i].get<int64_t>() != id) {
            problems.push_back("param group " + std::to_string(g) + " position " +
                               std::to_string(i) + ": id " + ids[i].dump() + ", expected " +
                               std::to_string(id));
          }
        }
      }
      auto hp = detail::check_group_hyper_params(groups[g], algorithm_, g);
      problems.insert(problems.end(), hp.begin(), hp.end());
    }
    saved.groups = groups;
  }
  saved.scaler = state.scaler;

  const auto& keys = algorithm_ == Algorithm::kSgd ? kSgdKeys : kAdamKeys;
  for (const auto& [id, entry] : state.state) {
    if (id < 0 || id >= static_cast<int64_t>(slots_.size())) {
      saved.report.unexpected_keys.push_back("state[" + std::to_string(id) + "]");
      continue;
    }
    if (info_[id].role == ParamRole::kFrozen) {
      saved.report.unexpected_keys.push_back("state[" + std::to_string(id) + "] (" +
                                             info_[id].fqn + " is frozen)");
      continue;
    }
    auto& p = saved.params[id];
    for (const auto& [key, t] : entry) {
      if (key == "step") {
        if (!t.defined() || t.numel() != 1) {
          problems.push_back("state[" + std::to_string(id) + "].step is not a scalar");
        } else {
          p.step = static_cast<int64_t>(t.item<double>());
        }
      } else if (std::find(keys.begin(), keys.end(), key) != keys.end()) {
        p.moments[key] = t;
      } else {
        saved.report.unexpected_keys.push_back("state[" + std::to_string(id) + "]." + key);
      }
    }
  }
  for (const auto& [id, t] : state.fp32_params) {
    if (id < 0 || id >= static_cast<int64_t>(slots_.size()) ||
        info_[id].role == ParamRole::kFrozen) {
      saved.report.unexpected_keys.push_back("fp32_params[" + std::to_string(id) + "]");
      continue;
    }
    saved.params[id].fp32 = t;
    saved.params[id].fp32_source = "fp32_params[" + std::to_string(id) + "]";
  }
  // Trainable params that the state never stepped may start fresh.
  for (size_t id = 0; id < slots_.size(); ++id) {
    auto& p = saved.params[id];
    p.fresh_ok = !state.state.count(static_cast<int64_t>(id));
    if (info_[id].role == ParamRole::kMaster && !p.fp32.defined()) {
      saved.report.missing_keys.push_back("fp32_params[" + std::to_string(id) + "] for " +
                                          name(static_cast<int64_t>(id)));
    }
  }
  return apply_loaded(std::move(saved), options);
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
    if (!groups.is_array() || groups.size() != param_groups().size()) {
      problems.push_back("the state has " + std::to_string(groups.is_array() ? groups.size() : 0) +
                         " param groups, the optimizer has " +
                         std::to_string(param_groups().size()));
    } else {
      // Each group must list the same parameters, by name, in the same order.
      size_t k = 0;
      for (size_t g = 0; g < groups.size(); ++g) {
        const auto& names = groups[g].contains("params") ? groups[g]["params"] : nlohmann::json();
        const size_t want = param_groups()[g].params().size();
        if (!names.is_array() || names.size() != want) {
          problems.push_back("param group " + std::to_string(g) + " lists " +
                             std::to_string(names.is_array() ? names.size() : 0) +
                             " params in the state, " + std::to_string(want) +
                             " in the optimizer");
          k += want;
          continue;
        }
        for (size_t i = 0; i < want; ++i, ++k) {
          if (names[i] != info_[k].fqn) {
            problems.push_back("param group " + std::to_string(g) + " position " +
                               std::to_string(i) + ": the state has " + names[i].dump() +
                               ", the optimizer has '" + info_[k].fqn + "'");
          }
        }
        auto hp = detail::check_group_hyper_params(groups[g], algorithm_, g);
        problems.insert(problems.end(), hp.begin(), hp.end());
      }
      saved.groups = groups;
    }
    if (c.contains("frozen")) frozen_then = c["frozen"].get<std::set<std::string>>();
    if (c.contains("without_state")) {
      without_state_then = c["without_state"].get<std::set<std::string>>();
    }
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
    if (!p.moments.empty() || p.step == 0 || p.fresh_ok) continue;
    for (const auto& kind : {moment_keys[0]}) saved.report.missing_keys.push_back(prefix + kind + "." + info.fqn);
  }
  for (const auto& [key, value] : state.tensors) {
    if (key.rfind(prefix, 0) == 0 && !used.count(key)) saved.report.unexpected_keys.push_back(key);
  }
  return apply_loaded(std::move(saved), options);
}

LoadReport Float16Optimizer::apply_loaded(Loaded&& saved, const LoadOptions& options) {
  auto& problems = saved.problems;
  const bool adam = algorithm_ != Algorithm::kSgd;
  for (size_t k = 0; k < slots_.size(); ++k) {
    const ParamInfo& info = info_[k];
    auto& p = saved.params[k];
    const at::Tensor& param = slots_[k]->param;
    for (const auto& [kind, t] : p.moments) {
      check_tensor(t, param, "'" + info.fqn + "' " + kind, /*must_be_fp32=*/false, problems);
    }
    if (p.fp32.defined()) {
      check_tensor(p.fp32, param, p.fp32_source, /*must_be_fp32=*/true, problems);
    }
    if (p.moments.empty()) continue;
    // A parameter with state needs all of its algorithm's moments.
    const bool amsgrad = adam && detail::adam_hyper_params(param_groups()[info.group].options(),
                                                           algorithm_).amsgrad;
    std::vector<std::string> need = adam ? std::vector<std::string>{"exp_avg", "exp_avg_sq"}
                                         : std::vector<std::string>{"momentum_buffer"};
    if (amsgrad) need.push_back("max_exp_avg_sq");
    for (const auto& kind : need) {
      if (!p.moments.count(kind)) {
        saved.report.missing_keys.push_back("'" + info.fqn + "' " + kind);
      }
    }
    if (p.step <= 0) problems.push_back("'" + info.fqn + "' has moments but step " + std::to_string(p.step));
  }
  if (!saved.scaler.is_object()) problems.push_back("no loss scaler state");
  LossScaler scaler_copy = scaler_;
  if (saved.scaler.is_object()) {
    try {
      scaler_copy.load_state(saved.scaler);
    } catch (const c10::Error& e) {
      problems.push_back(e.what_without_backtrace());
    }
  }
  if (options.strict) {
    for (const auto& key : saved.report.missing_keys) problems.push_back("missing " + key);
    for (const auto& key : saved.report.unexpected_keys) problems.push_back("unexpected " + key);
  }
  TORCH_CHECK(problems.empty(), "[mixprec::Float16Optimizer] cannot load the state:\n  - ",
              mixprec::detail::join(problems, "\n  - "));

  if (options.dry_run) return std::move(saved.report);
  // Everything checked: apply.
  at::NoGradGuard no_grad;
  for (size_t g = 0; g < param_groups().size() && saved.groups.is_array(); ++g) {
    detail::set_group_hyper_params(param_groups()[g].options(), saved.groups[g], algorithm_);
  }
  scaler_ = scaler_copy;
  for (size_t k = 0; k < slots_.size(); ++k) {
    Slot& slot = *slots_[k];
    auto& p = saved.params[k];
    const ParamInfo& info = info_[k];
    if (info.role == ParamRole::kFrozen) continue;
    auto fp32_copy = [](const at::Tensor& t) { return t.detach().to(at::kFloat).contiguous().clone(); };
    slot.exp_avg = slot.exp_avg_sq = slot.max_exp_avg_sq = slot.momentum_buffer = at::Tensor();
    slot.step = 0;
    if (!p.moments.empty()) {
      slot.step = p.step;
      for (auto& [kind, t] : p.moments) {
        at::Tensor value = fp32_copy(t);
        if (kind == "exp_avg") slot.exp_avg = value;
        if (kind == "exp_avg_sq") slot.exp_avg_sq = value;
        if (kind == "max_exp_avg_sq") slot.max_exp_avg_sq = value;
        if (kind == "momentum_buffer") slot.momentum_buffer = value;
      }
    }
    if (info.role == ParamRole::kMaster) {
      if (p.fp32.defined()) {
        slot.master.copy_(p.fp32);
      } else {
        slot.master.copy_(slot.param.detach());
        saved.report.notes.push_back("'" + info.fqn + "': main copy re-derived from the " +
                                     c10::toString(slot.param.scalar_type()) + " model parameter");
      }
    } else if (p.fp32.defined()) {
      // Saved with a main copy, now native FP32: the parameter takes the main copy's value.
      slot.param.detach().copy_(p.fp32);
      saved.report.notes.push_back("'" + info.fqn + "' is now native FP32: took its value from " +
                                   p.fp32_source);
    }
  }
  copy_masters_to_model();
  return std::move(saved.report);
}

void Float16Optimizer::save(torch::serialize::OutputArchive& archive) const {
  const PositionalStateDict sd = state_dict();
  for (const auto& [id, entry] : sd.state) {
    for (const auto& [key, t] : entry) {
      archive.write("state/" + std::to_string(id) + "/" + key, t);
    }
  }
  for (const auto& [id, t] : sd.fp32_params) archive.write("fp32_params/" + std::to_string(id), t);
  archive.write("param_groups", c10::IValue(sd.param_groups.dump()));
  archive.write("scaler", c10::IValue(sd.scaler.dump()));
}

void Float16Optimizer::load(torch::serialize::InputArchive& archive) {
  PositionalStateDict sd;
  c10::IValue groups, scaler;
  TORCH_CHECK(archive.try_read("param_groups", groups) && groups.isString(),
              "[mixprec::Float16Optimizer::load] the archive has no mixprec param_groups "
              "(was it written by another optimizer?)");
  TORCH_CHECK(archive.try_read("scaler", scaler) && scaler.isString(),
              "[mixprec::Float16Optimizer::load] the archive has no loss scaler state");
  sd.param_groups = nlohmann::json::parse(groups.toStringRef());
  sd.scaler = nlohmann::json::parse(scaler.toStringRef());
  for (const std::string& key : archive.keys()) {
    if (key.rfind("state/", 0) == 0) {
      const auto slash = key.find('/', 6);
      TORCH_CHECK(slash != std::string::npos, "[mixprec::Float16Optimizer::load] bad key ", key);
      at::Tensor t;
      archive.read(key, t);
      sd.state[std::stoll(key.substr(6, slash - 6))][key.substr(slash + 1)] = t;
    } else if (key.rfind("fp32_params/", 0) == 0) {
      at::Tensor t;
      archive.read(key, t);
      sd.fp32_params[std::stoll(key.substr(12))] = t;
    }
  }
  load_state_dict(sd);
}

}  // namespace mixprec::optim
