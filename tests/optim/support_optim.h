// Shared pieces of the optimizer tests: the upstream regression model and helpers.
#pragma once

#include "mixprec/optim/float16_optimizer.h"
#include "mixprec/precision/convert.h"
#include "mixprec/precision/keep_fp32.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>

namespace mixprec::testing {

// The upstream regression model. In optimizer order (optimizer_order(); LibTorch itself lists
// a module's own parameters before its children's, so the order is given explicitly):
//   pre.weight (8×8, BF16, trainable), frozen.weight (8×8, BF16, frozen),
//   gate (24, FP32 kept, trainable), post.weight (8×8, BF16, trainable).
struct InterleavedImpl : torch::nn::Module {
  explicit InterleavedImpl(bool gate_fp32 = true) {
    pre = register_module("pre", torch::nn::Linear(torch::nn::LinearOptions(8, 8).bias(false)));
    frozen =
        register_module("frozen", torch::nn::Linear(torch::nn::LinearOptions(8, 8).bias(false)));
    frozen->weight.set_requires_grad(false);
    gate = register_parameter("gate", torch::randn({24}));
    if (gate_fp32) keep_in_fp32(gate);
    post = register_module("post", torch::nn::Linear(torch::nn::LinearOptions(8, 8).bias(false)));
    convert_module_to_dtype_except_fp32_marked(*this, at::kBFloat16);
  }
  std::vector<at::Tensor> optimizer_order() const {
    return {pre->weight, frozen->weight, gate, post->weight};
  }
  // A loss that reaches every trainable parameter.
  at::Tensor loss(const at::Tensor& x) {
    at::Tensor h = post(frozen(pre(x.to(pre->weight.scalar_type()))));
    return h.to(at::kFloat).pow(2).mean() + (gate.to(at::kFloat) * h.to(at::kFloat).mean()).sum();
  }
  torch::nn::Linear pre{nullptr}, frozen{nullptr}, post{nullptr};
  at::Tensor gate;
};
TORCH_MODULE(Interleaved);

// Sets deterministic gradients (a function of the step and the parameter's name).
inline void set_grads(torch::nn::Module& model, int64_t step) {
  int64_t salt = 0;
  for (auto& item : model.named_parameters()) {
    at::Tensor& p = item.value();
    ++salt;
    if (!p.requires_grad()) continue;
    at::Tensor g = at::sin(at::arange(p.numel(), at::kFloat) * 0.37 + 1.3 * step + salt) * 0.1;
    p.mutable_grad() = g.reshape(p.sizes()).to(p.scalar_type()).clone();
  }
}

// A Float16Optimizer over `model` with one group in the model's optimizer order.
template <typename Options>
std::unique_ptr<optim::Float16Optimizer> make_optimizer(const Interleaved& model,
                                                        const Options& options,
                                                        optim::Float16OptimizerOptions mixed = {}) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(model->optimizer_order());
  return std::make_unique<optim::Float16Optimizer>(*model, std::move(groups),
                                                   std::make_unique<Options>(options), mixed);
}

// Same dtype, shape and bits, wherever each tensor lives.
inline bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         (a.device() == b.device() ? at::equal(a, b) : at::equal(a.cpu(), b.cpu()));
}

}  // namespace mixprec::testing
