// Uses of the reducer and the ZeRO-1 optimizer that cannot give every rank the right result:
// each is an error naming what is at fault (and, where the ranks' gradients can no longer agree,
// a failed group), never ranks that silently differ or wait for one another until a timeout.
// And the legitimate unusual ones: a rank whose backward reached nothing in the first step, a
// state dict round trip on a rank that holds no piece of some parameter.
#include "distributed/mp/mp_support.h"
#include "mixprec/distributed/distributed_optimizer.h"
#include "mixprec/distributed/grad_reducer.h"
#include "mixprec/distributed/init.h"
#include "support/error_message.h"

#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

namespace mixprec::testing {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using distributed::DistributedOptimizer;
using distributed::GradReducer;
using distributed::GradReducerOptions;
using distributed::ReduceMode;

// Two FP32 parameters, `a` (12 elements) and `b` (5), in one bucket (kOneBucket): sharded over
// two or three ranks, some rank holds no piece of `b`.
struct PairImpl : torch::nn::Module {
  PairImpl() {
    a = register_parameter("a", at::arange(12, at::kFloat).div(4));
    b = register_parameter("b", at::arange(5, at::kFloat).div(2));
  }
  // Σ p · w_r: the gradient is w_r, a different one on every rank.
  at::Tensor loss(int rank) const { return (a * (rank + 1)).sum() + (b * (rank + 2)).sum() * 0.5; }
  at::Tensor a, b;
};
TORCH_MODULE(Pair);

constexpr int64_t kOneBucket = 64;

// In reduce-scatter mode a .grad holds the average only in this rank's shard after finish():
// adding the next step's gradient to it would give wrong sums on every rank alike.
TEST(ReducerMisuse, ReduceScatterGradientsCannotCarryIntoTheNextStep) {
  Pair model;
  GradReducer reducer(
      world_ptr(), *model,
      GradReducerOptions().mode(ReduceMode::kReduceScatter).bucket_numel(kOneBucket));
  reducer.zero_grad();
  model->loss(world().rank()).backward();
  reducer.finish();
  const std::string message = error_of([&] { model->loss(world().rank()).backward(); });
  EXPECT_NE(message.find("would be added to the last step's"), std::string::npos) << message;
  // Cleared the reducer's way or torch's way (.grad none), the next step is a step again.
  reducer.zero_grad();
  model->loss(world().rank()).backward();
  reducer.finish();
  model->a.mutable_grad().reset();
  model->b.mutable_grad().reset();
  model->loss(world().rank()).backward();
  reducer.finish();
  // Cleared torch's way, then micro-batches accumulated: the first one starts afresh, the
  // next ones add to it.
  model->a.mutable_grad().reset();
  model->b.mutable_grad().reset();
  {
    GradReducer::NoSyncGuard no_sync(reducer);
    model->loss(world().rank()).backward();
  }
  model->loss(world().rank()).backward();
  reducer.finish();
  // A parameter no backward reached, whose .grad was not cleared, is not reduced again.
  model->a.mutable_grad().reset();
  model->a.sum().backward();
  const std::string stale = error_of([&] { reducer.finish(); });
  EXPECT_NE(stale.find("the gradient of 'b' is the last step's"), std::string::npos) << stale;
  reducer.zero_grad();
}

// A second backward before finish() adds into buckets whose reduction is in flight: the group
// cannot be trusted any more, and says so on every later call; a NoSyncGuard cannot begin then.
TEST(ReducerMisuse, ABackwardIntoBucketsInFlightFailsTheGroup) {
  auto group = own_group("backward-into-flight", std::chrono::seconds(10));
  Pair model;
  GradReducer reducer(group, *model, GradReducerOptions().bucket_numel(kOneBucket));
  reducer.zero_grad();
  model->loss(world().rank()).backward();  // the bucket completes: in flight
  const std::string guard = error_of([&] { GradReducer::NoSyncGuard no_sync(reducer); });
  EXPECT_NE(guard.find("bucket reduction(s) of a synchronized backward are in flight"),
            std::string::npos)
      << guard;
  // Even with .grad cleared first: adopting the new one would copy into the buffer in flight.
  model->a.mutable_grad().reset();
  const std::string second = error_of([&] { model->loss(world().rank()).backward(); });
  EXPECT_NE(second.find("arrived while its bucket's reduction was in flight"), std::string::npos)
      << second;
  const std::string later = error_of([&] { reducer.finish(); });
  EXPECT_NE(later.find("the process group is unusable"), std::string::npos) << later;
  world().barrier();
}

// A rank whose backward reached nothing in the first step (an empty micro-batch) still takes
// part in agreeing on the launch order: no collective is left unpaired.
TEST(ReducerMisuse, ARankWithoutBackwardInTheFirstStepDoesNotHang) {
  auto group = own_group("first-step-without-backward", std::chrono::seconds(10));
  Pair model;
  GradReducer reducer(group, *model, GradReducerOptions().bucket_numel(kOneBucket));
  reducer.zero_grad();
  if (world().rank() != 1) model->loss(world().rank()).backward();
  reducer.finish();
  const int n = world().size();
  double sum = 0;
  for (int r = 0; r < n; ++r) sum += r == 1 ? 0 : r + 1;
  EXPECT_TRUE(at::allclose(model->a.grad(), at::full({12}, sum / n))) << model->a.grad();
  reducer.zero_grad();
  model->loss(world().rank()).backward();
  reducer.finish();
  EXPECT_TRUE(same_on_all_ranks(model->a.grad()));
}

// A rank's own state dict loads back even where it holds no piece of a parameter; and a
// state some rank refuses is refused on every rank, none left waiting in the parameter gather.
TEST(ReducerMisuse, ZeroStateDictRoundTripsAndOneRanksRefusalIsEveryRanks) {
  auto group = own_group("zero-load-agreement", std::chrono::seconds(10));
  Pair model;
  GradReducer reducer(
      group, *model,
      GradReducerOptions().mode(ReduceMode::kReduceScatter).bucket_numel(kOneBucket));
  DistributedOptimizer zero(reducer, *model, torch::optim::SGDOptions(0.1).momentum(0.9));
  auto step = [&] {
    zero.zero_grad();
    reducer.zero_grad();
    model->loss(world().rank()).backward();
    ASSERT_TRUE(zero.update().success);
  };
  step();
  const ShardedStateDict saved = zero.sharded_state_dict().clone();
  const at::Tensor a_then = model->a.detach().clone(), b_then = model->b.detach().clone();
  step();
  {
    at::NoGradGuard no_grad;
    model->a.copy_(a_then);
    model->b.copy_(b_then);
  }
  const LoadReport report = zero.load_sharded_state_dict(saved);
  EXPECT_TRUE(report.missing_keys.empty()) << report.to_string();
  step();
  const at::Tensor a_after = model->a.detach().clone();

  ShardedStateDict bad = saved.clone();
  if (world().rank() == world().size() - 1) bad.common["optimizer"]["step"] = -3;
  const at::Tensor a_before = model->a.detach().clone();
  const std::string message = error_of([&] { zero.load_sharded_state_dict(bad); });
  if (world().size() > 1 && world().rank() != world().size() - 1) {
    EXPECT_NE(message.find("other rank refused its part"), std::string::npos) << message;
  } else {
    // The refusing rank's own error, which says what is wrong with its part.
    EXPECT_NE(message.find("cannot load the state"), std::string::npos) << message;
    EXPECT_EQ(message.find("other rank"), std::string::npos) << message;
  }
  EXPECT_TRUE(at::equal(model->a, a_before)) << "nothing changed";
  EXPECT_TRUE(same_on_all_ranks(a_after));
}

// A .grad of another shape set from outside cannot be taken into the parameter's range:
// finish() stops short of the collectives it was to start, so the group is failed, and every
// later call says so instead of pairing its collectives with the other ranks' next ones.
TEST(ReducerMisuse, AGradOfAnotherShapeFailsTheGroup) {
  auto group = own_group("grad-of-another-shape", std::chrono::seconds(10));
  Pair model;
  GradReducer reducer(group, *model, GradReducerOptions().bucket_numel(kOneBucket));
  reducer.zero_grad();
  model->b.mutable_grad() = at::ones({3});
  const std::string first = error_of([&] { reducer.finish(); });
  EXPECT_NE(first, "");
  const std::string later = error_of([&] { reducer.zero_grad(); });
  EXPECT_NE(later.find("the process group is unusable"), std::string::npos) << later;
  EXPECT_NE(later.find("GradReducer::finish failed before starting every bucket"),
            std::string::npos)
      << later;
  world().barrier();
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::testing
