// DistributedOptimizer's sharded state in memory: Float16Optimizer's keys, shapes and common
// state, each rank holding its pieces; a Float16Optimizer state loads into ZeRO-1.
#include "distributed/mp/zero_support.h"
#include "mixprec/checkpoint/format/state_keys.h"
#include "support/error_message.h"

#include <gtest/gtest.h>

namespace mixprec::testing {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

namespace keys = checkpoint::keys;

bool power_of_two(int n) { return (n & (n - 1)) == 0; }

// Keys, global shapes, common state and values equal plain DP's Float16Optimizer (the same
// averaged gradients: bitwise for every N) and, for power-of-two N, the single process's.
TEST(ZeroStateDict, KeysShapesCommonAndValuesAreFloat16Optimizers) {
  ZeroRun zero;
  Fp16Run dp(/*data_parallel=*/true), single(/*data_parallel=*/false);
  // Before any step: masters only, every trainable parameter without state.
  expect_zero_state_equals(*zero.optimizer, dp.optimizer->sharded_state_dict(), "before a step");
  for (int64_t step = 0; step < 3; ++step) {
    EXPECT_TRUE(zero.step(step).success);
    dp.step(step);
    single.step(step);
  }
  expect_zero_state_equals(*zero.optimizer, dp.optimizer->sharded_state_dict(), "vs plain DP");
  if (power_of_two(world().size())) {
    expect_zero_state_equals(*zero.optimizer, single.optimizer->sharded_state_dict(),
                             "vs one process");
  }
  const auto commons =
      world().all_gather_strings(zero.optimizer->sharded_state_dict().common.dump());
  for (const auto& c : commons) EXPECT_EQ(c, commons[0]) << "the common state is replicated";
}

// A Float16Optimizer's state (whole tensors) checked and applied into ZeRO-1 on every rank;
// training then continues exactly as the Float16Optimizer does (plain DP: bitwise, any N).
TEST(ZeroStateDict, Float16OptimizerStateLoadsIntoZeroAndTrainingContinues) {
  Fp16Run dp(/*data_parallel=*/true);
  for (int64_t step = 0; step < 2; ++step) dp.step(step);
  ZeroRun zero;
  {
    at::NoGradGuard no_grad;
    auto from = dp.model->named_parameters();
    for (auto& item : zero.model->named_parameters()) item.value().copy_(from[item.key()]);
  }
  ShardedStateDict state = dp.optimizer->sharded_state_dict();
  state.merge(model_sharded_state_dict(*dp.model));
  const LoadReport report = zero.optimizer->apply(zero.optimizer->check_sharded_state_dict(state));
  EXPECT_TRUE(report.clean()) << report.to_string();
  expect_zero_state_equals(*zero.optimizer, dp.optimizer->sharded_state_dict(), "after the load");
  for (int64_t step = 2; step < 4; ++step) {
    zero.step(step);
    dp.step(step);
  }
  expect_params_equal(*zero.model, *dp.model, "continued");
  expect_zero_state_equals(*zero.optimizer, dp.optimizer->sharded_state_dict(), "continued");
}

// A state for another shape or another algorithm is refused before anything changes, with
// the same message on every rank (key decisions use every key, not only a rank's pieces).
TEST(ZeroStateDict, BadStatesAreRefusedNamingTheKeyOnEveryRank) {
  ZeroRun zero;
  zero.step(0);
  const ShardedStateDict before = zero.optimizer->sharded_state_dict().clone();
  Fp16Run dp(/*data_parallel=*/true);
  dp.step(0);
  ShardedStateDict wrong_shape = dp.optimizer->sharded_state_dict().clone();
  const std::string key = keys::optimizer_state_key(keys::kExpAvg, "fc2.weight");
  wrong_shape.tensors[key] = ShardedTensor::whole(at::zeros({16, 7}));
  const std::string message =
      error_of([&] { zero.optimizer->check_sharded_state_dict(wrong_shape); });
  EXPECT_NE(message.find("'fc2.weight' exp_avg: shape [16, 7], the parameter has [7, 16]"),
            std::string::npos)
      << message;
  const auto all = world().all_gather_strings(message);
  for (const auto& m : all) EXPECT_EQ(m, all[0]);

  ShardedStateDict other_algorithm = dp.optimizer->sharded_state_dict().clone();
  other_algorithm.common["optimizer"]["algorithm"] = "sgd";
  EXPECT_NE(error_of([&] {
              zero.optimizer->check_sharded_state_dict(other_algorithm);
            }).find("the state is for algorithm \"sgd\", the optimizer runs adamw"),
            std::string::npos);
  ShardedStateDict missing = dp.optimizer->sharded_state_dict().clone();
  missing.tensors.erase(keys::optimizer_state_key(keys::kExpAvgSq, "gate"));
  EXPECT_NE(error_of([&] {
              zero.optimizer->check_sharded_state_dict(missing);
            }).find("missing optimizer.state.exp_avg_sq.gate"),
            std::string::npos);
  const ShardedStateDict after = zero.optimizer->sharded_state_dict();
  ASSERT_EQ(after.tensors.size(), before.tensors.size());
  for (const auto& [k, piece] : before.tensors) {
    EXPECT_TRUE(at::equal(after.at(k).local, piece.local)) << "changed: " << k;
  }
  EXPECT_EQ(after.common.dump(), before.common.dump());
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::testing
