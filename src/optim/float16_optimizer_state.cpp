// Float16Optimizer in torch's positional form: state_dict(), load_state_dict(), and the
// torch::serialize archive built on them.
#include "mixprec/optim/float16_optimizer.h"

#include "detail/name_match.h"
#include "optim/optimizer_slot.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

namespace mixprec::optim {

using detail::copy_of;
using detail::kAdamKeys;
using detail::kSgdKeys;

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
      // torch stores the step as a float32 scalar; a double is exact up to 2^53 steps.
      entry["step"] = at::scalar_tensor(static_cast<double>(s.step), at::kDouble);
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

LoadReport Float16Optimizer::load_state_dict(const PositionalStateDict& state,
                                             const LoadOptions& options) {
  Loaded saved;
  saved.params.resize(slots_.size());
  auto& problems = saved.problems;
  auto name = [&](int64_t id) { return "id " + std::to_string(id) + " ('" + info_[id].fqn + "')"; };

  // Groups must match one to one, in order and size: ids are positions.
  const auto& groups = state.param_groups;
  detail::check_saved_groups(
      groups, param_groups(), algorithm_,
      [](size_t, size_t, size_t id, const nlohmann::json& entry) -> std::string {
        if (entry.is_number_integer() && entry.get<int64_t>() == static_cast<int64_t>(id)) return {};
        return "id " + entry.dump() + ", expected " + std::to_string(id);
      },
      problems);
  if (groups.is_array() && groups.size() == param_groups().size()) saved.groups = groups;
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

namespace {
int64_t parse_id(const std::string& key, const std::string& digits) {
  TORCH_CHECK(!digits.empty() && digits.size() < 18 &&
                  digits.find_first_not_of("0123456789") == std::string::npos,
              "[mixprec::Float16Optimizer::load] archive key '", key, "' has no parameter id");
  return std::stoll(digits);
}
}  // namespace

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
      sd.state[parse_id(key, key.substr(6, slash - 6))][key.substr(slash + 1)] = t;
    } else if (key.rfind("fp32_params/", 0) == 0) {
      at::Tensor t;
      archive.read(key, t);
      sd.fp32_params[parse_id(key, key.substr(12))] = t;
    }
  }
  load_state_dict(sd);
}

}  // namespace mixprec::optim
