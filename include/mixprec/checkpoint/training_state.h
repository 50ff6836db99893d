// Saving and resuming a whole training state: model, optimizer, RNG, user metadata.
//
// The checkpoint holds the model's tensors under their FQNs, the optimizer's FQN-keyed state
// (optim/float16_optimizer.h: sharded_state_dict), the default CPU generator's state as the
// tensor "rng.cpu", and in the common state "optimizer" (step, groups, scaler) and "user"
// (anything the caller passes: data position, config, …).
#pragma once

#include "mixprec/checkpoint/load.h"
#include "mixprec/checkpoint/save.h"
#include "mixprec/optim/float16_optimizer.h"

#include <nlohmann/json.hpp>

namespace torch::nn {
class Module;
}

namespace mixprec::checkpoint {

// The full sharded state dict of a training state (model + optimizer + RNG + user).
ShardedStateDict training_state_dict(const torch::nn::Module& model,
                                     const optim::Float16Optimizer& optimizer,
                                     const nlohmann::json& user = nlohmann::json::object());

// save_checkpoint(root, name, training_state_dict(...)).
SaveResult save_training_state(const std::filesystem::path& root, const std::string& name,
                               const torch::nn::Module& model,
                               const optim::Float16Optimizer& optimizer,
                               const nlohmann::json& user = nlohmann::json::object(),
                               const SaveOptions& options = {});

struct ResumeResult {
  std::filesystem::path dir;  // the checkpoint loaded
  std::string note;           // why it is not what `latest` names, if it is not (load.h)
  LoadReport model;
  LoadReport optimizer;
  nlohmann::json user;  // what save_training_state was given
};

// Loads `path` (a checkpoint directory, or a root: its newest complete checkpoint, normally
// the one `latest` names; see find_checkpoint in load.h and `note`) into model and
// optimizer, and restores the CPU RNG. Everything is read and validated — checksums, keys,
// shapes, dtypes, for the model and the optimizer — before anything is changed: on any error
// model, optimizer and RNG are exactly as before. Throws c10::Error or FormatError listing
// the problems (naming file and key).
ResumeResult load_training_state(const std::filesystem::path& path, torch::nn::Module& model,
                                 optim::Float16Optimizer& optimizer,
                                 const LoadOptions& options = {});

}  // namespace mixprec::checkpoint
