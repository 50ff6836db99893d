#include "mixprec/quant/quant_linear.h"

#include "mixprec/optim/float16_optimizer.h"
#include "mixprec/precision/convert.h"
#include "mixprec/precision/float16_module.h"
#include "mixprec/precision/keep_fp32.h"
#include "mixprec/precision/module_clone.h"
#include "mixprec/quant/fake_quant.h"
#include "mixprec/quant/quant_state.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>
#include <torch/types.h>

#include <atomic>
#include <filesystem>
#include <thread>
#include <vector>

namespace mixprec::quant {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

const QuantConfig kFp8 = QuantConfig().fp8(Fp8Recipe::kHybrid);
const QuantConfig kFp8Param = QuantConfig().fp8(Fp8Recipe::kE4M3).fp8_param(true);

// A layer built inside an fp8_param init scope: its primary weight is FP8 with a scale.
QuantLinear fp8_weight_layer(int64_t in, int64_t out) {
  QuantModelInitGuard init(kFp8Param);
  return QuantLinear(in, out);
}

double relative_error(const at::Tensor& y, const at::Tensor& ref) {
  return ((y.to(at::kFloat) - ref.to(at::kFloat)).norm() / ref.to(at::kFloat).norm())
      .item<double>();
}

TEST(QuantLinear, PlainForwardIsExactlyLinear) {
  at::manual_seed(0);
  QuantLinear layer(16, 8);
  at::Tensor x = torch::randn({4, 16});
  EXPECT_TRUE(at::equal(layer(x), at::linear(x, layer->weight, layer->bias)));
  EXPECT_EQ(layer->last_compute().operands, QuantFormat::kNone);
}

// Inside autocast: FP8-sized error (operands carry ≤ 1/16 relative rounding each, the GEMM
// averages them out to a few percent); inside the disabled scope: bit-exact.
TEST(QuantLinear, AutocastQuantizesDisabledScopeIsExact) {
  at::manual_seed(1);
  QuantLinear layer(64, 32);
  at::Tensor x = torch::randn({8, 64});
  const at::Tensor ref = at::linear(x, layer->weight, layer->bias);

  QuantAutocastGuard autocast(kFp8);
  at::Tensor y = layer(x);
  const double err = relative_error(y, ref);
  EXPECT_GT(err, 1e-4) << "FP8 operands must change the result";
  EXPECT_LT(err, 0.08);
  EXPECT_EQ(layer->last_compute().operands, QuantFormat::kFp8Hybrid);
  // The result is exactly the GEMM of the FP8-rounded operands.
  at::Tensor expected =
      at::linear(fake_quantize_fp8(x, at::kFloat8_e4m3fn),
                 fake_quantize_fp8(layer->weight.detach(), at::kFloat8_e4m3fn), layer->bias);
  EXPECT_TRUE(at::allclose(y, expected, 1e-6, 1e-6));
  {
    auto off = fp8_disabled_context(kFp8, /*is_init=*/false);
    EXPECT_TRUE(at::equal(layer(x), ref));
    EXPECT_EQ(layer->last_compute().operands, QuantFormat::kNone);
  }
  EXPECT_FALSE(at::equal(layer(x), ref));
}

TEST(QuantLinear, Fp4AutocastUsesNvFp4) {
  at::manual_seed(2);
  QuantLinear layer(64, 16);
  at::Tensor x = torch::randn({4, 64});
  const at::Tensor ref = at::linear(x, layer->weight, layer->bias);
  QuantAutocastGuard autocast(QuantConfig().fp4(Fp4Recipe::kNvFp4));
  const double err = relative_error(layer(x), ref);
  EXPECT_GT(err, 0.01);
  EXPECT_LT(err, 0.4);
  EXPECT_EQ(layer->last_compute().operands, QuantFormat::kNvFp4);
}

TEST(QuantLinear, Fp32MarkedWeightIsNeverQuantized) {
  at::manual_seed(3);
  QuantLinear router(16, 4);
  keep_in_fp32(router->weight);
  convert_module_to_dtype_except_fp32_marked(*router, at::kBFloat16);
  EXPECT_EQ(router->weight.scalar_type(), at::kFloat);
  at::Tensor x = torch::randn({2, 16}, torch::kBFloat16);
  QuantAutocastGuard autocast(kFp8);
  at::Tensor y = router(x);
  EXPECT_EQ(y.scalar_type(), at::kFloat);
  EXPECT_TRUE(
      at::equal(y, at::linear(x.to(at::kFloat), router->weight, router->bias.to(at::kFloat))));
  EXPECT_TRUE(router->last_compute().kept_fp32);
  EXPECT_EQ(router->last_compute().operands, QuantFormat::kNone);
}

// Kept FP32 by a plan's name or pattern, not only by a mark: never quantized either.
TEST(QuantLinear, WeightKeptFp32ByAPlanPatternIsNeverQuantized) {
  at::manual_seed(3);
  Float16Module wrapped(QuantLinear(16, 4),
                        Float16ModuleOptions().plan(PrecisionPlan().keep_fp32_pattern("weight")));
  auto& router = *wrapped->module()->as<QuantLinearImpl>();
  EXPECT_EQ(router.weight.scalar_type(), at::kFloat);
  QuantAutocastGuard autocast(kFp8);
  router.forward(torch::randn({2, 16}, torch::kBFloat16));
  EXPECT_TRUE(router.last_compute().kept_fp32);
  EXPECT_EQ(router.last_compute().operands, QuantFormat::kNone);
}

TEST(QuantLinear, ModelInitWithFp8ParamHoldsFp8PrimaryWeights) {
  at::manual_seed(4);
  QuantModelInitGuard init(kFp8Param);
  QuantLinear layer(32, 8);
  EXPECT_EQ(layer->weight.scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_FALSE(layer->weight.requires_grad());
  ASSERT_TRUE(layer->has_fp8_weight());
  EXPECT_EQ(layer->named_buffers()["weight_scale_inv"].dim(), 0);
  const at::Tensor w = layer->dequantized_weight(at::kFloat);
  at::Tensor x = torch::randn({3, 32});
  EXPECT_TRUE(at::equal(layer(x), at::linear(x, w, layer->bias)));
  EXPECT_TRUE(layer->last_compute().fp8_weight);
  // The conversion leaves FP8 primary weights alone, and their scale FP32: rounding it would
  // move every dequantized value.
  const at::Tensor scale = layer->weight_scale_inv.clone();
  auto report = convert_module_to_dtype_except_fp32_marked(*layer, at::kBFloat16);
  EXPECT_EQ(layer->weight.scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_EQ(report.entries[0].why, "quantized primary weight");
  EXPECT_EQ(layer->weight_scale_inv.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(layer->weight_scale_inv, scale));
  EXPECT_TRUE(at::equal(layer->dequantized_weight(at::kFloat), w));
  // Keeping an FP8 primary weight in FP32 is a contradiction: named, it is an error; a broad
  // pattern simply does not cover it.
  EXPECT_THROW(PrecisionPlan().keep_fp32_name("weight").resolve(*layer), c10::Error);
  auto resolved = PrecisionPlan().keep_fp32_pattern("*").resolve(*layer);
  EXPECT_EQ(resolved.tensors[0].reason, KeepReason::kNone);
}

TEST(QuantLinear, Fp8PrimaryWeightsSurviveClone) {
  std::shared_ptr<torch::nn::Module> copy;
  QuantLinear layer = fp8_weight_layer(16, 4);
  copy = layer->clone();  // outside the init scope, as clone() usually runs
  auto* cloned = copy->as<QuantLinearImpl>();
  ASSERT_NE(cloned, nullptr);
  EXPECT_EQ(cloned->weight.scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_TRUE(at::equal(cloned->weight.to(at::kFloat), layer->weight.to(at::kFloat)));
  EXPECT_TRUE(at::equal(cloned->weight_scale_inv, layer->weight_scale_inv));
  EXPECT_FALSE(cloned->weight.is_same(layer->weight));
}

// A clone keeps the original's layout whatever init scope is active where it is taken (an
// EMA copy built alongside an FP8 model): a high-precision layer gains no FP8 weight, an FP8
// one stays FP8. Before, the first threw inside LibTorch's clone ("does not have the same
// number of buffers").
TEST(QuantLinear, ClonesKeepTheLayoutInsideAnInitScope) {
  at::manual_seed(6);
  QuantLinear plain(16, 8);
  QuantLinear fp8(nullptr);
  {
    QuantModelInitGuard init(kFp8Param);
    fp8 = QuantLinear(16, 8);
  }
  const at::Tensor x = torch::randn({2, 16});
  for (const QuantConfig& scope :
       {kFp8Param, QuantConfig().fp4(Fp4Recipe::kNvFp4).fp4_param(true), QuantConfig()}) {
    QuantModelInitGuard init(scope);
    for (QuantLinear layer : {plain, fp8}) {
      const std::shared_ptr<torch::nn::Module> copies[] = {layer->clone(),
                                                           mixprec::clone_module(*layer)};
      for (const auto& copy : copies) {
        auto* cloned = copy->as<QuantLinearImpl>();
        ASSERT_NE(cloned, nullptr);
        EXPECT_EQ(cloned->has_fp8_weight(), layer->has_fp8_weight());
        EXPECT_EQ(cloned->weight.scalar_type(), layer->weight.scalar_type());
        EXPECT_EQ(cloned->named_buffers().size(), layer->named_buffers().size());
        EXPECT_EQ(cloned->weight.requires_grad(), layer->weight.requires_grad());
        EXPECT_TRUE(at::equal(cloned->forward(x), layer->forward(x)));
      }
    }
  }
}

TEST(QuantLinear, DisabledInitScopeBuildsHighPrecisionWeights) {
  QuantModelInitGuard init(kFp8Param);
  auto off = fp8_disabled_context(kFp8Param, /*is_init=*/true);
  QuantLinear router(32, 8);
  EXPECT_EQ(router->weight.scalar_type(), at::kFloat);
  EXPECT_FALSE(router->has_fp8_weight());
}

// Backward runs what forward decided, even after the scope has closed.
TEST(QuantLinear, BackwardFollowsTheForwardDecision) {
  at::manual_seed(5);
  QuantLinear layer(16, 4);
  at::Tensor x = torch::randn({2, 16}).requires_grad_(true);
  at::Tensor y;
  {
    QuantAutocastGuard autocast(kFp8);
    y = layer(x);
  }
  at::Tensor g = torch::randn({2, 4});
  y.backward(g);
  // Transformer Engine's hybrid recipe: both backward GEMMs read dY rounded to E5M2 and the
  // E4M3 operands forward used; their results (and the bias gradient) are not rounded.
  const at::Tensor wq = fake_quantize_fp8(layer->weight.detach(), at::kFloat8_e4m3fn);
  const at::Tensor xq = fake_quantize_fp8(x.detach(), at::kFloat8_e4m3fn);
  const at::Tensor gq = fake_quantize_fp8(g, at::kFloat8_e5m2);
  EXPECT_TRUE(at::allclose(x.grad(), at::matmul(gq, wq), 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(layer->weight.grad(), at::matmul(gq.t(), xq), 1e-5, 1e-6));
  EXPECT_TRUE(at::equal(layer->bias.grad(), g.sum(0)));
  EXPECT_FALSE(at::equal(x.grad(), fake_quantize_fp8(x.grad(), at::kFloat8_e5m2)));
}

// What forward must compute, from scratch: both operands through quantize_for_gemm, the bias
// added inside the GEMM, the output through quantize_gemm_output_gradient (the bias's gradient,
// the unrounded dY, is checked in BackwardFollowsTheForwardDecision).
at::Tensor uncached_forward(QuantLinearImpl& layer, const at::Tensor& x, QuantFormat format) {
  return quantize_gemm_output_gradient(
      at::linear(quantize_for_gemm(x, format), quantize_for_gemm(layer.weight, format),
                 layer.bias.defined() ? layer.bias.detach() : layer.bias),
      format);
}

// The weight operand is computed once per weight version; the results (values and gradients)
// are bit for bit those of computing it every time.
TEST(QuantLinear, WeightOperandIsKeptBetweenForwardsAndEqualsRecomputation) {
  at::manual_seed(6);
  QuantLinear layer(64, 32);
  const at::Tensor x = torch::randn({8, 64});
  const at::Tensor g = torch::randn({8, 32});
  QuantAutocastGuard autocast(kFp8);
  for (int call = 0; call < 3; ++call) {
    SCOPED_TRACE(call);
    const at::Tensor xi = x.clone().requires_grad_(true);
    layer->zero_grad();
    const at::Tensor y = layer(xi);
    y.backward(g);
    const at::Tensor weight_grad = layer->weight.grad().clone(), input_grad = xi.grad().clone();

    const at::Tensor xr = x.clone().requires_grad_(true);
    layer->zero_grad();
    const at::Tensor expected = uncached_forward(*layer, xr, QuantFormat::kFp8Hybrid);
    expected.backward(g);
    EXPECT_TRUE(at::equal(y, expected));
    EXPECT_TRUE(at::equal(weight_grad, layer->weight.grad()));
    EXPECT_TRUE(at::equal(input_grad, xr.grad()));
    // The kept operand's gradient is the straight-through one: dYq · Xq, with dY in E5M2.
    const at::Tensor gq = fake_quantize_fp8(g, at::kFloat8_e5m2);
    EXPECT_TRUE(at::allclose(
        weight_grad, at::matmul(gq.t(), fake_quantize_fp8(x, at::kFloat8_e4m3fn)), 1e-5, 1e-6));
  }
  EXPECT_EQ(layer->operand_computations(), 1);
}

// Runs a forward under autocast and checks it against recomputation; returns how many times
// the layer has computed its weight operand so far.
int64_t forward_and_check(QuantLinearImpl& layer, const at::Tensor& x) {
  QuantAutocastGuard autocast(kFp8);
  at::NoGradGuard no_grad;
  const at::Tensor y = layer.forward(x);
  EXPECT_TRUE(at::equal(y, uncached_forward(layer, x, QuantFormat::kFp8Hybrid)));
  return layer.operand_computations();
}

TEST(QuantLinear, AnOptimizerStepInvalidatesTheWeightOperand) {
  at::manual_seed(7);
  QuantLinear model(32, 16);
  convert_module_to_dtype_except_fp32_marked(*model, at::kBFloat16);
  QuantLinearImpl& layer = *model;
  optim::Float16Optimizer opt(*model, torch::optim::AdamWOptions(1e-2));
  const at::Tensor x = torch::randn({4, 32}, at::kBFloat16);
  EXPECT_EQ(forward_and_check(layer, x), 1);
  EXPECT_EQ(forward_and_check(layer, x), 1);
  for (int step = 0; step < 2; ++step) {
    {
      QuantAutocastGuard autocast(kFp8);
      layer.forward(x).to(at::kFloat).square().sum().backward();
    }
    const at::Tensor before = layer.weight.detach().clone();
    ASSERT_TRUE(opt.update().success);  // writes the BF16 weight through raw pointers
    ASSERT_FALSE(at::equal(before, layer.weight));
    EXPECT_EQ(forward_and_check(layer, x), 2 + step);
    opt.zero_grad();
  }
}

TEST(QuantLinear, CopyLoadAndSetDataInvalidateTheWeightOperand) {
  at::manual_seed(8);
  QuantLinear layer(32, 16), other(32, 16);
  const at::Tensor x = torch::randn({4, 32});
  EXPECT_EQ(forward_and_check(*layer, x), 1);
  {
    at::NoGradGuard no_grad;
    layer->weight.copy_(other->weight);
  }
  EXPECT_EQ(forward_and_check(*layer, x), 2);
  // A LibTorch archive load writes the parameters in place.
  const auto path = std::filesystem::temp_directory_path() / "quant_linear_cache_test.pt";
  QuantLinear saved(32, 16);
  torch::save(saved, path.string());
  torch::load(layer, path.string());
  std::filesystem::remove(path);
  ASSERT_TRUE(at::equal(layer->weight, saved->weight));
  EXPECT_EQ(forward_and_check(*layer, x), 3);
  layer->weight.set_data(torch::randn({16, 32}));
  EXPECT_EQ(forward_and_check(*layer, x), 4);
  // Writes LibTorch cannot see (Tensor::data() has its own version counter) need a clear.
  layer->weight.data().mul_(2);
  layer->clear_operand_cache();
  EXPECT_EQ(forward_and_check(*layer, x), 5);
  // Another format is another operand; a clone computes its own.
  {
    QuantAutocastGuard fp4(QuantConfig().fp4(Fp4Recipe::kNvFp4));
    at::NoGradGuard no_grad;
    EXPECT_TRUE(at::equal(layer(x), uncached_forward(*layer, x, QuantFormat::kNvFp4)));
  }
  EXPECT_EQ(layer->operand_computations(), 6);
  auto copy = std::dynamic_pointer_cast<QuantLinearImpl>(layer->clone());
  EXPECT_EQ(forward_and_check(*copy, x), 1);
}

TEST(QuantLinear, Fp8PrimaryWeightOperandFollowsWeightAndScale) {
  at::manual_seed(9);
  QuantLinear layer = fp8_weight_layer(32, 8);
  const at::Tensor x = torch::randn({3, 32});
  auto check = [&] {
    QuantAutocastGuard autocast(kFp8Param);
    EXPECT_TRUE(
        at::equal(layer(x), at::linear(fake_quantize_fp8(x, at::kFloat8_e4m3fn),
                                       layer->dequantized_weight(at::kFloat), layer->bias)));
    return layer->operand_computations();
  };
  EXPECT_EQ(check(), 1);
  EXPECT_EQ(check(), 1);
  layer->weight_scale_inv.mul_(2);  // the scale is a source too
  EXPECT_EQ(check(), 2);
  {
    at::NoGradGuard no_grad;
    layer->weight.copy_(quantize_fp8(torch::randn({8, 32}), at::kFloat8_e4m3fn).data);
  }
  EXPECT_EQ(check(), 3);
}

TEST(QuantLinear, BadInputNamesTheShape) {
  QuantLinear layer(16, 4);
  try {
    layer(torch::randn({2, 15}));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("expects input (..., 16), got shape [2, 15]"), std::string::npos) << msg;
  }
  EXPECT_THROW(QuantLinear(0, 4), c10::Error);
}

// LibTorch counts FP8 dtypes as floating: an FP8 input would run the GEMM in FP8 itself.
TEST(QuantLinear, AnFp8InputIsRefusedNamingTheLayer) {
  QuantLinear layer = fp8_weight_layer(16, 4);
  const at::Tensor x = torch::randn({2, 16}).to(at::kFloat8_e4m3fn);
  try {
    layer(x);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("QuantLinear(16, 4) takes a high-precision floating input"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("Float8_e4m3fn"), std::string::npos) << msg;
  }
  // An FP8 weight cannot be marked FP32 either: it would be reported kept while quantized.
  EXPECT_THROW(keep_in_fp32(layer->weight), c10::Error);
}

// SPEC: FP32-marked tensors are never quantized — an input as much as a weight.
TEST(QuantLinear, AnFp32MarkedInputIsNeverQuantized) {
  at::manual_seed(11);
  QuantLinear layer(16, 4);
  convert_module_to_dtype_except_fp32_marked(*layer, at::kBFloat16);
  const at::Tensor x = keep_in_fp32(torch::randn({3, 16}));
  QuantAutocastGuard autocast(kFp8);
  const at::Tensor y = layer(x);
  EXPECT_EQ(layer->last_compute().operands, QuantFormat::kNone);
  EXPECT_TRUE(layer->last_compute().input_kept_fp32);
  EXPECT_EQ(y.scalar_type(), at::kFloat);
  EXPECT_TRUE(
      at::equal(y, at::linear(x, layer->weight.to(at::kFloat), layer->bias.to(at::kFloat))));
  // The same values unmarked are quantized.
  EXPECT_FALSE(at::equal(layer(x.clone()).to(at::kFloat), y));
}

// The bias is added inside the GEMM, as without quantization: one rounding of a BF16 output,
// not one for the product and another for the bias.
TEST(QuantLinear, TheBiasIsAddedInsideTheGemm) {
  at::manual_seed(15);
  QuantLinear layer(256, 128);
  convert_module_to_dtype_except_fp32_marked(*layer, at::kBFloat16);
  const at::Tensor x = torch::randn({64, 256}, at::kBFloat16);
  QuantAutocastGuard autocast(kFp8);
  at::NoGradGuard no_grad;
  const at::Tensor xq = fake_quantize_fp8(x, at::kFloat8_e4m3fn);
  const at::Tensor wq = fake_quantize_fp8(layer->weight, at::kFloat8_e4m3fn);
  EXPECT_TRUE(at::equal(layer(x), at::linear(xq, wq, layer->bias)));
}

// A quantized layer's output is a tensor of its own, as at::linear's is: it may be written in
// place (relu_, a residual +=), with or without a bias.
TEST(QuantLinear, TheOutputMayBeWrittenInPlace) {
  for (const bool with_bias : {true, false}) {
    SCOPED_TRACE(with_bias);
    at::manual_seed(16);
    QuantLinear layer(QuantLinearOptions(16, 4).bias(with_bias));
    const at::Tensor x = torch::randn({3, 16}).requires_grad_(true);
    QuantAutocastGuard autocast(kFp8);
    at::Tensor y = layer(x);
    const at::Tensor expected = (y.detach() + 1).relu();
    y += 1;
    y.relu_();
    EXPECT_TRUE(at::equal(y.detach(), expected));
    y.sum().backward();
    EXPECT_TRUE(layer->weight.grad().defined());
  }
}

// Both FP8 recipes round the weight to E4M3 in forward: one kept operand serves both.
TEST(QuantLinear, BothFp8RecipesShareTheKeptWeightOperand) {
  at::manual_seed(12);
  QuantLinear layer(32, 8);
  const at::Tensor x = torch::randn({4, 32});
  for (int i = 0; i < 4; ++i) {
    QuantAutocastGuard autocast(i % 2 ? kFp8 : QuantConfig().fp8(Fp8Recipe::kE4M3));
    layer(x);
  }
  EXPECT_EQ(layer->operand_computations(), 1);
}

// A gradient penalty differentiates through backward (create_graph): every backward node of a
// quantized GEMM is differentiable, straight through.
TEST(QuantLinear, SecondOrderGradientsFlowThroughAQuantizedGemm) {
  at::manual_seed(13);
  QuantLinear layer(8, 4);
  const at::Tensor x = torch::randn({5, 8}).requires_grad_(true);
  at::Tensor y;
  {
    QuantAutocastGuard autocast(kFp8);
    y = layer(x);
  }
  const at::Tensor gx = torch::autograd::grad({y.square().sum()}, {x}, {}, /*retain_graph=*/true,
                                              /*create_graph=*/true)[0];
  ASSERT_TRUE(gx.requires_grad());
  gx.square().sum().backward();
  ASSERT_TRUE(layer->weight.grad().defined());
  EXPECT_TRUE(at::isfinite(layer->weight.grad()).all().item<bool>());
  EXPECT_GT(layer->weight.grad().abs().sum().item<float>(), 0.0f);
}

// Forward may run on several threads at once, as torch::nn::Linear's can; the threads share
// the kept operand while the weight changes between rounds.
TEST(QuantLinear, ThreadsShareOneLayerWhileTheWeightChanges) {
  at::manual_seed(14);
  QuantLinear layer(64, 64);
  const at::Tensor x = torch::randn({16, 64});
  constexpr int kThreads = 4, kRounds = 400;
  std::atomic<int> mismatches{0};
  for (int round = 0; round < kRounds; ++round) {
    {
      at::NoGradGuard no_grad;
      layer->weight.add_(1e-3);
    }
    at::Tensor expected;
    {
      at::NoGradGuard no_grad;
      expected = uncached_forward(*layer, x, QuantFormat::kFp8Hybrid);
    }
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        QuantAutocastGuard autocast(t % 2 ? kFp8 : QuantConfig().fp8(Fp8Recipe::kE4M3));
        at::NoGradGuard no_grad;
        if (!at::equal(layer(x), expected)) ++mismatches;
      });
    }
    for (auto& thread : threads) thread.join();
  }
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(layer->operand_computations(), kRounds);
}

// Both FP8 recipes build FP8 primary weights in an fp8_param init scope: the hybrid recipe
// differs from E4M3 in backward only.
TEST(QuantLinear, ModelInitWithTheHybridRecipeAlsoHoldsFp8PrimaryWeights) {
  at::manual_seed(17);
  QuantModelInitGuard init(QuantConfig().fp8(Fp8Recipe::kHybrid).fp8_param(true));
  QuantLinear layer(16, 4);
  EXPECT_TRUE(layer->has_fp8_weight());
  EXPECT_EQ(layer->weight.scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_FALSE(layer->weight.requires_grad());
}

// A disabled NVFP4 init scope (fp8_disabled_context keeps the format, off) builds weights as
// outside any scope: not rounded onto the NVFP4 grid, as the enabled scope's are.
TEST(QuantLinear, DisabledFp4InitScopeLeavesTheWeightUnrounded) {
  const QuantConfig fp4 = QuantConfig().fp4(Fp4Recipe::kNvFp4).fp4_param(true);
  QuantModelInitGuard init(fp4);
  at::manual_seed(18);
  QuantLinear rounded(64, 8);
  auto off = fp8_disabled_context(fp4, /*is_init=*/true);
  at::manual_seed(18);
  QuantLinear plain(64, 8);
  EXPECT_FALSE(at::equal(plain->weight, rounded->weight));
  EXPECT_TRUE(at::equal(fake_quantize_nvfp4(plain->weight), rounded->weight));
}

// Without a kept operand the GEMM runs in the weight's dtype, as torch::nn::Linear's after a
// conversion: a BF16 layer takes an FP32 input to BF16 and returns BF16, quantized or not.
TEST(QuantLinear, TheGemmRunsInTheWeightsDtype) {
  at::manual_seed(19);
  QuantLinear layer(16, 4);
  convert_module_to_dtype_except_fp32_marked(*layer, at::kBFloat16);
  const at::Tensor x = torch::randn({3, 16});
  const at::Tensor y = layer(x);
  EXPECT_EQ(layer->last_compute().dtype, at::kBFloat16);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(y, at::linear(x.to(at::kBFloat16), layer->weight, layer->bias)));
  QuantAutocastGuard autocast(kFp8);
  EXPECT_EQ(layer(x).scalar_type(), at::kBFloat16);
  EXPECT_EQ(layer->last_compute().dtype, at::kBFloat16);
}

// An FP8 primary weight is used as it is under FP8 autocast, not quantized again: its values
// need not span the E4M3 range (a copy, a load), and rescaling them to it would round them.
TEST(QuantLinear, AnFp8PrimaryWeightIsNotRequantizedForAnFp8Gemm) {
  at::manual_seed(20);
  QuantLinear layer = fp8_weight_layer(32, 8);
  {
    at::NoGradGuard no_grad;
    layer->weight.copy_(torch::randn({8, 32}).to(at::kFloat8_e4m3fn));  // amax far below 448
    layer->weight_scale_inv.fill_(1.0);
  }
  const at::Tensor x = torch::randn({3, 32});
  const at::Tensor w = layer->dequantized_weight(at::kFloat);
  ASSERT_FALSE(at::equal(fake_quantize_fp8(w, at::kFloat8_e4m3fn), w));
  QuantAutocastGuard autocast(kFp8);
  EXPECT_TRUE(
      at::equal(layer(x), at::linear(fake_quantize_fp8(x, at::kFloat8_e4m3fn), w, layer->bias)));
  EXPECT_EQ(layer->last_compute().operands, QuantFormat::kFp8Hybrid);
}

// A zero-sized layer is refused by QuantLinear itself, naming the sizes, not by whatever
// LibTorch's initializer throws on an empty weight.
TEST(QuantLinear, NonPositiveSizesAreRefusedNamingThem) {
  for (const auto& [in, out] : {std::pair<int64_t, int64_t>{0, 4}, {4, 0}}) {
    try {
      QuantLinear layer(in, out);
      FAIL() << "expected an error for " << in << " x " << out;
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("[mixprec::QuantLinear] in_features and out_features must be positive, "
                         "got " +
                         std::to_string(in) + " and " + std::to_string(out)),
                std::string::npos)
          << msg;
    }
  }
}

// A layer without a bias rounds dY in the recipe's gradient format as one with a bias does.
TEST(QuantLinear, ALayerWithoutBiasRoundsTheOutputGradientToo) {
  at::manual_seed(22);
  QuantLinear layer(QuantLinearOptions(16, 4).bias(false));
  const at::Tensor x = torch::randn({2, 16}).requires_grad_(true);
  at::Tensor y;
  {
    QuantAutocastGuard autocast(kFp8);
    y = layer(x);
  }
  const at::Tensor g = torch::randn({2, 4});
  y.backward(g);
  const at::Tensor wq = fake_quantize_fp8(layer->weight.detach(), at::kFloat8_e4m3fn);
  const at::Tensor xq = fake_quantize_fp8(x.detach(), at::kFloat8_e4m3fn);
  const at::Tensor gq = fake_quantize_fp8(g, at::kFloat8_e5m2);
  ASSERT_FALSE(at::equal(gq, g));
  EXPECT_TRUE(at::allclose(x.grad(), at::matmul(gq, wq), 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(layer->weight.grad(), at::matmul(gq.t(), xq), 1e-5, 1e-6));
}

// last_compute().to_string() says what the GEMM ran in and why: the operand format and GEMM
// dtype, and each of an FP8 primary weight, a weight kept FP32, an input kept FP32.
TEST(QuantLinear, LastComputeSaysWhatTheGemmRanIn) {
  EXPECT_EQ(LinearCompute{}.to_string(), "fp32");
  LinearCompute quantized;
  quantized.operands = QuantFormat::kFp8Hybrid;
  quantized.dtype = at::kBFloat16;
  quantized.fp8_weight = true;
  EXPECT_EQ(quantized.to_string(), "fp8-hybrid operands, bf16 GEMM, fp8 primary weight");
  LinearCompute kept;
  kept.kept_fp32 = true;
  kept.input_kept_fp32 = true;
  EXPECT_EQ(kept.to_string(), "fp32, weight kept fp32, input kept fp32");
  at::manual_seed(23);
  QuantLinear layer(16, 4);
  convert_module_to_dtype_except_fp32_marked(*layer, at::kBFloat16);
  QuantAutocastGuard autocast(kFp8);
  layer(keep_in_fp32(torch::randn({2, 16})));
  EXPECT_EQ(layer->last_compute().to_string(), "fp32, input kept fp32");
}

// Under NVFP4 autocast an FP8 primary weight is still rounded: the E4M3 grid is not NVFP4's.
TEST(QuantLinear, AnFp8PrimaryWeightIsRoundedForAnNvFp4Gemm) {
  at::manual_seed(24);
  QuantLinear layer = fp8_weight_layer(32, 8);
  const at::Tensor x = torch::randn({3, 32});
  const at::Tensor w = layer->dequantized_weight(at::kFloat);
  ASSERT_FALSE(at::equal(fake_quantize_nvfp4(w), w));
  QuantAutocastGuard autocast(QuantConfig().fp4(Fp4Recipe::kNvFp4));
  at::NoGradGuard no_grad;
  EXPECT_TRUE(
      at::equal(layer(x), at::linear(fake_quantize_nvfp4(x), fake_quantize_nvfp4(w), layer->bias)));
  EXPECT_EQ(layer->last_compute().operands, QuantFormat::kNvFp4);
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::quant
