// A small training setup shared by the checkpoint tests and the resume worker: a BF16 (or
// FP16) MLP with an FP32 router and norm, AdamW with masters, data drawn with the default
// CPU generator (so the RNG state decides the data order).
#pragma once

#include "mixprec/optim/float16_optimizer.h"
#include "mixprec/precision/convert.h"
#include "mixprec/precision/keep_fp32.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>

namespace mixprec::testing {

struct TinyNetImpl : torch::nn::Module {
  explicit TinyNetImpl(c10::ScalarType half) {
    at::manual_seed(1234);  // same initial weights in every process
    up = register_module("up", torch::nn::Linear(16, 32));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})));
    router = register_parameter("router", keep_in_fp32(torch::randn({4, 32}) * 0.1));
    down = register_module("down", torch::nn::Linear(32, 4));
    convert_module_to_dtype_except_fp32_marked(*this, half,
                                               PrecisionPlan().keep_fp32_pattern("norm.*"));
  }
  at::Tensor loss(const at::Tensor& x, const at::Tensor& y) {
    const auto half = up->weight.scalar_type();
    at::Tensor h = at::gelu(up(x.to(half)));
    h = norm(h);
    at::Tensor gate = at::softmax(at::linear(h.to(at::kFloat), router), -1);
    at::Tensor out = down(h.to(half)).to(at::kFloat) * gate;
    return (out - y).pow(2).mean();
  }
  torch::nn::Linear up{nullptr}, down{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  at::Tensor router;
};
TORCH_MODULE(TinyNet);

struct TrainingSetup {
  c10::ScalarType half;
  TinyNet model;
  std::unique_ptr<optim::Float16Optimizer> optimizer;
  at::Tensor data_x, data_y;  // a fixed dataset; batches are drawn from it at random

  explicit TrainingSetup(c10::ScalarType half_type) : half(half_type), model(half_type) {
    optim::Float16OptimizerOptions mixed;
    mixed.clip_grad(1.0);
    if (half == at::kHalf) {
      auto scaler = optim::LossScalerOptions::fp16_dynamic();
      scaler.initial_scale(1e30);  // overflows first: skipped steps and backoff get exercised
      scaler.max_scale(1e30);
      scaler.growth_interval(3);
      mixed.loss_scaler(scaler);
    }
    optimizer = std::make_unique<optim::Float16Optimizer>(
        *model, torch::optim::AdamWOptions(3e-3).weight_decay(0.01), mixed);
    at::Generator data_gen = at::detail::createCPUGenerator(99);
    data_x = at::randn({256, 16}, data_gen);
    data_y = at::randn({256, 4}, data_gen);
  }

  // One training step; the batch is drawn with the default CPU generator.
  void step() {
    const at::Tensor idx = at::randint(0, data_x.size(0), {8}, at::kLong);
    optimizer->zero_grad();
    at::Tensor loss = model->loss(data_x.index_select(0, idx), data_y.index_select(0, idx));
    (loss * optimizer->loss_scale()).backward();
    optimizer->update();
  }
};

}  // namespace mixprec::testing
