// DistributedOptimizer loading: check_sharded_state_dict() and apply().
//
// Decisions about keys (which exist, with which global shape and dtype, which are missing or
// unexpected) are made from every optimizer key of the state, which every rank sees whole or
// as an empty piece: so every rank reaches the same verdict on them. Only the values of this
// rank's own pieces are taken. The rules follow Float16Optimizer's loader (optim/
// float16_optimizer_load.cpp) so that a state loads the same into either.
#include "mixprec/distributed/distributed_optimizer.h"

#include "detail/name_match.h"
#include "mixprec/checkpoint/format/box.h"
#include "mixprec/checkpoint/format/state_keys.h"
#include "optim/algorithm_traits.h"
#include "optim/optimizer_slot.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <map>
#include <optional>
#include <set>

namespace mixprec::distributed {

namespace keys = mixprec::checkpoint::keys;
using optim::ParamRole;

namespace {
std::string str(std::string_view s) { return std::string(s); }
}  // namespace

struct CheckedShardedState::Plan {
  const DistributedOptimizer* owner = nullptr;
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> groups;  // empty: keep current
  std::optional<optim::LossScaler> scaler;
  std::vector<int64_t> steps;  // parallel to params_info()
  struct Piece {
    std::vector<at::Tensor> state;  // parallel to state_kinds(); none: starts fresh
    at::Tensor fp32;                // the piece's FP32 value (main copy or native parameter)
  };
  std::vector<Piece> pieces;  // parallel to local_shards()
  LoadReport report;
};

CheckedShardedState::CheckedShardedState(std::unique_ptr<Plan> plan) : plan_(std::move(plan)) {}
CheckedShardedState::CheckedShardedState(CheckedShardedState&&) noexcept = default;
CheckedShardedState& CheckedShardedState::operator=(CheckedShardedState&&) noexcept = default;
CheckedShardedState::~CheckedShardedState() = default;

const LoadReport& CheckedShardedState::report() const {
  TORCH_CHECK(plan_, "[mixprec::distributed::CheckedShardedState] the state was already applied");
  return plan_->report;
}

CheckedShardedState DistributedOptimizer::check_sharded_state_dict(
    const ShardedStateDict& state, const LoadOptions& options) const {
  auto plan = std::make_unique<CheckedShardedState::Plan>();
  plan->owner = this;
  std::vector<std::string> problems;
  LoadReport& report = plan->report;
  const auto kinds = traits_->state_kinds();

  // The common state.
  const std::string optimizer_field = str(keys::kCommonOptimizer);
  nlohmann::json common = nlohmann::json::object();
  if (state.common.contains(optimizer_field) && state.common[optimizer_field].is_object()) {
    common = state.common[optimizer_field];
  } else {
    problems.push_back("common state has no '" + optimizer_field + "' object");
  }
  auto field = [&](std::string_view name) {
    return common.contains(str(name)) ? common[str(name)] : nlohmann::json();
  };
  const bool have_common = problems.empty();
  if (have_common && field(keys::kAlgorithm) != nlohmann::json(str(traits_->name()))) {
    problems.push_back("the state is for algorithm " + field(keys::kAlgorithm).dump() +
                       ", the optimizer runs " + str(traits_->name()));
  }
  const nlohmann::json groups = field(keys::kParamGroups);
  if (have_common) {
    optim::detail::check_saved_groups(
        groups, param_groups(),
        [this](size_t k, const nlohmann::json& entry) -> std::string {
          if (entry == info_[k].fqn) return {};
          return "the state has " + entry.dump() + ", the optimizer has '" + info_[k].fqn + "'";
        },
        problems);
  }
  if (groups.is_array() && groups.size() == param_groups().size()) {
    for (size_t g = 0; g < groups.size(); ++g) {
      const std::string where = "param group " + std::to_string(g) + ": ";
      auto loaded = traits_->from_json(param_groups()[g].options(), groups[g], where, problems);
      if (loaded) {
        if (const std::string bad = traits_->range_problem(*loaded); !bad.empty()) {
          problems.push_back(where + bad);
        }
      }
      plan->groups.push_back(std::move(loaded));
    }
  }
  std::set<std::string> fresh_ok;  // frozen or never stepped when saved
  std::set<std::string> frozen_then;
  for (std::string_view list_name : {keys::kFrozen, keys::kWithoutState}) {
    const nlohmann::json list = field(list_name);
    if (list.is_null()) continue;
    bool ok = list.is_array();
    for (const auto& item : list) ok = ok && item.is_string();
    if (!ok) {
      problems.push_back("common state: '" + str(list_name) + "' is not a list of names");
      continue;
    }
    for (const auto& item : list) {
      fresh_ok.insert(item.get<std::string>());
      if (list_name == keys::kFrozen) frozen_then.insert(item.get<std::string>());
    }
  }
  std::vector<int64_t> saved_step(info_.size(), 0);
  if (have_common) {
    const nlohmann::json step = field(keys::kStep);
    if (const std::string bad = optim::detail::step_problem(step); !bad.empty()) {
      problems.push_back("common state: 'step' " + bad);
    } else {
      saved_step.assign(info_.size(), step.get<int64_t>());
    }
    std::map<std::string, size_t> index_of;
    for (size_t k = 0; k < info_.size(); ++k) index_of.emplace(info_[k].fqn, k);
    const nlohmann::json steps = field(keys::kSteps);
    if (!steps.is_null() && !steps.is_object()) {
      problems.push_back("common state: 'steps' is not an object");
    } else if (steps.is_object()) {
      for (const auto& [fqn, s] : steps.items()) {
        auto it = index_of.find(fqn);
        if (it == index_of.end()) {
          report.unexpected_keys.push_back("steps['" + fqn + "'] (no such parameter)");
        } else if (const std::string bad = optim::detail::step_problem(s); !bad.empty()) {
          problems.push_back("common state: 'steps' of '" + fqn + "': " + bad);
        } else {
          saved_step[it->second] = s.get<int64_t>();
        }
      }
    }
    const nlohmann::json scaler = field(keys::kScaler);
    if (!scaler.is_object()) {
      problems.push_back("no loss scaler state");
    } else if (scaler.contains("dynamic") && scaler["dynamic"] != scaler_.is_dynamic()) {
      report.notes.push_back(std::string("loss scaler: the state is ") +
                             (scaler_.is_dynamic() ? "constant" : "dynamic") +
                             ", this optimizer's is not; keeping the configured scaler");
    } else {
      try {
        optim::LossScaler loaded = scaler_;
        loaded.load_state(scaler);
        plan->scaler = loaded;
      } catch (const c10::Error& e) {
        problems.push_back(e.what_without_backtrace());
      }
    }
  }

  // Keys, per parameter: judged from the whole key set, the same on every rank.
  auto checked_key = [&](const std::string& key, size_t k,
                         bool must_be_fp32) -> const ShardedTensor* {
    auto it = state.tensors.find(key);
    if (it == state.tensors.end()) return nullptr;
    const ShardedTensor& t = it->second;
    if (t.global_shape != shapes_[k]) {
      problems.push_back("'" + key + "': global shape " +
                         checkpoint::dims_to_string(t.global_shape) + ", the parameter has " +
                         checkpoint::dims_to_string(shapes_[k]));
    }
    const auto dtype = t.local.defined() ? t.local.scalar_type() : at::kByte;
    if (!at::isFloatingType(dtype) || (must_be_fp32 && dtype != at::kFloat)) {
      problems.push_back("'" + key + "': dtype " + c10::toString(dtype) +
                         (must_be_fp32 ? ", expected Float (an FP32 value is never taken from a "
                                         "lower precision)"
                                       : ", expected a floating dtype"));
    }
    return &t;
  };
  std::set<std::string> used;
  std::vector<std::vector<const ShardedTensor*>> moments(info_.size());
  std::vector<const ShardedTensor*> fp32(info_.size(), nullptr);
  std::vector<bool> install(info_.size(), false);
  for (size_t k = 0; k < info_.size(); ++k) {
    const optim::ParamInfo& info = info_[k];
    if (info.role == ParamRole::kFrozen) continue;  // its keys, if any, are unexpected
    moments[k].assign(kinds.size(), nullptr);
    bool any_moment = false;
    for (size_t i = 0; i < kinds.size(); ++i) {
      const std::string key = keys::optimizer_state_key(kinds[i], info.fqn);
      moments[k][i] = checked_key(key, k, /*must_be_fp32=*/false);
      if (moments[k][i]) {
        used.insert(key);
        any_moment = true;
      }
    }
    const std::string master_key = keys::optimizer_state_key(keys::kFp32Param, info.fqn);
    fp32[k] = checked_key(master_key, k, /*must_be_fp32=*/true);
    if (fp32[k]) {
      used.insert(master_key);
      if (info.role == ParamRole::kNativeFp32) {
        report.notes.push_back("'" + info.fqn + "' is now native FP32: took its value from " +
                               master_key);
      }
    } else if (info.role == ParamRole::kMaster) {
      auto model = state.tensors.find(info.fqn);
      if (model != state.tensors.end() && model->second.local.scalar_type() == at::kFloat &&
          model->second.global_shape == shapes_[k]) {
        fp32[k] = &model->second;
        report.notes.push_back("'" + info.fqn +
                               "' had no main copy in the state (saved as native FP32): main "
                               "copy seeded from its FP32 model value");
      } else if (frozen_then.count(info.fqn)) {
        report.notes.push_back("'" + info.fqn + "': main copy re-derived from the model parameter");
      } else {
        report.missing_keys.push_back(master_key);
      }
    }
    const bool loaded_group = info.group < plan->groups.size() && plan->groups[info.group];
    const std::vector<bool> held = traits_->held_state(
        loaded_group ? *plan->groups[info.group] : param_groups()[info.group].options());
    const bool has_state = any_moment || (saved_step[k] > 0 && !fresh_ok.count(info.fqn));
    if (!has_state) continue;
    std::vector<std::string> missing;
    for (size_t i = 0; i < kinds.size(); ++i) {
      if (held[i] && !moments[k][i]) missing.emplace_back(kinds[i]);
    }
    for (const auto& kind : missing) {
      report.missing_keys.push_back(keys::optimizer_state_key(kind, info.fqn));
    }
    if (!missing.empty()) {
      report.notes.push_back("'" + info.fqn + "': incomplete optimizer state, starts fresh");
    } else if (saved_step[k] <= 0) {
      problems.push_back("'" + info.fqn + "' has optimizer state but step " +
                         std::to_string(saved_step[k]));
    } else {
      install[k] = true;
    }
  }
  for (const auto& [key, value] : state.tensors) {
    if (keys::is_optimizer_key(key) && !used.count(key)) report.unexpected_keys.push_back(key);
  }

  // Values: this rank's pieces only.
  plan->steps.assign(info_.size(), 0);
  for (size_t k = 0; k < info_.size(); ++k) plan->steps[k] = install[k] ? saved_step[k] : 0;
  for (const LocalShard& s : shards_) {
    auto& piece = plan->pieces.emplace_back();
    const size_t k = s.info;
    auto take = [&](const ShardedTensor* t, const std::string& key) -> at::Tensor {
      if (t == nullptr || t->global_shape != shapes_[k]) return {};
      try {
        return t->flat_elements(s.shard.begin, s.shard.end);
      } catch (const c10::Error& e) {
        problems.push_back("'" + key + "': " + e.what_without_backtrace());
        return {};
      }
    };
    piece.fp32 = take(fp32[k], keys::optimizer_state_key(keys::kFp32Param, s.shard.fqn));
    if (!install[k]) continue;
    piece.state.resize(kinds.size());
    for (size_t i = 0; i < kinds.size(); ++i) {
      piece.state[i] = take(moments[k][i], keys::optimizer_state_key(kinds[i], s.shard.fqn));
    }
  }
  if (options.strict()) {
    for (const auto& key : report.missing_keys) problems.push_back("missing " + key);
    for (const auto& key : report.unexpected_keys) problems.push_back("unexpected " + key);
  }
  mixprec::detail::check_no_problems(
      problems, "[mixprec::distributed::DistributedOptimizer] cannot load the state");
  return CheckedShardedState(std::move(plan));
}

LoadReport DistributedOptimizer::apply(CheckedShardedState&& checked) {
  TORCH_CHECK(
      checked.plan_ && checked.plan_->owner == this,
      "[mixprec::distributed::DistributedOptimizer::apply] the state was checked by another "
      "optimizer, or was applied already");
  const std::unique_ptr<CheckedShardedState::Plan> plan = std::move(checked.plan_);
  at::NoGradGuard no_grad;
  for (size_t g = 0; g < plan->groups.size(); ++g) {
    if (plan->groups[g]) traits_->assign(param_groups()[g].options(), *plan->groups[g]);
  }
  if (plan->scaler) scaler_ = *plan->scaler;
  steps_ = plan->steps;
  for (size_t j = 0; j < shards_.size(); ++j) {
    LocalShard& s = shards_[j];
    const auto& piece = plan->pieces[j];
    // The state lives where the steps run: on the host when offloaded.
    const c10::Device where = options_.offload() ? c10::Device(c10::kCPU) : s.param.device();
    s.state.assign(s.state.size(), at::Tensor());
    for (size_t i = 0; i < piece.state.size(); ++i) {
      if (!piece.state[i].defined()) continue;
      s.state[i] = piece.state[i].to(where, at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    }
    if (s.role == ParamRole::kMaster) {
      s.master.copy_(piece.fp32.defined() ? piece.fp32 : s.param);
      optim::copy_master_to_model(s.master, s.param);
    } else if (piece.fp32.defined()) {
      s.param.copy_(piece.fp32);  // saved with a main copy, now native FP32
    }
  }
  gather_params();  // every rank's parameters from the owners' pieces
  return std::move(plan->report);
}

}  // namespace mixprec::distributed
