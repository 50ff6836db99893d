// distributed::training_state_dict and save_training_state: this rank's part of a training state.
#include "mixprec/distributed/collective_checkpoint.h"

#include "checkpoint/rng_state.h"
#include "mixprec/checkpoint/format/state_keys.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <set>

namespace mixprec::distributed {

namespace keys = mixprec::checkpoint::keys;

ShardedStateDict training_state_dict(const torch::nn::Module& model,
                                     const DistributedOptimizer& optimizer,
                                     const nlohmann::json& user) {
  const Communicator& comm = optimizer.communicator();
  const int64_t rank = comm.rank(), world = comm.size();
  // An overlapped parameter gather may still be writing the parameters this reads.
  optimizer.reducer().wait_param_gather();
  ShardedStateDict whole = model_sharded_state_dict(model);
  std::set<std::string> params;
  for (const auto& item : model.named_parameters()) params.insert(item.key());

  ShardedStateDict state;
  state.common = std::move(whole.common);
  for (auto& [key, shard] : whole.tensors) {
    TORCH_CHECK(!keys::is_optimizer_key(key) && !keys::is_rng_key(key),
                "[mixprec::distributed::training_state_dict] the model has a tensor named '", key,
                "', a name the checkpoint reserves for the optimizer or the RNG state");
    if (!params.count(key)) {
      // A buffer: rank 0's (data parallelism does not keep buffers identical).
      if (rank == 0) state.tensors.emplace(key, std::move(shard));
      continue;
    }
    // A parameter, identical on every rank: each writes its even share of the elements.
    const int64_t n = shard.local.numel();
    const int64_t begin = n * rank / world, end = n * (rank + 1) / world;
    ShardedTensor piece = ShardedTensor::flat(shard.local.view({-1}).narrow(0, begin, end - begin),
                                              shard.global_shape, begin);
    piece.version = shard.version;  // a view shares its tensor's version counter
    state.tensors.emplace(key, std::move(piece));
  }
  state.merge(optimizer.sharded_state_dict());
  for (auto& [key, rng] : checkpoint::detail::rng_states()) {
    state.tensors.emplace(keys::rng_rank_key(static_cast<int>(rank), key),
                          ShardedTensor::whole(rng));
    if (rank == 0) state.tensors.emplace(key, ShardedTensor::whole(rng));
  }
  state.common[std::string(keys::kCommonUser)] = user;
  return state;
}

std::size_t staging_bytes_when_stepped(const torch::nn::Module& model,
                                       const DistributedOptimizer& optimizer) {
  return checkpoint::staging_bytes_when_stepped(training_state_dict(model, optimizer), optimizer);
}

checkpoint::SaveResult save_training_state(const std::filesystem::path& root,
                                           const std::string& name, const torch::nn::Module& model,
                                           const DistributedOptimizer& optimizer,
                                           const nlohmann::json& user,
                                           const checkpoint::SaveOptions& options) {
  // Every rank holds the same model (GradReducer checked it): a reserved name throws on every
  // rank alike, before any collective.
  return save_checkpoint(optimizer.communicator(), root, name,
                         training_state_dict(model, optimizer, user), options);
}

}  // namespace mixprec::distributed
