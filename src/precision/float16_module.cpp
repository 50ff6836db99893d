#include "mixprec/precision/float16_module.h"

#include <c10/util/Exception.h>

namespace mixprec {

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

}  // namespace mixprec
