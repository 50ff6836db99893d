// The optimizer serves the model as it is now (SPEC §3): weights changed from outside, groups
// added, parameters unfrozen or re-typed after construction, tied weights.
#include "mixprec/optim/float16_optimizer.h"

#include "optim/support_optim.h"
#include "support/error_message.h"

#include <gtest/gtest.h>
#include <torch/nn/modules/embedding.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

namespace mixprec::optim {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using mixprec::testing::bitwise_equal;
using mixprec::testing::error_of;
using mixprec::testing::Interleaved;
using mixprec::testing::set_grads;

// --- weights changed from outside (issue 7 item 1) ---------------------------------------------

// "Pretrained" weights: another model's values, BF16 where the target is BF16.
ShardedStateDict pretrained_weights() {
  Interleaved source;
  return model_sharded_state_dict(*source).clone();
}

TEST(ModelChanges, ModelOnlyLoadAfterConstructionIsNotUndoneByTheStep) {
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(0.0));
  const ShardedStateDict weights = pretrained_weights();
  load_model_sharded_state_dict(*model, weights);
  set_grads(*model, 0);
  ASSERT_TRUE(opt->update().success);
  for (const auto& [fqn, t] : weights.tensors) {
    EXPECT_TRUE(bitwise_equal(model->named_parameters()[fqn], t.local)) << fqn;
  }
}

TEST(ModelChanges, CopyIntoAParamAfterConstructionIsNotUndoneByTheStep) {
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(0.0));
  const at::Tensor loaded = at::randn({8, 8}).to(at::kBFloat16);
  {
    at::NoGradGuard no_grad;
    model->post->weight.copy_(loaded);
  }
  set_grads(*model, 0);
  ASSERT_TRUE(opt->update().success);
  EXPECT_TRUE(bitwise_equal(model->post->weight, loaded));
  EXPECT_TRUE(bitwise_equal(opt->main_param("post.weight"), loaded.to(at::kFloat)));
}

// Everything the optimizer and its model hold, for "nothing changed" checks.
struct Snapshot {
  std::vector<at::Tensor> params, masters;
  explicit Snapshot(const Interleaved& model, const Float16Optimizer& opt) {
    for (const auto& p : model->parameters()) params.push_back(p.clone());
    for (const auto& info : opt.params_info()) {
      const at::Tensor& m = opt.main_param(info.fqn);
      masters.push_back(m.defined() ? m.clone() : at::Tensor());
    }
  }
  void expect_same(const Interleaved& model, const Float16Optimizer& opt) const {
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(model->parameters()[i], params[i])) << i;
    }
    for (size_t k = 0; k < masters.size(); ++k) {
      const at::Tensor& m = opt.main_param(opt.params_info()[k].fqn);
      EXPECT_EQ(m.defined(), masters[k].defined()) << k;
      if (m.defined()) EXPECT_TRUE(bitwise_equal(m, masters[k])) << k;
    }
  }
};

TEST(ModelChanges, OutsideWriteIsAnErrorNamingTheParamWhenAskedAndReloadAdoptsIt) {
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(
      model, torch::optim::AdamWOptions(0.0),
      Float16OptimizerOptions().on_external_param_change(ExternalParamChange::kError));
  const at::Tensor loaded = at::randn({8, 8}).to(at::kBFloat16);
  {
    at::NoGradGuard no_grad;
    model->post->weight.copy_(loaded);
  }
  set_grads(*model, 0);
  const Snapshot before(model, *opt);
  std::string msg = error_of([&] { opt->update(); });
  EXPECT_NE(msg.find("'post.weight' was written from outside"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("'pre.weight'"), std::string::npos) << msg;
  before.expect_same(model, *opt);
  msg = error_of([&] { opt->sharded_state_dict(); });
  EXPECT_NE(msg.find("'post.weight'"), std::string::npos) << "a stale master is never saved";

  opt->reload_model_params();
  EXPECT_TRUE(bitwise_equal(opt->main_param("post.weight"), loaded.to(at::kFloat)));
  ASSERT_TRUE(opt->update().success);
  EXPECT_TRUE(bitwise_equal(model->post->weight, loaded));
}

// Writing back the value the master rounds to (e.g. reloading the same weights) is no change:
// the master keeps the bits below BF16 precision.
TEST(ModelChanges, WriteOfTheSameValueKeepsTheMaster) {
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(
      model, torch::optim::AdamWOptions(1e-2),
      Float16OptimizerOptions().on_external_param_change(ExternalParamChange::kError));
  for (int s = 0; s < 3; ++s) {
    set_grads(*model, s);
    ASSERT_TRUE(opt->update().success);
  }
  const at::Tensor master = opt->main_param("pre.weight").clone();
  ASSERT_FALSE(at::equal(master, model->pre->weight.to(at::kFloat))) << "master has low bits";
  load_model_sharded_state_dict(*model, model_sharded_state_dict(*model).clone());
  EXPECT_NO_THROW(opt->sharded_state_dict());
  EXPECT_TRUE(bitwise_equal(opt->main_param("pre.weight"), master));
}

// A state dict taken after an outside write (default option) holds the new value, not the
// stale master: a checkpoint saved before the next step resumes from the loaded weights.
TEST(ModelChanges, StateDictAfterAnOutsideWriteHoldsTheNewValue) {
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-2));
  const ShardedStateDict weights = pretrained_weights();
  load_model_sharded_state_dict(*model, weights);
  const ShardedStateDict sd = opt->sharded_state_dict();
  EXPECT_TRUE(bitwise_equal(sd.at("optimizer.state.fp32_param.pre.weight").local,
                            weights.at("pre.weight").local.to(at::kFloat)));
}

// --- structure changed after construction (issue 7 item 2) -------------------------------------

TEST(ModelChanges, ParamFrozenAtConstructionAndUnfrozenLaterIsStepped) {
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-2));
  model->frozen->weight.set_requires_grad(true);
  set_grads(*model, 0);
  const at::Tensor before = model->frozen->weight.clone();
  const StepResult r = opt->update();
  ASSERT_TRUE(r.success);
  EXPECT_EQ(r.params_stepped, 4);
  EXPECT_FALSE(at::equal(model->frozen->weight, before)) << "an unfrozen param must be stepped";
  EXPECT_EQ(opt->params_info()[1].role, ParamRole::kMaster);
  EXPECT_EQ(opt->params_info()[1].id, 1) << "ids never shift";
  EXPECT_TRUE(opt->sharded_state_dict().contains("optimizer.state.fp32_param.frozen.weight"));
}

// Unfrozen between save and resume: the checkpoint has no master for it (it had none), and
// its model value is all there was, so a strict load takes the master from it.
TEST(ModelChanges, ParamFrozenWhenSavedLoadsStrictlyWhereItIsTrainable) {
  Interleaved ma;
  auto a = mixprec::testing::make_optimizer(ma, torch::optim::AdamWOptions(1e-2));
  for (int s = 0; s < 2; ++s) {
    set_grads(*ma, s);
    ASSERT_TRUE(a->update().success);
  }
  const ShardedStateDict saved = a->sharded_state_dict();
  Interleaved mb;
  mb->frozen->weight.set_requires_grad(true);
  auto b = mixprec::testing::make_optimizer(mb, torch::optim::AdamWOptions(1e-2));
  load_model_sharded_state_dict(*mb, model_sharded_state_dict(*ma));
  const LoadReport report = b->load_sharded_state_dict(saved);
  EXPECT_TRUE(report.clean()) << report.to_string();
  EXPECT_TRUE(bitwise_equal(b->main_param("frozen.weight"), ma->frozen->weight.to(at::kFloat)));
  set_grads(*mb, 2);
  EXPECT_TRUE(b->update().success);
}

// Two FP32 params; `late` is converted to BF16 after the optimizer exists (conversion run late).
struct TwoFp32Impl : torch::nn::Module {
  TwoFp32Impl() {
    early = register_parameter("early", torch::randn({6}));
    late = register_parameter("late", torch::randn({6}));
  }
  at::Tensor early, late;
};

TEST(ModelChanges, ParamRetypedAfterConstructionGetsAMasterBeforeAnyParamIsStepped) {
  auto model = std::make_shared<TwoFp32Impl>();
  Float16Optimizer opt(*model, torch::optim::SGDOptions(0.5));
  {
    at::NoGradGuard no_grad;
    model->late.set_data(model->late.to(at::kBFloat16));
  }
  model->early.mutable_grad() = at::ones({6});
  model->late.mutable_grad() = at::ones({6}, at::kBFloat16);
  const at::Tensor late_before = model->late.clone();
  const StepResult r = opt.update();
  ASSERT_TRUE(r.success);
  EXPECT_EQ(opt.params_info()[1].role, ParamRole::kMaster);
  EXPECT_TRUE(bitwise_equal(opt.main_param("late"), late_before.to(at::kFloat) - 0.5));
  EXPECT_TRUE(bitwise_equal(model->late, (late_before.to(at::kFloat) - 0.5).to(at::kBFloat16)));
}

TEST(ModelChanges, RetypeIsAnErrorBeforeAnyParamIsTouchedWhenAsked) {
  auto model = std::make_shared<TwoFp32Impl>();
  Float16Optimizer opt(
      *model, torch::optim::SGDOptions(0.5),
      Float16OptimizerOptions().on_external_param_change(ExternalParamChange::kError));
  {
    at::NoGradGuard no_grad;
    model->late.set_data(model->late.to(at::kBFloat16));
  }
  model->early.mutable_grad() = at::ones({6});
  model->late.mutable_grad() = at::ones({6}, at::kBFloat16);
  const at::Tensor early_before = model->early.clone();
  const std::string msg = error_of([&] { opt.update(); });
  EXPECT_NE(msg.find("'late' changed dtype from Float to BFloat16"), std::string::npos) << msg;
  EXPECT_TRUE(bitwise_equal(model->early, early_before)) << "an earlier param was stepped";
  EXPECT_EQ(opt.params_info()[1].role, ParamRole::kNativeFp32);
}

// BF16 with a master, converted to FP32 later (a new keep-FP32 rule): the parameter takes the
// master's value (better than the rounded one the conversion cast) and the copy is dropped.
TEST(ModelChanges, MasteredParamRetypedToFp32TakesTheMasterValue) {
  Interleaved model(/*gate_fp32=*/false);
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-2));
  for (int s = 0; s < 2; ++s) {
    set_grads(*model, s);
    ASSERT_TRUE(opt->update().success);
  }
  const at::Tensor master = opt->main_param("gate").clone();
  {
    at::NoGradGuard no_grad;
    model->gate.set_data(model->gate.to(at::kFloat));
  }
  const ShardedStateDict sd = opt->sharded_state_dict();
  EXPECT_FALSE(sd.contains("optimizer.state.fp32_param.gate"));
  EXPECT_TRUE(sd.contains("optimizer.state.exp_avg.gate")) << "moments stay";
  EXPECT_TRUE(bitwise_equal(model->gate, master));
  EXPECT_EQ(opt->params_info()[2].role, ParamRole::kNativeFp32);
  set_grads(*model, 2);
  EXPECT_TRUE(opt->update().success);
}

// A new value that arrives with a new dtype (set_data of another tensor, not a conversion of
// the old one) is the truth, as any outside write is: it is neither replaced by the master nor
// lost to it (SPEC 3: never silently undone by the next step).
TEST(ModelChanges, ANewValueArrivingWithANewDtypeIsKept) {
  for (const bool remainders : {false, true})
    for (const at::ScalarType to : {at::kFloat, at::kHalf}) {
      SCOPED_TRACE(std::string(c10::toString(to)) + (remainders ? " remainders" : ""));
      Interleaved model(/*gate_fp32=*/false);
      auto opt =
          mixprec::testing::make_optimizer(model, torch::optim::SGDOptions(0.0),
                                           Float16OptimizerOptions().master_remainders(remainders));
      set_grads(*model, 0);
      ASSERT_TRUE(opt->update().success);
      // 5 + i/1000: no BF16 parameter could hold these values (with remainders, that is what
      // tells a new value from a conversion).
      const at::Tensor fresh =
          (at::arange(model->gate.numel(), at::kFloat).div(1000).add(5).view(model->gate.sizes()))
              .to(to);
      {
        at::NoGradGuard no_grad;
        model->gate.set_data(fresh.clone());
      }
      set_grads(*model, 1);
      ASSERT_TRUE(opt->update().success);  // lr 0: nothing moves but what the sync decides
      EXPECT_TRUE(bitwise_equal(model->gate, fresh)) << model->gate;
      if (to == at::kHalf) {
        EXPECT_TRUE(bitwise_equal(opt->main_param("gate"), fresh.to(at::kFloat)));
      }
    }
}

// torch.optim.SGD keeps no "step": its state dict loads as it is (optimizer_state.h).
TEST(ModelChanges, TorchsSgdStateWithoutAStepLoads) {
  Interleaved ma;
  auto a = mixprec::testing::make_optimizer(ma, torch::optim::SGDOptions(0.1).momentum(0.9));
  set_grads(*ma, 0);
  ASSERT_TRUE(a->update().success);
  PositionalStateDict sd = a->state_dict();
  ASSERT_FALSE(sd.state.empty());
  for (auto& [id, entry] : sd.state) {
    ASSERT_TRUE(entry.count("momentum_buffer")) << id;
    entry.erase("step");
  }
  Interleaved mb;
  load_model_sharded_state_dict(*mb, model_sharded_state_dict(*ma));
  auto b = mixprec::testing::make_optimizer(mb, torch::optim::SGDOptions(0.1).momentum(0.9));
  const LoadReport report = b->load_state_dict(sd);
  EXPECT_TRUE(report.clean()) << report.to_string();
  set_grads(*ma, 1);
  set_grads(*mb, 1);
  ASSERT_TRUE(a->update().success);
  ASSERT_TRUE(b->update().success);
  EXPECT_TRUE(bitwise_equal(mb->pre->weight, ma->pre->weight)) << "the momentum was carried";
}

// A positional state saved while a parameter was frozen holds nothing for it; where it is
// trainable now, its main copy comes from the model, as the FQN-keyed load does.
TEST(ModelChanges, PositionalStateSavedWhileFrozenLoadsWhereItIsTrainable) {
  Interleaved ma;
  auto a = mixprec::testing::make_optimizer(ma, torch::optim::AdamWOptions(1e-2));
  set_grads(*ma, 0);
  ASSERT_TRUE(a->update().success);
  const PositionalStateDict saved = a->state_dict();
  Interleaved mb;
  mb->frozen->weight.set_requires_grad(true);
  load_model_sharded_state_dict(*mb, model_sharded_state_dict(*ma));
  auto b = mixprec::testing::make_optimizer(mb, torch::optim::AdamWOptions(1e-2));
  const LoadReport report = b->load_state_dict(saved);
  EXPECT_TRUE(report.missing_keys.empty()) << report.to_string();
  EXPECT_TRUE(bitwise_equal(b->main_param("frozen.weight"), ma->frozen->weight.to(at::kFloat)));
  set_grads(*mb, 1);
  EXPECT_TRUE(b->update().success);
}

TEST(ModelChanges, ShapeChangeOfATrainableParamIsAnError) {
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-2));
  {
    at::NoGradGuard no_grad;
    model->gate.set_data(at::zeros({25}));
  }
  const std::string msg = error_of([&] { opt->update(); });
  EXPECT_NE(msg.find("'gate' changed from [24] on cpu to [25] on cpu"), std::string::npos) << msg;
}

TEST(ModelChanges, AddedParamGroupIsStepped) {
  Interleaved model;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{model->pre->weight, model->gate});
  Float16Optimizer opt(*model, std::move(groups),
                       std::make_unique<torch::optim::AdamWOptions>(1e-2));
  opt.add_param_group(torch::optim::OptimizerParamGroup(
      {model->post->weight}, std::make_unique<torch::optim::AdamWOptions>(1e-3)));
  set_grads(*model, 0);
  const at::Tensor post_before = model->post->weight.clone();
  const StepResult r = opt.update();
  ASSERT_TRUE(r.success);
  EXPECT_EQ(r.params_stepped, 3);
  EXPECT_FALSE(at::equal(model->post->weight, post_before));
  ASSERT_EQ(opt.params_info().size(), 3u);
  EXPECT_EQ(opt.params_info()[2].fqn, "post.weight");
  EXPECT_EQ(opt.params_info()[2].group, 1u);
  const ShardedStateDict sd = opt.sharded_state_dict();
  EXPECT_TRUE(sd.contains("optimizer.state.fp32_param.post.weight"));
  EXPECT_EQ(sd.common["optimizer"]["param_groups"][1]["params"], nlohmann::json({"post.weight"}));
  EXPECT_EQ(opt.state_dict().param_groups[1]["params"], nlohmann::json({2}));
}

// torch's add_param_group is not virtual: a group added through the base class (or a
// parameter pushed into param_groups()) is refused at the next use, before anything changes.
TEST(ModelChanges, GroupAddedBehindTheOptimizersBackIsRefused) {
  Interleaved model;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{model->pre->weight, model->gate});
  Float16Optimizer opt(*model, std::move(groups),
                       std::make_unique<torch::optim::AdamWOptions>(1e-2));
  torch::optim::Optimizer& base = opt;
  base.add_param_group(torch::optim::OptimizerParamGroup({model->post->weight}));
  set_grads(*model, 0);
  const at::Tensor pre_before = model->pre->weight.clone();
  std::string msg = error_of([&] { opt.update(); });
  EXPECT_NE(msg.find("there are 2 param groups, the optimizer adopted 1"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("Float16Optimizer::add_param_group"), std::string::npos) << msg;
  EXPECT_TRUE(bitwise_equal(model->pre->weight, pre_before));
  msg = error_of([&] { opt.state_dict(); });
  EXPECT_NE(msg.find("param groups changed outside the optimizer"), std::string::npos) << msg;
  base.param_groups().pop_back();
  base.param_groups()[0].params().push_back(model->post->weight);
  msg = error_of([&] { opt.update(); });
  EXPECT_NE(msg.find("param group 0 has 3 params, the optimizer adopted 2"), std::string::npos)
      << msg;
}

TEST(ModelChanges, AddedGroupWithAParamAlreadyHeldIsRefusedAndChangesNothing) {
  Interleaved model;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{model->pre->weight, model->gate});
  Float16Optimizer opt(*model, std::move(groups),
                       std::make_unique<torch::optim::AdamWOptions>(1e-2));
  std::string msg = error_of([&] {
    opt.add_param_group(torch::optim::OptimizerParamGroup({model->post->weight, model->gate}));
  });
  EXPECT_NE(msg.find("'gate' appears twice (ids 1 and 3)"), std::string::npos) << msg;
  msg = error_of([&] {
    opt.add_param_group(
        torch::optim::OptimizerParamGroup({torch::randn({3}, torch::requires_grad())}));
  });
  EXPECT_NE(msg.find("param 0 of group 1 (id 2, Float [3]) was not a parameter of the model "
                     "when the optimizer was built"),
            std::string::npos)
      << msg;
  // Registered since construction: still not one the optimizer can take, and said so.
  const at::Tensor extra = model->register_parameter("extra", torch::randn({5}));
  msg = error_of([&] { opt.add_param_group(torch::optim::OptimizerParamGroup({extra})); });
  EXPECT_NE(msg.find("(id 2, Float [5]) was not a parameter of the model when the optimizer was "
                     "built (a parameter registered since cannot be added"),
            std::string::npos)
      << msg;
  msg = error_of([&] {
    opt.add_param_group(torch::optim::OptimizerParamGroup(
        {model->post->weight}, std::make_unique<torch::optim::AdamWOptions>(-1.0)));
  });
  EXPECT_NE(msg.find("lr"), std::string::npos) << msg;
  EXPECT_EQ(opt.param_groups().size(), 1u);
  EXPECT_EQ(opt.params_info().size(), 2u);
  set_grads(*model, 0);
  EXPECT_TRUE(opt.update().success);
}

// --- tied weights (issue 7 item 3) -------------------------------------------------------------

// A tied LM head: head.weight is embed.weight (one tensor, two names).
struct HeadImpl : torch::nn::Module {
  explicit HeadImpl(at::Tensor tied) { weight = register_parameter("weight", std::move(tied)); }
  at::Tensor weight;
};
TORCH_MODULE(Head);

struct TiedLmImpl : torch::nn::Module {
  TiedLmImpl() {
    embed = register_module("embed", torch::nn::Embedding(16, 8));
    head = register_module("head", Head(embed->weight));
    norm_scale = register_parameter("norm_scale", keep_in_fp32(torch::ones({8})));
    convert_module_to_dtype_except_fp32_marked(*this, at::kBFloat16);
  }
  torch::nn::Embedding embed{nullptr};
  Head head{nullptr};
  at::Tensor norm_scale;
};
TORCH_MODULE(TiedLm);

TEST(ModelChanges, TiedWeightsAreOneParameterUnderTheFirstName) {
  TiedLm model;
  ASSERT_TRUE(model->head->weight.is_same(model->embed->weight));
  Float16Optimizer opt(*model, torch::optim::AdamWOptions(1e-2));
  ASSERT_EQ(opt.params_info().size(), 2u);
  std::set<std::string> names;
  for (const auto& info : opt.params_info()) names.insert(info.fqn);
  EXPECT_EQ(names, (std::set<std::string>{"embed.weight", "norm_scale"}));
  set_grads(*model, 0);
  ASSERT_TRUE(opt.update().success);
  EXPECT_TRUE(model->head->weight.is_same(model->embed->weight));
  const ShardedStateDict sd = opt.sharded_state_dict();
  EXPECT_TRUE(sd.contains("optimizer.state.fp32_param.embed.weight"));
  EXPECT_FALSE(sd.contains("optimizer.state.fp32_param.head.weight"));
  EXPECT_TRUE(
      bitwise_equal(sd.at("optimizer.state.fp32_param.embed.weight").local.to(at::kBFloat16),
                    model->head->weight));
  // The whole training state round-trips into a fresh tied model.
  ShardedStateDict saved = model_sharded_state_dict(*model).clone();
  TiedLm other;
  Float16Optimizer other_opt(*other, torch::optim::AdamWOptions(1e-2));
  load_model_sharded_state_dict(*other, saved);
  EXPECT_TRUE(other_opt.load_sharded_state_dict(sd).clean());
  EXPECT_TRUE(bitwise_equal(other->head->weight, model->head->weight));
}

TEST(ModelChanges, ATiedParametersMainCopyAnswersToEachOfItsNames) {
  TiedLm model;
  Float16Optimizer opt(*model, torch::optim::AdamWOptions(1e-2));
  set_grads(*model, 0);
  ASSERT_TRUE(opt.update().success);
  const at::Tensor first = opt.main_param("embed.weight");
  ASSERT_TRUE(first.defined());
  EXPECT_TRUE(opt.main_param("head.weight").is_same(first));
  // A name the model never had is still refused, naming it.
  try {
    (void)opt.main_param("head.bias");
    ADD_FAILURE() << "expected c10::Error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'head.bias'"), std::string::npos) << e.what();
  }
  // A misspelt tied name is answered with the name it was meant to be.
  try {
    (void)opt.main_param("head.wieght");
    ADD_FAILURE() << "expected c10::Error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("close: head.weight"), std::string::npos) << e.what();
  }
}

// set_data with a new tensor of the same dtype and shape leaves the parameter's version as it
// was: the new storage alone tells of the write, and the step keeps the new value.
TEST(ModelChanges, SetDataAfterConstructionIsNotUndoneByTheStep) {
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(0.0));
  const at::Tensor loaded = at::randn({8, 8}).to(at::kBFloat16);
  {
    at::NoGradGuard no_grad;
    model->post->weight.set_data(loaded.clone());
  }
  set_grads(*model, 0);
  ASSERT_TRUE(opt->update().success);
  EXPECT_TRUE(bitwise_equal(model->post->weight, loaded));
  EXPECT_TRUE(bitwise_equal(opt->main_param("post.weight"), loaded.to(at::kFloat)));
}

// Parameters swapped inside a group behind the optimizer's back are refused at the next use,
// naming the position and the parameter it held.
TEST(ModelChanges, ParamsReorderedInAGroupAreRefused) {
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-2));
  auto& params = opt->param_groups()[0].params();
  std::swap(params[0], params[3]);
  set_grads(*model, 0);
  const at::Tensor pre_before = model->pre->weight.clone();
  const std::string msg = error_of([&] { opt->update(); });
  EXPECT_NE(msg.find("param group 0 position 0 is no longer 'pre.weight'"), std::string::npos)
      << msg;
  EXPECT_TRUE(bitwise_equal(model->pre->weight, pre_before));
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::optim
