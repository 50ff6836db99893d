#include "mixprec/quant/fake_quant.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>

#include <torch/types.h>
#include <cmath>

namespace mixprec::quant {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

TEST(FakeQuantFp8, ValuesAreExactlyRepresentableAndAmaxMapsToMax) {
  at::manual_seed(0);
  at::Tensor x = torch::randn({64, 33}) * 3;
  for (auto fp8 : {at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
    ScaledFp8 q = quantize_fp8(x, fp8);
    EXPECT_EQ(q.data.scalar_type(), fp8);
    EXPECT_EQ(q.data.sizes(), x.sizes());
    EXPECT_EQ(q.scale_inv.dim(), 0);
    // The largest magnitude lands on the format's largest finite value.
    EXPECT_FLOAT_EQ(q.data.to(at::kFloat).abs().max().item<float>(), fp8_max(fp8));
    EXPECT_FLOAT_EQ(q.scale_inv.item<float>(), x.abs().max().item<float>() / fp8_max(fp8));
  }
}

// Relative error of round-to-nearest with m mantissa bits is at most 2^-(m+1) for normal
// values; e4m3 has 3 bits (≤ 1/16), e5m2 has 2 (≤ 1/8). Values near the subnormal range
// get an absolute bound instead.
TEST(FakeQuantFp8, ErrorIsFp8Sized) {
  at::manual_seed(1);
  at::Tensor x = torch::randn({4096});
  for (auto [fp8, rel] :
       {std::pair{at::kFloat8_e4m3fn, 1.0 / 16}, std::pair{at::kFloat8_e5m2, 1.0 / 8}}) {
    ScaledFp8 q = quantize_fp8(x, fp8);
    at::Tensor y = dequantize_fp8(q, at::kFloat);
    at::Tensor err = (y - x).abs();
    const double tiny = q.scale_inv.item<double>() * (fp8 == at::kFloat8_e4m3fn ? 0.0156 : 6.2e-5);
    EXPECT_TRUE((err <= x.abs() * rel + tiny).all().item<bool>()) << fp8;
    EXPECT_GT(err.max().item<double>(), 0.0) << "quantization should not be lossless";
    // Idempotent: quantizing the dequantized values again changes nothing.
    EXPECT_TRUE(at::equal(fake_quantize_fp8(y, fp8), y)) << fp8;
  }
}

TEST(FakeQuantFp8, ZerosAndDtypes) {
  at::Tensor z = torch::zeros({5}, torch::kBFloat16);
  at::Tensor y = fake_quantize_fp8(z, at::kFloat8_e4m3fn);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(y, z));
  EXPECT_THROW(quantize_fp8(torch::ones({2}, torch::kLong), at::kFloat8_e4m3fn), c10::Error);
  EXPECT_THROW(quantize_fp8(torch::ones({2}), at::kHalf), c10::Error);
}

// A tensor so small that amax / fp8_max underflows FP32 keeps its zeros (no 0 / 0); a NaN or
// an Inf anywhere makes the whole result NaN, in the fused kernel and the ATen composition.
TEST(FakeQuantFp8, TinyAndNonFiniteInputs) {
  for (const auto fp8 : {at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
    const at::Tensor tiny = torch::tensor({0.0f, 1e-44f, -1e-44f});
    for (const at::Tensor& y :
         {fake_quantize_fp8(tiny, fp8), dequantize_fp8(quantize_fp8(tiny, fp8), at::kFloat)}) {
      EXPECT_FALSE(y.isnan().any().item<bool>()) << y;
      EXPECT_EQ(y[0].item<float>(), 0.0f);
    }
    for (const float bad : {std::nanf(""), std::numeric_limits<float>::infinity()}) {
      const at::Tensor x = torch::tensor({1.0f, bad, -2.0f, 0.0f});
      for (const at::Tensor& y :
           {fake_quantize_fp8(x, fp8), dequantize_fp8(quantize_fp8(x, fp8), at::kFloat)}) {
        EXPECT_TRUE(y.isnan().all().item<bool>()) << y;
      }
    }
  }
  EXPECT_TRUE(
      fake_quantize_nvfp4(torch::tensor({1.0f, std::nanf(""), 2.0f})).isnan().all().item<bool>());
}

// A tensor so small that 2688 / amax overflows FP32 (amax under ~7.9e-36) gets the largest
// finite global scale, as in Transformer Engine: a block of zeros decodes to zeros (not
// 0 * Inf), a block of tiny values to values near them (not 0). An Inf, like a NaN, makes
// the whole result NaN.
// FP64 inputs are computed in FP64: values outside FP32's range (1e39, 1e-50) quantize as
// they would scaled into it. Scaling by a power of two commutes with every step (amax, the
// scales, the rounding), so the results scale exactly.
TEST(FakeQuantFp64, ValuesOutsideFp32RangeQuantizeAsScaledOnes) {
  at::manual_seed(4);
  const at::Tensor x = torch::randn({5, 48}, torch::kDouble);
  for (const double s : {std::ldexp(1.0, 130), std::ldexp(1.0, -170), std::ldexp(1.0, 900)}) {
    for (const auto fp8 : {at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
      EXPECT_TRUE(at::equal(fake_quantize_fp8(x * s, fp8), fake_quantize_fp8(x, fp8) * s))
          << s << " " << fp8;
      const ScaledFp8 q = quantize_fp8(x * s, fp8);
      EXPECT_EQ(q.scale_inv.scalar_type(), at::kDouble);
      EXPECT_TRUE(at::equal(dequantize_fp8(q, at::kDouble), fake_quantize_fp8(x, fp8) * s));
    }
    EXPECT_TRUE(at::equal(fake_quantize_nvfp4(x * s), fake_quantize_nvfp4(x) * s)) << s;
  }
  // The reviewer's cases: all-NaN and all-zero results before.
  const at::Tensor big = torch::tensor({1e39, 1.0, -2.0}, torch::kDouble);
  for (const at::Tensor& y :
       {fake_quantize_fp8(big, at::kFloat8_e4m3fn), fake_quantize_nvfp4(big)}) {
    EXPECT_NEAR(y[0].item<double>() / 1e39, 1.0, 1e-12) << y;
    EXPECT_FALSE(y.isnan().any().item<bool>()) << y;
  }
  const at::Tensor tiny = torch::tensor({1e-50, 2e-50, -3e-50}, torch::kDouble);
  const at::Tensor y = fake_quantize_fp8(tiny, at::kFloat8_e4m3fn);
  EXPECT_TRUE(((y - tiny).abs() <= tiny.abs() / 16).all().item<bool>()) << y;
}

// An FP64 value just past a tie between two FP8 values rounds up, not onto the tie: LibTorch's
// FP64 -> FP8 conversion goes through FP32, where 1.0625 + 2^-30 becomes 1.0625 (E4M3's tie
// between 1 and 1.125) and then 1.
TEST(FakeQuantFp64, ValuesAreRoundedOnce) {
  const double above_tie = 1.0625 + std::ldexp(1.0, -30);
  const double below_tie = 1.0625 - std::ldexp(1.0, -30);
  const at::Tensor x = torch::tensor({448.0, above_tie, -above_tie, below_tie}, torch::kDouble);
  const at::Tensor y = fake_quantize_fp8(x, at::kFloat8_e4m3fn);
  EXPECT_EQ(y[1].item<double>(), 1.125);
  EXPECT_EQ(y[2].item<double>(), -1.125);
  EXPECT_EQ(y[3].item<double>(), 1.0);
  // The same for NVFP4's E4M3 block scales: with a tensor amax of 2688 the global scale is 1,
  // and a block of amax 6 * (1.0625 + 2^-30) gets the block scale 1.125, not 1; its amax
  // (5.67 units) then decodes as 6 * 1.125 (it would have been clamped to 6 * 1).
  at::Tensor blocks = torch::zeros({32}, torch::kDouble);
  blocks.narrow(0, 0, 16).fill_(2688.0);
  blocks[16] = 6 * above_tie;
  const at::Tensor nv = fake_quantize_nvfp4(blocks);
  EXPECT_EQ(nv[0].item<double>(), 2688.0);
  EXPECT_EQ(nv[16].item<double>(), 6.75);
}

TEST(FakeQuantNvFp4, TinyAndNonFiniteInputs) {
  for (const float v : {1e-30f, 1e-35f, 5e-36f, 1e-37f, 1e-44f}) {
    at::Tensor x = torch::zeros({32});
    x.narrow(0, 0, 16).fill_(v);
    x[3] = -v;
    const at::Tensor y = fake_quantize_nvfp4(x);
    EXPECT_FALSE(y.isnan().any().item<bool>()) << v << ": " << y;
    EXPECT_TRUE(at::equal(y.narrow(0, 16, 16), torch::zeros({16}))) << v << ": " << y;
    // In FP32's normal range the block's values keep their size and sign (a block of equal
    // magnitudes rounds to 6 or 4 block-scale units: at most a third off). Further down the
    // block scale, amax / 6 times the largest global scale, falls below E4M3's smallest
    // denormal and the block decodes to zeros, as in Transformer Engine.
    if (v >= std::numeric_limits<float>::min()) {
      EXPECT_NEAR(y[0].item<float>() / v, 1.0f, 0.34f) << v << ": " << y;
      EXPECT_LT(y[3].item<float>(), 0.0f) << v;
    }
  }
  EXPECT_TRUE(fake_quantize_nvfp4(torch::zeros({20})).eq(0).all().item<bool>());
  at::Tensor with_inf = torch::randn({40});
  with_inf[20] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(fake_quantize_nvfp4(with_inf).isnan().all().item<bool>());
}

TEST(FakeQuantNvFp4, ValuesLieOnTheScaledE2M1Grid) {
  at::manual_seed(2);
  at::Tensor x = torch::randn({8, 40});  // 40 = two full blocks and a padded one
  at::Tensor y = fake_quantize_nvfp4(x);
  EXPECT_EQ(y.sizes(), x.sizes());
  // Per block, every value divided by the block's largest |value| / 6 is an E2M1 magnitude.
  const std::vector<float> grid = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (int64_t r = 0; r < 8; ++r) {
    for (int64_t b = 0; b < 40; b += 16) {
      at::Tensor block = y[r].narrow(0, b, std::min<int64_t>(16, 40 - b));
      const float amax = block.abs().max().item<float>();
      ASSERT_GT(amax, 0);
      at::Tensor units = block.abs() / (amax / 6);
      for (int64_t i = 0; i < units.numel(); ++i) {
        const float u = units[i].item<float>();
        float best = 1e9;
        for (float g : grid) best = std::min(best, std::abs(u - g));
        EXPECT_LT(best, 1e-3) << "row " << r << " block " << b << " value " << u;
      }
    }
  }
  // 4-bit: error per value is at most half a step of the block's grid (step ≤ 2 units).
  at::Tensor rel = ((y - x).abs() / x.abs().max()).max();
  EXPECT_LT(rel.item<float>(), 0.25);
  EXPECT_GT(rel.item<float>(), 0.0);
}

// Operands pass their gradient straight through; the output node rounds dY in the recipe's
// gradient format.
TEST(QuantizeForGemm, OperandsPassGradientsThroughAndTheOutputRoundsThem) {
  at::manual_seed(3);
  at::Tensor g = torch::randn({32}) * 1e-3;
  for (auto [format, grad_dtype] : {std::pair{QuantFormat::kFp8Hybrid, at::kFloat8_e5m2},
                                    std::pair{QuantFormat::kFp8E4M3, at::kFloat8_e4m3fn}}) {
    at::Tensor x = torch::randn({32}).requires_grad_(true);
    at::Tensor y = quantize_for_gemm(x, format);
    EXPECT_TRUE(at::equal(y.detach(), fake_quantize_fp8(x.detach(), at::kFloat8_e4m3fn)));
    y.backward(g);
    EXPECT_TRUE(at::equal(x.grad(), g));

    at::Tensor out = torch::randn({32}).requires_grad_(true);
    at::Tensor same = quantize_gemm_output_gradient(out, format);
    EXPECT_TRUE(at::equal(same.detach(), out.detach()));
    same.backward(g);
    EXPECT_TRUE(at::equal(out.grad(), fake_quantize_fp8(g, grad_dtype)));
  }
  at::Tensor x = torch::randn({4}).requires_grad_(true);
  EXPECT_TRUE(quantize_for_gemm(x, QuantFormat::kNone).is_same(x));
  EXPECT_TRUE(quantize_gemm_output_gradient(x, QuantFormat::kNone).is_same(x));
}

// Errors name the function the caller called and what it was given.
TEST(FakeQuantErrors, NameTheCallAndTheDtype) {
  auto message = [](auto&& call) {
    try {
      call();
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  const std::string wrong_format = message([] { fake_quantize_fp8(torch::randn({4}), at::kHalf); });
  EXPECT_NE(wrong_format.find("[mixprec::quant::fake_quantize_fp8] the target format"),
            std::string::npos)
      << wrong_format;
  EXPECT_NE(wrong_format.find("Half"), std::string::npos) << wrong_format;
  const std::string fp4_int = message([] { fake_quantize_nvfp4(torch::ones({4}, at::kInt)); });
  EXPECT_NE(fp4_int.find("[mixprec::quant::fake_quantize_nvfp4]"), std::string::npos) << fp4_int;
  EXPECT_NE(fp4_int.find("Int of shape [4]"), std::string::npos) << fp4_int;
  const std::string fp8_input =
      message([] { quantize_fp8(torch::randn({4}).to(at::kFloat8_e5m2), at::kFloat8_e4m3fn); });
  EXPECT_NE(fp8_input.find("Float8_e5m2"), std::string::npos) << fp8_input;
}

// Each value rounds to the nearest E2M1 magnitude, ties to even: spacing 0.5 below 2, 1 from
// 2 to 4, 2 from 4 to 6. A block whose largest value is 6 (and a tensor whose largest is 6)
// has a block scale of exactly 1, so the results are the E2M1 values themselves.
TEST(FakeQuantNvFp4, RoundsToTheNearestE2M1ValueTiesToEven) {
  const at::Tensor x = torch::tensor({6.0f, 3.0f, 3.2f, 3.5f, 2.6f, 2.5f, 1.25f, 0.3f, 0.25f, -5.0f,
                                      -4.9f, 4.5f, 1.75f, 0.0f, -3.0f, 1.1f});
  const at::Tensor expected = torch::tensor({6.0f, 3.0f, 3.0f, 4.0f, 3.0f, 2.0f, 1.0f, 0.5f, 0.0f,
                                             -4.0f, -4.0f, 4.0f, 2.0f, 0.0f, -3.0f, 1.0f});
  const at::Tensor y = fake_quantize_nvfp4(x);
  EXPECT_TRUE(at::equal(y, expected)) << y;
}

// A kept forward value must match the operand's shape and dtype: one of another dtype (a
// BF16 operand kept for an FP32 GEMM) is refused, naming both.
TEST(QuantizeForGemm, AKeptForwardValueOfAnotherDtypeOrShapeIsRefused) {
  const at::Tensor x = torch::randn({4});
  for (const at::Tensor& bad : {x.to(at::kBFloat16), torch::randn({5}), at::Tensor()}) {
    EXPECT_THROW(quantize_for_gemm(x, QuantFormat::kFp8E4M3, bad), c10::Error) << bad;
  }
  try {
    quantize_for_gemm(x, QuantFormat::kFp8E4M3, x.to(at::kBFloat16));
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("forward_value must have x's shape [4] and dtype Float, got [4] BFloat16"),
              std::string::npos)
        << msg;
  }
  EXPECT_NO_THROW(quantize_for_gemm(x, QuantFormat::kFp8E4M3, x.clone()));
}

// An empty tensor quantizes to an empty tensor of its shape and dtype, as in quantize_fp8
// (no amax to take, no block to scale).
TEST(FakeQuantNvFp4, EmptyTensorsComeBackEmpty) {
  for (const auto& shape : {std::vector<int64_t>{0}, {0, 16}, {4, 0}, {2, 0, 40}}) {
    const at::Tensor x = torch::empty(shape, at::kBFloat16);
    at::Tensor y;
    ASSERT_NO_THROW(y = fake_quantize_nvfp4(x)) << x.sizes();
    EXPECT_EQ(y.sizes(), x.sizes());
    EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  }
}

// An FP64 value exactly on a tie between two FP8 values rounds to the even one, up as well as
// down (1.0625 lies between 1 and 1.125, 1.1875 between 1.125 and 1.25).
TEST(FakeQuantFp64, ExactTiesRoundToEven) {
  const at::Tensor x = torch::tensor({448.0, 1.0625, 1.1875, -1.1875}, torch::kDouble);
  const at::Tensor y = fake_quantize_fp8(x, at::kFloat8_e4m3fn);
  EXPECT_EQ(y[1].item<double>(), 1.0);
  EXPECT_EQ(y[2].item<double>(), 1.25);
  EXPECT_EQ(y[3].item<double>(), -1.25);
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::quant
