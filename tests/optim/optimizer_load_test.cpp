// Loading optimizer state: loaded hyper-parameters and steps are validated exactly as the
// constructor and the step validate them, before anything changes (issue 7 item 4).
#include "mixprec/optim/float16_optimizer.h"

#include "optim/support_optim.h"
#include "support/error_message.h"

#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <limits>

namespace mixprec::optim {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using mixprec::testing::bitwise_equal;
using mixprec::testing::error_of;
using mixprec::testing::Interleaved;
using mixprec::testing::set_grads;

template <typename Options>
struct Trained {
  Interleaved model;
  std::unique_ptr<Float16Optimizer> opt;
  explicit Trained(const Options& options) {
    opt = mixprec::testing::make_optimizer(model, options);
    for (int s = 0; s < 2; ++s) {
      set_grads(*model, s);
      EXPECT_TRUE(opt->update().success);
    }
  }
};

// Everything the optimizer and its model hold, for "nothing changed" checks.
struct Snapshot {
  ShardedStateDict state;
  std::vector<at::Tensor> params;
  explicit Snapshot(Trained<torch::optim::AdamWOptions>& t) {
    state = t.opt->sharded_state_dict().clone();
    for (const auto& p : t.model->parameters()) params.push_back(p.clone());
  }
  void expect_same_as(Trained<torch::optim::AdamWOptions>& t) const {
    const ShardedStateDict now = t.opt->sharded_state_dict();
    EXPECT_EQ(now.common, state.common);
    ASSERT_EQ(now.tensors.size(), state.tensors.size());
    for (const auto& [key, v] : state.tensors) {
      EXPECT_TRUE(bitwise_equal(now.at(key).local, v.local)) << key;
    }
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(t.model->parameters()[i], params[i])) << i;
    }
  }
};

// Loads `bad` (sharded) into a trained AdamW optimizer: the error names `needle`, and nothing
// changes.
void expect_sharded_load_refused(const ShardedStateDict& bad, const std::string& needle) {
  Trained<torch::optim::AdamWOptions> target(torch::optim::AdamWOptions(1e-3));
  const Snapshot before(target);
  const std::string msg = error_of([&] { target.opt->load_sharded_state_dict(bad); });
  EXPECT_NE(msg.find(needle), std::string::npos) << "expected '" << needle << "' in: " << msg;
  before.expect_same_as(target);
}

void expect_positional_load_refused(const PositionalStateDict& bad, const std::string& needle) {
  Trained<torch::optim::AdamWOptions> target(torch::optim::AdamWOptions(1e-3));
  const Snapshot before(target);
  const std::string msg = error_of([&] { target.opt->load_state_dict(bad); });
  EXPECT_NE(msg.find(needle), std::string::npos) << "expected '" << needle << "' in: " << msg;
  before.expect_same_as(target);
}

// A parameter without elements counts its steps but never gets a moment: its state loads back.
TEST(OptimizerLoad, AStateWithAZeroSizeParameterLoadsBack) {
  struct WithEmpty : torch::nn::Module {
    WithEmpty() {
      a = register_parameter("a", at::randn({8}).to(at::kBFloat16));
      empty = register_parameter("empty", at::randn({0, 4}).to(at::kBFloat16));
    }
    at::Tensor a, empty;
  };
  for (const bool sgd : {false, true}) {
    SCOPED_TRACE(sgd ? "SGD with momentum" : "AdamW");
    auto make = [&](WithEmpty& m) {
      return sgd ? std::make_unique<Float16Optimizer>(m,
                                                      torch::optim::SGDOptions(0.1).momentum(0.9))
                 : std::make_unique<Float16Optimizer>(m, torch::optim::AdamWOptions(1e-2));
    };
    WithEmpty m, m2;
    auto opt = make(m);
    for (auto& p : m.parameters()) p.mutable_grad() = at::ones_like(p);
    ASSERT_TRUE(opt->update().success);
    auto o2 = make(m2);
    o2->load_sharded_state_dict(opt->sharded_state_dict());
    auto o3 = make(m2);
    const PositionalStateDict positional = opt->state_dict();
    o3->load_state_dict(positional);
    // As torch holds it: empty moments, which torch's own step reads.
    const auto& entry = positional.state.at(1);
    for (const char* kind : sgd ? std::vector<const char*>{"momentum_buffer"}
                                : std::vector<const char*>{"exp_avg", "exp_avg_sq"}) {
      ASSERT_TRUE(entry.count(kind)) << kind;
      EXPECT_EQ(entry.at(kind).sizes(), at::IntArrayRef({0, 4})) << kind;
    }
  }
}

// A state saved after an option that adds a state kind was switched on, before the next step:
// the step creates that kind itself (max_exp_avg_sq at zeros, the momentum buffer from the
// gradient), so the load must not ask for it, and the steps that follow match an uninterrupted
// run bitwise.
TEST(OptimizerLoad, AStateKindSwitchedOnSinceTheLastStepIsNotRequired) {
  for (const bool sgd : {false, true}) {
    SCOPED_TRACE(sgd ? "SGD momentum 0 -> 0.9" : "AdamW amsgrad off -> on");
    auto make = [&](Interleaved& m) {
      return sgd ? mixprec::testing::make_optimizer(m, torch::optim::SGDOptions(0.1))
                 : mixprec::testing::make_optimizer(m, torch::optim::AdamWOptions(1e-2));
    };
    auto switch_on = [&](Float16Optimizer& o) {
      auto& options = o.param_groups()[0].options();
      if (sgd) {
        static_cast<torch::optim::SGDOptions&>(options).momentum(0.9);
      } else {
        static_cast<torch::optim::AdamWOptions&>(options).amsgrad(true);
      }
    };
    Interleaved straight, resumed;
    auto a = make(straight);
    set_grads(*straight, 0);
    ASSERT_TRUE(a->update().success);
    switch_on(*a);
    const ShardedStateDict saved = a->sharded_state_dict().clone();
    load_model_sharded_state_dict(*resumed, model_sharded_state_dict(*straight).clone());
    auto b = make(resumed);
    b->load_sharded_state_dict(saved);  // strict
    for (int s = 1; s < 3; ++s) {
      set_grads(*straight, s);
      set_grads(*resumed, s);
      ASSERT_TRUE(a->update().success);
      ASSERT_TRUE(b->update().success);
    }
    auto theirs = straight->named_parameters();
    for (const auto& item : resumed->named_parameters()) {
      EXPECT_TRUE(bitwise_equal(item.value(), theirs[item.key()])) << item.key();
    }
  }
}

// A gradient of a dtype no step takes is named by its parameter.
TEST(OptimizerLoad, AGradientOfAnotherDtypeIsNamed) {
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-2));
  set_grads(*model, 0);
  model->pre->weight.mutable_grad() = at::ones_like(model->pre->weight, at::kDouble);
  const std::string message = error_of([&] { opt->update(); });
  EXPECT_NE(message.find("gradient of 'pre.weight' is Double"), std::string::npos) << message;
}

TEST(OptimizerLoad, OutOfRangeAdamHyperParametersAreRefusedInBothForms) {
  Trained<torch::optim::AdamWOptions> source(torch::optim::AdamWOptions(1e-2));
  const ShardedStateDict saved = source.opt->sharded_state_dict();
  const PositionalStateDict positional = source.opt->state_dict();
  const std::vector<std::pair<nlohmann::json, std::string>> cases = {
      {{{"lr", -1.0}}, "lr"},
      {{{"betas", {1.5, 0.9}}}, "beta1"},
      {{{"betas", {0.9, 1.0}}}, "beta2"},
      {{{"eps", -1.0}}, "eps"},
      {{{"weight_decay", -0.5}}, "weight_decay"},
  };
  for (const auto& [patch, needle] : cases) {
    SCOPED_TRACE(patch.dump());
    ShardedStateDict bad = saved;
    bad.common["optimizer"]["param_groups"][0].update(patch);
    expect_sharded_load_refused(bad, needle);
    expect_sharded_load_refused(bad, "param group 0");
    PositionalStateDict bad_positional = positional;
    bad_positional.param_groups[0].update(patch);
    expect_positional_load_refused(bad_positional, needle);
  }
}

TEST(OptimizerLoad, SgdNesterovRuleIsCheckedOnLoad) {
  Interleaved model_a, model_b;
  auto a = mixprec::testing::make_optimizer(model_a, torch::optim::SGDOptions(0.1).momentum(0.9));
  set_grads(*model_a, 0);
  ASSERT_TRUE(a->update().success);
  ShardedStateDict bad = a->sharded_state_dict();
  bad.common["optimizer"]["param_groups"][0]["nesterov"] = true;
  bad.common["optimizer"]["param_groups"][0]["dampening"] = 0.5;
  auto b = mixprec::testing::make_optimizer(model_b, torch::optim::SGDOptions(0.1).momentum(0.9));
  const std::string msg = error_of([&] { b->load_sharded_state_dict(bad); });
  EXPECT_NE(msg.find("nesterov"), std::string::npos) << msg;
  EXPECT_FALSE(b->param_groups()[0].options().get_lr() != 0.1);
  EXPECT_FALSE(static_cast<torch::optim::SGDOptions&>(b->param_groups()[0].options()).nesterov());
}

TEST(OptimizerLoad, BadShardedStepIsRefused) {
  Trained<torch::optim::AdamWOptions> source(torch::optim::AdamWOptions(1e-2));
  const ShardedStateDict saved = source.opt->sharded_state_dict();
  const std::vector<nlohmann::json> bad_steps = {
      -1, 2.5, 1e20, nlohmann::json(std::numeric_limits<uint64_t>::max()), "3", nullptr};
  for (const auto& step : bad_steps) {
    SCOPED_TRACE(step.dump());
    ShardedStateDict bad = saved;
    bad.common["optimizer"]["step"] = step;
    expect_sharded_load_refused(bad, "'step'");
  }
  for (const auto& step : bad_steps) {
    SCOPED_TRACE("steps.gate = " + step.dump());
    ShardedStateDict bad = saved;
    bad.common["optimizer"]["steps"]["gate"] = step;
    expect_sharded_load_refused(bad, "gate");
  }
}

// A saved step of a parameter this optimizer does not have is unexpected: strict refuses it,
// a non-strict load reports it by name.
TEST(OptimizerLoad, StepsOfAnUnknownParameterAreUnexpected) {
  Trained<torch::optim::AdamWOptions> source(torch::optim::AdamWOptions(1e-2));
  ShardedStateDict bad = source.opt->sharded_state_dict();
  bad.common["optimizer"]["steps"]["nope"] = 3;
  expect_sharded_load_refused(bad, "unexpected steps['nope'] (no such parameter)");
  Trained<torch::optim::AdamWOptions> target(torch::optim::AdamWOptions(1e-3));
  const LoadReport report = target.opt->load_sharded_state_dict(bad, LoadOptions().strict(false));
  EXPECT_EQ(report.unexpected_keys,
            (std::vector<std::string>{"steps['nope'] (no such parameter)"}));
}

TEST(OptimizerLoad, BadPositionalStepIsRefused) {
  Trained<torch::optim::AdamWOptions> source(torch::optim::AdamWOptions(1e-2));
  const PositionalStateDict saved = source.opt->state_dict();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (double step : {nan, -2.0, 2.5, 1e20, std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE(step);
    PositionalStateDict bad = saved;
    bad.state[2]["step"] = at::scalar_tensor(step, at::kDouble);
    expect_positional_load_refused(bad, "state[2].step");
  }
}

// Step 0 is a valid count, but moments at step 0 are no state a step leaves behind (Adam's
// bias correction at step 0 divides by zero): refused, in both forms, naming the parameter.
TEST(OptimizerLoad, MomentsWithStepZeroAreRefused) {
  Trained<torch::optim::AdamWOptions> source(torch::optim::AdamWOptions(1e-2));
  ShardedStateDict sharded = source.opt->sharded_state_dict();
  sharded.common["optimizer"]["steps"]["gate"] = 0;
  expect_sharded_load_refused(sharded, "'gate' has optimizer state but step 0");
  PositionalStateDict positional = source.opt->state_dict();
  positional.state[2]["step"] = at::scalar_tensor(0.0, at::kDouble);
  expect_positional_load_refused(positional, "'gate' has optimizer state but step 0");
}

// The bounds of a positional step exactly: 2^63 (the first double beyond int64) and a negative
// integer step are refused; an integer step tensor (torch.optim keeps a float one) loads.
TEST(OptimizerLoad, PositionalStepBoundsAreExact) {
  Trained<torch::optim::AdamWOptions> source(torch::optim::AdamWOptions(1e-2));
  const PositionalStateDict saved = source.opt->state_dict();
  PositionalStateDict bad = saved;
  bad.state[2]["step"] = at::scalar_tensor(9223372036854775808.0, at::kDouble);
  expect_positional_load_refused(bad, "state[2].step 9.22337e+18 is not a non-negative integer");
  bad.state[2]["step"] = at::scalar_tensor(-1, at::kLong);
  expect_positional_load_refused(bad, "state[2].step -1 is negative");
  PositionalStateDict integral = saved;
  integral.state[2]["step"] = at::scalar_tensor(2, at::kLong);
  Trained<torch::optim::AdamWOptions> target(torch::optim::AdamWOptions(1e-3));
  EXPECT_TRUE(target.opt->load_state_dict(integral).clean());
}

// A constant scaler's state (BF16 training) resumed with a dynamic scaler (FP16) keeps the
// configured scaler and says so: its constant scale of 1 is no dynamic scale to continue from.
TEST(OptimizerLoad, AScalerStateOfTheOtherKindKeepsTheConfiguredScaler) {
  Trained<torch::optim::AdamWOptions> source(torch::optim::AdamWOptions(1e-2));
  Interleaved model;
  const LossScalerOptions dynamic = LossScalerOptions::fp16_dynamic();
  auto target = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-3),
                                                 Float16OptimizerOptions().loss_scaler(dynamic));
  const LoadReport report = target->load_sharded_state_dict(source.opt->sharded_state_dict());
  EXPECT_TRUE(target->loss_scaler().is_dynamic());
  EXPECT_EQ(target->loss_scale(), dynamic.initial_scale());
  EXPECT_NE(report.to_string().find("loss scaler: the state is constant"), std::string::npos)
      << report.to_string();
}

// --- two typed steps: check, then apply -------------------------------------------------------

TEST(OptimizerLoad, CheckChangesNothingAndApplyInstallsWhatWasChecked) {
  Trained<torch::optim::AdamWOptions> source(torch::optim::AdamWOptions(1e-2));
  ShardedStateDict saved = source.opt->sharded_state_dict();
  saved.tensors.erase("optimizer.state.exp_avg.gate");
  Trained<torch::optim::AdamWOptions> target(torch::optim::AdamWOptions(1e-3));
  const Snapshot before(target);
  CheckedOptimizerState checked =
      target.opt->check_sharded_state_dict(saved, LoadOptions().strict(false));
  EXPECT_EQ(checked.report().missing_keys,
            std::vector<std::string>{"optimizer.state.exp_avg.gate"});
  before.expect_same_as(target);
  const LoadReport report = target.opt->apply(std::move(checked));
  EXPECT_EQ(report.missing_keys, std::vector<std::string>{"optimizer.state.exp_avg.gate"});
  EXPECT_DOUBLE_EQ(target.opt->param_groups()[0].options().get_lr(), 1e-2);
  EXPECT_TRUE(bitwise_equal(target.opt->main_param("post.weight"),
                            saved.at("optimizer.state.fp32_param.post.weight").local));
  EXPECT_FALSE(target.opt->sharded_state_dict().contains("optimizer.state.exp_avg.gate"))
      << "gate's incomplete state starts fresh";
}

TEST(OptimizerLoad, CheckedStateAppliesOnceAndOnlyToItsOptimizer) {
  Trained<torch::optim::AdamWOptions> source(torch::optim::AdamWOptions(1e-2));
  const PositionalStateDict saved = source.opt->state_dict();
  Trained<torch::optim::AdamWOptions> a(torch::optim::AdamWOptions(1e-3));
  Trained<torch::optim::AdamWOptions> b(torch::optim::AdamWOptions(1e-3));
  CheckedOptimizerState checked = a.opt->check_state_dict(saved);
  const Snapshot b_before(b);
  std::string msg = error_of([&] { b.opt->apply(std::move(checked)); });
  EXPECT_NE(msg.find("checked by another optimizer"), std::string::npos) << msg;
  b_before.expect_same_as(b);
  EXPECT_TRUE(a.opt->apply(std::move(checked)).clean());
  msg = error_of([&] { a.opt->apply(std::move(checked)); });
  EXPECT_NE(msg.find("applied already"), std::string::npos) << msg;
}

// The check relied on the parameters' roles: a conversion run between check and apply makes
// the checked value stale, and apply refuses it without touching anything.
TEST(OptimizerLoad, ApplyRefusesAStateCheckedBeforeARoleChange) {
  Trained<torch::optim::AdamWOptions> source(torch::optim::AdamWOptions(1e-2));
  const ShardedStateDict saved = source.opt->sharded_state_dict();
  Trained<torch::optim::AdamWOptions> target(torch::optim::AdamWOptions(1e-3));
  CheckedOptimizerState checked = target.opt->check_sharded_state_dict(saved);
  {
    at::NoGradGuard no_grad;
    target.model->gate.set_data(target.model->gate.to(at::kBFloat16));
  }
  const at::Tensor gate_before = target.model->gate.clone();
  const std::string msg = error_of([&] { target.opt->apply(std::move(checked)); });
  EXPECT_NE(msg.find("changed role since the state was checked"), std::string::npos) << msg;
  EXPECT_EQ(target.opt->params_info()[2].role, ParamRole::kNativeFp32) << "nothing applied";
  EXPECT_TRUE(bitwise_equal(target.model->gate, gate_before));
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::optim
