// Float16Optimizer with master_remainders (float16_optimizer.h): BF16 masters held as the
// parameter + an int16 remainder, against the FP32-master path of the same optimizer given the
// same gradients. Masters (as state dicts give them), moments and steps: bitwise; BF16
// parameters: bitwise but at exact even ties (one further from zero); FP16, native FP32 and
// frozen parameters: untouched by the option.
#include "mixprec/optim/float16_optimizer.h"

#include "optim/support_mixed.h"
#include "support/error_message.h"

#include <gtest/gtest.h>

namespace mixprec::optim {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using mixprec::testing::AlgoCase;
using mixprec::testing::error_of;
using mixprec::testing::expect_params_consistent;
using mixprec::testing::expect_same_optimizer_state;
using mixprec::testing::expect_same_params;
using mixprec::testing::make_mixed_optimizer;
using mixprec::testing::Mixed;
using mixprec::testing::same_bits_any;
using mixprec::testing::set_mixed_grads;

Float16OptimizerOptions with_remainders() {
  return Float16OptimizerOptions().master_remainders(true);
}

// Trainable parameters by dtype, in elements.
int64_t trainable_numel(const Mixed& model, at::ScalarType dtype) {
  int64_t n = 0;
  for (const auto& p : model->parameters()) {
    if (p.requires_grad() && p.scalar_type() == dtype) n += p.numel();
  }
  return n;
}

class Remainders : public ::testing::TestWithParam<AlgoCase> {};

TEST_P(Remainders, ManyStepsBitwiseWithFp32Masters) {
  Mixed ma, mb;
  auto a = make_mixed_optimizer(*ma, GetParam());
  auto b = make_mixed_optimizer(*mb, GetParam(), with_remainders());
  int64_t ties = 0;
  for (int64_t step = 0; step < 40; ++step) {
    // "b" misses its gradient on some steps: it keeps its state and is not stepped.
    const std::vector<std::string> skip =
        step % 3 == 1 ? std::vector<std::string>{"b"} : std::vector<std::string>{};
    set_mixed_grads(*ma, step, 1.0, skip);
    set_mixed_grads(*mb, step, 1.0, skip);
    ASSERT_TRUE(a->update().success);
    ASSERT_TRUE(b->update().success);
    const std::string where = "step " + std::to_string(step);
    expect_same_optimizer_state(*a, *b, where);
    expect_params_consistent(*ma, *a, *mb, where);
    ties += mixprec::testing::even_ties(a->main_param("big"));
  }
  // Most runs see no even tie at all (about 2^-17 per element-step); TiesRoundAwayFromZero
  // puts masters on them on purpose.
  RecordProperty("even_ties_seen", std::to_string(ties));
}

TEST_P(Remainders, StateBytesDropTwoPerBf16Element) {
  Mixed ma, mb;
  auto a = make_mixed_optimizer(*ma, GetParam());
  auto b = make_mixed_optimizer(*mb, GetParam(), with_remainders());
  set_mixed_grads(*ma, 0);
  set_mixed_grads(*mb, 0);
  ASSERT_TRUE(a->update().success);
  ASSERT_TRUE(b->update().success);
  const int64_t bf16 = trainable_numel(mb, at::kBFloat16);
  EXPECT_EQ(a->state_bytes(ParamRole::kMaster) - b->state_bytes(ParamRole::kMaster), 2 * bf16);
  EXPECT_EQ(a->state_bytes(ParamRole::kNativeFp32), b->state_bytes(ParamRole::kNativeFp32));
  EXPECT_EQ(b->state_bytes(ParamRole::kFrozen), 0);
}

INSTANTIATE_TEST_SUITE_P(Algorithms, Remainders,
                         ::testing::ValuesIn(mixprec::testing::algo_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(RemainderBytes, AdamHoldsTenBytesPerBf16ElementAndTwelvePerFp16) {
  Mixed model;
  auto opt = make_mixed_optimizer(*model, mixprec::testing::algo_cases()[0], with_remainders());
  set_mixed_grads(*model, 0);
  ASSERT_TRUE(opt->update().success);
  EXPECT_EQ(opt->state_bytes(ParamRole::kMaster),
            10 * trainable_numel(model, at::kBFloat16) + 12 * trainable_numel(model, at::kHalf));
}

// Masters placed exactly on BF16 ties by a load: the FP32-master path rounds them to even,
// the remainder form away from zero (one more where the lower neighbour is even); the masters
// themselves come back exactly, and stepping on from there stays bitwise.
TEST(RemainderTies, TiesRoundAwayFromZeroAndMastersStayExact) {
  const AlgoCase algo = mixprec::testing::algo_cases()[1];
  Mixed ma, mb;
  auto a = make_mixed_optimizer(*ma, algo);
  auto b = make_mixed_optimizer(*mb, algo, with_remainders());
  set_mixed_grads(*ma, 0);
  set_mixed_grads(*mb, 0);
  ASSERT_TRUE(a->update().success);
  ASSERT_TRUE(b->update().success);
  ShardedStateDict state = a->sharded_state_dict().clone();
  // "a" (37 elements): ties above BF16 values in ±[0.125, 32) whose low bit alternates (even
  // for even positions), signs in a pattern of three.
  const at::Tensor i = at::arange(37, at::kLong);
  const at::Tensor high = (i * 977) % 0x800 + 0x3E00;
  const at::Tensor sign = (i % 3 == 0).to(at::kLong) * 0x8000;
  at::Tensor bits = (high + sign) * 65536 + 0x8000;  // as unsigned 32-bit patterns
  bits = at::where(bits >= (int64_t{1} << 31), bits - (int64_t{1} << 32), bits);
  state.tensors.at("optimizer.state.fp32_param.a").local = bits.to(at::kInt).view(at::kFloat);
  a->load_sharded_state_dict(state);
  b->load_sharded_state_dict(state);
  const at::Tensor master = a->main_param("a");
  ASSERT_EQ(mixprec::testing::even_ties(master), 19);  // even low bit: every other element
  EXPECT_TRUE(same_bits_any(b->main_param("a"), master));
  const at::Tensor expected = mixprec::testing::ties_away_param(master, ma->param("a"));
  EXPECT_TRUE(same_bits_any(mb->param("a"), expected));
  EXPECT_FALSE(same_bits_any(mb->param("a"), ma->param("a")));  // the ties differ
  for (int64_t step = 1; step < 6; ++step) {
    set_mixed_grads(*ma, step);
    set_mixed_grads(*mb, step);
    ASSERT_TRUE(a->update().success);
    ASSERT_TRUE(b->update().success);
    expect_same_optimizer_state(*a, *b, "step " + std::to_string(step));
    expect_params_consistent(*ma, *a, *mb, "step " + std::to_string(step));
  }
}

// State dicts do not depend on the option: saved with it on or off, loaded with it off or on,
// in both forms, training continues bitwise as the run that never switched.
struct Crossing {
  bool save_with, load_with, positional;
};
class RemainderStateDicts : public ::testing::TestWithParam<Crossing> {};

TEST_P(RemainderStateDicts, LoadAcrossTheOptionContinuesBitwise) {
  const Crossing c = GetParam();
  const AlgoCase algo = mixprec::testing::algo_cases()[1];  // amsgrad: every moment kind
  auto opts = [](bool on) { return on ? with_remainders() : Float16OptimizerOptions(); };
  Mixed saved_model;
  auto saved = make_mixed_optimizer(*saved_model, algo, opts(c.save_with));
  for (int64_t step = 0; step < 5; ++step) {
    set_mixed_grads(*saved_model, step, 1.0, {"w"});  // "w" never stepped: no state
    ASSERT_TRUE(saved->update().success);
  }
  Mixed loaded_model(/*seed=*/99);
  auto loaded = make_mixed_optimizer(*loaded_model, algo, opts(c.load_with));
  load_model_sharded_state_dict(*loaded_model, model_sharded_state_dict(*saved_model).clone());
  const LoadReport report =
      c.positional ? loaded->load_state_dict(saved->state_dict())
                   : loaded->load_sharded_state_dict(saved->sharded_state_dict().clone());
  EXPECT_TRUE(report.clean()) << report.to_string();
  expect_same_optimizer_state(*saved, *loaded, "after the load");
  for (int64_t step = 5; step < 12; ++step) {
    set_mixed_grads(*saved_model, step);
    set_mixed_grads(*loaded_model, step);
    ASSERT_TRUE(saved->update().success);
    ASSERT_TRUE(loaded->update().success);
    const std::string where = "step " + std::to_string(step);
    expect_same_optimizer_state(*saved, *loaded, where);
    if (c.save_with == c.load_with) {
      expect_same_params(*saved_model, *loaded_model, where);
    } else if (!c.save_with) {
      expect_params_consistent(*saved_model, *saved, *loaded_model, where);
    } else {
      expect_params_consistent(*loaded_model, *loaded, *saved_model, where);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Both, RemainderStateDicts,
                         ::testing::Values(Crossing{false, true, false},
                                           Crossing{true, false, false},
                                           Crossing{true, true, false}, Crossing{false, true, true},
                                           Crossing{true, false, true}, Crossing{true, true, true}),
                         [](const auto& info) {
                           const Crossing& c = info.param;
                           return std::string(c.save_with ? "On" : "Off") + "To" +
                                  (c.load_with ? "On" : "Off") +
                                  (c.positional ? "Positional" : "Sharded");
                         });

// The state dict's fp32_param is joined into a fresh tensor; it still records a version that a
// later step changes, as an alias of an FP32 master would, and keeps the value it had.
TEST(RemainderStateDicts, JoinedMasterIsASnapshotWhoseVersionAStepChanges) {
  Mixed model;
  auto opt = make_mixed_optimizer(*model, mixprec::testing::algo_cases()[0], with_remainders());
  set_mixed_grads(*model, 0);
  ASSERT_TRUE(opt->update().success);
  const ShardedStateDict state = opt->sharded_state_dict();
  const ShardedTensor& master = state.at("optimizer.state.fp32_param.big");
  ASSERT_GE(master.version, 0);
  EXPECT_EQ(master.local._version(), master.version);
  const at::Tensor before = master.local.clone();
  set_mixed_grads(*model, 1);
  ASSERT_TRUE(opt->update().success);
  EXPECT_NE(master.local._version(), master.version) << "a step after the dict went unnoticed";
  EXPECT_TRUE(same_bits_any(master.local, before));
  EXPECT_FALSE(same_bits_any(opt->main_param("big"), before));
}

// --- the model written from outside --------------------------------------------------------

TEST(RemainderOutsideWrites, WriteReseedsTheMasterAsTheParameterExactly) {
  const AlgoCase algo = mixprec::testing::algo_cases()[0];
  Mixed ma, mb;
  auto a = make_mixed_optimizer(*ma, algo);
  auto b = make_mixed_optimizer(*mb, algo, with_remainders());
  for (int64_t step = 0; step < 3; ++step) {
    set_mixed_grads(*ma, step);
    set_mixed_grads(*mb, step);
    ASSERT_TRUE(a->update().success);
    ASSERT_TRUE(b->update().success);
  }
  const at::Tensor written = (at::randn({3, 7}) * 3).to(at::kBFloat16);
  {
    at::NoGradGuard no_grad;
    ma->param("w").copy_(written);
    mb->param("w").copy_(written);
  }
  expect_same_optimizer_state(*a, *b, "after the write");  // both follow the model
  EXPECT_TRUE(same_bits_any(b->main_param("w"), written.to(at::kFloat)));
  for (int64_t step = 3; step < 8; ++step) {
    set_mixed_grads(*ma, step);
    set_mixed_grads(*mb, step);
    ASSERT_TRUE(a->update().success);
    ASSERT_TRUE(b->update().success);
    expect_same_optimizer_state(*a, *b, "step " + std::to_string(step));
    expect_params_consistent(*ma, *a, *mb, "step " + std::to_string(step));
  }
}

// The parameter is half of the master: a write of the very same value cannot be told from a
// change, so it re-seeds too (the FP32-master path keeps its master; float16_optimizer.h).
TEST(RemainderOutsideWrites, WriteOfTheSameValueReseedsToo) {
  Mixed model;
  auto opt = make_mixed_optimizer(*model, mixprec::testing::algo_cases()[0], with_remainders());
  set_mixed_grads(*model, 0);
  ASSERT_TRUE(opt->update().success);
  const at::Tensor param = model->param("big");
  ASSERT_FALSE(same_bits_any(opt->main_param("big"), param.to(at::kFloat)));  // low bits held
  {
    at::NoGradGuard no_grad;
    param.copy_(param.clone());
  }
  opt->sharded_state_dict();  // follows the model
  EXPECT_TRUE(same_bits_any(opt->main_param("big"), param.to(at::kFloat)));
}

TEST(RemainderOutsideWrites, ReloadModelParamsZeroesTheRemainders) {
  Mixed model;
  auto opt = make_mixed_optimizer(*model, mixprec::testing::algo_cases()[3], with_remainders());
  set_mixed_grads(*model, 0);
  ASSERT_TRUE(opt->update().success);
  opt->reload_model_params();
  for (const char* fqn : {"a", "b", "big", "s", "w"}) {
    EXPECT_TRUE(same_bits_any(opt->main_param(fqn), model->param(fqn).to(at::kFloat))) << fqn;
  }
}

TEST(RemainderOutsideWrites, KErrorRefusesTheWriteNamingTheParameter) {
  Mixed model;
  auto opt =
      make_mixed_optimizer(*model, mixprec::testing::algo_cases()[0],
                           with_remainders().on_external_param_change(ExternalParamChange::kError));
  set_mixed_grads(*model, 0);
  ASSERT_TRUE(opt->update().success);
  {
    at::NoGradGuard no_grad;
    model->param("a").add_(1.0);
  }
  set_mixed_grads(*model, 1);
  const std::string msg = error_of([&] { opt->update(); });
  EXPECT_NE(msg.find("'a' was written from outside the optimizer"), std::string::npos) << msg;
}

// Re-typed from outside (a conversion after construction): BF16 → FP32 takes the joined master,
// BF16 → FP16 keeps it (exact in FP16's range), FP16 → BF16 splits its master. As the
// FP32-master path does, bit for bit.
TEST(RemainderOutsideWrites, RetypedParametersKeepTheirMasters) {
  const AlgoCase algo = mixprec::testing::algo_cases()[0];
  Mixed ma, mb;
  auto a = make_mixed_optimizer(*ma, algo);
  auto b = make_mixed_optimizer(*mb, algo, with_remainders());
  auto both_step = [&](int64_t step) {
    set_mixed_grads(*ma, step);
    set_mixed_grads(*mb, step);
    ASSERT_TRUE(a->update().success);
    ASSERT_TRUE(b->update().success);
  };
  for (int64_t step = 0; step < 3; ++step) both_step(step);
  const at::Tensor w_master = a->main_param("w").clone();
  const at::Tensor a_master = a->main_param("a").clone();
  for (Mixed* m : {&ma, &mb}) {
    at::NoGradGuard no_grad;
    (*m)->param("w").set_data((*m)->param("w").to(at::kFloat));
    (*m)->param("a").set_data((*m)->param("a").to(at::kHalf));
    (*m)->param("h").set_data((*m)->param("h").to(at::kBFloat16));
  }
  expect_same_optimizer_state(*a, *b, "after the conversion");
  EXPECT_TRUE(same_bits_any(mb->param("w"), w_master)) << "native FP32 takes the master";
  EXPECT_TRUE(same_bits_any(b->main_param("a"), a_master));
  expect_params_consistent(*ma, *a, *mb, "after the conversion");
  for (int64_t step = 3; step < 7; ++step) {
    both_step(step);
    expect_same_optimizer_state(*a, *b, "step " + std::to_string(step));
    expect_params_consistent(*ma, *a, *mb, "step " + std::to_string(step));
  }
}

// Bitwise resume with the option on: N steps straight == k steps, state dicts taken (as a
// checkpoint would), a fresh model and optimizer loaded, N − k steps.
TEST(RemainderResume, TrainSaveLoadTrainIsBitwiseTrainingStraight) {
  for (const AlgoCase& algo : mixprec::testing::algo_cases()) {
    SCOPED_TRACE(algo.name);
    Mixed straight_model;
    auto straight = make_mixed_optimizer(*straight_model, algo, with_remainders());
    Mixed first_model;
    auto first = make_mixed_optimizer(*first_model, algo, with_remainders());
    for (int64_t step = 0; step < 6; ++step) {
      set_mixed_grads(*first_model, step);
      ASSERT_TRUE(first->update().success);
    }
    const ShardedStateDict model_state = model_sharded_state_dict(*first_model).clone();
    const ShardedStateDict optimizer_state = first->sharded_state_dict().clone();
    Mixed resumed_model(/*seed=*/5);
    auto resumed = make_mixed_optimizer(*resumed_model, algo, with_remainders());
    load_model_sharded_state_dict(*resumed_model, model_state);
    resumed->load_sharded_state_dict(optimizer_state);
    for (int64_t step = 0; step < 14; ++step) {
      set_mixed_grads(*straight_model, step);
      ASSERT_TRUE(straight->update().success);
      if (step < 6) continue;
      set_mixed_grads(*resumed_model, step);
      ASSERT_TRUE(resumed->update().success);
    }
    expect_same_params(*straight_model, *resumed_model, "resumed");
    expect_same_optimizer_state(*straight, *resumed, "resumed");
  }
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::optim
