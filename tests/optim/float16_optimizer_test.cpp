#include "mixprec/optim/float16_optimizer.h"

#include "optim/support_optim.h"

#include "support/counting_allocator.h"
#include "support/error_message.h"

#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>
#include <torch/utils.h>

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace mixprec::optim {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using mixprec::testing::Interleaved;
using mixprec::testing::set_grads;

using mixprec::testing::CountingAllocatorGuard;
using mixprec::testing::error_of;

TEST(Float16Optimizer, RolesFollowDtypeAndRequiresGrad) {
  Interleaved model;
  auto opt_ptr = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-3));
  Float16Optimizer& opt = *opt_ptr;
  const auto& info = opt.params_info();
  ASSERT_EQ(info.size(), 4u);
  EXPECT_EQ(info[0].fqn, "pre.weight");
  EXPECT_EQ(info[0].role, ParamRole::kMaster);
  EXPECT_EQ(info[1].role, ParamRole::kFrozen);
  EXPECT_EQ(info[2].fqn, "gate");
  EXPECT_EQ(info[2].role, ParamRole::kNativeFp32);
  EXPECT_EQ(info[3].role, ParamRole::kMaster);
  EXPECT_EQ(opt.main_param("pre.weight").scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(opt.main_param("pre.weight"), model->pre->weight.to(at::kFloat)));
  EXPECT_FALSE(opt.main_param("frozen.weight").defined());
  EXPECT_FALSE(opt.main_param("gate").defined());
}

TEST(Float16Optimizer, StepUpdatesMastersAndRoundsModelParams) {
  Interleaved model;
  auto opt_ptr = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-2));
  Float16Optimizer& opt = *opt_ptr;
  const at::Tensor frozen_before = model->frozen->weight.clone();
  const at::Tensor gate_before = model->gate.clone();
  const void* gate_storage = model->gate.data_ptr();
  set_grads(*model, 0);
  StepResult r = opt.update();
  EXPECT_TRUE(r.success);
  EXPECT_EQ(r.params_stepped, 3);
  EXPECT_GT(r.grad_norm, 0);
  EXPECT_TRUE(at::equal(model->frozen->weight, frozen_before));
  EXPECT_FALSE(at::equal(model->gate, gate_before));
  EXPECT_EQ(model->gate.data_ptr(), gate_storage);  // in place
  EXPECT_TRUE(at::equal(model->pre->weight, opt.main_param("pre.weight").to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(model->post->weight, opt.main_param("post.weight").to(at::kBFloat16)));
}

// The native-FP32 path allocates nothing but its two moments: no hidden FP32 copy.
struct Fp32OnlyImpl : torch::nn::Module {
  Fp32OnlyImpl() { w = register_parameter("w", torch::randn({1 << 16})); }
  at::Tensor w;
};

TEST(Float16Optimizer, NativeFp32ParamsGetNoCopy) {
  auto model = std::make_shared<Fp32OnlyImpl>();
  const int64_t n = model->w.numel();
  int64_t at_construction = 0, at_first_step = 0, at_second_step = 0;
  {
    const CountingAllocatorGuard counting;
    Float16Optimizer opt(*model, torch::optim::AdamWOptions(1e-3));
    at_construction = counting.bytes();
    model->w.mutable_grad() = at::ones_like(model->w);
    const int64_t before_first = counting.bytes();
    opt.update();
    at_first_step = counting.bytes() - before_first;
    opt.update();
    at_second_step = counting.bytes() - before_first - at_first_step;
    EXPECT_EQ(opt.state_bytes(ParamRole::kNativeFp32), 8 * n);
  }
  EXPECT_LT(at_construction, 4096) << "construction must not copy an FP32 param";
  EXPECT_LE(at_first_step, 8 * n + 4096) << "first step: exp_avg + exp_avg_sq only";
  EXPECT_LT(at_second_step, 4096) << "later steps allocate nothing per parameter";
}

// A skipped step holds on to no gradient: zero_grad() frees them before the next backward
// (in FP16 training, early steps overflow often — and would hold two steps' gradients).
TEST(Float16Optimizer, ASkippedStepHoldsNoGradient) {
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-3));
  set_grads(*model, 0);
  model->gate.mutable_grad()[3] = std::numeric_limits<float>::quiet_NaN();
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> grads;
  for (const at::Tensor& p : model->parameters()) {
    if (p.grad().defined()) grads.emplace_back(p.grad().getIntrusivePtr());
  }
  ASSERT_EQ(grads.size(), 3u);
  EXPECT_FALSE(opt->update().success);
  opt->zero_grad();
  for (const auto& grad : grads) EXPECT_TRUE(grad.expired());
}

// Running out of memory for the state a first step creates changes nothing: the step can be
// retried, and then gives what one uninterrupted step gives (torch.optim creates the state of
// every parameter before it updates any). Every allocation of the step fails in turn.
class StepOutOfMemory : public ::testing::TestWithParam<bool> {};

TEST_P(StepOutOfMemory, ChangesNothing) {
  const bool offload = GetParam();
  const auto fresh = [offload] {
    torch::manual_seed(7);  // the same initial weights every time
    Interleaved model;
    Float16OptimizerOptions options;
    if (offload) options.offload(OffloadOptions().chunk_bytes(256));
    auto opt = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-2), options);
    set_grads(*model, 0);
    return std::make_pair(model, std::move(opt));
  };
  auto [reference, reference_opt] = fresh();
  int64_t allocations = 0;
  {
    const CountingAllocatorGuard counting;
    ASSERT_TRUE(reference_opt->update().success);
    allocations = counting.allocations();
  }
  ASSERT_GE(allocations, 6);  // two moments for each of three parameters
  for (int64_t failing = 0; failing < allocations; ++failing) {
    SCOPED_TRACE("allocation " + std::to_string(failing + 1) + " fails");
    auto [model, opt] = fresh();
    {
      CountingAllocatorGuard counting;
      counting.fail_after(failing);
      const std::string message = error_of([&] { opt->update(); });
      EXPECT_NE(message.find("simulated out-of-memory"), std::string::npos) << message;
    }
    EXPECT_TRUE(opt->update().success);
    for (const auto& item : model->named_parameters()) {
      EXPECT_TRUE(at::equal(item.value(), reference->named_parameters()[item.key()])) << item.key();
    }
    EXPECT_TRUE(at::equal(opt->main_param("pre.weight"), reference_opt->main_param("pre.weight")));
  }
}

INSTANTIATE_TEST_SUITE_P(Float16Optimizer, StepOutOfMemory, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "Offloaded" : "OnDevice"; });

TEST(Float16Optimizer, StateBytesPerParam) {
  Interleaved model;
  auto opt_ptr = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-3));
  Float16Optimizer& opt = *opt_ptr;
  set_grads(*model, 0);
  opt.update();
  EXPECT_EQ(opt.state_bytes(ParamRole::kMaster), 12 * 2 * 64);  // master + 2 moments
  EXPECT_EQ(opt.state_bytes(ParamRole::kNativeFp32), 8 * 24);   // 2 moments
  EXPECT_EQ(opt.state_bytes(ParamRole::kFrozen), 0);
}

TEST(Float16Optimizer, ZeroGradAndLrSchedulerWork) {
  Interleaved model;
  auto opt_ptr = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-2));
  Float16Optimizer& opt = *opt_ptr;
  torch::optim::StepLR scheduler(opt, /*step_size=*/1, /*gamma=*/0.5);
  set_grads(*model, 0);
  opt.zero_grad();
  EXPECT_FALSE(model->pre->weight.grad().defined());
  scheduler.step();  // LibTorch's StepLR changes nothing on its first step
  scheduler.step();
  EXPECT_DOUBLE_EQ(opt.param_groups()[0].options().get_lr(), 5e-3);
}

TEST(Float16Optimizer, ClipsByGlobalNormIncludingNativeFp32) {
  Interleaved a, b;
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].copy_(a->parameters()[i]);
  auto clipped_ptr = mixprec::testing::make_optimizer(a, torch::optim::SGDOptions(1.0),
                                                      Float16OptimizerOptions().clip_grad(0.01));
  Float16Optimizer& clipped = *clipped_ptr;
  auto plain_ptr = mixprec::testing::make_optimizer(b, torch::optim::SGDOptions(1.0));
  Float16Optimizer& plain = *plain_ptr;
  set_grads(*a, 0);
  set_grads(*b, 0);
  const double norm = plain.update().grad_norm;
  // Expected global norm over pre, gate and post (frozen excluded), in double.
  double sumsq = 0;
  for (auto* p : {&a->pre->weight, &a->gate, &a->post->weight}) {
    sumsq += p->grad().to(at::kDouble).pow(2).sum().item<double>();
  }
  EXPECT_NEAR(norm, std::sqrt(sumsq), 1e-9 * std::sqrt(sumsq));
  const at::Tensor gate_before = a->gate.clone();
  const StepResult r = clipped.update();
  EXPECT_NEAR(r.grad_norm, norm, 1e-12);
  // SGD with lr 1: the update is the clipped gradient. It is recovered by subtracting FP32
  // values of magnitude ~|gate|, so it is known to within an ulp of the largest of them.
  const at::Tensor delta = gate_before - a->gate;
  const double coef = 0.01 / (norm + 1e-6);
  const double ulp = 1.2e-7 * gate_before.abs().max().item<double>();
  EXPECT_TRUE(at::allclose(delta, a->gate.grad() * coef, 1e-5, 2 * ulp));
}

TEST(Float16Optimizer, Fp16DynamicScalerSkipsOverflowAndBacksOff) {
  torch::NoGradGuard no_grad;
  auto model = std::make_shared<Fp32OnlyImpl>();
  model->w.set_data(model->w.to(at::kHalf));
  LossScalerOptions scaler = LossScalerOptions::fp16_dynamic();
  scaler.hysteresis(1);
  Float16Optimizer opt(*model, torch::optim::AdamWOptions(1e-3),
                       Float16OptimizerOptions().loss_scaler(scaler));
  EXPECT_EQ(opt.params_info()[0].role, ParamRole::kMaster);
  const at::Tensor before = model->w.clone();
  at::Tensor g = at::full_like(model->w, 1.0);
  g[7] = std::numeric_limits<float>::infinity();
  model->w.mutable_grad() = g;
  StepResult r = opt.update();
  EXPECT_FALSE(r.success);
  EXPECT_EQ(r.loss_scale, 65536.0);
  EXPECT_EQ(opt.loss_scale(), 32768.0);
  EXPECT_TRUE(at::equal(model->w, before));
  // Scaled gradients are unscaled on the fly: a clean step with g * scale behaves like g.
  model->w.mutable_grad() = at::full_like(model->w, 0.5 * opt.loss_scale());
  r = opt.update();
  EXPECT_TRUE(r.success);
  EXPECT_NEAR(r.grad_norm, 0.5 * std::sqrt(static_cast<double>(model->w.numel())), 1e-6);
}

TEST(Float16Optimizer, NonFiniteBf16GradsSkipOrErrorPerOption) {
  Interleaved model;
  auto skip_ptr = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-3));
  Float16Optimizer& skip = *skip_ptr;
  set_grads(*model, 0);
  model->gate.mutable_grad()[3] = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor post_before = model->post->weight.clone();
  StepResult r = skip.update();
  EXPECT_FALSE(r.success);
  EXPECT_TRUE(at::equal(model->post->weight, post_before));
  EXPECT_EQ(skip.state_bytes(ParamRole::kNativeFp32), 0);

  auto strict_ptr = mixprec::testing::make_optimizer(
      model, torch::optim::AdamWOptions(1e-3),
      Float16OptimizerOptions().non_finite_grads(NonFiniteGrads::kError));
  Float16Optimizer& strict = *strict_ptr;
  const std::string msg = error_of([&] { strict.update(); });
  EXPECT_NE(msg.find("non-finite gradient in parameter 'gate'"), std::string::npos) << msg;
  EXPECT_TRUE(at::equal(model->post->weight, post_before));
}

struct WrongDtypeImpl : torch::nn::Module {
  WrongDtypeImpl() {
    register_parameter("ok", torch::randn({4}));
    register_parameter("A_log", torch::randn({4}, torch::kDouble));
  }
};

TEST(Float16Optimizer, TrainableParamOfOtherDtypeIsAnError) {
  auto model = std::make_shared<WrongDtypeImpl>();
  const std::string msg =
      error_of([&] { Float16Optimizer(*model, torch::optim::AdamWOptions(1e-3)); });
  EXPECT_NE(msg.find("'A_log' is a trainable Double parameter"), std::string::npos) << msg;
}

TEST(Float16Optimizer, ParamNotInModelIsAnError) {
  Interleaved model;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{model->pre->weight, torch::randn({3})});
  const std::string msg = error_of([&] {
    Float16Optimizer(*model, std::move(groups), std::make_unique<torch::optim::AdamWOptions>());
  });
  EXPECT_NE(msg.find("param 1 of group 0 (id 1, Float [3]) is not a parameter of the model"),
            std::string::npos)
      << msg;
}

TEST(Float16Optimizer, MixedOptionTypesAcrossGroupsAreAnError) {
  Interleaved model;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{model->pre->weight},
                      std::make_unique<torch::optim::AdamWOptions>());
  groups.emplace_back(std::vector<at::Tensor>{model->post->weight},
                      std::make_unique<torch::optim::SGDOptions>(0.1));
  EXPECT_THROW(
      Float16Optimizer(*model, std::move(groups), std::make_unique<torch::optim::AdamWOptions>()),
      c10::Error);
}

// A bad hyper-parameter (set after construction, e.g. by a scheduler) fails the whole step
// before any parameter or state changes.
TEST(Float16Optimizer, BadHyperParameterFailsTheStepAtomically) {
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::SGDOptions(0.1).momentum(0.9));
  auto& options = static_cast<torch::optim::SGDOptions&>(opt->param_groups()[0].options());
  options.nesterov(true).dampening(0.5);
  set_grads(*model, 0);
  const at::Tensor pre_before = model->pre->weight.clone();
  const std::string msg = error_of([&] { opt->update(); });
  EXPECT_NE(msg.find("param group 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("nesterov requires"), std::string::npos) << msg;
  EXPECT_TRUE(at::equal(model->pre->weight, pre_before));
  EXPECT_TRUE(opt->state_dict().state.empty());
  options.dampening(0);
  EXPECT_TRUE(opt->update().success);
}

// The constructor checks hyper-parameters with the step's own ranges, per group.
TEST(Float16Optimizer, BadHyperParameterIsRefusedAtConstruction) {
  Interleaved model;
  const std::string msg = error_of([&] {
    mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-3).betas({0.9, 1.5}));
  });
  EXPECT_NE(msg.find("param group 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("beta2"), std::string::npos) << msg;
}

TEST(Float16Optimizer, MainParamIsLookedUpByName) {
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-3));
  EXPECT_TRUE(at::equal(opt->main_param("post.weight"), model->post->weight.to(at::kFloat)));
  const std::string msg = error_of([&] { opt->main_param("post.wieght"); });
  EXPECT_NE(msg.find("no parameter 'post.wieght' (close: post.weight)"), std::string::npos) << msg;
}

TEST(Float16Optimizer, ParameterListedTwiceIsAnError) {
  Interleaved model;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{model->pre->weight});
  groups.emplace_back(std::vector<at::Tensor>{model->pre->weight, model->gate});
  const std::string msg = error_of([&] {
    Float16Optimizer(*model, std::move(groups), std::make_unique<torch::optim::AdamWOptions>());
  });
  EXPECT_NE(msg.find("'pre.weight' appears twice (ids 0 and 1)"), std::string::npos) << msg;
}

TEST(Float16Optimizer, SgdMomentumMatchesTorch) {
  // Native FP32 path against torch::optim::SGD on a copy.
  torch::NoGradGuard no_grad;
  auto ours = std::make_shared<Fp32OnlyImpl>();
  at::Tensor theirs = ours->w.detach().clone().requires_grad_(true);
  auto options =
      torch::optim::SGDOptions(0.05).momentum(0.9).dampening(0.1).weight_decay(0.01).nesterov(
          false);
  Float16Optimizer opt(*ours, options);
  torch::optim::SGD reference({theirs}, options);
  for (int step = 0; step < 4; ++step) {
    at::Tensor g = at::sin(at::arange(ours->w.numel(), at::kFloat) * 0.1 + step);
    ours->w.mutable_grad() = g;
    theirs.mutable_grad() = g.clone();
    opt.update();
    reference.step();
  }
  EXPECT_TRUE(at::allclose(ours->w, theirs, 0, 1e-6));
}

// the clip coefficient is torch's clip_grad_norm_ one, max_norm / (norm + 1e-6),
// checked where the 1e-6 matters (a norm of ~6e-4: 1.6e-3 relative), with an lr that makes
// the update large against the ulps of the parameter.
TEST(Float16Optimizer, ClipCoefficientIsMaxNormOverNormPlusEpsilon) {
  Interleaved a;
  torch::NoGradGuard no_grad;
  auto opt = mixprec::testing::make_optimizer(a, torch::optim::SGDOptions(1000.0),
                                              Float16OptimizerOptions().clip_grad(1e-4));
  set_grads(*a, 0);
  for (auto& p : a->parameters()) {
    if (p.grad().defined())
      p.mutable_grad() = (p.grad().to(at::kFloat) * 0.001).to(p.scalar_type());
  }
  double sumsq = 0;
  for (auto* p : {&a->pre->weight, &a->gate, &a->post->weight}) {
    sumsq += p->grad().to(at::kDouble).pow(2).sum().item<double>();
  }
  const double norm = std::sqrt(sumsq);
  const at::Tensor gate_before = a->gate.clone();
  const StepResult r = opt->update();
  EXPECT_NEAR(r.grad_norm, norm, 1e-9 * norm);
  const at::Tensor delta = gate_before - a->gate;
  const double coef = 1000.0 * 1e-4 / (norm + 1e-6);
  const double ulp = 1.2e-7 * gate_before.abs().max().item<double>();
  EXPECT_TRUE(at::allclose(delta, a->gate.grad() * coef, 1e-4, 2 * ulp))
      << (delta / (a->gate.grad() * coef)).max().item<double>();
}

// clip_grad is a norm: infinity is refused when the optimizer is built, as a negative is,
// naming the option and the value.
TEST(Float16Optimizer, InfiniteClipGradIsRefused) {
  Interleaved model;
  const std::string msg = error_of([&] {
    mixprec::testing::make_optimizer(
        model, torch::optim::AdamWOptions(1e-3),
        Float16OptimizerOptions().clip_grad(std::numeric_limits<double>::infinity()));
  });
  EXPECT_NE(msg.find("clip_grad must be a finite value >= 0, got inf"), std::string::npos) << msg;
}

// A frozen parameter of any dtype (an integer table registered as a parameter) is no
// problem: only trainable ones must be Float, BFloat16 or Half.
struct FrozenLongImpl : torch::nn::Module {
  FrozenLongImpl() {
    w = register_parameter("w", torch::randn({4}));
    register_parameter("index", torch::arange(4), /*requires_grad=*/false);
  }
  at::Tensor w;
};

TEST(Float16Optimizer, FrozenParamOfOtherDtypeIsAccepted) {
  auto model = std::make_shared<FrozenLongImpl>();
  Float16Optimizer opt(*model, torch::optim::SGDOptions(0.5));
  ASSERT_EQ(opt.params_info().size(), 2u);
  EXPECT_EQ(opt.params_info()[1].role, ParamRole::kFrozen);
  model->w.mutable_grad() = at::ones({4});
  const at::Tensor w_before = model->w.clone();
  const StepResult r = opt.update();
  EXPECT_TRUE(r.success);
  EXPECT_EQ(r.params_stepped, 1);
  EXPECT_TRUE(at::equal(model->w, w_before - 0.5));
}

// The fused step reads a parameter as one flat run: a strided (transposed) trainable one is
// refused at construction, by name.
struct TransposedImpl : torch::nn::Module {
  TransposedImpl() { register_parameter("w_t", torch::randn({4, 6}).t()); }
};

TEST(Float16Optimizer, NonContiguousTrainableParamIsAnError) {
  auto model = std::make_shared<TransposedImpl>();
  const std::string msg =
      error_of([&] { Float16Optimizer(*model, torch::optim::AdamWOptions(1e-3)); });
  EXPECT_NE(msg.find("'w_t' must be dense and contiguous"), std::string::npos) << msg;
}

// Clipping acts on the unscaled gradient (the loss scale divided out first), and only above
// the limit: a norm under clip_grad leaves the update as it is.
TEST(Float16Optimizer, ClippingActsOnTheUnscaledGradientAndOnlyAboveTheLimit) {
  for (const double clip : {0.5, 1000.0}) {
    SCOPED_TRACE(clip);
    torch::NoGradGuard no_grad;
    auto model = std::make_shared<Fp32OnlyImpl>();  // 2^16 elements
    Float16Optimizer opt(
        *model, torch::optim::SGDOptions(1.0),
        Float16OptimizerOptions().loss_scaler(LossScalerOptions::fp16_dynamic()).clip_grad(clip));
    const at::Tensor before = model->w.clone();
    const at::Tensor g = at::full_like(model->w, 1.0 / 256);  // global norm 1
    model->w.mutable_grad() = g * opt.loss_scale();
    const StepResult r = opt.update();
    ASSERT_TRUE(r.success);
    EXPECT_DOUBLE_EQ(r.grad_norm, 1.0);
    const double coef = clip < 1.0 ? clip / (1.0 + 1e-6) : 1.0;
    // The update is recovered by subtracting FP32 values of magnitude ~|w| (< 8): 1e-6 is a
    // few ulps of them, far below a wrong coefficient's effect (>= 2e-3).
    EXPECT_TRUE(at::allclose(before - model->w, g * coef, 0, 1e-6));
  }
}

// With a dynamic loss scaler an overflow is expected: the step is skipped (never an error,
// whatever non_finite_grads says), its norm is reported infinite, and it is not counted.
TEST(Float16Optimizer, OverflowUnderADynamicScalerIsSkippedAndNotCounted) {
  torch::NoGradGuard no_grad;
  auto model = std::make_shared<Fp32OnlyImpl>();
  Float16Optimizer opt(*model, torch::optim::AdamWOptions(1e-3),
                       Float16OptimizerOptions()
                           .loss_scaler(LossScalerOptions::fp16_dynamic())
                           .non_finite_grads(NonFiniteGrads::kError));
  model->w.mutable_grad() = at::ones_like(model->w);
  ASSERT_TRUE(opt.update().success);
  at::Tensor g = at::ones_like(model->w);
  g[3] = std::numeric_limits<float>::infinity();
  model->w.mutable_grad() = g;
  const at::Tensor before = model->w.clone();
  StepResult r;
  EXPECT_NO_THROW(r = opt.update());
  EXPECT_FALSE(r.success);
  EXPECT_TRUE(std::isinf(r.grad_norm)) << r.grad_norm;
  EXPECT_EQ(r.params_stepped, 0);
  EXPECT_TRUE(at::equal(model->w, before));
  // A NaN is reported as an overflow too: the norm is infinite, not NaN.
  g[3] = std::numeric_limits<float>::quiet_NaN();
  model->w.mutable_grad() = g;
  EXPECT_NO_THROW(r = opt.update());
  EXPECT_FALSE(r.success);
  EXPECT_TRUE(std::isinf(r.grad_norm)) << r.grad_norm;
  EXPECT_TRUE(at::equal(model->w, before));
  EXPECT_EQ(opt.state_dict().state.at(0).at("step").item<double>(), 1.0);
}

// Adam's weight decay is L2 (added to the gradient before the moments), not AdamW's decoupled
// one: the native FP32 path against torch::optim::Adam on a copy.
TEST(Float16Optimizer, AdamWeightDecayMatchesTorch) {
  torch::NoGradGuard no_grad;
  auto ours = std::make_shared<Fp32OnlyImpl>();
  at::Tensor theirs = ours->w.detach().clone().requires_grad_(true);
  const auto options = torch::optim::AdamOptions(0.01).weight_decay(0.1);
  Float16Optimizer opt(*ours, options);
  torch::optim::Adam reference({theirs}, options);
  for (int step = 0; step < 4; ++step) {
    at::Tensor g = at::sin(at::arange(ours->w.numel(), at::kFloat) * 0.1 + step);
    ours->w.mutable_grad() = g;
    theirs.mutable_grad() = g.clone();
    ASSERT_TRUE(opt.update().success);
    reference.step();
  }
  // A few ulps of |w| < 8 apart at most; decoupled decay would be ~1e-3 away.
  EXPECT_TRUE(at::allclose(ours->w, theirs, 1e-6, 1e-6));
}

// Plain SGD (momentum 0) keeps no momentum buffer, as torch's does: no state memory beyond the
// masters, and none in the state dict.
TEST(Float16Optimizer, SgdWithoutMomentumHoldsNoBuffer) {
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::SGDOptions(0.1));
  set_grads(*model, 0);
  ASSERT_TRUE(opt->update().success);
  EXPECT_EQ(opt->state_bytes(ParamRole::kNativeFp32), 0);
  EXPECT_EQ(opt->state_bytes(ParamRole::kMaster), 2 * 8 * 8 * 4);  // pre and post's masters
  for (const auto& [id, entry] : opt->state_dict().state) {
    EXPECT_EQ(entry.count("momentum_buffer"), 0u) << id;
  }
}

// A parameter frozen at construction is not the optimizer's: a gradient left on it (stale,
// even of another shape) is never read, checked or stepped.
TEST(Float16Optimizer, AFrozenParamsGradientIsNeverRead) {
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::SGDOptions(0.1));
  set_grads(*model, 0);
  model->frozen->weight.mutable_grad() = at::ones({3}, at::kDouble);
  const at::Tensor frozen_before = model->frozen->weight.clone();
  const StepResult r = opt->update();
  EXPECT_TRUE(r.success);
  EXPECT_EQ(r.params_stepped, 3);
  EXPECT_TRUE(at::equal(model->frozen->weight, frozen_before));
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::optim
