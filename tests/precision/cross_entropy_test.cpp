// cross_entropy_in_fp32 against the LibTorch composition it replaces,
// at::cross_entropy_loss(logits.to(at::kFloat), targets): loss and gradient for each logit
// dtype, row lengths around the vector width, strided logits, infinities and NaN, thread-count
// independence, and its errors.
#include "mixprec/precision/cross_entropy.h"

#include "../../src/optim/kernels/kernel_args.h"  // choosing the Highway target
#include "support/error_message.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace mixprec {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using testing::error_of;

struct LossAndGrad {
  at::Tensor loss;
  at::Tensor grad;  // in the logits' dtype
};

LossAndGrad ours(const at::Tensor& logits, const at::Tensor& targets) {
  const at::Tensor x = logits.detach().requires_grad_(true);
  const at::Tensor loss = cross_entropy_in_fp32(x, targets);
  loss.backward();
  return {loss.detach(), x.grad()};
}

LossAndGrad libtorch(const at::Tensor& logits, const at::Tensor& targets) {
  const at::Tensor x = logits.detach().requires_grad_(true);
  const at::Tensor loss = at::cross_entropy_loss(x.to(at::kFloat), targets);
  loss.backward();
  return {loss.detach(), x.grad()};
}

// The gradients' bit patterns as integers: equal, or one unit in the last place apart.
int64_t max_ulps_apart(const at::Tensor& a, const at::Tensor& b) {
  const auto bits = a.scalar_type() == at::kFloat ? at::kInt : at::kShort;
  return (a.view(bits).to(at::kLong) - b.view(bits).to(at::kLong)).abs().max().item<int64_t>();
}

TEST(CrossEntropyInFp32, MatchesLibTorchsCompositionForEachDtypeAndRowLength) {
  at::manual_seed(3);
  for (const auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    // Around the widths of every Highway target (4, 8, 16 lanes), and a vocabulary.
    for (const int64_t classes : {1, 3, 8, 15, 16, 17, 33, 256, 1000}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + ", " + std::to_string(classes) + " classes");
      const at::Tensor logits = (at::randn({37, classes}) * 4).to(dtype);
      const at::Tensor targets = at::randint(classes, {37}, at::kLong);
      const LossAndGrad got = ours(logits, targets), want = libtorch(logits, targets);
      EXPECT_EQ(got.loss.scalar_type(), at::kFloat);
      EXPECT_EQ(got.loss.dim(), 0);
      EXPECT_NEAR(got.loss.item<float>(), want.loss.item<float>(),
                  2e-6 * std::abs(want.loss.item<float>()) + 1e-7);
      ASSERT_EQ(got.grad.scalar_type(), dtype);
      // FP32 gradients within a few ulps of the probabilities they come from (the target's,
      // p - 1 times 1/N, cancels); rounded to BF16/FP16, at most one unit apart, and only where
      // the FP32 values straddle a rounding boundary.
      if (dtype == at::kFloat) {
        EXPECT_TRUE(at::allclose(got.grad, want.grad, 1e-5, 1e-8));
      } else {
        EXPECT_LE(max_ulps_apart(got.grad, want.grad), 1);
        const double differing = (got.grad != want.grad).to(at::kDouble).mean().item<double>();
        EXPECT_LT(differing, 0.01);
      }
    }
  }
}

// Every compiled Highway target this CPU runs (their vectors are 4 to 16 lanes wide) gives the
// same closeness to LibTorch, on rows shorter and longer than its vectors.
TEST(CrossEntropyInFp32, EveryTargetMatchesLibTorch) {
  struct RestoreAutomaticTarget {
    ~RestoreAutomaticTarget() { optim::detail::force_simd_target(""); }
  } restore;
  at::manual_seed(5);
  for (const auto& name : optim::detail::supported_simd_targets()) {
    optim::detail::force_simd_target(name);
    for (const int64_t classes : {3, 21, 256}) {
      SCOPED_TRACE(name + ", " + std::to_string(classes) + " classes");
      const at::Tensor logits = (at::randn({9, classes}) * 4).to(at::kBFloat16);
      const at::Tensor targets = at::randint(classes, {9}, at::kLong);
      const LossAndGrad got = ours(logits, targets), want = libtorch(logits, targets);
      EXPECT_NEAR(got.loss.item<float>(), want.loss.item<float>(),
                  2e-6 * std::abs(want.loss.item<float>()) + 1e-7);
      EXPECT_LE(max_ulps_apart(got.grad, want.grad), 1);
    }
  }
}

TEST(CrossEntropyInFp32, TheGradientScalesWithTheIncomingOne) {
  const at::Tensor logits = at::randn({8, 20}).to(at::kBFloat16).requires_grad_(true);
  const at::Tensor targets = at::randint(20, {8}, at::kLong);
  (cross_entropy_in_fp32(logits, targets) * 0.25).backward();
  const LossAndGrad want = libtorch(logits, targets);
  EXPECT_TRUE(
      at::allclose(logits.grad().to(at::kFloat), want.grad.to(at::kFloat) * 0.25, 1e-2, 1e-6));
}

TEST(CrossEntropyInFp32, StridedLogitsAreReadAsTheirValues) {
  const at::Tensor wide = at::randn({40, 64}).to(at::kBFloat16);
  const at::Tensor logits = wide.t().slice(0, 0, 32);  // [32, 40], columns of `wide`
  ASSERT_FALSE(logits.is_contiguous());
  const at::Tensor targets = at::randint(40, {32}, at::kLong);
  const LossAndGrad got = ours(logits, targets), want = libtorch(logits, targets);
  EXPECT_NEAR(got.loss.item<float>(), want.loss.item<float>(), 1e-5);
  EXPECT_LE(max_ulps_apart(got.grad.contiguous(), want.grad.contiguous()), 1);
}

// -Inf logits take no probability (a finite loss, zero gradient there); +Inf or NaN anywhere
// in a row make its loss NaN, as LibTorch's log-softmax does.
TEST(CrossEntropyInFp32, InfinitiesAndNaNFollowLibTorch) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  at::Tensor logits = at::randn({3, 20});
  logits[0][5] = -inf;
  logits[0][19] = -inf;
  const at::Tensor targets = at::tensor({2, 4, 7}, at::kLong);
  {
    const at::Tensor row = logits.slice(0, 0, 1).to(at::kBFloat16);
    const LossAndGrad a = ours(row, targets.slice(0, 0, 1));
    const LossAndGrad b = libtorch(row, targets.slice(0, 0, 1));
    EXPECT_TRUE(std::isfinite(a.loss.item<float>()));
    EXPECT_NEAR(a.loss.item<float>(), b.loss.item<float>(), 1e-5);
    EXPECT_EQ(a.grad[0][5].item<float>(), 0.0f);
    EXPECT_EQ(a.grad[0][19].item<float>(), 0.0f);
  }
  for (const float bad : {inf, std::numeric_limits<float>::quiet_NaN()}) {
    at::Tensor row = at::randn({1, 20});
    row[0][11] = bad;
    const LossAndGrad got = ours(row.to(at::kBFloat16), targets.slice(0, 1, 2));
    EXPECT_TRUE(std::isnan(got.loss.item<float>())) << bad;
    EXPECT_TRUE(got.grad.isnan().all().item<bool>()) << bad;
    EXPECT_TRUE(std::isnan(libtorch(row, targets.slice(0, 1, 2)).loss.item<float>())) << bad;
  }
}

TEST(CrossEntropyInFp32, ResultsDoNotDependOnTheNumberOfThreads) {
  const at::Tensor logits = at::randn({512, 300}).to(at::kBFloat16);  // several row chunks
  const at::Tensor targets = at::randint(300, {512}, at::kLong);
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const LossAndGrad one = ours(logits, targets);
  at::set_num_threads(std::max(2, threads));
  const LossAndGrad many = ours(logits, targets);
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(one.loss, many.loss));
  EXPECT_TRUE(at::equal(one.grad, many.grad));
}

TEST(CrossEntropyInFp32, NoRowsGiveLibTorchsNaN) {
  const at::Tensor loss =
      cross_entropy_in_fp32(at::zeros({0, 5}, at::kBFloat16), at::zeros({0}, at::kLong));
  EXPECT_TRUE(std::isnan(loss.item<float>()));
}

TEST(CrossEntropyInFp32, BadArgumentsAreRefusedNamingWhatIsWrong) {
  const at::Tensor logits = at::randn({4, 6}).to(at::kBFloat16);
  const at::Tensor targets = at::tensor({0, 1, 2, 3}, at::kLong);
  EXPECT_NE(error_of([&] {
              (void)cross_entropy_in_fp32(logits.view({24}), targets);
            }).find("must be [N, V]"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              (void)cross_entropy_in_fp32(logits.to(at::kDouble), targets);
            }).find("BF16, FP16 or FP32, got Double"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              (void)cross_entropy_in_fp32(logits, targets.to(at::kInt));
            }).find("targets must be int64 [N]"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              (void)cross_entropy_in_fp32(logits, targets.slice(0, 0, 3));
            }).find("targets must be int64 [N]"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              (void)cross_entropy_in_fp32(logits, at::tensor({0, 1, 6, 3}, at::kLong));
            }).find("target 6 of row 2 lies outside [0, 6)"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              (void)cross_entropy_in_fp32(logits, at::tensor({0, -1, 2, 3}, at::kLong));
            }).find("target -1 of row 1"),
            std::string::npos);
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec
