// DistributedOptimizer::sharded_state_dict: this rank's pieces under Float16Optimizer's keys.
// Key and field names come from checkpoint/format/state_keys.h; hyper-parameters are written
// by the optimizer's traits table, as Float16Optimizer writes them.
#include "mixprec/distributed/distributed_optimizer.h"

#include "mixprec/checkpoint/format/state_keys.h"
#include "optim/algorithm_traits.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace mixprec::distributed {

namespace keys = mixprec::checkpoint::keys;
using optim::ParamRole;

namespace {
std::string str(std::string_view s) { return std::string(s); }

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}
}  // namespace

ShardedStateDict DistributedOptimizer::sharded_state_dict() const {
  ShardedStateDict out;
  const auto kinds = traits_->state_kinds();
  // The pieces: state tensors are 1-D FP32 pieces already; a flat slice aliases them.
  for (const LocalShard& s : shards_) {
    const optim::ParamInfo& info = info_[s.info];
    const std::vector<int64_t>& shape = shapes_[s.info];
    if (s.master.defined()) {
      out.tensors.emplace(keys::optimizer_state_key(keys::kFp32Param, info.fqn),
                          ShardedTensor::flat(s.master.detach(), shape, s.shard.begin));
    }
    if (steps_[s.info] == 0) continue;
    for (size_t i = 0; i < kinds.size(); ++i) {
      if (!s.state[i].defined()) continue;
      out.tensors.emplace(keys::optimizer_state_key(kinds[i], info.fqn),
                          ShardedTensor::flat(s.state[i].detach(), shape, s.shard.begin));
    }
  }
  // A trainable parameter without elements has no piece anywhere; rank 0 declares its keys
  // (empty, as Float16Optimizer's state for it is), so that the checkpoint has them.
  if (reducer_.communicator().rank() == 0) {
    for (size_t k = 0; k < info_.size(); ++k) {
      if (info_[k].role == ParamRole::kFrozen || numel_of(shapes_[k]) != 0) continue;
      auto empty = [&] { return ShardedTensor::flat(at::empty({0}, at::kFloat), shapes_[k], 0); };
      if (info_[k].role == ParamRole::kMaster) {
        out.tensors.emplace(keys::optimizer_state_key(keys::kFp32Param, info_[k].fqn), empty());
      }
      if (steps_[k] == 0) continue;
      const std::vector<bool> held = traits_->held_state(param_groups()[info_[k].group].options());
      for (size_t i = 0; i < kinds.size(); ++i) {
        if (held[i])
          out.tensors.emplace(keys::optimizer_state_key(kinds[i], info_[k].fqn), empty());
      }
    }
  }

  // The common state, replicated: the same fields and values as Float16Optimizer's.
  const int64_t common_step = steps_.empty() ? 0 : *std::max_element(steps_.begin(), steps_.end());
  nlohmann::json groups = nlohmann::json::array();
  for (const auto& group : param_groups()) {  // every group, empty ones included
    groups.push_back(traits_->to_json(group.options()));
    groups.back()[str(keys::kParams)] = nlohmann::json::array();
  }
  nlohmann::json frozen = nlohmann::json::array();
  nlohmann::json without_state = nlohmann::json::array();
  nlohmann::json steps = nlohmann::json::object();
  for (size_t k = 0; k < info_.size(); ++k) {
    const optim::ParamInfo& info = info_[k];
    groups[info.group][str(keys::kParams)].push_back(info.fqn);
    if (info.role == ParamRole::kFrozen) {
      frozen.push_back(info.fqn);
    } else if (steps_[k] == 0) {
      without_state.push_back(info.fqn);
    } else if (steps_[k] != common_step) {
      steps[info.fqn] = steps_[k];
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

}  // namespace mixprec::distributed
