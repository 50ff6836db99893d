// Saving and resuming a whole training state: model, optimizer, RNG, user metadata.
//
// The checkpoint holds (names from checkpoint/format/state_keys.h) the model's tensors under
// their FQNs, the optimizer's FQN-keyed state (optim/float16_optimizer.h: sharded_state_dict),
// the default CPU generator's state as "rng.cpu" and, where CUDA is available when saving,
// each CUDA device's default generator's state as "rng.cuda.<index>"; in the common state
// "optimizer" (step, groups, scaler) and "user" (anything the caller passes: data position,
// config, …).
#pragma once

#include "mixprec/checkpoint/load.h"
#include "mixprec/checkpoint/save.h"
#include "mixprec/optim/float16_optimizer.h"

#include <nlohmann/json.hpp>

#include <map>
#include <string>

namespace torch::nn {
class Module;
}

namespace mixprec::checkpoint {

// The full sharded state dict of a training state (model + optimizer + RNG + user). Throws
// c10::Error if a model tensor's name is one the checkpoint reserves (an "optimizer." or
// "rng." key). The functions of this header are one process's: each throws c10::Error naming
// its distributed:: counterpart (collective_checkpoint.h) for a sharded optimizer (a
// distributed::DistributedOptimizer, which is a Float16Optimizer).
ShardedStateDict training_state_dict(const torch::nn::Module& model,
                                     const optim::Float16Optimizer& optimizer,
                                     const nlohmann::json& user = nlohmann::json::object());

// The staging bytes (async_save.h: staging_bytes_for) a training state dict of `optimizer`
// will need once every trainable parameter has been stepped: what AsyncCheckpointSaver::
// reserve() must be given when training starts, as moments are made at a parameter's first
// step. `state` is a training state dict of `optimizer` (this header's training_state_dict,
// or distributed/collective_checkpoint.h's for a DistributedOptimizer): its bytes plus each
// state tensor the steps will still create (Float16Optimizer::state_tensor_bytes_to_come),
// aligned as the arena aligns it: exactly the later save's staging_bytes_for, unless the
// model or the groups' hyper-parameters change meanwhile.
std::size_t staging_bytes_when_stepped(const ShardedStateDict& state,
                                       const optim::Float16Optimizer& optimizer);
// staging_bytes_when_stepped(training_state_dict(model, optimizer), optimizer).
std::size_t staging_bytes_when_stepped(const torch::nn::Module& model,
                                       const optim::Float16Optimizer& optimizer);

// save_checkpoint(root, name, training_state_dict(...)).
SaveResult save_training_state(const std::filesystem::path& root, const std::string& name,
                               const torch::nn::Module& model,
                               const optim::Float16Optimizer& optimizer,
                               const nlohmann::json& user = nlohmann::json::object(),
                               const SaveOptions& options = {});

// A training state dict split by the reserved names (state_keys.h), e.g. to load only the
// model's weights from a training checkpoint:
//   load_model_sharded_state_dict(model, split_training_state(read_checkpoint(dir)).model).
struct TrainingStateParts {
  // Every tensor that is neither an optimizer nor an RNG key; common fields other than
  // "optimizer" and "user".
  ShardedStateDict model;
  // "optimizer." tensors and common["optimizer"].
  ShardedStateDict optimizer;
  // "rng.cpu", "rng.cuda.<index>".
  std::map<std::string, at::Tensor> rng;
  nlohmann::json user = nlohmann::json::object();
};
TrainingStateParts split_training_state(ShardedStateDict state);

struct ResumeResult {
  std::filesystem::path dir;  // the checkpoint loaded
  std::string note;           // why it is not what `latest` names, if it is not (load.h)
  LoadReport model;
  LoadReport optimizer;
  LoadReport rng;       // notes: RNG states ignored, devices left as they were
  nlohmann::json user;  // what save_training_state was given
};

// Loads `path` (a checkpoint directory, or a root: its newest complete checkpoint, normally
// the one `latest` names; see find_checkpoint in load.h and `note`) into model and
// optimizer, and restores the RNG: the CPU generator, and each CUDA device's generator whose
// state the checkpoint holds. A CUDA state is ignored with a note in `rng` where this process
// has no CUDA (or not that device): a GPU run can be resumed or inspected on a CPU machine.
// Everything is read and validated — checksums, keys, shapes, dtypes, hyper-parameters, RNG
// states, for model and optimizer — before anything is changed: on any error model, optimizer
// and RNG are exactly as before. Throws c10::Error or FormatError listing the problems (naming
// file and key).
ResumeResult load_training_state(const std::filesystem::path& path, torch::nn::Module& model,
                                 optim::Float16Optimizer& optimizer,
                                 const LoadOptions& options = {});

}  // namespace mixprec::checkpoint
