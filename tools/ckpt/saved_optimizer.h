// The optimizer as a checkpoint recorded it, recovered from common.json's "optimizer" object
// and the manifest's key set alone: no model and no optimizer object are needed.
//
// Role of each parameter listed in the param groups (float16_optimizer.h, sharded_state_dict):
//   frozen       listed in optimizer.frozen: no state, no master;
//   fp32 master  has the key "optimizer.state.fp32_param.<fqn>" (a BF16/FP16 model parameter
//                stepped through an FP32 main copy);
//   native fp32  any other trainable parameter: stepped in place, state but no master.
#pragma once

#include "mixprec/checkpoint/format/manifest.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mixprec::tools {

enum class SavedRole { kMaster, kNativeFp32, kFrozen };
// "fp32 master", "native fp32", "frozen".
const char* role_name(SavedRole role);

struct SavedParam {
  std::string fqn;
  std::size_t group = 0;
  SavedRole role = SavedRole::kNativeFp32;
  bool has_state = false;  // false for frozen params and those listed in without_state
  std::int64_t step = 0;   // the common step unless optimizer.steps overrides it
  // Keys "optimizer.state.<name>.<fqn>" present in the manifest (fp32_param included).
  std::vector<std::string> state_keys;
};

struct SavedOptimizer {
  std::string algorithm;  // "adamw", "adam", "sgd"
  std::int64_t step = 0;
  nlohmann::json scaler;                           // as saved; null if absent
  std::vector<nlohmann::json> group_hyper_params;  // each group without its "params"
  std::vector<SavedParam> params;                  // in group order
  // Keys under "optimizer.state." whose FQN is in no param group (a corrupt or foreign save).
  std::vector<std::string> orphan_state_keys;
};

// nullopt when `common` has no "optimizer" member (a checkpoint that is not a training state).
// Throws ToolError(kExitUsage) "<source>: optimizer.<field>: <what>" when it is there but
// malformed (wrong JSON type, an FQN listed twice).
std::optional<SavedOptimizer> read_saved_optimizer(const nlohmann::json& common,
                                                   const checkpoint::Manifest& manifest,
                                                   const std::string& source);

}  // namespace mixprec::tools
