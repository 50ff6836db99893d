// Float16Module: run a module in BF16/FP16 with the precision plan applied — any module with
// a forward() LibTorch's AnyModule can hold (not a templated one, such as
// torch::nn::Sequential's: wrap a subclass whose forward calls it).
//
// Megatron's Float16Module, for LibTorch: the wrapped module is converted once with
// convert_module_to_dtype_except_fp32_marked; on the first pipeline stage FP32 floating
// inputs are cast to the half dtype, on the last stage BF16/FP16 outputs are cast back to
// FP32 (unless fp32_output is false). Tensors nested in vectors, tuples, pairs and optionals
// are handled; non-floating tensors and non-tensor arguments pass through untouched.
//
// The wrapper adopts the wrapped module's parameters, buffers and children under their own
// names, so its named_parameters(), state and saved archive carry no wrapper prefix: a
// checkpoint of the wrapper loads into the bare module and back — a bare module converted the
// same way (LibTorch's archive load keeps each tensor's dtype and refuses another).
// It adopts them once, at construction: a parameter, buffer or submodule registered on the
// wrapped module itself afterwards (or one removed or replaced there) would run in forward but
// be missing from the wrapper's parameters and state, so an optimizer or checkpoint of the
// wrapper would silently leave it out. forward (before and after the wrapped module's own, so
// that one registering a tensor lazily in its first forward is caught there), save, load and
// mixprec's model state dicts (sharded_state_dict.h) throw c10::Error naming it instead;
// register everything before wrapping. (Tensors registered deeper, on a submodule, are seen:
// the wrapper holds the same submodule. Neither kind is converted.)
#pragma once

#include "mixprec/detail/nested_cast.h"
#include "mixprec/precision/convert.h"
#include "mixprec/precision/precision_plan.h"

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <concepts>
#include <type_traits>

namespace mixprec {

struct Float16ModuleOptions {
  // kHalf or kBFloat16 (checked at construction).
  TORCH_ARG(c10::ScalarType, dtype) = at::kBFloat16;
  // First pipeline stage: cast FP32 inputs to `dtype`. Later stages get half inputs already.
  TORCH_ARG(bool, is_first_stage) = true;
  // Last pipeline stage: outputs may be upcast to FP32 (see fp32_output).
  TORCH_ARG(bool, is_last_stage) = true;
  // On the last stage, cast BF16/FP16 outputs to FP32 (for a loss computed in FP32).
  TORCH_ARG(bool, fp32_output) = true;
  // Names and patterns to keep FP32, on top of keep_in_fp32 marks on tensors.
  TORCH_ARG(PrecisionPlan, plan) = {};
};

class Float16ModuleImpl : public torch::nn::Module {
 public:
  // Converts `inner` in place (see convert.h; throws before changing anything on a bad plan
  // or dtype) and takes over its tensors and children for naming purposes.
  explicit Float16ModuleImpl(torch::nn::AnyModule inner, Float16ModuleOptions options = {});

  template <typename M>
  requires(!std::same_as<std::decay_t<M>, torch::nn::AnyModule>) explicit Float16ModuleImpl(
      M inner, Float16ModuleOptions options = {})
      : Float16ModuleImpl(torch::nn::AnyModule(std::move(inner)), std::move(options)) {}

  // Calls the wrapped module's forward (call it as `wrapped->forward(x)`: the holder's
  // operator() cannot deduce a template forward). `Return` is what that forward returns (a tensor
  // by default); arguments must have the exact types it takes, as with AnyModule.
  template <typename Return = at::Tensor, typename... Args>
  Return forward(Args&&... args) {
    check_adopted("forward");
    const c10::ScalarType half = options_.dtype();
    auto to_half = [&](const at::Tensor& t) {
      return options_.is_first_stage() && t.defined() && t.scalar_type() == at::kFloat ? t.to(half)
                                                                                       : t;
    };
    Return out = inner_.forward<Return>(
        detail::map_tensors(std::decay_t<Args>(std::forward<Args>(args)), to_half)...);
    check_adopted("forward");  // a tensor the wrapped forward registered lazily
    if (!options_.is_last_stage() || !options_.fp32_output()) return out;
    return detail::map_tensors(std::move(out), [](const at::Tensor& t) {
      const bool half_out =
          t.defined() && (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16);
      return half_out ? t.to(at::kFloat) : t;
    });
  }

  // Also sets the wrapped module's own training flag (it is not registered as a child).
  void train(bool on = true) override;

  // Module::save / Module::load, after checking (as forward does) that the wrapper still holds
  // every parameter, buffer and child of the wrapped module.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  const Float16ModuleOptions& options() const { return options_; }
  const ConversionReport& conversion_report() const { return report_; }
  const std::shared_ptr<torch::nn::Module>& module() const { return inner_ptr_; }

  // Throws c10::Error, naming `op` and every difference, unless the wrapper's own parameters,
  // buffers and children are still exactly the wrapped module's (same names, same tensors and
  // modules). forward, save, load and the model state dicts call it; call it before building an
  // optimizer from parameters() if the wrapped module may have changed since wrapping.
  void check_adopted(const char* op) const;

 private:
  Float16ModuleOptions options_;
  torch::nn::AnyModule inner_;
  std::shared_ptr<torch::nn::Module> inner_ptr_;
  ConversionReport report_;
};

TORCH_MODULE(Float16Module);

}  // namespace mixprec
