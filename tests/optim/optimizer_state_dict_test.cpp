// State dicts of Float16Optimizer: the upstream regression, more parameter orders, round trips,
// precision-plan changes and bad input.
#include "mixprec/optim/float16_optimizer.h"

#include "optim/support_optim.h"

#include "support/error_message.h"

#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <sstream>

#include <set>

namespace mixprec::optim {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using mixprec::testing::bitwise_equal;
using mixprec::testing::Interleaved;
using mixprec::testing::set_grads;

using mixprec::testing::error_of;

std::set<std::string> keys_with_prefix(const ShardedStateDict& sd, const std::string& prefix) {
  std::set<std::string> out;
  for (const auto& [key, value] : sd.tensors) {
    if (key.rfind(prefix, 0) == 0) out.insert(key.substr(prefix.size()));
  }
  return out;
}

// The upstream regression, exactly: trainable BF16 pre.weight, frozen BF16 frozen.weight,
// native FP32 gate, trainable BF16 post.weight; one step.
TEST(OptimizerStateDict, UpstreamInterleavedRegression) {
  Interleaved model;
  auto opt_ptr = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-3));
  Float16Optimizer& opt = *opt_ptr;
  set_grads(*model, 0);
  ASSERT_TRUE(opt.update().success);

  const ShardedStateDict sd = opt.sharded_state_dict();
  EXPECT_EQ(keys_with_prefix(sd, "optimizer.state.fp32_param."),
            (std::set<std::string>{"pre.weight", "post.weight"}));
  for (const char* fqn : {"pre.weight", "post.weight"}) {
    const at::Tensor& master = sd.at(std::string("optimizer.state.fp32_param.") + fqn).local;
    EXPECT_EQ(master.sizes(), (std::vector<int64_t>{8, 8}));
    EXPECT_EQ(master.scalar_type(), at::kFloat);
  }
  const std::set<std::string> stateful{"pre.weight", "gate", "post.weight"};
  EXPECT_EQ(keys_with_prefix(sd, "optimizer.state.exp_avg."), stateful);
  EXPECT_EQ(keys_with_prefix(sd, "optimizer.state.exp_avg_sq."), stateful);
  EXPECT_EQ(sd.at("optimizer.state.exp_avg.gate").local.sizes(), (std::vector<int64_t>{24}));
  EXPECT_EQ(sd.at("optimizer.state.exp_avg_sq.post.weight").local.sizes(),
            (std::vector<int64_t>{8, 8}));
  // Each entry lands on its own parameter: the master is that parameter's master.
  EXPECT_TRUE(at::equal(sd.at("optimizer.state.fp32_param.post.weight").local,
                        opt.main_param("post.weight")));
  EXPECT_EQ(sd.common["optimizer"]["step"], 1);

  const PositionalStateDict pos = opt.state_dict();
  EXPECT_EQ(pos.state.count(1), 0u) << "frozen id 1 has no state";
  for (int64_t id : {0, 2, 3}) {
    ASSERT_EQ(pos.state.count(id), 1u) << id;
    EXPECT_EQ(pos.state.at(id).at("exp_avg").sizes(), model->optimizer_order()[id].sizes());
    EXPECT_EQ(pos.state.at(id).at("step").item<float>(), 1.0f);
  }
  EXPECT_EQ(pos.fp32_params.size(), 2u);
  EXPECT_EQ(pos.fp32_params.count(0) + pos.fp32_params.count(3), 2u);
  EXPECT_EQ(pos.param_groups[0]["params"], nlohmann::json({0, 1, 2, 3}));
}

// Parameters named a, b, c, ... with per-parameter dtype/trainability, for other orders.
struct SpecNetImpl : torch::nn::Module {
  explicit SpecNetImpl(const std::string& spec) {  // 'h' BF16, 'f' FP32, 'z' frozen BF16
    for (size_t i = 0; i < spec.size(); ++i) {
      at::Tensor t = torch::randn({static_cast<int64_t>(3 + i)});
      if (spec[i] != 'f') t = t.to(at::kBFloat16);
      register_parameter(std::string(1, static_cast<char>('a' + i)), t, spec[i] != 'z');
    }
  }
};
TORCH_MODULE(SpecNet);

class OrderTest : public ::testing::TestWithParam<std::string> {};

TEST_P(OrderTest, MastersAndMomentsLandOnTheirOwnParameter) {
  const std::string spec = GetParam();
  SpecNet model(spec);
  Float16Optimizer opt(*model, torch::optim::AdamWOptions(1e-3));
  set_grads(*model, 0);
  opt.update();
  const ShardedStateDict sd = opt.sharded_state_dict();
  for (size_t i = 0; i < spec.size(); ++i) {
    const std::string fqn(1, static_cast<char>('a' + i));
    const at::Tensor param = model->named_parameters()[fqn];
    EXPECT_EQ(sd.contains("optimizer.state.fp32_param." + fqn), spec[i] == 'h') << spec << fqn;
    EXPECT_EQ(sd.contains("optimizer.state.exp_avg." + fqn), spec[i] != 'z') << spec << fqn;
    if (spec[i] == 'h') {
      EXPECT_TRUE(
          at::equal(sd.at("optimizer.state.fp32_param." + fqn).local.to(at::kBFloat16), param));
    }
    if (spec[i] != 'z') {
      EXPECT_EQ(sd.at("optimizer.state.exp_avg." + fqn).local.numel(), param.numel());
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Orders, OrderTest,
                         ::testing::Values("fhhzh", "hzhf", "ffhh", "zzhf", "hfzfh", "zzz"));

// Three groups of two parameters each (a b | c d | e f), with learning rates 1e-2, 1e-3, 1e-4.
std::unique_ptr<Float16Optimizer> three_group_optimizer(SpecNet& model) {
  auto p = model->named_parameters();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{p["a"], p["b"]},
                      std::make_unique<torch::optim::AdamWOptions>(1e-2));
  groups.emplace_back(std::vector<at::Tensor>{p["c"], p["d"]},
                      std::make_unique<torch::optim::AdamWOptions>(1e-3));
  groups.emplace_back(std::vector<at::Tensor>{p["e"], p["f"]},
                      std::make_unique<torch::optim::AdamWOptions>(1e-4));
  return std::make_unique<Float16Optimizer>(*model, std::move(groups),
                                            std::make_unique<torch::optim::AdamWOptions>());
}

TEST(OptimizerStateDict, SeveralGroupsAndAnAllFrozenGroup) {
  SpecNet model("hfzzhf");
  auto owned = three_group_optimizer(model);
  Float16Optimizer& opt = *owned;
  set_grads(*model, 0);
  opt.update();
  const auto sd = opt.sharded_state_dict();
  EXPECT_EQ(keys_with_prefix(sd, "optimizer.state.fp32_param."), (std::set<std::string>{"a", "e"}));
  EXPECT_EQ(keys_with_prefix(sd, "optimizer.state.exp_avg."),
            (std::set<std::string>{"a", "b", "e", "f"}));
  const auto& groups_json = sd.common["optimizer"]["param_groups"];
  ASSERT_EQ(groups_json.size(), 3u);
  EXPECT_EQ(groups_json[1]["params"], nlohmann::json({"c", "d"}));
  EXPECT_DOUBLE_EQ(groups_json[2]["lr"].get<double>(), 1e-4);
  const auto pos = opt.state_dict();
  EXPECT_EQ(pos.param_groups[2]["params"], nlohmann::json({4, 5}));
  EXPECT_EQ(pos.state.count(2) + pos.state.count(3), 0u);
}

// Several groups load back in both forms: each group's ids (positional) and names (sharded)
// are checked from the group's own first parameter on (group 1 starts at id 2, group 2 at 4).
TEST(OptimizerStateDict, SeveralGroupsLoadBackInBothForms) {
  SpecNet ma("hfzzhf"), mb("hfzzhf");
  auto a = three_group_optimizer(ma);
  set_grads(*ma, 0);
  ASSERT_TRUE(a->update().success);
  auto b = three_group_optimizer(mb);
  EXPECT_TRUE(b->load_sharded_state_dict(a->sharded_state_dict()).clean());
  EXPECT_TRUE(b->load_state_dict(a->state_dict()).clean());
  EXPECT_EQ(b->sharded_state_dict().common, a->sharded_state_dict().common);
}

// Trains `model` with `opt` from step `from` to `to` (deterministic grads).
void train(torch::nn::Module& model, Float16Optimizer& opt, int from, int to) {
  for (int s = from; s < to; ++s) {
    set_grads(model, s);
    ASSERT_TRUE(opt.update().success);
  }
}

void expect_same_state(torch::nn::Module& ma, Float16Optimizer& a, torch::nn::Module& mb,
                       Float16Optimizer& b) {
  auto pa = ma.named_parameters(), pb = mb.named_parameters();
  for (const auto& item : pa)
    EXPECT_TRUE(bitwise_equal(item.value(), pb[item.key()])) << item.key();
  const auto sa = a.sharded_state_dict(), sb = b.sharded_state_dict();
  ASSERT_EQ(sa.tensors.size(), sb.tensors.size());
  for (const auto& [key, t] : sa.tensors) {
    ASSERT_TRUE(sb.contains(key)) << key;
    EXPECT_TRUE(bitwise_equal(t.local, sb.at(key).local)) << key;
  }
  EXPECT_EQ(sa.common, sb.common);
}

TEST(OptimizerStateDict, ShardedRoundTripResumesBitwise) {
  Interleaved ma;
  auto a_ptr =
      mixprec::testing::make_optimizer(ma, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  Float16Optimizer& a = *a_ptr;
  train(*ma, a, 0, 3);
  ShardedStateDict saved = model_sharded_state_dict(*ma);
  saved.merge(a.sharded_state_dict());

  Interleaved mb;  // different initial values
  auto b_ptr =
      mixprec::testing::make_optimizer(mb, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  Float16Optimizer& b = *b_ptr;
  load_model_sharded_state_dict(*mb, model_sharded_state_dict(*ma));
  const LoadReport report = b.load_sharded_state_dict(saved);
  EXPECT_TRUE(report.clean()) << report.to_string();
  EXPECT_FALSE(b.main_param("gate").defined()) << "native FP32 gate must not gain a copy";
  expect_same_state(*ma, a, *mb, b);
  train(*ma, a, 3, 6);
  train(*mb, b, 3, 6);
  expect_same_state(*ma, a, *mb, b);
}

// A load takes the loaded moments' memory only where nothing else refers to it (a checkpoint
// read's fresh tensors): the caller's own state dict, held through the load, is copied, so the
// optimizer's in-place steps afterwards leave it as it was.
TEST(OptimizerStateDict, ALoadedStateDictTheCallerHoldsIsCopiedNotTaken) {
  Interleaved ma;
  auto a = mixprec::testing::make_optimizer(ma, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  train(*ma, *a, 0, 3);
  ShardedStateDict saved = a->sharded_state_dict();  // tensors of its own, as a user's dict
  for (auto& [key, t] : saved.tensors) t.local = t.local.clone();
  std::map<std::string, at::Tensor> before;
  for (const auto& [key, t] : saved.tensors) before.emplace(key, t.local.clone());

  Interleaved mb;
  auto b = mixprec::testing::make_optimizer(mb, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  load_model_sharded_state_dict(*mb, model_sharded_state_dict(*ma));
  EXPECT_TRUE(b->load_sharded_state_dict(saved).clean());
  train(*mb, *b, 3, 5);
  for (const auto& [key, t] : saved.tensors) {
    EXPECT_TRUE(bitwise_equal(t.local, before.at(key))) << key << " was written by the steps";
  }
  // And the steps did move the optimizer's own moments.
  bool moved = false;
  for (const auto& [key, t] : b->sharded_state_dict().tensors) {
    if (before.count(key) && t.local.sizes() == before.at(key).sizes()) {
      moved |= !bitwise_equal(t.local, before.at(key));
    }
  }
  EXPECT_TRUE(moved);
}

// Parameters stepped unevenly: the sharded form records each step that differs from the common
// one, and lists a parameter never stepped as without state; both load strictly and resume
// bitwise (a lost step would change Adam's bias correction).
TEST(OptimizerStateDict, ShardedRoundTripKeepsUnevenStepsAndUnsteppedParameters) {
  auto train_uneven = [](Interleaved& m, Float16Optimizer& opt) {
    for (int s = 0; s < 2; ++s) {
      set_grads(*m, s);
      m->post->weight.mutable_grad() = at::Tensor();      // never stepped
      if (s == 1) m->gate.mutable_grad() = at::Tensor();  // stepped once
      ASSERT_TRUE(opt.update().success);
    }
  };
  Interleaved ma;
  auto a = mixprec::testing::make_optimizer(ma, torch::optim::AdamWOptions(1e-2));
  train_uneven(ma, *a);
  ShardedStateDict saved = model_sharded_state_dict(*ma);
  saved.merge(a->sharded_state_dict());
  const nlohmann::json& common = saved.common["optimizer"];
  EXPECT_EQ(common["step"], 2);
  EXPECT_EQ(common["steps"], nlohmann::json({{"gate", 1}}));
  EXPECT_EQ(common["without_state"], nlohmann::json({"post.weight"}));

  Interleaved mb;
  auto b = mixprec::testing::make_optimizer(mb, torch::optim::AdamWOptions(1e-2));
  load_model_sharded_state_dict(*mb, model_sharded_state_dict(*ma));
  const LoadReport report = b->load_sharded_state_dict(saved);
  EXPECT_TRUE(report.clean()) << report.to_string();
  expect_same_state(*ma, *a, *mb, *b);
  train(*ma, *a, 2, 4);
  train(*mb, *b, 2, 4);
  expect_same_state(*ma, *a, *mb, *b);
}

TEST(OptimizerStateDict, PositionalRoundTripResumesBitwise) {
  Interleaved ma;
  LossScalerOptions scaler = LossScalerOptions::fp16_dynamic();
  auto a_ptr = mixprec::testing::make_optimizer(ma, torch::optim::AdamWOptions(1e-2).amsgrad(true),
                                                Float16OptimizerOptions().loss_scaler(scaler));
  Float16Optimizer& a = *a_ptr;
  train(*ma, a, 0, 2);
  const PositionalStateDict saved = a.state_dict();
  const ShardedStateDict model_state = model_sharded_state_dict(*ma);

  Interleaved mb;
  auto b_ptr = mixprec::testing::make_optimizer(mb, torch::optim::AdamWOptions(1e-3),
                                                Float16OptimizerOptions().loss_scaler(scaler));
  Float16Optimizer& b = *b_ptr;
  load_model_sharded_state_dict(*mb, model_state);
  EXPECT_TRUE(b.load_state_dict(saved).clean());
  EXPECT_DOUBLE_EQ(b.param_groups()[0].options().get_lr(), 1e-2) << "hyper-parameters restored";
  train(*ma, a, 2, 4);
  train(*mb, b, 2, 4);
  expect_same_state(*ma, a, *mb, b);
}

// torch::save / torch::load of the optimizer keep working (through the positional form).
TEST(OptimizerStateDict, TorchSerializeArchiveRoundTrip) {
  Interleaved ma;
  auto a_ptr = mixprec::testing::make_optimizer(ma, torch::optim::AdamWOptions(1e-2));
  train(*ma, *a_ptr, 0, 2);
  std::stringstream archive;
  torch::save(*a_ptr, archive);
  Interleaved mb;
  auto b_ptr = mixprec::testing::make_optimizer(mb, torch::optim::AdamWOptions(1e-3));
  load_model_sharded_state_dict(*mb, model_sharded_state_dict(*ma));
  torch::load(*b_ptr, archive);
  expect_same_state(*ma, *a_ptr, *mb, *b_ptr);
}

// Saved with gate as BF16 + main copy; loaded where gate is native FP32.
TEST(OptimizerStateDict, PlanChangeMasterToNativeFp32) {
  Interleaved ma(/*gate_fp32=*/false);
  auto a_ptr = mixprec::testing::make_optimizer(ma, torch::optim::AdamWOptions(1e-2));
  Float16Optimizer& a = *a_ptr;
  train(*ma, a, 0, 2);
  ASSERT_TRUE(a.main_param("gate").defined());
  ShardedStateDict saved = model_sharded_state_dict(*ma);
  saved.merge(a.sharded_state_dict());

  Interleaved mb(/*gate_fp32=*/true);
  auto b_ptr = mixprec::testing::make_optimizer(mb, torch::optim::AdamWOptions(1e-2));
  Float16Optimizer& b = *b_ptr;
  load_model_sharded_state_dict(*mb, model_sharded_state_dict(*ma));
  const LoadReport report = b.load_sharded_state_dict(saved);
  EXPECT_TRUE(report.clean());
  ASSERT_EQ(report.notes.size(), 1u);
  EXPECT_NE(report.notes[0].find("'gate' is now native FP32"), std::string::npos);
  EXPECT_TRUE(bitwise_equal(mb->gate, a.main_param("gate")))
      << "gate takes the master's FP32 value";
  EXPECT_FALSE(b.main_param("gate").defined());
  const auto sb = b.sharded_state_dict();
  EXPECT_TRUE(at::equal(sb.at("optimizer.state.exp_avg.gate").local,
                        saved.at("optimizer.state.exp_avg.gate").local));
  EXPECT_FALSE(sb.contains("optimizer.state.fp32_param.gate"));
}

// Saved with gate native FP32; loaded where gate is BF16 and needs a main copy.
TEST(OptimizerStateDict, PlanChangeNativeFp32ToMaster) {
  Interleaved ma(/*gate_fp32=*/true);
  auto a_ptr = mixprec::testing::make_optimizer(ma, torch::optim::AdamWOptions(1e-2));
  Float16Optimizer& a = *a_ptr;
  train(*ma, a, 0, 2);
  ShardedStateDict saved = model_sharded_state_dict(*ma);
  saved.merge(a.sharded_state_dict());

  Interleaved mb(/*gate_fp32=*/false);
  auto b_ptr = mixprec::testing::make_optimizer(mb, torch::optim::AdamWOptions(1e-2));
  Float16Optimizer& b = *b_ptr;
  load_model_sharded_state_dict(*mb, model_sharded_state_dict(*ma));
  const LoadReport report = b.load_sharded_state_dict(saved);
  EXPECT_TRUE(report.clean()) << report.to_string();
  ASSERT_TRUE(b.main_param("gate").defined());
  EXPECT_TRUE(bitwise_equal(b.main_param("gate"), ma->gate.detach()))
      << "master seeded from FP32 value";
  EXPECT_TRUE(at::equal(mb->gate, ma->gate.to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(b.sharded_state_dict().at("optimizer.state.exp_avg_sq.gate").local,
                        saved.at("optimizer.state.exp_avg_sq.gate").local));
}

// --- bad input: clear errors, nothing changed -------------------------------------------------

struct Trained {
  Interleaved model;
  std::unique_ptr<Float16Optimizer> opt;
  ShardedStateDict saved;
  Trained() {
    opt = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-2));
    train(*model, *opt, 0, 2);
    saved = opt->sharded_state_dict();
  }
};

void expect_load_fails_and_changes_nothing(ShardedStateDict bad, const std::string& needle) {
  Interleaved model;
  auto opt_ptr = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-3));
  Float16Optimizer& opt = *opt_ptr;
  train(*model, opt, 0, 1);
  const ShardedStateDict before = opt.sharded_state_dict().clone();
  std::vector<at::Tensor> params_before;
  for (const auto& p : model->parameters()) params_before.push_back(p.clone());
  const std::string msg = error_of([&] { opt.load_sharded_state_dict(bad); });
  EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  const ShardedStateDict after = opt.sharded_state_dict();
  EXPECT_EQ(before.common, after.common);
  for (const auto& [key, t] : before.tensors) {
    EXPECT_TRUE(bitwise_equal(t.local, after.at(key).local)) << key;
  }
  for (size_t i = 0; i < params_before.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(model->parameters()[i], params_before[i]));
  }
}

TEST(OptimizerStateDictErrors, MissingKeyStrictErrorsNonStrictReports) {
  Trained t;
  ShardedStateDict bad = t.saved;
  bad.tensors.erase("optimizer.state.fp32_param.post.weight");
  bad.tensors.erase("optimizer.state.exp_avg_sq.gate");
  expect_load_fails_and_changes_nothing(bad, "missing optimizer.state.fp32_param.post.weight");
  expect_load_fails_and_changes_nothing(bad, "missing optimizer.state.exp_avg_sq.gate");

  Interleaved model;
  auto opt_ptr = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-3));
  Float16Optimizer& opt = *opt_ptr;
  bad.tensors.erase("optimizer.state.exp_avg.gate");
  const LoadReport report = opt.load_sharded_state_dict(bad, LoadOptions().strict(false));
  EXPECT_EQ(report.missing_keys, (std::vector<std::string>{"optimizer.state.fp32_param.post.weight",
                                                           "optimizer.state.exp_avg.gate",
                                                           "optimizer.state.exp_avg_sq.gate"}))
      << report.to_string();
  // What was there is loaded; post.weight's master comes from its model value, gate starts fresh.
  EXPECT_TRUE(at::equal(opt.sharded_state_dict().at("optimizer.state.exp_avg.pre.weight").local,
                        bad.at("optimizer.state.exp_avg.pre.weight").local));
  EXPECT_FALSE(opt.sharded_state_dict().contains("optimizer.state.exp_avg.gate"));
  EXPECT_EQ(report.notes.size(), 2u) << report.to_string();
  // The optimizer keeps working after a non-strict load of a partial state.
  set_grads(*model, 5);
  EXPECT_TRUE(opt.update().success);
}

// A state with only one of a parameter's moments must not be half-installed (non-strict).
TEST(OptimizerStateDictErrors, PartialMomentsStartFreshInNonStrictMode) {
  Trained t;
  ShardedStateDict bad = t.saved;
  bad.tensors.erase("optimizer.state.exp_avg_sq.gate");
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-3));
  const LoadReport report = opt->load_sharded_state_dict(bad, LoadOptions().strict(false));
  EXPECT_EQ(report.missing_keys, std::vector<std::string>{"optimizer.state.exp_avg_sq.gate"});
  EXPECT_FALSE(opt->sharded_state_dict().contains("optimizer.state.exp_avg.gate"));
  set_grads(*model, 3);
  EXPECT_TRUE(opt->update().success);
}

// Adam state with a step but no moments is missing state, not a fresh start (positional).
TEST(OptimizerStateDictErrors, PositionalStepWithoutMomentsIsMissing) {
  Trained t;
  PositionalStateDict pos = t.opt->state_dict();
  for (auto& [id, entry] : pos.state) {
    entry.erase("exp_avg");
    entry.erase("exp_avg_sq");
  }
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-3));
  const std::string msg = error_of([&] { opt->load_state_dict(pos); });
  EXPECT_NE(msg.find("missing optimizer.state.exp_avg.gate"), std::string::npos) << msg;
}

// SGD without momentum has a step but no tensors: its own state round-trips in strict mode.
TEST(OptimizerStateDict, SgdWithoutMomentumRoundTrips) {
  Interleaved ma, mb;
  auto a = mixprec::testing::make_optimizer(ma, torch::optim::SGDOptions(0.1));
  train(*ma, *a, 0, 2);
  auto b = mixprec::testing::make_optimizer(mb, torch::optim::SGDOptions(0.1));
  EXPECT_TRUE(b->load_sharded_state_dict(a->sharded_state_dict()).clean());
  EXPECT_TRUE(b->load_state_dict(a->state_dict()).clean());
  EXPECT_EQ(b->state_dict().state.size(), 3u);
}

// The amsgrad setting being loaded decides the options, not the current one; a state without
// max_exp_avg_sq loads either way (amsgrad switched on after the last step: the next step
// starts it at zeros, as an uninterrupted run does). The moments it cannot rebuild are
// required (OptimizerStateDictErrors).
TEST(OptimizerStateDict, AmsgradFollowsTheLoadedGroup) {
  Trained t;  // amsgrad off
  Interleaved model;
  auto opt =
      mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-3).amsgrad(true));
  EXPECT_TRUE(opt->load_sharded_state_dict(t.saved).clean());
  EXPECT_FALSE(
      static_cast<torch::optim::AdamWOptions&>(opt->param_groups()[0].options()).amsgrad());
  ShardedStateDict with_amsgrad = t.saved;
  with_amsgrad.common["optimizer"]["param_groups"][0]["amsgrad"] = true;
  Interleaved other;
  auto plain = mixprec::testing::make_optimizer(other, torch::optim::AdamWOptions(1e-3));
  EXPECT_TRUE(plain->load_sharded_state_dict(with_amsgrad).clean());
  EXPECT_TRUE(
      static_cast<torch::optim::AdamWOptions&>(plain->param_groups()[0].options()).amsgrad());
}

TEST(OptimizerStateDictErrors, UnexpectedKey) {
  Trained t;
  ShardedStateDict bad = t.saved;
  bad.tensors.emplace("optimizer.state.exp_avg.frozen.weight",
                      ShardedTensor::whole(torch::zeros({8, 8})));
  bad.tensors.emplace("optimizer.state.exp_avg.nothing", ShardedTensor::whole(torch::zeros({2})));
  expect_load_fails_and_changes_nothing(bad, "unexpected optimizer.state.exp_avg.frozen.weight");
  expect_load_fails_and_changes_nothing(bad, "unexpected optimizer.state.exp_avg.nothing");
}

// Positional main copies the optimizer has no place for: one of the frozen parameter (id 1)
// or of an id past its parameters is refused in strict mode and reported otherwise.
TEST(OptimizerStateDictErrors, PositionalMainCopyOfAFrozenOrUnknownIdIsUnexpected) {
  Trained t;
  PositionalStateDict bad = t.opt->state_dict();
  bad.fp32_params[1] = torch::zeros({8, 8});
  bad.fp32_params[4] = torch::zeros({8});
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-3));
  const std::string msg = error_of([&] { opt->load_state_dict(bad); });
  EXPECT_NE(msg.find("unexpected fp32_params[1]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unexpected fp32_params[4]"), std::string::npos) << msg;
  const LoadReport report = opt->load_state_dict(bad, LoadOptions().strict(false));
  EXPECT_EQ(report.unexpected_keys, (std::vector<std::string>{"fp32_params[1]", "fp32_params[4]"}));
}

// A positional state entry of a parameter frozen now is unexpected, and the key says which
// parameter it is and why.
TEST(OptimizerStateDictErrors, PositionalStateOfAFrozenIdNamesTheParameter) {
  Trained t;
  PositionalStateDict bad = t.opt->state_dict();
  bad.state[1] = bad.state.at(0);  // id 1 is frozen.weight, shaped like pre.weight
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-3));
  const std::string msg = error_of([&] { opt->load_state_dict(bad); });
  EXPECT_NE(msg.find("unexpected state[1] (frozen.weight is frozen)"), std::string::npos) << msg;
  const LoadReport report = opt->load_state_dict(bad, LoadOptions().strict(false));
  EXPECT_EQ(report.unexpected_keys,
            (std::vector<std::string>{"state[1] (frozen.weight is frozen)"}));
}

// A positional state entry for the id just past the last parameter (the bound is exclusive) is
// unexpected like any unknown id: strict refuses it, a non-strict load reports it.
TEST(OptimizerStateDictErrors, PositionalStateOfTheIdPastTheLastIsUnexpected) {
  Trained t;
  PositionalStateDict bad = t.opt->state_dict();
  const int64_t count = static_cast<int64_t>(t.model->parameters().size());
  bad.state[count] = bad.state.rbegin()->second;
  Interleaved model;
  auto opt = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-3));
  const std::string msg = error_of([&] { opt->load_state_dict(bad); });
  const std::string key = "state[" + std::to_string(count) + "]";
  EXPECT_NE(msg.find("unexpected " + key), std::string::npos) << msg;
  const LoadReport report = opt->load_state_dict(bad, LoadOptions().strict(false));
  EXPECT_EQ(report.unexpected_keys, (std::vector<std::string>{key}));
}

TEST(OptimizerStateDictErrors, ShapeMismatchNamesTheParameter) {
  Trained t;
  ShardedStateDict bad = t.saved;
  bad.tensors["optimizer.state.exp_avg.gate"] = ShardedTensor::whole(torch::zeros({25}));
  expect_load_fails_and_changes_nothing(bad, "'gate' exp_avg: shape [25], the parameter has [24]");
}

TEST(OptimizerStateDictErrors, ATransposedStateOfTheSameSizeIsRefused) {
  Trained t;
  ShardedStateDict bad = t.saved;
  // [24] as [4, 6] and [6, 4]: same element count, other shapes. Only the shape tells them apart.
  bad.tensors["optimizer.state.exp_avg.gate"] = ShardedTensor::whole(torch::zeros({4, 6}));
  expect_load_fails_and_changes_nothing(bad,
                                        "'gate' exp_avg: shape [4, 6], the parameter has [24]");
}

TEST(OptimizerStateDictErrors, LowerPrecisionMasterIsRejected) {
  Trained t;
  ShardedStateDict bad = t.saved;
  auto& m = bad.tensors["optimizer.state.fp32_param.pre.weight"];
  m.local = m.local.to(at::kBFloat16);
  expect_load_fails_and_changes_nothing(bad,
                                        "optimizer.state.fp32_param.pre.weight: dtype BFloat16");
}

TEST(OptimizerStateDictErrors, GroupMismatch) {
  Trained t;
  ShardedStateDict bad = t.saved;
  auto& names = bad.common["optimizer"]["param_groups"][0]["params"];
  std::swap(names[0], names[3]);
  expect_load_fails_and_changes_nothing(bad, "position 0: the state has \"post.weight\"");
  bad = t.saved;
  bad.common["optimizer"]["param_groups"].push_back(bad.common["optimizer"]["param_groups"][0]);
  expect_load_fails_and_changes_nothing(bad, "the state has 2 param groups, the optimizer has 1");

  Interleaved model;
  auto opt_ptr = mixprec::testing::make_optimizer(model, torch::optim::AdamWOptions(1e-3));
  Float16Optimizer& opt = *opt_ptr;
  PositionalStateDict pos = t.opt->state_dict();
  pos.param_groups[0]["params"] = {0, 1, 2};
  const std::string msg = error_of([&] { opt.load_state_dict(pos); });
  EXPECT_NE(msg.find("param group 0 has 3 params in the state, 4 in the optimizer"),
            std::string::npos)
      << msg;
}

TEST(OptimizerStateDictErrors, ModelLoadValidatesFirst) {
  Interleaved source, target;
  ShardedStateDict sd = model_sharded_state_dict(*source);
  sd.tensors["gate"] = ShardedTensor::whole(torch::zeros({23}));
  sd.tensors.erase("post.weight");
  const at::Tensor pre_before = target->pre->weight.clone();
  const std::string msg = error_of([&] { load_model_sharded_state_dict(*target, sd); });
  EXPECT_NE(msg.find("'gate': shape [23]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing key 'post.weight'"), std::string::npos) << msg;
  EXPECT_TRUE(at::equal(target->pre->weight, pre_before));
}

// An archive key whose parameter id does not fit in int64 (19 digits) is refused naming the
// key, as a c10::Error: not a std::out_of_range from the number conversion.
TEST(OptimizerStateDictErrors, ArchiveIdBeyondInt64IsRefusedNamingTheKey) {
  Interleaved ma;
  auto a = mixprec::testing::make_optimizer(ma, torch::optim::AdamWOptions(1e-2));
  train(*ma, *a, 0, 1);
  torch::serialize::OutputArchive out;
  a->save(out);
  out.write("state/9999999999999999999/step", at::scalar_tensor(1.0));
  std::stringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  in.load_from(bytes);
  Interleaved mb;
  auto b = mixprec::testing::make_optimizer(mb, torch::optim::AdamWOptions(1e-3));
  const std::string msg = error_of([&] { b->load(in); });
  EXPECT_NE(msg.find("archive key 'state/9999999999999999999/step' has no parameter id"),
            std::string::npos)
      << msg;
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::optim
