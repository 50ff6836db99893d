#include "mixprec/sharded_state_dict.h"

#include "detail/name_match.h"

#include <ATen/ATen.h>
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

bool ShardedTensor::is_whole() const { return local.sizes().vec() == global_shape; }

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

// The model's own tensors by FQN, tied tensors once (under their first name).
std::map<std::string, at::Tensor> own_tensors(const torch::nn::Module& model) {
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

ShardedStateDict model_sharded_state_dict(const torch::nn::Module& model) {
  ShardedStateDict out;
  for (const auto& [key, t] : own_tensors(model)) {
    out.tensors.emplace(key, ShardedTensor::whole(t.detach()));
  }
  return out;
}

namespace {
bool is_optimizer_key(const std::string& key) { return key.rfind("optimizer.", 0) == 0; }
}  // namespace

LoadReport load_model_sharded_state_dict(torch::nn::Module& model, const ShardedStateDict& state,
                                         const LoadOptions& options) {
  const std::map<std::string, at::Tensor> own = own_tensors(model);
  LoadReport report;
  std::vector<std::string> problems;
  for (const auto& [key, target] : own) {
    auto it = state.tensors.find(key);
    if (it == state.tensors.end()) {
      report.missing_keys.push_back(key);
      continue;
    }
    const ShardedTensor& saved = it->second;
    TORCH_CHECK(saved.is_whole(), "[mixprec::load_model_sharded_state_dict] '", key,
                "' is a shard; reshard it before loading (checkpoint loader does this)");
    if (saved.local.sizes() != target.sizes()) {
      problems.push_back("'" + key + "': shape " + c10::str(saved.local.sizes()) +
                         " in the state, " + c10::str(target.sizes()) + " in the model");
    }
    const bool both_floating = at::isFloatingType(saved.local.scalar_type()) &&
                               at::isFloatingType(target.scalar_type());
    if (!both_floating && saved.local.scalar_type() != target.scalar_type()) {
      problems.push_back("'" + key + "': dtype " + c10::toString(saved.local.scalar_type()) +
                         " in the state, " + c10::toString(target.scalar_type()) +
                         " in the model");
    }
  }
  for (const auto& [key, value] : state.tensors) {
    if (!is_optimizer_key(key) && !own.count(key)) {
      report.unexpected_keys.push_back(key);
    }
  }
  if (options.strict) {
    for (const auto& key : report.missing_keys) problems.push_back("missing key '" + key + "'");
    for (const auto& key : report.unexpected_keys) {
      auto near = detail::close_matches(key, [&] {
        std::vector<std::string> names;
        for (const auto& [k, v] : own) names.push_back(k);
        return names;
      }());
      problems.push_back("unexpected key '" + key + "'" +
                         (near.empty() ? "" : " (model has: " + detail::join(near) + ")"));
    }
  }
  detail::check_no_problems(
      problems, "[mixprec::load_model_sharded_state_dict] cannot load into " + model.name());

  if (options.dry_run) return report;
  at::NoGradGuard no_grad;
  for (const auto& [key, target] : own) {
    auto it = state.tensors.find(key);
    if (it != state.tensors.end()) at::Tensor(target).copy_(it->second.local);
  }
  return report;
}

}  // namespace mixprec
