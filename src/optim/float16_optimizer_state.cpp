// Float16Optimizer in torch's positional form: state_dict(), load_state_dict(), and the
// torch::serialize archive built on them.
#include "mixprec/optim/float16_optimizer.h"

#include "optim/optimizer_slot.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <algorithm>

namespace mixprec::optim {

using detail::copy_of;

namespace {

// A positional state holds whole tensors; an undefined one stays undefined (and is refused
// by the check, naming it).
ShardedTensor whole_or_none(const at::Tensor& t) {
  if (t.defined()) return ShardedTensor::whole(t);
  return ShardedTensor();
}

}  // namespace

PositionalStateDict Float16Optimizer::state_dict() const {
  TORCH_CHECK(!sharded(), "[", who_,
              "::state_dict] torch's positional form holds one rank's pieces without their "
              "layout; use sharded_state_dict()");
  sync_with_model();
  PositionalStateDict out;
  const auto kinds = traits_->state_kinds();
  int64_t id = 0;
  for (size_t g = 0; g < param_groups().size(); ++g) {
    nlohmann::json group = traits_->to_json(param_groups()[g].options());
    group["params"] = nlohmann::json::array();
    for (size_t i = 0; i < param_groups()[g].params().size(); ++i, ++id) {
      group["params"].push_back(id);
      const Slot& s = *slots_[id];
      if (s.has_master()) out.fp32_params[id] = copy_of(s.master_value());
      if (!s.has_state()) continue;
      auto& entry = out.state[id];
      // torch stores the step as a float32 scalar; a double is exact up to 2^53 steps.
      entry["step"] = at::scalar_tensor(static_cast<double>(s.step), at::kDouble);
      std::vector<at::Tensor> moments = s.state;
      // A zero-size parameter's step allocates nothing, but torch's optimizers hold (empty)
      // moments for it and step from them: give them, so that this dict steps in torch too.
      if (s.param.numel() == 0) {
        traits_->allocate_state(param_groups()[g].options(), s.param.sizes(), c10::kCPU, moments);
      }
      for (size_t j = 0; j < kinds.size(); ++j) {
        if (moments[j].defined()) entry[std::string(kinds[j])] = copy_of(moments[j]);
      }
    }
    out.param_groups.push_back(std::move(group));
  }
  out.scaler = scaler_.state();
  return out;
}

CheckedOptimizerState Float16Optimizer::check_state_dict(const PositionalStateDict& state,
                                                         const LoadOptions& options) const {
  TORCH_CHECK(!sharded(), "[", who_,
              "::check_state_dict] torch's positional form holds no layout of the pieces; use "
              "check_sharded_state_dict()");
  Parsed saved;
  saved.sync = plan_sync(detail::SyncPurpose::kLoad);
  saved.params.resize(slots_.size());
  auto& problems = saved.problems;
  auto& report = saved.report;
  const int64_t count = static_cast<int64_t>(slots_.size());
  auto role = [&](int64_t id) { return saved.sync.slots[id].role; };
  auto entry_name = [](int64_t id) { return "state[" + std::to_string(id) + "]"; };

  // Groups must match one to one, in order and size: ids are positions.
  detail::check_saved_groups(
      state.param_groups, param_groups(),
      [](size_t id, const nlohmann::json& entry) -> std::string {
        if (entry.is_number_integer() && entry.get<int64_t>() == static_cast<int64_t>(id))
          return {};
        return "id " + entry.dump() + ", expected " + std::to_string(id);
      },
      problems);
  if (state.param_groups.is_array() && state.param_groups.size() == param_groups().size()) {
    saved.groups = state.param_groups;
  }
  saved.scaler = state.scaler;

  const auto kinds = traits_->state_kinds();
  for (const auto& [id, entry] : state.state) {
    if (id < 0 || id >= count) {
      report.unexpected_keys.push_back(entry_name(id));
      continue;
    }
    if (role(id) == ParamRole::kFrozen) {
      report.unexpected_keys.push_back(entry_name(id) + " (" + info_[id].fqn + " is frozen)");
      continue;
    }
    auto& p = saved.params[id];
    for (const auto& [key, t] : entry) {
      if (key == "step") {
        std::string bad;
        if (!t.defined() || t.numel() != 1 || t.scalar_type() == at::kBool) {
          bad = "is not a numeric scalar";
        } else if (at::isIntegralType(t.scalar_type(), /*includeBool=*/false)) {
          const int64_t v = t.item<int64_t>();
          bad = v < 0 ? std::to_string(v) + " is negative" : "";
          if (bad.empty()) p.step = v;
        } else {
          const double v = t.item<double>();
          bad = detail::step_problem(v);
          if (bad.empty()) p.step = static_cast<int64_t>(v);
        }
        if (!bad.empty()) problems.push_back(entry_name(id) + ".step " + bad);
      } else if (std::find(kinds.begin(), kinds.end(), key) != kinds.end()) {
        p.moments[key] = whole_or_none(t);
      } else {
        report.unexpected_keys.push_back(entry_name(id) + "." + key);
      }
    }
  }
  for (const auto& [id, t] : state.fp32_params) {
    if (id < 0 || id >= count || role(id) == ParamRole::kFrozen) {
      report.unexpected_keys.push_back("fp32_params[" + std::to_string(id) + "]");
      continue;
    }
    saved.params[id].fp32 = whole_or_none(t);
    saved.params[id].fp32_source = "fp32_params[" + std::to_string(id) + "]";
  }
  // Trainable params that the state never stepped may start fresh.
  for (int64_t id = 0; id < count; ++id) {
    auto& p = saved.params[id];
    p.fresh_ok = !state.state.count(id);
    // torch.optim.SGD keeps no "step": its momentum buffer alone says the parameter was
    // stepped (how often, SGD never uses).
    if (!p.fresh_ok && traits_->algorithm() == Algorithm::kSgd && !p.moments.empty() &&
        !state.state.at(id).count("step")) {
      p.step = 1;
    }
    // A parameter without state and without a main copy was frozen or not yet stepped when the
    // state was saved (torch saves neither for it): its main copy is re-derived from the model
    // (the load notes it), as a trainable parameter's is at construction.
    if (role(id) == ParamRole::kMaster && !p.fp32.local.defined() && !p.fresh_ok) {
      report.missing_keys.push_back("fp32_params[" + std::to_string(id) + "] for id " +
                                    std::to_string(id) + " ('" + info_[id].fqn + "')");
    }
  }
  return check_parsed(std::move(saved), options);
}

void Float16Optimizer::save(torch::serialize::OutputArchive& archive) const {
  const PositionalStateDict sd = state_dict();  // follows the model first
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
  sd.param_groups =
      nlohmann::json::parse(groups.toStringRef(), nullptr, /*allow_exceptions=*/false);
  sd.scaler = nlohmann::json::parse(scaler.toStringRef(), nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(!sd.param_groups.is_discarded() && !sd.scaler.is_discarded(),
              "[mixprec::Float16Optimizer::load] the archive's param_groups or scaler is not JSON");
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
