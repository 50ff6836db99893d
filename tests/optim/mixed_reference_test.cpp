// The mixed case (BF16 param + FP32 master) against PyTorch 2.13's own torch.optim.AdamW.
//
// tests/optim/data/adamw_mixed_reference.json is written by
// scripts/reference/adamw_mixed_reference.py: PyTorch steps an FP32 master with BF16 gradients
// (upcast exactly) and rounds it to BF16 after each step. Inputs and results are bit patterns.
#include "mixprec/optim/float16_optimizer.h"
#include "support/test_env.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>
#include <nlohmann/json.hpp>

#include <fstream>

namespace mixprec::optim {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

const nlohmann::json& reference() {
  static const nlohmann::json doc = [] {
    std::ifstream in(mixprec::test::source_dir() + "/tests/optim/data/adamw_mixed_reference.json");
    EXPECT_TRUE(in.good()) << "reference file missing";
    return nlohmann::json::parse(in);
  }();
  return doc;
}

// Largest distance in units of the last place between two FP32 tensors (for failure messages).
int64_t max_ulp(const at::Tensor& a, const at::Tensor& b) {
  return (a.contiguous().view(at::kInt).to(at::kLong) - b.contiguous().view(at::kInt).to(at::kLong))
      .abs()
      .max()
      .item<int64_t>();
}

at::Tensor from_bits(const nlohmann::json& bits, c10::ScalarType dtype) {
  if (dtype == at::kFloat) {
    std::vector<int32_t> v = bits.get<std::vector<int32_t>>();
    return at::tensor(v, at::kInt).view(at::kFloat).clone();
  }
  std::vector<int32_t> v = bits.get<std::vector<int32_t>>();
  return at::tensor(v, at::kInt).to(at::kShort).view(at::kBFloat16).clone();
}

struct OneParamImpl : torch::nn::Module {
  explicit OneParamImpl(at::Tensor w) { register_parameter("w", std::move(w)); }
};

struct Replay {
  at::Tensor master, model_param, exp_avg, exp_avg_sq, max_exp_avg_sq;
};

Replay replay(const nlohmann::json& c) {
  const auto& doc = reference();
  auto model = std::make_shared<OneParamImpl>(from_bits(doc["param_bf16"], at::kBFloat16));
  Float16Optimizer opt(*model,
                       torch::optim::AdamWOptions(c["lr"].get<double>())
                           .betas({c["betas"][0].get<double>(), c["betas"][1].get<double>()})
                           .eps(c["eps"].get<double>())
                           .weight_decay(c["weight_decay"].get<double>())
                           .amsgrad(c["amsgrad"].get<bool>()));
  at::Tensor w = model->named_parameters()["w"];
  for (const auto& g : doc["grads_bf16"]) {
    w.mutable_grad() = from_bits(g, at::kBFloat16);
    EXPECT_TRUE(opt.update().success);
  }
  const auto sd = opt.sharded_state_dict();
  Replay r{opt.main_param("w"),
           w.detach(),
           sd.at("optimizer.state.exp_avg.w").local,
           sd.at("optimizer.state.exp_avg_sq.w").local,
           {}};
  if (c["amsgrad"].get<bool>()) r.max_exp_avg_sq = sd.at("optimizer.state.max_exp_avg_sq.w").local;
  return r;
}

// Against the fused CPU AdamW, which mixprec's kernel mirrors operation for operation:
// bit-identical masters, moments and BF16 parameters. N is a multiple of 8, so no element
// falls in the scalar loop LibTorch runs for the last numel % 8 (see fused_kernels.h).
TEST(MixedReference, BitwiseAgainstTorchFusedAdamW) {
  int cases = 0;
  for (const auto& c : reference()["cases"]) {
    if (c["implementation"] != "fused") continue;
    ++cases;
    const Replay r = replay(c);
    const auto& e = c["expected"];
    EXPECT_TRUE(at::equal(r.master, from_bits(e["master"], at::kFloat))) << c["name"];
    EXPECT_TRUE(at::equal(r.model_param, from_bits(e["model_param"], at::kBFloat16))) << c["name"];
    EXPECT_TRUE(at::equal(r.exp_avg, from_bits(e["exp_avg"], at::kFloat))) << c["name"];
    EXPECT_TRUE(at::equal(r.exp_avg_sq, from_bits(e["exp_avg_sq"], at::kFloat)))
        << c["name"] << " max ulp "
        << max_ulp(r.exp_avg_sq, from_bits(e["exp_avg_sq"], at::kFloat));
    if (r.max_exp_avg_sq.defined()) {
      EXPECT_TRUE(at::equal(r.max_exp_avg_sq, from_bits(e["max_exp_avg_sq"], at::kFloat)));
    }
  }
  EXPECT_EQ(cases, 2);
}

// Against the single-tensor AdamW (torch's default on CPU). It computes the same formulas in a
// different order (lerp for exp_avg, a separate sqrt/divide for the denominator), so FP32
// results differ by rounding: after 5 steps at most a few units in the last place of the
// update's size. The bound below is 1e-6 relative to the master's magnitude plus 1e-9 absolute
// (an ulp of 1.0 is 1.2e-7); BF16 parameters (8 mantissa bits) must be identical except where
// a master sits on a rounding boundary, which these inputs never hit.
TEST(MixedReference, CloseToTorchSingleTensorAdamW) {
  int cases = 0;
  for (const auto& c : reference()["cases"]) {
    if (c["implementation"] != "single_tensor") continue;
    ++cases;
    const Replay r = replay(c);
    const auto& e = c["expected"];
    const at::Tensor expected = from_bits(e["master"], at::kFloat);
    EXPECT_TRUE(at::allclose(r.master, expected, 1e-6, 1e-9))
        << c["name"] << " max diff " << (r.master - expected).abs().max().item<float>();
    EXPECT_TRUE(at::equal(r.model_param, from_bits(e["model_param"], at::kBFloat16))) << c["name"];
    EXPECT_TRUE(at::allclose(r.exp_avg, from_bits(e["exp_avg"], at::kFloat), 1e-6, 1e-9))
        << c["name"];
    EXPECT_TRUE(at::allclose(r.exp_avg_sq, from_bits(e["exp_avg_sq"], at::kFloat), 1e-6, 0));
  }
  EXPECT_EQ(cases, 2);
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::optim
