#include "mixprec/checkpoint/training_state.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/Utils.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <mutex>

namespace mixprec::checkpoint {
namespace {

constexpr const char* kRngKey = "rng.cpu";

at::Tensor cpu_rng_state() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

}  // namespace

ShardedStateDict training_state_dict(const torch::nn::Module& model,
                                     const optim::Float16Optimizer& optimizer,
                                     const nlohmann::json& user) {
  ShardedStateDict state = model_sharded_state_dict(model);
  state.merge(optimizer.sharded_state_dict());
  TORCH_CHECK(!state.contains(kRngKey), "[mixprec::checkpoint] the model has a tensor named '",
              kRngKey, "', which the checkpoint uses for the RNG state");
  state.tensors.emplace(kRngKey, ShardedTensor::whole(cpu_rng_state()));
  state.common["user"] = user;
  return state;
}

SaveResult save_training_state(const std::filesystem::path& root, const std::string& name,
                               const torch::nn::Module& model,
                               const optim::Float16Optimizer& optimizer,
                               const nlohmann::json& user, const SaveOptions& options) {
  return save_checkpoint(root, name, training_state_dict(model, optimizer, user), options);
}

ResumeResult load_training_state(const std::filesystem::path& path, torch::nn::Module& model,
                                 optim::Float16Optimizer& optimizer, const LoadOptions& options) {
  ResumeResult result;
  ResolvedCheckpoint resolved = find_checkpoint(path);
  result.dir = std::move(resolved.dir);
  result.note = std::move(resolved.note);
  ShardedStateDict state = read_checkpoint(result.dir);  // verifies every chunk's checksum
  TORCH_CHECK(state.contains(kRngKey), "[mixprec::checkpoint] ", result.dir.string(),
              ": no '", kRngKey, "' tensor (not a training-state checkpoint?)");
  const at::Tensor rng = state.at(kRngKey).local;
  state.tensors.erase(kRngKey);

  // Validate everything first: model and optimizer both, in dry-run mode.
  LoadOptions check = options;
  check.dry_run = true;
  load_model_sharded_state_dict(model, state, check);
  optimizer.load_sharded_state_dict(state, check);
  {
    // The RNG state's validity is checked by setting it on a scratch generator.
    at::Generator scratch = at::detail::createCPUGenerator();
    scratch.set_state(rng);
  }
  // Apply: the model first (the optimizer may seed masters from its FP32 tensors and then
  // rewrites half-precision parameters from masters).
  LoadOptions apply = options;
  apply.dry_run = false;
  result.model = load_model_sharded_state_dict(model, state, apply);
  result.optimizer = optimizer.load_sharded_state_dict(state, apply);
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(rng);
  }
  result.user = state.common.contains("user") ? state.common["user"] : nlohmann::json::object();
  return result;
}

}  // namespace mixprec::checkpoint
