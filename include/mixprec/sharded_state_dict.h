// Sharded state dicts: the FQN-keyed form of model and optimizer state that checkpoints store.
//
// Every tensor is keyed by a name derived from the model's fully qualified names ("fc.weight",
// "optimizer.state.exp_avg.fc.weight"), never by position or pointer. A ShardedTensor is the
// slice of a global tensor that this rank holds; with no data parallelism it is the whole
// tensor. Non-tensor state (step, hyper-parameters, loss scaler, RNG, user metadata) travels
// in `common`, a JSON object.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace mixprec {

struct ShardedTensor {
  at::Tensor local;                    // this rank's slice; contiguous
  std::vector<int64_t> global_shape;   // shape of the whole tensor
  std::vector<int64_t> global_offset;  // where `local` starts in it, per dimension
  int64_t replica_id = 0;              // 0 for the copy that is written; others are duplicates
  // `local`'s version counter when this entry was made (whole() records it; -1: unchecked).
  // State dicts alias live tensors, so savers refuse an entry whose tensor changed since
  // (checkpoint/save.h): a training step between building a dict and saving it would mix
  // two steps. An optimizer step bumps the version of every tensor it writes.
  int64_t version = -1;

  // The whole tensor, held by one rank.
  static ShardedTensor whole(at::Tensor tensor);
  // True if `local` is the whole global tensor.
  bool is_whole() const;
};

struct ShardedStateDict {
  std::map<std::string, ShardedTensor> tensors;
  nlohmann::json common = nlohmann::json::object();

  // Adds every tensor and common entry of `other`. Throws c10::Error naming the key if a
  // tensor key or a top-level common key is already present (nothing added then).
  void merge(ShardedStateDict other);
  bool contains(const std::string& key) const { return tensors.count(key) != 0; }
  // A deep copy: every tensor cloned (state dicts alias live state by default), versions
  // recorded afresh.
  ShardedStateDict clone() const;
  // The tensor under `key`; throws c10::Error naming the key if absent.
  const ShardedTensor& at(const std::string& key) const;
};

// What a load found that did not fit (non-strict loads return it; strict loads throw).
struct LoadReport {
  std::vector<std::string> missing_keys;     // expected but absent
  std::vector<std::string> unexpected_keys;  // present but unused
  std::vector<std::string> notes;            // e.g. a master re-derived across a plan change
  bool clean() const { return missing_keys.empty() && unexpected_keys.empty(); }
  std::string to_string() const;
};

struct LoadOptions {
  // Strict: any missing or unexpected key is an error listing all of them. Non-strict: what
  // matches is loaded and the rest is reported. Shape and dtype errors are errors either way.
  bool strict = true;
  // Validate and report exactly as a real load would, but change nothing. Lets a caller that
  // loads several objects (model, optimizer) check all of them before applying any.
  bool dry_run = false;
};

// The model's parameters and buffers under their fully qualified names (tied tensors once,
// under the first name), as whole tensors. Tensors are the module's own (not copies).
ShardedStateDict model_sharded_state_dict(const torch::nn::Module& model);

// Copies model tensors from `state` (keys = FQNs; keys under "optimizer." belong to the
// optimizer and are ignored here). Validates every key, shape and dtype before copying
// anything: on any error the model is unchanged. Floating values are cast to the parameter's
// current dtype (a precision plan may have changed since the save; the optimizer's own load
// then restores FP32 values from masters), non-floating tensors must match dtype exactly.
// Strict: throws c10::Error listing every missing/unexpected key; non-strict: reports them.
LoadReport load_model_sharded_state_dict(torch::nn::Module& model, const ShardedStateDict& state,
                                         const LoadOptions& options = {});

}  // namespace mixprec
