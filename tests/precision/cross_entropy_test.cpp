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

// Our gradient against LibTorch's, for logits of `rows` rows: within a unit in the last place
// of the logits' dtype (relative 2^-7 in BF16, 2^-10 in FP16, 1e-5 in FP32) plus a few FP32
// ulps of the step 1/rows: the target's element, (p - 1) / rows, cancels where p is near 1,
// and there both carry the rounding of p.
void expect_gradient_close(const at::Tensor& got, const at::Tensor& want, int64_t rows) {
  ASSERT_EQ(got.scalar_type(), want.scalar_type());
  const double rtol = got.scalar_type() == at::kBFloat16 ? 0x1p-7
                      : got.scalar_type() == at::kHalf   ? 0x1p-10
                                                         : 1e-5;
  EXPECT_TRUE(at::allclose(got.to(at::kFloat), want.to(at::kFloat), rtol,
                           16 * 0x1p-24 / static_cast<double>(rows)));
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
      expect_gradient_close(got.grad, want.grad, 37);
      // Rounded to BF16/FP16 the two differ only where their FP32 values straddle a rounding
      // boundary.
      if (dtype != at::kFloat) {
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
    for (const auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
      for (const int64_t classes : {3, 21, 256}) {
        SCOPED_TRACE(name + ", " + c10::toString(dtype) + ", " + std::to_string(classes) +
                     " classes");
        const at::Tensor logits = (at::randn({9, classes}) * 4).to(dtype);
        const at::Tensor targets = at::randint(classes, {9}, at::kLong);
        const LossAndGrad got = ours(logits, targets), want = libtorch(logits, targets);
        EXPECT_NEAR(got.loss.item<float>(), want.loss.item<float>(),
                    2e-6 * std::abs(want.loss.item<float>()) + 1e-7);
        expect_gradient_close(got.grad, want.grad, 9);
      }
    }
  }
}

TEST(CrossEntropyInFp32, TheGradientScalesWithTheIncomingOne) {
  const at::Tensor logits = at::randn({8, 20}).to(at::kBFloat16).requires_grad_(true);
  const at::Tensor targets = at::randint(20, {8}, at::kLong);
  (cross_entropy_in_fp32(logits, targets) * 0.25).backward();
  // A quarter is exact in BF16: the gradient is a quarter of the unscaled one, bit for bit.
  const LossAndGrad unscaled = ours(logits, targets);
  EXPECT_TRUE(at::equal(logits.grad(), (unscaled.grad.to(at::kFloat) * 0.25).to(at::kBFloat16)));
}

TEST(CrossEntropyInFp32, StridedLogitsAreReadAsTheirValues) {
  const at::Tensor wide = at::randn({40, 64}).to(at::kBFloat16);
  const at::Tensor logits = wide.t().slice(0, 0, 32);  // [32, 40], columns of `wide`
  ASSERT_FALSE(logits.is_contiguous());
  const at::Tensor targets = at::randint(40, {32}, at::kLong);
  const LossAndGrad got = ours(logits, targets), want = libtorch(logits, targets);
  EXPECT_NEAR(got.loss.item<float>(), want.loss.item<float>(), 1e-5);
  expect_gradient_close(got.grad, want.grad, 32);
}

// -Inf logits take no probability (a finite loss, zero gradient there), and -Inf at the target
// makes the loss +Inf; +Inf or NaN anywhere in a row, or a row of nothing but -Inf, make its
// loss and gradient NaN, as LibTorch's log-softmax does. In a full vector and in the partial
// one at a row's end, for each dtype.
TEST(CrossEntropyInFp32, InfinitiesAndNaNFollowLibTorch) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  for (const auto dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    for (const int64_t classes : {17, 20}) {
      for (const int64_t column : {int64_t{5}, classes - 1}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + ", " + std::to_string(classes) +
                     " classes, column " + std::to_string(column));
        const at::Tensor target = at::tensor({2}, at::kLong);
        at::Tensor masked = at::randn({1, classes});
        masked[0][column] = -inf;
        const LossAndGrad a = ours(masked.to(dtype), target);
        EXPECT_NEAR(a.loss.item<float>(), libtorch(masked.to(dtype), target).loss.item<float>(),
                    1e-5);
        EXPECT_EQ(a.grad[0][column].item<float>(), 0.0f);
        EXPECT_TRUE(a.grad.isfinite().all().item<bool>());

        at::Tensor at_target = at::randn({1, classes});
        at_target[0][column] = -inf;
        const at::Tensor column_target = at::tensor({column}, at::kLong);
        EXPECT_EQ(ours(at_target.to(dtype), column_target).loss.item<float>(), inf);
        EXPECT_EQ(libtorch(at_target.to(dtype), column_target).loss.item<float>(), inf);

        for (const float bad : {inf, std::numeric_limits<float>::quiet_NaN()}) {
          at::Tensor row = at::randn({1, classes});
          row[0][column] = bad;
          const LossAndGrad got = ours(row.to(dtype), target);
          EXPECT_TRUE(std::isnan(got.loss.item<float>())) << bad;
          EXPECT_TRUE(got.grad.isnan().all().item<bool>()) << bad;
          EXPECT_TRUE(std::isnan(libtorch(row.to(dtype), target).loss.item<float>())) << bad;
        }
      }
      const at::Tensor all_masked = at::full({1, classes}, -inf, dtype);
      const LossAndGrad m = ours(all_masked, at::tensor({2}, at::kLong));
      EXPECT_TRUE(std::isnan(m.loss.item<float>()));
      EXPECT_TRUE(m.grad.isnan().all().item<bool>());
      const LossAndGrad want = libtorch(all_masked, at::tensor({2}, at::kLong));
      EXPECT_TRUE(std::isnan(want.loss.item<float>()));
      EXPECT_TRUE(want.grad.isnan().all().item<bool>());
    }
  }
}

// The gradient is the kernel's, outside autograd: a second derivative is refused, not zero.
TEST(CrossEntropyInFp32, ASecondDerivativeIsRefused) {
  const at::Tensor logits = at::randn({4, 6}, at::kFloat).requires_grad_(true);
  const at::Tensor loss = cross_entropy_in_fp32(logits, at::tensor({0, 1, 2, 3}, at::kLong));
  EXPECT_NE(error_of([&] {
              (void)torch::autograd::grad({loss}, {logits}, {}, /*retain_graph=*/true,
                                          /*create_graph=*/true);
            }).find("has no second derivative"),
            std::string::npos);
}

// Logits that need no gradient (evaluation) and targets that are a strided view.
TEST(CrossEntropyInFp32, WorksWithoutGradientsAndWithStridedTargets) {
  const at::Tensor logits = at::randn({6, 10}).to(at::kBFloat16);
  const at::Tensor targets = at::randint(10, {6, 2}, at::kLong).select(1, 1);
  ASSERT_FALSE(targets.is_contiguous());
  at::NoGradGuard no_grad;
  const at::Tensor loss = cross_entropy_in_fp32(logits, targets);
  EXPECT_FALSE(loss.requires_grad());
  EXPECT_NEAR(loss.item<float>(),
              at::cross_entropy_loss(logits.to(at::kFloat), targets).item<float>(), 1e-5);
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
