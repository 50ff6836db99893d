// Fused optimizer kernels against the real references, in the same process:
//   * at::_fused_adamw_ / at::_fused_adam_ / at::_fused_sgd_ (LibTorch's fused CPU kernels),
//   * torch::optim::AdamW / Adam / SGD (LibTorch's tensor-op optimizers),
//   * at::Tensor::to(kBFloat16 / kHalf) for the model-parameter rounding.
//
// Tolerances, and why:
//   * vs the fused kernels: BIT-EXACT. Our kernel performs the same float operations in the same
//     order, with the same FMAs the AVX2/AVX-512 build of the reference executes. One exception
//     lies in the reference itself: its remainder loop (the last numel % 16 elements) is
//     auto-vectorized 8 wide by its compiler, and the final numel % 8 elements fall to a scalar
//     epilogue that contracts `v * beta2 + (c * g) * g` (and SGD's momentum) the other way:
//     one rounding differs per step there, so those <= 7 elements get kTailUlps. Without FMA
//     hardware (Highway SSE4/SSSE3/scalar, ATen "default") the FMAs round twice, and only the
//     tolerance applies.
//   * vs torch::optim: that code uses other formulas for the same math (mul_+add_ instead of
//     lerp_, division by a scalar done as a reciprocal multiply), a few roundings per step
//     that differ. Bound per step: 1 ulp of the parameter (the final add may round the other
//     way) plus a few ulps of the update (|update| <= ~3 lr here); errors add up over steps.
//     (torch::optim::SGD happens to use the same FMAs: it matches bit for bit, which the
//     tolerance does not require.)
#include "mixprec/optim/fused_kernels.h"

#include <ATen/Version.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "optim/support_kernels.h"

// White-box hooks (SIMD target selection, the non-CPU fallback) from the private headers.
#include "../../src/optim/kernels/aten_fallback.h"
#include "../../src/optim/kernels/format_dispatch.h"
#include "../../src/optim/kernels/kernel_args.h"

namespace mixprec::optim {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using mixprec::testing::bumped_by;
using mixprec::testing::expect_rejected;
using mixprec::testing::same_bits;

constexpr int64_t kSteps = 4;
// The reference's scalar epilogue rounds one multiply-add differently: 1 ulp per step, and a
// difference carried into later steps through the moments can grow relative to a shrinking
// value (observed: <= 3 after 4 steps).
constexpr int64_t kTailUlps = 2 * kSteps;
constexpr int64_t kRefEpilogue = 8;  // the reference's scalar epilogue: the last numel % 8

// Largest distance in FP32 ulps (representable values between a and b); NaN counts as huge.
int64_t max_ulps(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0) return 0;
  auto ordered = [](const at::Tensor& t) {
    at::Tensor bits = t.contiguous().view(at::kInt).to(at::kLong);
    return at::where(bits < 0, -bits - (int64_t{1} << 31), bits);
  };
  at::Tensor d = (ordered(a) - ordered(b)).abs();
  d.masked_fill_(a.isnan() | b.isnan(), int64_t{1} << 40);
  return d.max().item<int64_t>();
}

// max |a-b| / (|b| * 2^-23 + floor): an error measured in ulps of max(|b|, floor / 2^-23).
double max_rel_ulps(const at::Tensor& a, const at::Tensor& b, double floor) {
  if (a.numel() == 0) return 0.0;
  at::Tensor ad = a.to(at::kDouble), bd = b.to(at::kDouble);
  return ((ad - bd).abs() / (bd.abs() * std::ldexp(1.0, -23) + floor)).max().item<double>();
}

// True when both sides execute the reference's FMAs: a Highway target with FMA for us, and
// LibTorch's AVX2 or AVX-512 kernels (not its "DEFAULT" build, chosen on CPUs without AVX2 or
// through ATEN_CPU_CAPABILITY).
bool bit_exact_targets() {
  const std::string ours = detail::active_simd_target();
  const std::string aten = at::get_cpu_capability();
  return (aten == "AVX2" || aten == "AVX512") &&
         (ours == "AVX2" || ours == "AVX3" || ours == "AVX3_DL");
}

struct AdamState {
  at::Tensor param, exp_avg, exp_avg_sq, max_exp_avg_sq;
  AdamState clone() const {
    return {param.clone(), exp_avg.clone(), exp_avg_sq.clone(),
            max_exp_avg_sq.defined() ? max_exp_avg_sq.clone() : at::Tensor()};
  }
};

AdamState fresh_state(int64_t n, bool amsgrad) {
  return {at::randn({n}), at::zeros({n}), at::zeros({n}), amsgrad ? at::zeros({n}) : at::Tensor()};
}

void reference_fused_adam(AdamState& s, const at::Tensor& grad, int64_t step,
                          const AdamHyperParams& hp) {
  std::vector<at::Tensor> max_sq;
  if (hp.amsgrad) max_sq.push_back(s.max_exp_avg_sq);
  const std::vector<at::Tensor> steps{at::full({}, static_cast<float>(step))};
  if (hp.decoupled_weight_decay) {
    at::_fused_adamw_({s.param}, {grad}, {s.exp_avg}, {s.exp_avg_sq}, max_sq, steps, hp.lr,
                      hp.beta1, hp.beta2, hp.weight_decay, hp.eps, hp.amsgrad, hp.maximize);
  } else {
    at::_fused_adam_({s.param}, {grad}, {s.exp_avg}, {s.exp_avg_sq}, max_sq, steps, hp.lr, hp.beta1,
                     hp.beta2, hp.weight_decay, hp.eps, hp.amsgrad, hp.maximize);
  }
}

void ours_adam(AdamState& s, const at::Tensor& grad, int64_t step, const AdamHyperParams& hp,
               const at::Tensor& model = {}, double grad_scale_inv = 1.0) {
  fused_adam_step(s.param, grad, s.exp_avg, s.exp_avg_sq, s.max_exp_avg_sq, model, step, hp,
                  grad_scale_inv);
}

// Bit-exact except the reference's scalar epilogue (see the file comment).
void expect_matches_fused(const at::Tensor& ours, const at::Tensor& ref, const char* what) {
  const int64_t n = ours.numel();
  const int64_t vec_end = bit_exact_targets() ? n - n % kRefEpilogue : 0;
  EXPECT_TRUE(same_bits(ours.slice(0, 0, vec_end), ref.slice(0, 0, vec_end)))
      << what << ": " << max_ulps(ours.slice(0, 0, vec_end), ref.slice(0, 0, vec_end))
      << " ulps in the vector part";
  EXPECT_LE(max_ulps(ours.slice(0, vec_end), ref.slice(0, vec_end)), kTailUlps) << what;
}

struct AdamCase {
  const char* name;
  AdamHyperParams hp;
};

std::vector<AdamCase> adam_cases() {
  auto hp = [](double wd, bool decoupled, bool amsgrad, bool maximize, double beta1 = 0.9) {
    AdamHyperParams h;
    h.lr = 1e-2;
    h.beta1 = beta1;
    h.weight_decay = wd;
    h.decoupled_weight_decay = decoupled;
    h.amsgrad = amsgrad;
    h.maximize = maximize;
    return h;
  };
  return {{"AdamW", hp(0.01, true, false, false)},
          {"AdamWNoDecay", hp(0.0, true, false, false)},
          {"AdamL2", hp(0.1, false, false, false)},
          {"AdamWAmsgrad", hp(0.05, true, true, false)},
          {"AdamAmsgradMaximize", hp(0.02, false, true, true)},
          {"AdamWMaximizeBeta05", hp(0.01, true, false, true, 0.5)}};  // lerp's other branch
}

class AdamVsFused : public ::testing::TestWithParam<std::tuple<int64_t, int>> {};

TEST_P(AdamVsFused, MatchesAtenFusedKernelOverSteps) {
  const auto [n, which] = GetParam();
  const AdamCase c = adam_cases()[which];
  at::manual_seed(n + which);
  AdamState ours = fresh_state(n, c.hp.amsgrad);
  AdamState ref = ours.clone();
  for (int64_t step = 1; step <= kSteps; ++step) {
    const at::Tensor grad = at::randn({n}) * (0.5 * step);
    ours_adam(ours, grad, step, c.hp);
    reference_fused_adam(ref, grad, step, c.hp);
  }
  expect_matches_fused(ours.param, ref.param, "param");
  expect_matches_fused(ours.exp_avg, ref.exp_avg, "exp_avg");
  expect_matches_fused(ours.exp_avg_sq, ref.exp_avg_sq, "exp_avg_sq");
  if (c.hp.amsgrad) expect_matches_fused(ours.max_exp_avg_sq, ref.max_exp_avg_sq, "max_exp_avg_sq");
}

INSTANTIATE_TEST_SUITE_P(Sizes, AdamVsFused,
                         ::testing::Combine(::testing::Values(1, 7, 24, 1000003),
                                            ::testing::Range(0, 6)),
                         [](const auto& info) {
                           return adam_cases()[std::get<1>(info.param)].name + std::string("_") +
                                  std::to_string(std::get<0>(info.param));
                         });

TEST(FusedAdam, MidTrainingStateMatchesFusedKernel) {
  // Large step counts (bias corrections near 1) and non-zero moments.
  const int64_t n = 4099;
  at::manual_seed(3);
  AdamHyperParams hp;
  hp.weight_decay = 0.1;
  AdamState ours{at::randn({n}), at::randn({n}) * 0.1, at::rand({n}) * 0.01, {}};
  AdamState ref = ours.clone();
  for (int64_t step = 1000; step < 1003; ++step) {
    const at::Tensor grad = at::randn({n});
    ours_adam(ours, grad, step, hp);
    reference_fused_adam(ref, grad, step, hp);
  }
  expect_matches_fused(ours.param, ref.param, "param");
  expect_matches_fused(ours.exp_avg, ref.exp_avg, "exp_avg");
  expect_matches_fused(ours.exp_avg_sq, ref.exp_avg_sq, "exp_avg_sq");
}

// ---------------------------------------------------------------- vs torch::optim

// Per step: 1 ulp of the parameter + 2^-19 * lr (a few ulps of an update of up to ~3 lr).
void expect_matches_torch_optim(const at::Tensor& ours, const at::Tensor& ref, double lr,
                                int64_t steps) {
  const double ulps = max_rel_ulps(ours, ref, std::ldexp(lr, -19) * steps);
  EXPECT_LE(ulps, static_cast<double>(steps)) << "error in ulps of the parameter/update scale";
}

TEST(FusedAdam, MatchesTorchOptimAdamWAndAdam) {
  const int64_t n = 1000003;
  for (int variant = 0; variant < 4; ++variant) {
    const bool decoupled = variant % 2 == 0, amsgrad = variant >= 2;
    SCOPED_TRACE(std::string(decoupled ? "AdamW" : "Adam") + (amsgrad ? "+amsgrad" : ""));
    at::manual_seed(10 + variant);
    AdamHyperParams hp;
    hp.lr = 1e-2;
    hp.weight_decay = 0.05;
    hp.decoupled_weight_decay = decoupled;
    hp.amsgrad = amsgrad;
    AdamState ours = fresh_state(n, amsgrad);
    at::Tensor p = ours.param.clone().set_requires_grad(true);
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (decoupled) {
      opt = std::make_unique<torch::optim::AdamW>(
          std::vector<at::Tensor>{p},
          torch::optim::AdamWOptions(hp.lr).weight_decay(hp.weight_decay).amsgrad(amsgrad));
    } else {
      opt = std::make_unique<torch::optim::Adam>(
          std::vector<at::Tensor>{p},
          torch::optim::AdamOptions(hp.lr).weight_decay(hp.weight_decay).amsgrad(amsgrad));
    }
    for (int64_t step = 1; step <= kSteps; ++step) {
      const at::Tensor grad = at::randn({n});
      ours_adam(ours, grad, step, hp);
      p.mutable_grad() = grad.clone();
      opt->step();
    }
    expect_matches_torch_optim(ours.param, p.detach(), hp.lr, kSteps);
  }
}

TEST(FusedAdam, MaximizeEqualsNegatedGradient) {
  // torch::optim has no maximize; torch.optim defines it as stepping on -grad.
  const int64_t n = 1027;
  at::manual_seed(4);
  AdamHyperParams hp;
  hp.weight_decay = 0.01;
  AdamState a = fresh_state(n, false), b = a.clone();
  AdamHyperParams hp_max = hp;
  hp_max.maximize = true;
  for (int64_t step = 1; step <= kSteps; ++step) {
    const at::Tensor grad = at::randn({n});
    ours_adam(a, grad, step, hp_max);
    ours_adam(b, -grad, step, hp);
  }
  EXPECT_TRUE(same_bits(a.param, b.param));
}

// ---------------------------------------------------------------- mixed precision streams

class AdamMixed : public ::testing::TestWithParam<c10::ScalarType> {};

TEST_P(AdamMixed, ModelParamIsRneOfMainAndLowPrecisionGradIsWidenedExactly) {
  const c10::ScalarType half = GetParam();
  const int64_t n = 100003;
  at::manual_seed(5);
  AdamHyperParams hp;
  hp.weight_decay = 0.01;
  hp.amsgrad = true;
  AdamState mixed = fresh_state(n, true), fp32 = mixed.clone();
  at::Tensor model = at::empty({n}, at::TensorOptions(half));
  for (int64_t step = 1; step <= kSteps; ++step) {
    const at::Tensor grad = at::randn({n}).to(half);
    ours_adam(mixed, grad, step, hp, model);
    ours_adam(fp32, grad.to(at::kFloat), step, hp);
    ASSERT_TRUE(same_bits(model, mixed.param.to(half))) << "step " << step;
  }
  EXPECT_TRUE(same_bits(mixed.param, fp32.param));
  EXPECT_TRUE(same_bits(mixed.exp_avg, fp32.exp_avg));
  EXPECT_TRUE(same_bits(mixed.exp_avg_sq, fp32.exp_avg_sq));
  EXPECT_TRUE(same_bits(mixed.max_exp_avg_sq, fp32.max_exp_avg_sq));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, AdamMixed, ::testing::Values(at::kBFloat16, at::kHalf),
                         [](const auto& info) { return std::string(c10::toString(info.param)); });

TEST(FusedAdam, GradScaleInvEqualsFeedingTheScaledGradient) {
  const int64_t n = 70001;
  const double inv = 1.0 / 1024.0 / 3.0;  // not a power of two: the product rounds
  for (const auto grad_dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(grad_dtype));
    at::manual_seed(6);
    AdamHyperParams hp;
    AdamState a = fresh_state(n, false), b = a.clone();
    for (int64_t step = 1; step <= kSteps; ++step) {
      const at::Tensor grad = (at::randn({n}) * 3072.0).to(grad_dtype);
      ours_adam(a, grad, step, hp, {}, inv);
      ours_adam(b, grad.to(at::kFloat) * inv, step, hp);
    }
    EXPECT_TRUE(same_bits(a.param, b.param));
    EXPECT_TRUE(same_bits(a.exp_avg_sq, b.exp_avg_sq));
  }
}

// ---------------------------------------------------------------- SGD

struct SgdCase {
  const char* name;
  SgdHyperParams hp;
};

std::vector<SgdCase> sgd_cases() {
  auto hp = [](double momentum, double dampening, bool nesterov, double wd, bool maximize) {
    SgdHyperParams h;
    h.lr = 0.05;
    h.momentum = momentum;
    h.dampening = dampening;
    h.nesterov = nesterov;
    h.weight_decay = wd;
    h.maximize = maximize;
    return h;
  };
  return {{"Plain", hp(0, 0, false, 0, false)},
          {"WeightDecay", hp(0, 0, false, 0.1, false)},
          {"MomentumDampening", hp(0.9, 0.1, false, 0.01, false)},
          {"Nesterov", hp(0.9, 0, true, 0.01, false)},
          {"NesterovMaximize", hp(0.8, 0, true, 0, true)}};
}

class SgdVsReferences : public ::testing::TestWithParam<std::tuple<int64_t, int>> {};

TEST_P(SgdVsReferences, MatchesFusedKernelAndTorchOptimSgd) {
  const auto [n, which] = GetParam();
  const SgdHyperParams hp = sgd_cases()[which].hp;
  const bool momentum = hp.momentum != 0.0;
  at::manual_seed(20 + which);
  at::Tensor ours = at::randn({n});
  at::Tensor ref = ours.clone(), torch_p = ours.clone().set_requires_grad(true);
  at::Tensor ours_buf = momentum ? at::empty({n}) : at::Tensor();
  at::Tensor ref_buf = momentum ? at::empty({n}) : at::Tensor();
  torch::optim::SGD opt({torch_p}, torch::optim::SGDOptions(hp.lr)
                                       .momentum(hp.momentum)
                                       .dampening(hp.dampening)
                                       .nesterov(hp.nesterov)
                                       .weight_decay(hp.weight_decay));
  for (int64_t step = 1; step <= kSteps; ++step) {
    const at::Tensor grad = at::randn({n});
    fused_sgd_step(ours, grad, ours_buf, {}, step == 1, hp);
    std::vector<at::Tensor> bufs;
    if (momentum) bufs.push_back(ref_buf);
    at::_fused_sgd_({ref}, {grad}, bufs, hp.weight_decay, hp.momentum, hp.lr, hp.dampening,
                    hp.nesterov, hp.maximize, step == 1);
    torch_p.mutable_grad() = hp.maximize ? -grad : grad.clone();  // no maximize in C++
    opt.step();
  }
  expect_matches_fused(ours, ref, "param");
  if (momentum) expect_matches_fused(ours_buf, ref_buf, "momentum_buffer");
  expect_matches_torch_optim(ours, torch_p.detach(), hp.lr, kSteps);
}

INSTANTIATE_TEST_SUITE_P(Sizes, SgdVsReferences,
                         ::testing::Combine(::testing::Values(1, 7, 24, 1000003),
                                            ::testing::Range(0, 5)),
                         [](const auto& info) {
                           return sgd_cases()[std::get<1>(info.param)].name + std::string("_") +
                                  std::to_string(std::get<0>(info.param));
                         });

TEST(FusedSgd, LowPrecisionStreamsAndScale) {
  const int64_t n = 50001;
  at::manual_seed(7);
  SgdHyperParams hp;
  hp.momentum = 0.9;
  hp.weight_decay = 0.01;
  for (const auto half : {at::kBFloat16, at::kHalf}) {
    at::Tensor a = at::randn({n}), b = a.clone(), buf_a = at::empty({n}), buf_b = at::empty({n});
    at::Tensor model = at::empty({n}, at::TensorOptions(half));
    for (int64_t step = 1; step <= kSteps; ++step) {
      const at::Tensor grad = (at::randn({n}) * 512.0).to(half);
      fused_sgd_step(a, grad, buf_a, model, step == 1, hp, 1.0 / 512.0);
      fused_sgd_step(b, grad.to(at::kFloat) * (1.0 / 512.0), buf_b, {}, step == 1, hp);
      ASSERT_TRUE(same_bits(model, a.to(half)));
    }
    EXPECT_TRUE(same_bits(a, b));
    EXPECT_TRUE(same_bits(buf_a, buf_b));
  }
}

// ---------------------------------------------------------------- conversions

// Every FP32 exponent and many mantissas: random bit patterns plus the rounding edge cases.
at::Tensor float_patterns() {
  at::manual_seed(8);
  at::Tensor random = at::randint(INT32_MIN, INT32_MAX, {1 << 20}, at::kInt).view(at::kFloat);
  // clang-format off
  const std::vector<float> edges = {
      0.f, -0.f, 1.f, 1.00390625f, 1.01171875f,                           // BF16 ties
      std::ldexp(1.f, -25), std::ldexp(1.5f, -25), std::ldexp(3.f, -25),  // FP16 subnormal ties
      std::ldexp(1.f, -24), std::ldexp(1023.5f, -24), std::ldexp(1.f, -14),
      65504.f, 65519.99f, 65520.f, 65536.f, 3.4e38f, -3.4e38f,            // overflow to Inf
      INFINITY, -INFINITY, std::ldexp(1.f, -126), std::ldexp(1.f, -149), 1e-40f, -1e-45f};
  // clang-format on
  at::Tensor fixed = at::tensor(edges);
  // Ties for BF16 (low 16 bits 0x8000) and FP16 (low 13 bits 0x1000) on both mantissa parities.
  at::Tensor ties = at::arange(0, 1 << 16, at::kInt) * 65536 + 0x8000;
  at::Tensor ties16 = at::arange(0, 1 << 19, at::kInt) * 8192 + 0x1000;
  return at::cat({random, fixed, ties.view(at::kFloat), ties16.view(at::kFloat)});
}

void expect_rne_like_aten(const at::Tensor& master, const at::Tensor& model) {
  const at::Tensor expected = master.to(model.scalar_type());
  const at::Tensor nan = master.isnan();
  EXPECT_TRUE(at::equal(model.isnan(), nan));
  const at::Tensor keep = ~nan;
  EXPECT_TRUE(same_bits(model.masked_select(keep), expected.masked_select(keep)));
}

TEST(CopyMasterToModel, RoundsToNearestEvenLikeTensorTo) {
  const at::Tensor master = float_patterns();
  for (const auto half : {at::kBFloat16, at::kHalf}) {
    at::Tensor model = at::empty_like(master, at::TensorOptions(half));
    copy_master_to_model(master, model);
    expect_rne_like_aten(master, model);
  }
}

// Every compiled Highway target this CPU runs must round and widen identically.
TEST(SimdTargets, EveryTargetConvertsExactlyAndAgreesOnAdam) {
  const std::vector<std::string> targets = detail::supported_simd_targets();
  ASSERT_FALSE(targets.empty());
  const at::Tensor master = float_patterns();
  // Widening: every FP16/BF16 pattern through SGD with lr=1 from -0 gives param = -grad
  // exactly (fma(g, -1, -0) = -g, signed zeros included).
  const at::Tensor all16 = at::arange(-32768, 32768, at::kInt).to(at::kShort);
  SgdHyperParams unit;
  unit.lr = 1.0;
  at::manual_seed(9);
  const int64_t n = 10007;
  const at::Tensor grad = at::randn({n});
  AdamHyperParams hp;
  hp.weight_decay = 0.01;
  AdamState best = fresh_state(n, false);
  const AdamState start = best.clone();
  ours_adam(best, grad, 1, hp);
  struct RestoreAutomaticTarget {
    ~RestoreAutomaticTarget() { detail::force_simd_target(""); }
  } restore;
  for (const auto& name : targets) {
    SCOPED_TRACE(name);
    detail::force_simd_target(name);
    ASSERT_EQ(detail::active_simd_target(), name);
    for (const auto half : {at::kBFloat16, at::kHalf}) {
      at::Tensor model = at::empty_like(master, at::TensorOptions(half));
      copy_master_to_model(master, model);
      expect_rne_like_aten(master, model);
      const at::Tensor g16 = all16.view(half);
      at::Tensor p = at::full({g16.numel()}, -0.0f);
      fused_sgd_step(p, g16, {}, {}, false, unit);
      const at::Tensor expected = -g16.to(at::kFloat);
      EXPECT_TRUE(at::equal(p.isnan(), expected.isnan()));
      EXPECT_TRUE(same_bits(p.masked_select(~p.isnan()), expected.masked_select(~p.isnan())));
    }
    AdamState s = start.clone();
    ours_adam(s, grad, 1, hp);
    // Without FMA hardware hn::MulAdd rounds twice: one extra rounding per fused op.
    const bool fma = name == "AVX2" || name == "AVX3" || name == "AVX3_DL";
    EXPECT_LE(max_ulps(s.param, best.param), fma ? 0 : 2);
  }
}

// One template maps run-time formats to kernel instantiations: every pair must reach its own.
TEST(FormatDispatch, EveryRuntimePairReachesItsInstantiation) {
  using detail::GradFormat;
  using detail::ModelFormat;
  for (const auto g : {GradFormat::kF32, GradFormat::kBF16, GradFormat::kF16}) {
    for (const auto m :
         {ModelFormat::kNone, ModelFormat::kBF16, ModelFormat::kF16, ModelFormat::kBF16Remainder}) {
      const auto [grad, model] = detail::dispatch_formats(g, m, [](auto gt, auto mt) {
        constexpr GradFormat kGrad = decltype(gt)::value;  // compile-time constants
        constexpr ModelFormat kModel = decltype(mt)::value;
        return std::pair{kGrad, kModel};
      });
      EXPECT_EQ(grad, g);
      EXPECT_EQ(model, m);
    }
  }
}

// ---------------------------------------------------------------- grad_stats

TEST(GradStats, SumOfSquaresAndFiniteness) {
  at::manual_seed(11);
  for (const int64_t n : {0, 1, 7, 1000003}) {
    for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      SCOPED_TRACE(std::to_string(n) + " " + c10::toString(dtype));
      const at::Tensor g = (at::randn({n}) * 100.0).to(dtype);
      const double inv = 1.0 / 3.0;
      const double expected = at::sum(at::square(g.to(at::kDouble) * inv)).item<double>();
      const GradStats stats = grad_stats(g, inv);
      EXPECT_NEAR(stats.sum_of_squares, expected, 1e-12 * expected);
      EXPECT_TRUE(stats.all_finite);
      if (n == 0) continue;
      for (const float bad : {INFINITY, -INFINITY, NAN}) {
        at::Tensor h = g.clone();
        h[n / 2] = bad;
        EXPECT_FALSE(grad_stats(h).all_finite) << bad;
      }
    }
  }
}

// all_finite judges the gradient's elements, not the scaled sum: a large grad_scale_inv may make
// the sum overflow a double while every element is finite.
TEST(GradStats, FiniteElementsStayFiniteWhenTheScaledSumOverflows) {
  const at::Tensor g = at::full({5}, 1e30f);
  const GradStats stats = grad_stats(g, 1e200);
  EXPECT_TRUE(std::isinf(stats.sum_of_squares)) << stats.sum_of_squares;
  EXPECT_TRUE(stats.all_finite);
}

// ---------------------------------------------------------------- argument checks

// All arguments of one fused_adam_step call, valid until a test breaks one of them.
struct AdamCall {
  int64_t n = 33;
  at::Tensor param = at::randn({n}), grad = at::randn({n}).to(at::kBFloat16);
  at::Tensor exp_avg = at::rand({n}), exp_avg_sq = at::rand({n}), max_sq = at::rand({n});
  at::Tensor model = at::empty({n}, at::TensorOptions(at::kBFloat16));
  int64_t step = 3;
  AdamHyperParams hp = [] {
    AdamHyperParams h;
    h.amsgrad = true;
    return h;
  }();
  double inv = 1.0;
  void run() const {
    fused_adam_step(param, grad, exp_avg, exp_avg_sq, max_sq, model, step, hp, inv);
  }
};

TEST(FusedAdamErrors, EachBadArgumentIsNamedAndNothingIsWritten) {
  const auto meta = at::TensorOptions(at::kMeta);
  const std::vector<std::pair<std::string, std::function<void(AdamCall&)>>> cases = {
      {"param is undefined", [](AdamCall& c) { c.param = at::Tensor(); }},
      {"param must be float32", [](AdamCall& c) { c.param = c.param.to(at::kDouble); }},
      {"grad must be float32, bfloat16 or float16",
       [](AdamCall& c) { c.grad = c.grad.to(at::kInt); }},
      {"grad has 32 elements", [](AdamCall& c) { c.grad = c.grad.slice(0, 1); }},
      {"grad is on meta", [meta](AdamCall& c) { c.grad = at::empty({c.n}, meta); }},
      {"exp_avg must be contiguous",
       [](AdamCall& c) {
         c.exp_avg = at::rand({c.n, 2}).select(1, 0);
       }},
      {"exp_avg_sq must be float32",
       [](AdamCall& c) { c.exp_avg_sq = c.exp_avg_sq.to(at::kHalf); }},
      {"max_exp_avg_sq must be defined exactly when hp.amsgrad",
       [](AdamCall& c) { c.max_sq = at::Tensor(); }},
      {"max_exp_avg_sq must be defined exactly when hp.amsgrad",
       [](AdamCall& c) { c.hp.amsgrad = false; }},
      {"model_param must be bfloat16 or float16", [](AdamCall& c) { c.model = at::empty({c.n}); }},
      {"model_param has 34 elements",
       [](AdamCall& c) { c.model = at::empty({c.n + 1}, at::TensorOptions(at::kHalf)); }},
      {"exp_avg and exp_avg_sq share memory", [](AdamCall& c) { c.exp_avg_sq = c.exp_avg; }},
      {"step counts this update", [](AdamCall& c) { c.step = 0; }},
      {"hp.lr", [](AdamCall& c) { c.hp.lr = -1.0; }},
      {"hp.beta1", [](AdamCall& c) { c.hp.beta1 = 1.0; }},
      {"hp.beta2", [](AdamCall& c) { c.hp.beta2 = -0.1; }},
      {"hp.eps", [](AdamCall& c) { c.hp.eps = -1.0; }},
      {"hp.weight_decay", [](AdamCall& c) { c.hp.weight_decay = -0.1; }},
      {"grad_scale_inv must be finite", [](AdamCall& c) { c.inv = NAN; }},
  };
  for (const auto& [message, breaker] : cases) {
    SCOPED_TRACE(message);
    AdamCall call;
    breaker(call);
    expect_rejected([&] { call.run(); },
                    {call.param, call.grad, call.exp_avg, call.exp_avg_sq, call.max_sq, call.model},
                    "fused_adam_step", message);
  }
}

TEST(FusedSgdErrors, MomentumBufferAndHyperParams) {
  const int64_t n = 9;
  at::Tensor p = at::randn({n}), g = at::randn({n}), buf = at::randn({n});
  SgdHyperParams with_momentum;
  with_momentum.momentum = 0.9;
  auto sgd = [&](const at::Tensor& b, const SgdHyperParams& hp) {
    return [&, b, hp] { fused_sgd_step(p, g, b, {}, false, hp); };
  };
  expect_rejected(sgd({}, with_momentum), {p}, "fused_sgd_step", "momentum_buffer must be defined");
  expect_rejected(sgd(buf, SgdHyperParams{}), {p, buf}, "fused_sgd_step",
                  "momentum_buffer must be defined");
  SgdHyperParams nesterov = with_momentum;
  nesterov.nesterov = true;
  nesterov.dampening = 0.1;
  expect_rejected(sgd(buf, nesterov), {p, buf}, "fused_sgd_step", "hp.nesterov");
  expect_rejected(sgd(p, with_momentum), {p}, "fused_sgd_step",
                  "param and momentum_buffer share memory");
  expect_rejected([&] { (void)grad_stats(g.to(at::kInt)); }, {}, "grad_stats", "grad must be");
  expect_rejected([&] { copy_master_to_model(g.to(at::kHalf), at::empty({n}, at::kHalf)); }, {},
                  "copy_master_to_model", "master must be float32");
  at::Tensor fp32_model = at::empty({n});
  expect_rejected([&] { copy_master_to_model(g, fp32_model); }, {fp32_model},
                  "copy_master_to_model", "model_param must be bfloat16 or float16");
}

// Every tensor a CPU kernel writes has its version counter bumped, as an in-place ATen op's
// would be (the optimizer tells its own writes from outside ones by them); what it only reads
// keeps its version (bumped_by: support_kernels.h).
TEST(FusedKernels, CpuKernelsBumpTheVersionOfWhatTheyWriteOnly) {
  const AdamCall adam;
  EXPECT_EQ(bumped_by([&] { adam.run(); }, {adam.param, adam.exp_avg, adam.exp_avg_sq, adam.max_sq,
                                            adam.model, adam.grad}),
            (std::vector<bool>{true, true, true, true, true, false}));
  const int64_t n = 33;
  const at::Tensor param = at::randn({n}), grad = at::randn({n}), buf = at::zeros({n});
  const at::Tensor model = at::empty({n}, at::TensorOptions(at::kHalf));
  SgdHyperParams sgd;
  sgd.momentum = 0.9;
  EXPECT_EQ(bumped_by([&] { fused_sgd_step(param, grad, buf, model, true, sgd); },
                      {param, buf, model, grad}),
            (std::vector<bool>{true, true, true, false}));
  EXPECT_EQ(bumped_by([&] { copy_master_to_model(param, model); }, {param, model}),
            (std::vector<bool>{false, true}));
}

// ---------------------------------------------------------------- non-CPU fallback

TEST(AtenFallback, MatchesSimdPathClosely) {
  // Run on CPU tensors: ATen divides by the bias-correction scalar as a reciprocal multiply,
  // and copies BF16 with its own rounding code; everything else is the same op sequence.
  const int64_t n = 20011;
  at::manual_seed(12);
  AdamHyperParams hp;
  hp.weight_decay = 0.01;
  hp.amsgrad = true;
  AdamState a = fresh_state(n, true), b = a.clone();
  at::Tensor model_a = at::empty({n}, at::kBFloat16), model_b = model_a.clone();
  SgdHyperParams sgd;
  sgd.momentum = 0.9;
  sgd.nesterov = true;
  at::Tensor sa = at::randn({n}), sb = sa.clone(), buf_a = at::empty({n}), buf_b = at::empty({n});
  for (int64_t step = 1; step <= kSteps; ++step) {
    const at::Tensor grad = at::randn({n}).to(at::kBFloat16);
    ours_adam(a, grad, step, hp, model_a, 0.5);
    detail::adam_step_aten(b.param, grad, b.exp_avg, b.exp_avg_sq, b.max_exp_avg_sq, model_b, step,
                           hp, 0.5);
    fused_sgd_step(sa, grad, buf_a, {}, step == 1, sgd, 0.5);
    detail::sgd_step_aten(sb, grad, buf_b, {}, step == 1, sgd, 0.5);
  }
  expect_matches_torch_optim(a.param, b.param, hp.lr, kSteps);
  EXPECT_TRUE(same_bits(model_b, b.param.to(at::kBFloat16)));
  EXPECT_LE(max_ulps(sa, sb), 2 * kSteps);
  const at::Tensor g = at::randn({n});
  EXPECT_NEAR(detail::sum_of_squares_aten(g) * 4.0, grad_stats(g, 2.0).sum_of_squares,
              1e-12 * grad_stats(g, 2.0).sum_of_squares);
}

TEST(AtenFallback, NonCpuTensorsTakeTheAtenPath) {
  // Meta tensors have no data: this checks dispatch and shapes, not values.
  const auto meta = at::TensorOptions(at::kMeta);
  const int64_t n = 5;
  AdamHyperParams hp;
  EXPECT_NO_THROW(fused_adam_step(at::empty({n}, meta), at::empty({n}, meta.dtype(at::kHalf)),
                                  at::empty({n}, meta), at::empty({n}, meta), {},
                                  at::empty({n}, meta.dtype(at::kBFloat16)), 1, hp));
  SgdHyperParams sgd;
  sgd.momentum = 0.5;
  EXPECT_NO_THROW(fused_sgd_step(at::empty({n}, meta), at::empty({n}, meta), at::empty({n}, meta),
                                 {}, true, sgd));
  EXPECT_NO_THROW(
      copy_master_to_model(at::empty({n}, meta), at::empty({n}, meta.dtype(at::kHalf))));
}

TEST(FusedKernels, EmptyTensorsAreNoOps) {
  AdamHyperParams hp;
  EXPECT_NO_THROW(fused_adam_step(at::empty({0}), at::empty({0}), at::empty({0}), at::empty({0}),
                                  {}, {}, 1, hp));
  EXPECT_NO_THROW(copy_master_to_model(at::empty({0}), at::empty({0}, at::kHalf)));
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::optim
