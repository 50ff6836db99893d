// A small module with every kind of tensor the precision plan has to deal with.
#pragma once

#include "mixprec/precision/keep_fp32.h"

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/types.h>

namespace mixprec::testing {

// Tensors (names relative to the module):
//   fc.weight, fc.bias        floating params, cast by default
//   norm.weight, norm.bias    LayerNorm params (a pattern "*norm*" target)
//   router_weight             param marked keep_in_fp32 in reset()
//   expert_bias               float buffer marked keep_in_fp32 in reset()
//   running_scale             float buffer, cast by default
//   tokens_per_expert         int64 buffer, never cast
//   expert_mask               bool buffer, never cast
struct ToyNetImpl : torch::nn::Cloneable<ToyNetImpl> {
  explicit ToyNetImpl(int64_t width = 8, int64_t experts = 4) : width(width), experts(experts) {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(width, width));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})));
    router_weight =
        register_parameter("router_weight", keep_in_fp32(torch::randn({experts, width})));
    expert_bias = register_buffer("expert_bias", keep_in_fp32(torch::zeros({experts})));
    running_scale = register_buffer("running_scale", torch::ones({width}));
    tokens_per_expert = register_buffer("tokens_per_expert", torch::zeros({experts}, torch::kLong));
    expert_mask = register_buffer("expert_mask", torch::ones({experts}, torch::kBool));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = norm(fc(x)) * running_scale;
    at::Tensor logits = at::linear(h.to(router_weight.scalar_type()), router_weight) + expert_bias;
    return logits;
  }

  int64_t width;
  int64_t experts;
  torch::nn::Linear fc{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  at::Tensor router_weight, expert_bias, running_scale, tokens_per_expert, expert_mask;
};
TORCH_MODULE(ToyNet);

}  // namespace mixprec::testing
