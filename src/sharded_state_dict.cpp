#include "mixprec/sharded_state_dict.h"

#include "mixprec/checkpoint/format/state_keys.h"
#include "mixprec/precision/convert.h"
#include "mixprec/precision/float16_module.h"

#include "detail/name_match.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <unordered_set>

namespace mixprec {

ShardedTensor ShardedTensor::whole(at::Tensor tensor) {
  TORCH_CHECK(tensor.defined(), "[mixprec::ShardedTensor::whole] undefined tensor");
  ShardedTensor out;
  out.global_shape = tensor.sizes().vec();
  out.global_offset.assign(tensor.dim(), 0);
  out.local = tensor.is_contiguous() ? std::move(tensor) : tensor.contiguous();
  if (!out.local.is_inference()) out.version = out.local._version();
  return out;
}

ShardedTensor ShardedTensor::flat(at::Tensor local, std::vector<int64_t> global_shape,
                                  int64_t begin) {
  TORCH_CHECK(local.defined() && local.dim() == 1,
              "[mixprec::ShardedTensor::flat] the local piece must be a defined 1-D tensor");
  int64_t numel = 1;
  for (int64_t d : global_shape) numel *= d;
  const int64_t end = begin + local.numel();
  TORCH_CHECK(begin >= 0 && end <= numel, "[mixprec::ShardedTensor::flat] elements [", begin, ", ",
              end, ") do not lie in a tensor of shape ", global_shape);
  ShardedTensor out;
  out.global_shape = std::move(global_shape);
  out.flat_range = FlatRange{begin, end};
  out.local = local.is_contiguous() ? std::move(local) : local.contiguous();
  if (!out.local.is_inference()) out.version = out.local._version();
  return out;
}

bool ShardedTensor::is_whole() const {
  if (flat_range && flat_range->begin != 0) return false;
  return local.sizes().vec() == global_shape;
}

at::Tensor ShardedTensor::flat_elements(int64_t begin, int64_t end) const {
  if (flat_range) {
    TORCH_CHECK(begin >= flat_range->begin && end <= flat_range->end,
                "[mixprec::ShardedTensor] holds elements [", flat_range->begin, ", ",
                flat_range->end, "), not [", begin, ", ", end, ")");
    return local.narrow(0, begin - flat_range->begin, end - begin);
  }
  TORCH_CHECK(is_whole(), "[mixprec::ShardedTensor] holds the box at ", global_offset, " of shape ",
              local.sizes(), ", not the whole tensor ", global_shape);
  return local.reshape({-1}).narrow(0, begin, end - begin);
}

void ShardedStateDict::merge(ShardedStateDict other) {
  for (const auto& [key, value] : other.tensors) {
    TORCH_CHECK(!tensors.count(key), "[mixprec::ShardedStateDict::merge] duplicate tensor key '",
                key, "'");
  }
  for (const auto& [key, value] : other.common.items()) {
    TORCH_CHECK(!common.contains(key), "[mixprec::ShardedStateDict::merge] duplicate common key '",
                key, "'");
  }
  for (auto& [key, value] : other.tensors) tensors.emplace(key, std::move(value));
  for (auto& [key, value] : other.common.items()) common[key] = std::move(value);
}

ShardedStateDict ShardedStateDict::clone() const {
  ShardedStateDict out;
  out.common = common;
  for (const auto& [key, shard] : tensors) {
    ShardedTensor copy = shard;
    copy.local = shard.local.clone();
    copy.version = copy.local.is_inference() ? -1 : copy.local._version();
    out.tensors.emplace(key, std::move(copy));
  }
  return out;
}

const ShardedTensor& ShardedStateDict::at(const std::string& key) const {
  auto it = tensors.find(key);
  TORCH_CHECK(it != tensors.end(), "[mixprec::ShardedStateDict] no tensor '", key, "'");
  return it->second;
}

std::string LoadReport::to_string() const {
  std::string out;
  if (!missing_keys.empty()) out += "missing keys: " + detail::join(missing_keys) + "\n";
  if (!unexpected_keys.empty()) out += "unexpected keys: " + detail::join(unexpected_keys) + "\n";
  for (const auto& note : notes) out += "note: " + note + "\n";
  return out.empty() ? "clean\n" : out;
}

namespace {

// The model's own tensors by FQN, tied tensors once (under their first name). A Float16Module
// in it (or the model itself) must still hold every tensor of the module it wraps: one
// registered there after wrapping would be left out of the state silently (`op` names the
// caller in that error).
std::map<std::string, at::Tensor> own_tensors(const torch::nn::Module& model, const char* op) {
  if (const auto* wrapper = dynamic_cast<const Float16ModuleImpl*>(&model)) {
    wrapper->check_adopted(op);
  }
  // Descendants only: modules(true) would need the model owned by a shared_ptr.
  for (const auto& module : model.modules(/*include_self=*/false)) {
    if (const auto* wrapper = dynamic_cast<const Float16ModuleImpl*>(module.get())) {
      wrapper->check_adopted(op);
    }
  }
  std::map<std::string, at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  auto add = [&](const auto& named) {
    for (const auto& item : named) {
      const at::Tensor& t = item.value();
      if (!t.defined() || !seen.insert(t.unsafeGetTensorImpl()).second) continue;
      out.emplace(item.key(), t);
    }
  };
  add(model.named_parameters());
  add(model.named_buffers());
  return out;
}

}  // namespace

namespace {

// common["precision"][fqn] in the words of state_keys.h.
std::string precision_reason(const KeptFp32& kept) {
  namespace keys = checkpoint::keys;
  switch (kept.reason) {
    case KeepReason::kTensorMark:
      return std::string(keys::kKeptByMark);
    case KeepReason::kName:
      return std::string(keys::kKeptByName) + " " + kept.rule;
    case KeepReason::kPattern:
      return std::string(keys::kKeptByPattern) + " " + kept.rule;
    case KeepReason::kNone:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "no reason to describe");
}

}  // namespace

ShardedStateDict model_sharded_state_dict(const torch::nn::Module& model) {
  ShardedStateDict out;
  nlohmann::json precision = nlohmann::json::object();
  for (const auto& [key, t] : own_tensors(model, "model_sharded_state_dict")) {
    out.tensors.emplace(key, ShardedTensor::whole(t.detach()));
    // A tensor cast back to half after its conversion (Module::to) is no longer kept.
    const KeptFp32 kept = kept_fp32_reason(t);
    if (kept.reason != KeepReason::kNone && t.scalar_type() == at::kFloat) {
      precision[key] = precision_reason(kept);
    }
  }
  if (!precision.empty()) out.common[std::string(checkpoint::keys::kCommonPrecision)] = precision;
  return out;
}

CheckedModelState check_model_sharded_state_dict(const torch::nn::Module& model,
                                                 const ShardedStateDict& state,
                                                 const LoadOptions& options) {
  const std::map<std::string, at::Tensor> own =
      own_tensors(model, "check_model_sharded_state_dict");
  CheckedModelState checked;
  LoadReport& report = checked.report_;
  std::vector<std::string> problems;
  for (const auto& [key, target] : own) {
    auto it = state.tensors.find(key);
    if (it == state.tensors.end()) {
      report.missing_keys.push_back(key);
      continue;
    }
    const ShardedTensor& saved = it->second;
    if (!saved.is_whole()) {
      problems.push_back("'" + key +
                         "' is a shard; reshard it before loading (the checkpoint "
                         "loader does this)");
      continue;
    }
    if (saved.local.sizes() != target.sizes()) {
      problems.push_back("'" + key + "': shape " + c10::str(saved.local.sizes()) +
                         " in the state, " + c10::str(target.sizes()) + " in the model");
    }
    const bool both_floating =
        at::isFloatingType(saved.local.scalar_type()) && at::isFloatingType(target.scalar_type());
    if (!both_floating && saved.local.scalar_type() != target.scalar_type()) {
      problems.push_back("'" + key + "': dtype " + c10::toString(saved.local.scalar_type()) +
                         " in the state, " + c10::toString(target.scalar_type()) + " in the model");
    }
    checked.copies_.push_back({key, target, saved.local});
  }
  for (const auto& [key, value] : state.tensors) {
    if (!own.count(key)) report.unexpected_keys.push_back(key);
  }
  if (options.strict()) {
    for (const auto& key : report.missing_keys) problems.push_back("missing key '" + key + "'");
    std::vector<std::string> names;
    for (const auto& [k, v] : own) names.push_back(k);
    for (const auto& key : report.unexpected_keys) {
      auto near = detail::close_matches(key, names);
      problems.push_back("unexpected key '" + key + "'" +
                         (near.empty() ? "" : " (model has: " + detail::join(near) + ")"));
    }
  }
  detail::check_no_problems(
      problems, "[mixprec::load_model_sharded_state_dict] cannot load into " + model.name());
  checked.model_ = &model;
  return checked;
}

LoadReport apply_model_state(torch::nn::Module& model, CheckedModelState&& checked) {
  TORCH_CHECK(checked.model_ == &model,
              "[mixprec::apply_model_state] the state was checked "
              "against another module, or was applied already");
  const std::map<std::string, at::Tensor> own = own_tensors(model, "apply_model_state");
  for (const auto& copy : checked.copies_) {
    const auto now = own.find(copy.key);
    TORCH_CHECK(now != own.end() && now->second.is_same(copy.target),
                "[mixprec::apply_model_state] '", copy.key, "' of ", model.name(),
                " is no longer the tensor the state was checked against (it was replaced or "
                "removed); check it again");
    TORCH_CHECK(copy.target.sizes() == copy.value.sizes(), "[mixprec::apply_model_state] '",
                copy.key, "' of ", model.name(), " changed shape to ", copy.target.sizes(),
                " since the state was checked; check it again");
  }
  at::NoGradGuard no_grad;
  for (const auto& copy : checked.copies_) at::Tensor(copy.target).copy_(copy.value);
  checked.model_ = nullptr;
  checked.copies_.clear();
  return std::move(checked.report_);
}

LoadReport load_model_sharded_state_dict(torch::nn::Module& model, const ShardedStateDict& state,
                                         const LoadOptions& options) {
  return apply_model_state(model, check_model_sharded_state_dict(model, state, options));
}

}  // namespace mixprec
