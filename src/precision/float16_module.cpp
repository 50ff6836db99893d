#include "mixprec/precision/float16_module.h"

#include "detail/name_match.h"

#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <string>
#include <vector>

namespace mixprec {
namespace {

// Appends to `problems` what differs between what the wrapper adopted (`adopted`) and what the
// wrapped module holds now (`current`), one dict of its own tensors or children. `same` says
// whether two values are the same object; `describe` names a newly registered one.
template <typename Dict, typename Same, typename Describe>
void compare_adopted(const Dict& adopted, const Dict& current, const char* kind, Same same,
                     Describe describe, std::vector<std::string>& problems) {
  for (const auto& item : current) {
    const auto* held = adopted.find(item.key());
    if (held == nullptr) {
      problems.push_back(describe(item.key(), item.value()) + " was registered after wrapping");
    } else if (!same(*held, item.value())) {
      problems.push_back(std::string(kind) + " '" + item.key() + "' was replaced after wrapping");
    }
  }
  for (const auto& item : adopted) {
    if (current.find(item.key()) == nullptr) {
      problems.push_back(std::string(kind) + " '" + item.key() + "' was removed after wrapping");
    }
  }
}

}  // namespace

Float16ModuleImpl::Float16ModuleImpl(torch::nn::AnyModule inner, Float16ModuleOptions options)
    : torch::nn::Module("mixprec::Float16Module"),
      options_(std::move(options)),
      inner_(std::move(inner)) {
  TORCH_CHECK(!inner_.is_empty(), "[mixprec::Float16Module] the wrapped module is empty");
  inner_ptr_ = inner_.ptr();
  report_ =
      convert_module_to_dtype_except_fp32_marked(*inner_ptr_, options_.dtype(), options_.plan());
  // Adopt the inner module's tensors and children under their own names: no "module." prefix
  // in parameters(), state or archives, and Module::to/zero_grad reach every tensor.
  for (auto& p : inner_ptr_->named_parameters(/*recurse=*/false)) {
    register_parameter(p.key(), p.value(), p.value().defined() && p.value().requires_grad());
  }
  for (auto& b : inner_ptr_->named_buffers(/*recurse=*/false)) {
    register_buffer(b.key(), b.value());
  }
  for (auto& child : inner_ptr_->named_children()) {
    register_module(child.key(), child.value());
  }
  train(inner_ptr_->is_training());
}

void Float16ModuleImpl::train(bool on) {
  torch::nn::Module::train(on);
  inner_ptr_->train(on);
}

void Float16ModuleImpl::check_adopted(const char* op) const {
  const torch::nn::Module& inner = *inner_ptr_;
  // The common case, nothing registered since: the same names for the same objects, in the
  // same order. Only the top level is compared (the wrapper shares every submodule), a few
  // entries per forward.
  auto same_tensor = [](const at::Tensor& a, const at::Tensor& b) { return a.is_same(b); };
  auto same_module = [](const std::shared_ptr<torch::nn::Module>& a,
                        const std::shared_ptr<torch::nn::Module>& b) { return a == b; };
  auto same_items = [](const auto& a, const auto& b, auto same) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i].key() != b[i].key() || !same(a[i].value(), b[i].value())) return false;
    }
    return true;
  };
  const auto& params = named_parameters(/*recurse=*/false);
  const auto& buffers = named_buffers(/*recurse=*/false);
  const auto& children = named_children();
  const auto inner_params = inner.named_parameters(/*recurse=*/false);
  const auto inner_buffers = inner.named_buffers(/*recurse=*/false);
  const auto inner_children = inner.named_children();
  if (same_items(params, inner_params, same_tensor) &&
      same_items(buffers, inner_buffers, same_tensor) &&
      same_items(children, inner_children, same_module)) {
    return;
  }
  std::vector<std::string> problems;
  compare_adopted(
      params, inner_params, "parameter", same_tensor,
      [](const std::string& key, const at::Tensor&) { return "parameter '" + key + "'"; },
      problems);
  compare_adopted(
      buffers, inner_buffers, "buffer", same_tensor,
      [](const std::string& key, const at::Tensor&) { return "buffer '" + key + "'"; }, problems);
  compare_adopted(
      children, inner_children, "submodule", same_module,
      [](const std::string& key, const std::shared_ptr<torch::nn::Module>& child) {
        std::vector<std::string> names;
        for (const auto& p : child->named_parameters(/*recurse=*/true)) {
          names.push_back(key + "." + p.key());
        }
        for (const auto& b : child->named_buffers(/*recurse=*/true)) {
          names.push_back(key + "." + b.key());
        }
        return "submodule '" + key + "' (" +
               (names.empty() ? std::string("no tensors") : detail::join(names)) + ")";
      },
      problems);
  // Only the order differs (LibTorch keeps registration order, so this takes a removal and a
  // registration under the same name): still not what the wrapper adopted.
  if (problems.empty()) problems.push_back("its parameters, buffers or submodules were reordered");
  detail::check_no_problems(
      problems, std::string("[mixprec::Float16Module::") + op + "] the wrapped module " +
                    inner.name() +
                    " changed after wrapping; the wrapper's parameters and state (what an "
                    "optimizer or checkpoint of it sees) would leave the change out. Register "
                    "every parameter, buffer and submodule before wrapping");
}

void Float16ModuleImpl::save(torch::serialize::OutputArchive& archive) const {
  check_adopted("save");
  torch::nn::Module::save(archive);
}

void Float16ModuleImpl::load(torch::serialize::InputArchive& archive) {
  check_adopted("load");
  torch::nn::Module::load(archive);
}

}  // namespace mixprec
