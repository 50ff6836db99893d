#include "mixprec/quant/quant_linear.h"

#include "mixprec/precision/convert.h"
#include "mixprec/precision/keep_fp32.h"
#include "mixprec/quant/fake_quant.h"
#include "mixprec/quant/quant_state.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/types.h>

namespace mixprec::quant {
namespace {

const QuantConfig kFp8 = QuantConfig().fp8(Fp8Recipe::kHybrid);
const QuantConfig kFp8Param = QuantConfig().fp8(Fp8Recipe::kE4M3).fp8_param(true);

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
  // The conversion leaves FP8 primary weights alone.
  auto report = convert_module_to_dtype_except_fp32_marked(*layer, at::kBFloat16);
  EXPECT_EQ(layer->weight.scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_EQ(report.entries[0].why, "quantized primary weight");
  // Keeping an FP8 primary weight in FP32 is a contradiction: named, it is an error; a broad
  // pattern simply does not cover it.
  EXPECT_THROW(PrecisionPlan().keep_fp32_name("weight").resolve(*layer), c10::Error);
  auto resolved = PrecisionPlan().keep_fp32_pattern("*").resolve(*layer);
  EXPECT_EQ(resolved.tensors[0].reason, KeepReason::kNone);
}

TEST(QuantLinear, Fp8PrimaryWeightsSurviveClone) {
  std::shared_ptr<torch::nn::Module> copy;
  QuantLinear layer(nullptr);
  {
    QuantModelInitGuard init(kFp8Param);
    layer = QuantLinear(16, 4);
  }
  copy = layer->clone();  // outside the init scope, as clone() usually runs
  auto* cloned = copy->as<QuantLinearImpl>();
  ASSERT_NE(cloned, nullptr);
  EXPECT_EQ(cloned->weight.scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_TRUE(at::equal(cloned->weight.to(at::kFloat), layer->weight.to(at::kFloat)));
  EXPECT_TRUE(at::equal(cloned->weight_scale_inv, layer->weight_scale_inv));
  EXPECT_FALSE(cloned->weight.is_same(layer->weight));
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
  const at::Tensor wq = fake_quantize_fp8(layer->weight.detach(), at::kFloat8_e4m3fn);
  const at::Tensor expected = at::matmul(g, wq);
  EXPECT_TRUE(at::allclose(fake_quantize_fp8(x.grad(), at::kFloat8_e5m2), x.grad()));
  EXPECT_TRUE(at::allclose(x.grad(), fake_quantize_fp8(expected, at::kFloat8_e5m2), 1e-5, 1e-6));
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

}  // namespace
}  // namespace mixprec::quant
