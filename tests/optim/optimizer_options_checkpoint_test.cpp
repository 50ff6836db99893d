// Checkpoints do not depend on how the optimizer holds its state (master_remainders,
// offload; float16_optimizer.h): saved with either option on or off and resumed with any
// other combination, training continues bitwise as the run that saved. And the state dicts
// the options build are snapshots checkpoint savers can check: a step between building the
// dict and saving it (or during an async save's staging) is refused.
#include "mixprec/checkpoint/async_save.h"
#include "mixprec/checkpoint/save.h"
#include "mixprec/checkpoint/training_state.h"
#include "mixprec/optim/float16_optimizer.h"

#include "checkpoint/format/format_test_util.h"
#include "optim/support_mixed.h"
#include "support/error_message.h"

#include <gtest/gtest.h>

namespace mixprec::optim {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using mixprec::testing::error_of;
using mixprec::testing::expect_params_consistent;
using mixprec::testing::expect_same_optimizer_state;
using mixprec::testing::expect_same_params;
using mixprec::testing::make_mixed_optimizer;
using mixprec::testing::Mixed;
using mixprec::testing::set_mixed_grads;

struct Holding {
  bool remainders, offload;
  std::string name() const {
    return std::string(remainders ? "Remainders" : "Fp32Masters") + (offload ? "Offloaded" : "");
  }
  Float16OptimizerOptions options() const {
    Float16OptimizerOptions o;
    o.master_remainders(remainders);
    if (offload) o.offload(OffloadOptions().chunk_bytes(1024).chunks_in_flight(2));
    return o;
  }
};

const std::vector<Holding>& holdings() {
  static const std::vector<Holding> all = {
      {false, false}, {true, false}, {false, true}, {true, true}};
  return all;
}

class CheckpointAcrossHoldings : public ::testing::TestWithParam<std::tuple<Holding, Holding>> {};

TEST_P(CheckpointAcrossHoldings, ResumeContinuesBitwise) {
  const auto [save_as, load_as] = GetParam();
  const mixprec::testing::AlgoCase algo = mixprec::testing::algo_cases()[1];
  checkpoint::testing::TempDir root;
  Mixed saved_model;
  auto saved = make_mixed_optimizer(*saved_model, algo, save_as.options());
  for (int64_t step = 0; step < 4; ++step) {
    set_mixed_grads(*saved_model, step, 1.0, {"w"});
    ASSERT_TRUE(saved->update().success);
  }
  checkpoint::save_training_state(root.path(), "step4", *saved_model, *saved);

  Mixed loaded_model(/*seed=*/3);
  auto loaded = make_mixed_optimizer(*loaded_model, algo, load_as.options());
  const checkpoint::ResumeResult resumed =
      checkpoint::load_training_state(root.path(), *loaded_model, *loaded);
  EXPECT_TRUE(resumed.optimizer.clean()) << resumed.optimizer.to_string();
  for (int64_t step = 4; step < 10; ++step) {
    set_mixed_grads(*saved_model, step);
    set_mixed_grads(*loaded_model, step);
    ASSERT_TRUE(saved->update().success);
    ASSERT_TRUE(loaded->update().success);
    const std::string where = "step " + std::to_string(step);
    expect_same_optimizer_state(*saved, *loaded, where);
    if (save_as.remainders == load_as.remainders) {
      expect_same_params(*saved_model, *loaded_model, where);
    } else if (load_as.remainders) {
      expect_params_consistent(*saved_model, *saved, *loaded_model, where);
    } else {
      expect_params_consistent(*loaded_model, *loaded, *saved_model, where);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Holdings, CheckpointAcrossHoldings,
                         ::testing::Combine(::testing::ValuesIn(holdings()),
                                            ::testing::ValuesIn(holdings())),
                         [](const auto& info) {
                           return std::get<0>(info.param).name() + "To" +
                                  std::get<1>(info.param).name();
                         });

class SnapshotChecks : public ::testing::TestWithParam<Holding> {};

TEST_P(SnapshotChecks, StepAfterBuildingTheStateDictIsRefusedBySave) {
  checkpoint::testing::TempDir root;
  Mixed model;
  auto opt = make_mixed_optimizer(*model, mixprec::testing::algo_cases()[0], GetParam().options());
  set_mixed_grads(*model, 0);
  ASSERT_TRUE(opt->update().success);
  const ShardedStateDict state = checkpoint::training_state_dict(*model, *opt);
  set_mixed_grads(*model, 1);
  ASSERT_TRUE(opt->update().success);
  const std::string msg =
      error_of([&] { checkpoint::save_checkpoint(root.path(), "stale", state); });
  EXPECT_NE(msg.find("not a consistent snapshot"), std::string::npos) << msg;
  EXPECT_NE(msg.find("optimizer.state.fp32_param.big"), std::string::npos) << msg;
  EXPECT_NE(msg.find("optimizer.state.exp_avg.big"), std::string::npos) << msg;
  EXPECT_FALSE(std::filesystem::exists(root.path() / "stale"));
}

TEST_P(SnapshotChecks, StepDuringAsyncStagingIsRefused) {
  checkpoint::testing::TempDir root;
  Mixed model;
  auto opt = make_mixed_optimizer(*model, mixprec::testing::algo_cases()[0], GetParam().options());
  set_mixed_grads(*model, 0);
  ASSERT_TRUE(opt->update().success);
  checkpoint::AsyncSaveOptions options;
  int staged = 0;
  options.on_tensor_staged([&](const std::string&) {
    if (++staged == 2) {
      set_mixed_grads(*model, 1);
      opt->update();  // another thread of the loop stepping while save() stages
    }
  });
  checkpoint::AsyncCheckpointSaver saver(options);
  const std::string msg = error_of([&] {
    (void)saver.save(root.path(), "torn", checkpoint::training_state_dict(*model, *opt));
    saver.wait_until_staged();
  });
  EXPECT_NE(msg.find("changed while it was being staged"), std::string::npos) << msg;
  EXPECT_FALSE(std::filesystem::exists(root.path() / "torn"));
}

INSTANTIATE_TEST_SUITE_P(Holdings, SnapshotChecks, ::testing::ValuesIn(holdings()),
                         [](const auto& info) { return info.param.name(); });

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::optim
