// Sharded state dicts: the FQN-keyed form of model and optimizer state that checkpoints store.
//
// Every tensor is keyed by a name derived from the model's fully qualified names ("fc.weight",
// "optimizer.state.exp_avg.fc.weight"), never by position or pointer. A ShardedTensor is the
// slice of a global tensor that this rank holds; with no data parallelism it is the whole
// tensor. A slice is a box (an offset and a local shape per dimension), or a flat range of the
// tensor's row-major elements: ZeRO-1 shards a parameter's state by flat ranges
// (distributed/distributed_optimizer.h), and a range is generally no box. Non-tensor state (step,
// hyper-parameters, loss scaler, RNG, user metadata) travels in `common`, a JSON object.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}

namespace mixprec {

// Elements [begin, end) of a tensor flattened in row-major order.
struct FlatRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t numel() const { return end - begin; }
  bool operator==(const FlatRange&) const = default;
};

struct ShardedTensor {
  at::Tensor local;                    // this rank's slice; contiguous
  std::vector<int64_t> global_shape;   // shape of the whole tensor
  std::vector<int64_t> global_offset;  // where `local` starts in it, per dimension (box slices)
  int64_t replica_id = 0;              // 0 for the copy that is written; others are duplicates
  // `local`'s version counter when this entry was made (whole() records it; -1: unchecked).
  // State dicts alias live tensors, so savers refuse an entry whose tensor changed since
  // (checkpoint/save.h): a training step between building a dict and saving it would mix
  // two steps. An optimizer step bumps the version of every tensor it writes.
  int64_t version = -1;
  // Set for a flat slice: `local` is 1-D and holds elements [begin, end) of the global
  // tensor's row-major flattening; global_offset is then empty. Savers store it as the boxes
  // the range decomposes into (checkpoint/format/box.h: flat_range_boxes); read_checkpoint
  // returns one when ReadOptions::flat_range asks for it (checkpoint/load.h).
  std::optional<FlatRange> flat_range;

  // The whole tensor, held by one rank.
  static ShardedTensor whole(at::Tensor tensor);
  // Elements [begin, begin + local.numel()) of a tensor of `global_shape`; `local` must be
  // 1-D (it may be a view: its version is recorded as whole() does). Throws c10::Error if the
  // range does not lie in the global shape.
  static ShardedTensor flat(at::Tensor local, std::vector<int64_t> global_shape, int64_t begin);
  // True if `local` is the whole global tensor (a flat slice only for a 1-D tensor).
  bool is_whole() const;
  // The row-major elements [begin, end) of the global tensor that this slice holds, as a 1-D
  // view of `local`: a flat slice must contain the range; a box slice must be whole. Throws
  // c10::Error saying what the slice holds otherwise.
  at::Tensor flat_elements(int64_t begin, int64_t end) const;
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

// How a load treats keys that do not fit. A plain struct for now.
struct LoadOptions {
  // Strict: any missing or unexpected key is an error listing all of them. Non-strict: what
  // matches is loaded and the rest is reported. Shape and dtype errors are errors either way.
  TORCH_ARG(bool, strict) = true;
};

// The model's parameters and buffers under their fully qualified names (tied tensors once,
// under the first name), as whole tensors. Tensors are the module's own (not copies), but for
// a non-contiguous tensor, which is held as a contiguous copy (writing to it changes nothing).
// common["precision"] = {fqn: reason} for every FP32 tensor a conversion kept FP32
// (kept_fp32_reason, precision/convert.h), the reason as checkpoint/format/state_keys.h
// spells it: "mark", "name <fqn>", "pattern <glob>"; absent when there is none.
ShardedStateDict model_sharded_state_dict(const torch::nn::Module& model);

class CheckedModelState;

// Checks `state` (keys = the model's FQNs; nothing else: a caller holding a training state
// passes only its model part, see checkpoint/training_state.h) against every parameter and
// buffer of `model`: keys, shapes, dtypes. Floating values may have another floating dtype
// (a precision plan may have changed since the save; they are cast on apply, and the
// optimizer's own load then restores FP32 values from masters); non-floating tensors must
// match dtype exactly. Strict: throws c10::Error listing every missing/unexpected key (with
// close matches) and every mismatch; non-strict: mismatches throw, keys are reported. Changes
// nothing. The checked value holds handles to the model's tensors and to `state`'s.
CheckedModelState check_model_sharded_state_dict(const torch::nn::Module& model,
                                                 const ShardedStateDict& state,
                                                 const LoadOptions& options = {});

// Copies a checked state into the model it was checked against. Cannot fail on the state's
// content; throws c10::Error, changing nothing, if `checked` belongs to another module, was
// applied already, or a tensor of the model changed shape or was replaced by another tensor
// (register_parameter again) since the check, naming it.
LoadReport apply_model_state(torch::nn::Module& model, CheckedModelState&& checked);

// apply_model_state(model, check_model_sharded_state_dict(model, state, options)).
LoadReport load_model_sharded_state_dict(torch::nn::Module& model, const ShardedStateDict& state,
                                         const LoadOptions& options = {});

// Move-only, applied once: a moved-from state counts as applied.
class CheckedModelState {
 public:
  CheckedModelState(CheckedModelState&& other) noexcept
      : model_(std::exchange(other.model_, nullptr)),
        copies_(std::move(other.copies_)),
        report_(std::move(other.report_)) {}
  CheckedModelState& operator=(CheckedModelState&& other) noexcept {
    model_ = std::exchange(other.model_, nullptr);
    copies_ = std::move(other.copies_);
    report_ = std::move(other.report_);
    return *this;
  }
  CheckedModelState(const CheckedModelState&) = delete;
  CheckedModelState& operator=(const CheckedModelState&) = delete;

  // What apply_model_state will report: keys missing or unexpected (non-strict).
  const LoadReport& report() const { return report_; }

 private:
  friend CheckedModelState check_model_sharded_state_dict(const torch::nn::Module&,
                                                          const ShardedStateDict&,
                                                          const LoadOptions&);
  friend LoadReport apply_model_state(torch::nn::Module&, CheckedModelState&&);
  CheckedModelState() = default;

  const torch::nn::Module* model_ = nullptr;  // null once applied
  struct Copy {
    std::string key;    // the tensor's FQN
    at::Tensor target;  // the model's own tensor
    at::Tensor value;   // checked against it
  };
  std::vector<Copy> copies_;
  LoadReport report_;
};

}  // namespace mixprec
