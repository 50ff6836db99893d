#include "mixprec/checkpoint/training_state.h"

#include "checkpoint/rng_state.h"
#include "mixprec/checkpoint/async_save.h"
#include "mixprec/checkpoint/format/state_keys.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <optional>

namespace mixprec::checkpoint {

namespace {

// A DistributedOptimizer passes for a Float16Optimizer (it is one), but its state is this
// rank's pieces: saved alone it is a partial checkpoint, and loaded alone it would skip the
// ranks' agreement and restore rank 0's RNG state everywhere.
void check_not_sharded(const optim::Float16Optimizer& optimizer, const char* function) {
  TORCH_CHECK(!optimizer.sharded(), "[mixprec::checkpoint::", function,
              "] the optimizer holds one rank's pieces of the parameters (a "
              "distributed::DistributedOptimizer): every rank calls mixprec::distributed::",
              function, " together for its training state");
}

}  // namespace

ShardedStateDict training_state_dict(const torch::nn::Module& model,
                                     const optim::Float16Optimizer& optimizer,
                                     const nlohmann::json& user) {
  check_not_sharded(optimizer, "training_state_dict");
  ShardedStateDict state = model_sharded_state_dict(model);
  for (const auto& [key, value] : state.tensors) {
    TORCH_CHECK(!keys::is_optimizer_key(key) && !keys::is_rng_key(key),
                "[mixprec::checkpoint] the model has a tensor named '", key,
                "', a name the checkpoint reserves for the optimizer or the RNG state");
  }
  state.merge(optimizer.sharded_state_dict());
  for (auto& [key, rng] : detail::rng_states())
    state.tensors.emplace(key, ShardedTensor::whole(rng));
  state.common[std::string(keys::kCommonUser)] = user;
  return state;
}

std::size_t staging_bytes_when_stepped(const ShardedStateDict& state,
                                       const optim::Float16Optimizer& optimizer) {
  std::size_t bytes = staging_bytes_for(state);
  for (const int64_t more : optimizer.state_tensor_bytes_to_come())
    bytes += staging_bytes_for(static_cast<std::size_t>(more));
  return bytes;
}

std::size_t staging_bytes_when_stepped(const torch::nn::Module& model,
                                       const optim::Float16Optimizer& optimizer) {
  return staging_bytes_when_stepped(training_state_dict(model, optimizer), optimizer);
}

SaveResult save_training_state(const std::filesystem::path& root, const std::string& name,
                               const torch::nn::Module& model,
                               const optim::Float16Optimizer& optimizer, const nlohmann::json& user,
                               const SaveOptions& options) {
  check_not_sharded(optimizer, "save_training_state");
  return save_checkpoint(root, name, training_state_dict(model, optimizer, user), options);
}

TrainingStateParts split_training_state(ShardedStateDict state) {
  TrainingStateParts parts;
  for (auto& [key, tensor] : state.tensors) {
    if (keys::is_rng_key(key)) {
      parts.rng.emplace(key, tensor.local);
    } else if (keys::is_optimizer_key(key)) {
      parts.optimizer.tensors.emplace(key, std::move(tensor));
    } else {
      parts.model.tensors.emplace(key, std::move(tensor));
    }
  }
  for (auto& [field, value] : state.common.items()) {
    if (field == keys::kCommonOptimizer) {
      parts.optimizer.common[field] = std::move(value);
    } else if (field == keys::kCommonUser) {
      parts.user = std::move(value);
    } else {
      parts.model.common[field] = std::move(value);
    }
  }
  return parts;
}

ResumeResult load_training_state(const std::filesystem::path& path, torch::nn::Module& model,
                                 optim::Float16Optimizer& optimizer, const LoadOptions& options) {
  check_not_sharded(optimizer, "load_training_state");
  ResumeResult result;
  ResolvedCheckpoint resolved = find_checkpoint(path);
  result.dir = std::move(resolved.dir);
  result.note = std::move(resolved.note);
  // Reading verifies every chunk's checksum.
  TrainingStateParts parts = split_training_state(read_checkpoint(result.dir));

  // Check everything first: model, optimizer, RNG. The optimizer also sees the model's
  // tensors: across a changed precision plan a saved FP32 value seeds a new main copy. Their
  // errors say which checkpoint (a root's lookup may have taken another than `latest` names).
  std::optional<CheckedModelState> checked_model;
  std::optional<optim::CheckedOptimizerState> checked_optimizer;
  try {
    checked_model.emplace(check_model_sharded_state_dict(model, parts.model, options));
    ShardedStateDict optimizer_view = parts.optimizer;
    for (const auto& [key, tensor] : parts.model.tensors)
      optimizer_view.tensors.emplace(key, tensor);
    checked_optimizer.emplace(optimizer.check_sharded_state_dict(optimizer_view, options));
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "[mixprec::checkpoint::load_training_state] ", result.dir.string(), ": ",
                e.msg());
  }
  const detail::CheckedRng checked_rng = detail::check_rng(parts.rng, result.dir);
  // The checked states hold what they apply. Let go of the read tensors here, so that the
  // optimizer can keep the memory of moments and masters nothing else refers to instead of
  // copying it (Float16Optimizer::apply).
  parts.model.tensors.clear();
  parts.optimizer.tensors.clear();

  // Apply: the model first (the optimizer may seed masters from its values and then rewrites
  // half-precision parameters from masters).
  result.model = apply_model_state(model, std::move(*checked_model));
  result.optimizer = optimizer.apply(std::move(*checked_optimizer));
  detail::apply_rng(checked_rng);
  result.rng = checked_rng.report;
  result.user = std::move(parts.user);
  return result;
}

}  // namespace mixprec::checkpoint
