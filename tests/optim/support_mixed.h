// Shared pieces of the master-remainder and offloading tests: a model with every parameter
// role at odd sizes, deterministic gradients, and bitwise comparison of two optimizers.
#pragma once

#include "mixprec/optim/float16_optimizer.h"
#include "mixprec/sharded_state_dict.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace mixprec::testing {

// Parameters in named order (the optimizer's order): BF16 of odd sizes (one larger than a
// kernel grain, so several threads share it; one 0-dim), FP16, native FP32, frozen BF16.
struct MixedImpl : torch::nn::Module {
  explicit MixedImpl(uint64_t seed = 7) {
    at::manual_seed(seed);
    auto add = [&](const char* name, std::vector<int64_t> shape, at::ScalarType dtype,
                   bool trainable = true) {
      at::Tensor t = (at::randn(shape) * 0.5).to(dtype);
      register_parameter(name, t, trainable);
    };
    add("a", {37}, at::kBFloat16);
    add("b", {5, 13}, at::kBFloat16);
    add("big", {40003}, at::kBFloat16);
    add("s", {}, at::kBFloat16);
    add("h", {29}, at::kHalf);
    add("f", {11}, at::kFloat);
    add("z", {9}, at::kBFloat16, /*trainable=*/false);
    add("w", {3, 7}, at::kBFloat16);
  }
  at::Tensor param(const std::string& fqn) const { return named_parameters()[fqn]; }
};
TORCH_MODULE(Mixed);

// Deterministic gradients, a function of the step and the parameter (in its dtype, times
// `scale`); parameters listed in `skip` get none (undefined), as if backward missed them.
inline void set_mixed_grads(torch::nn::Module& model, int64_t step, double scale = 1.0,
                            const std::vector<std::string>& skip = {}) {
  int64_t salt = 0;
  for (auto& item : model.named_parameters()) {
    at::Tensor& p = item.value();
    ++salt;
    if (!p.requires_grad()) continue;
    if (std::find(skip.begin(), skip.end(), item.key()) != skip.end()) {
      p.mutable_grad() = at::Tensor();
      continue;
    }
    const at::Tensor g = at::sin(at::arange(std::max<int64_t>(p.numel(), 1), at::kFloat) * 0.731 +
                                 1.37 * step + salt) *
                         (0.05 * scale);
    p.mutable_grad() = g.reshape(p.sizes()).to(p.scalar_type());
  }
}

// Bit-for-bit equality of any two tensors (dtype, shape and bits; -0 != +0).
inline bool same_bits_any(const at::Tensor& a, const at::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  if (a.numel() == 0) return true;
  const auto as_int = a.element_size() == 4 ? at::kInt : at::kShort;
  return at::equal(a.cpu().contiguous().view(as_int), b.cpu().contiguous().view(as_int));
}

// Every tensor and the common state of two optimizers' FQN-keyed state dicts are the same.
inline void expect_same_optimizer_state(const optim::Float16Optimizer& a,
                                        const optim::Float16Optimizer& b,
                                        const std::string& where) {
  const ShardedStateDict sa = a.sharded_state_dict();
  const ShardedStateDict sb = b.sharded_state_dict();
  EXPECT_EQ(sa.common, sb.common) << where;
  ASSERT_EQ(sa.tensors.size(), sb.tensors.size()) << where;
  for (const auto& [key, t] : sa.tensors) {
    ASSERT_TRUE(sb.contains(key)) << where << ": " << key;
    EXPECT_TRUE(same_bits_any(t.local, sb.at(key).local)) << where << ": " << key;
  }
}

// Every parameter of two models is the same, bit for bit.
inline void expect_same_params(const torch::nn::Module& a, const torch::nn::Module& b,
                               const std::string& where) {
  const auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& item : pa) {
    EXPECT_TRUE(same_bits_any(item.value(), pb[item.key()])) << where << ": " << item.key();
  }
}

// The inner algorithms the tests run, with weight decay, amsgrad and momentum variants.
struct AlgoCase {
  std::string name;
  std::function<std::unique_ptr<torch::optim::OptimizerOptions>()> make;
};
inline std::vector<AlgoCase> algo_cases() {
  return {
      {"AdamW",
       [] {
         return std::make_unique<torch::optim::AdamWOptions>(
             torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
       }},
      {"AdamWAmsgrad",
       [] {
         return std::make_unique<torch::optim::AdamWOptions>(
             torch::optim::AdamWOptions(2e-2).weight_decay(0.1).amsgrad(true));
       }},
      {"AdamL2",
       [] {
         return std::make_unique<torch::optim::AdamOptions>(
             torch::optim::AdamOptions(1e-2).weight_decay(0.05));
       }},
      {"SgdNesterov",
       [] {
         return std::make_unique<torch::optim::SGDOptions>(
             torch::optim::SGDOptions(5e-2).momentum(0.9).nesterov(true));
       }},
      {"SgdDampenedDecay",
       [] {
         return std::make_unique<torch::optim::SGDOptions>(
             torch::optim::SGDOptions(0.1).momentum(0.5).dampening(0.25).weight_decay(0.01));
       }},
      {"SgdPlain",
       [] { return std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.1)); }},
  };
}

// A Float16Optimizer over every parameter of `model` in named order.
inline std::unique_ptr<optim::Float16Optimizer> make_mixed_optimizer(
    const torch::nn::Module& model, const AlgoCase& algo,
    optim::Float16OptimizerOptions options = {}) {
  return std::make_unique<optim::Float16Optimizer>(model, *algo.make(), std::move(options));
}

// What a BF16 parameter held with a remainder must be, given the FP32-master path's master
// and its (RNE) BF16 parameter: the same bits, one more (further from zero) where the master
// lies exactly on a tie above an even BF16 value (optim/master_remainder.h).
inline at::Tensor ties_away_param(const at::Tensor& master, const at::Tensor& rne_param) {
  const at::Tensor even_tie = master.view(at::kInt).bitwise_and(0x1FFFF) == 0x8000;
  const at::Tensor bits = rne_param.contiguous().view(at::kShort);
  return at::where(even_tie, bits + 1, bits).to(at::kShort).view(at::kBFloat16);
}

// Exact even ties among the masters of `fqns` (how often the parameters can differ).
inline int64_t even_ties(const at::Tensor& master) {
  return (master.view(at::kInt).bitwise_and(0x1FFFF) == 0x8000).sum().item<int64_t>();
}

// `rem` (remainder form) against `ref` (FP32 masters), after the same steps: every parameter
// but BF16 ones bitwise; BF16 ones bitwise except at even ties (ties_away_param).
inline void expect_params_consistent(const torch::nn::Module& ref_model,
                                     const optim::Float16Optimizer& ref,
                                     const torch::nn::Module& rem_model, const std::string& where) {
  const auto theirs = rem_model.named_parameters();
  for (const auto& item : ref_model.named_parameters()) {
    const at::Tensor& p = item.value();
    const at::Tensor& q = theirs[item.key()];
    if (p.scalar_type() == at::kBFloat16 && p.requires_grad()) {
      const at::Tensor master = ref.main_param(item.key());
      EXPECT_TRUE(same_bits_any(q, ties_away_param(master, p).reshape(p.sizes())))
          << where << ": " << item.key();
    } else {
      EXPECT_TRUE(same_bits_any(p, q)) << where << ": " << item.key();
    }
  }
}

}  // namespace mixprec::testing
