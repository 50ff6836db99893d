// GradReducer across real processes: averages per dtype, both modes, overlap on and off,
// exactness for identical gradients, accumulation, and misuse.
#include "distributed/mp/mp_support.h"
#include "mixprec/distributed/grad_reducer.h"
#include "support/error_message.h"

#include <gtest/gtest.h>

#include <map>
#include <memory>

namespace mixprec::testing {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using distributed::GradReducer;
using distributed::GradReducerOptions;
using distributed::ReduceMode;

// Parameters of three grad dtypes with odd sizes; loss = Σ p · w_rank, so grad(p) = w_rank.
struct ThreeDtypesImpl : torch::nn::Module {
  ThreeDtypesImpl() {
    a = register_parameter("a", at::zeros({7, 3}, at::kBFloat16));
    b = register_parameter("b", at::zeros({1001}, at::kFloat));
    c = register_parameter("c", at::zeros({1}, at::kHalf));
    d = register_parameter("d", at::zeros({5, 13}, at::kBFloat16));
    e = register_parameter("e", at::zeros({33}, at::kHalf));
  }
  at::Tensor a, b, c, d, e;
};
TORCH_MODULE(ThreeDtypes);

// Small integers divided by 8: exact in BF16/FP16, and so are their sums over ranks.
at::Tensor weight_for(const at::Tensor& p, int rank, int salt) {
  at::Tensor i = at::arange(p.numel(), at::kLong).view(p.sizes());
  return (((i * 5 + rank * 11 + salt * 3) % 19) - 9).to(at::kFloat).div(8).to(p.scalar_type());
}

// `skip`: a parameter the loss does not reach (it gets no gradient this step).
void backward_weighted(ThreeDtypes& model, int rank, const std::string& skip = "") {
  at::Tensor loss = at::zeros({}, at::kFloat);
  int salt = 0;
  for (auto& item : model->named_parameters()) {
    ++salt;
    if (item.key() == skip) continue;
    const at::Tensor& p = item.value();
    loss = loss + (p.to(at::kFloat) * weight_for(p, rank, salt).to(at::kFloat)).sum();
  }
  loss.backward();
}

// The average the reducer must produce: sum of every rank's weights, divided by N, rounded
// once to the dtype (through FP32 when `fp32`, else with the dtype's own division).
at::Tensor expected_average(const at::Tensor& p, int salt, bool fp32) {
  const int n = world().size();
  const at::ScalarType acc = fp32 ? at::kFloat : p.scalar_type();
  at::Tensor sum = at::zeros(p.sizes(), acc);
  for (int r = 0; r < n; ++r) sum += weight_for(p, r, salt).to(acc);
  if (n > 1) sum.div_(n);
  return sum.to(p.scalar_type());
}

// After backward_weighted on every rank and finish(): each parameter's .grad is
// expected_average of its salt (its position in the model, from 1), reduced in FP32.
void expect_every_grad_averaged(const torch::nn::Module& model) {
  int salt = 0;
  for (const auto& item : model.named_parameters()) {
    ++salt;
    EXPECT_TRUE(at::equal(item.value().grad(), expected_average(item.value(), salt, true)))
        << item.key();
  }
}

struct Case {
  ReduceMode mode;
  bool overlap;
  bool fp32;
};

TEST(GradReducer, AveragesEveryDtypeInBothModes) {
  const int rank = world().rank();
  for (Case c :
       {Case{ReduceMode::kAllReduce, true, true}, Case{ReduceMode::kAllReduce, false, true},
        Case{ReduceMode::kAllReduce, true, false}, Case{ReduceMode::kReduceScatter, true, true},
        Case{ReduceMode::kReduceScatter, false, false}}) {
    SCOPED_TRACE(std::string(c.mode == ReduceMode::kAllReduce ? "all-reduce" : "reduce-scatter") +
                 (c.overlap ? " overlap" : " no overlap") + (c.fp32 ? " fp32" : " native"));
    ThreeDtypes model;
    GradReducer reducer(world_ptr(), *model,
                        GradReducerOptions()
                            .mode(c.mode)
                            .overlap(c.overlap)
                            .grad_reduce_in_fp32(c.fp32)
                            .bucket_numel(40)
                            .shard_alignment(1));
    for (int step = 0; step < 2; ++step) {
      reducer.zero_grad();
      backward_weighted(model, rank);
      reducer.finish();
      const distributed::GradLayout& layout = reducer.layout();
      std::vector<distributed::ParamShard> mine = layout.param_shards(rank);
      int salt = 0;
      for (auto& item : model->named_parameters()) {
        ++salt;
        const at::Tensor expected = expected_average(item.value(), salt, c.fp32).view({-1});
        const at::Tensor grad = item.value().grad().view({-1});
        if (c.mode == ReduceMode::kAllReduce) {
          EXPECT_TRUE(at::equal(grad, expected)) << item.key();
          continue;
        }
        for (const auto& piece : mine) {
          if (piece.fqn != item.key()) continue;
          EXPECT_TRUE(at::equal(grad.narrow(0, piece.begin, piece.numel()),
                                expected.narrow(0, piece.begin, piece.numel())))
              << item.key() << "[" << piece.begin << ":" << piece.end << "]";
        }
      }
      // Overlap is a property of when collectives start, counted, not timed.
      const auto& timing = reducer.last_timing();
      EXPECT_GT(timing.buckets, 3);
      if (c.overlap) {
        EXPECT_GT(timing.launched_during_backward, 0);
      } else {
        EXPECT_EQ(timing.launched_during_backward, 0);
      }
    }
  }
}

// Identical gradients on every rank, power-of-two N: the average is bitwise the gradient.
TEST(GradReducer, IdenticalGradientsAverageExactlyForPowerOfTwoWorlds) {
  const int n = world().size();
  if (n & (n - 1)) GTEST_SKIP() << "N = " << n << " is not a power of two";
  MixedNet model;
  MixedNet reference;
  GradReducer reducer(world_ptr(), *model, GradReducerOptions().bucket_numel(64));
  for (int step = 0; step < 3; ++step) {
    const at::Tensor x = batch(step);
    reducer.zero_grad();
    model->loss(x).mul(1000).backward();  // larger values: FP32 ulps matter
    reducer.finish();
    for (auto& p : reference->parameters()) p.mutable_grad().reset();
    reference->loss(x).mul(1000).backward();
    auto ours = model->named_parameters();
    auto theirs = reference->named_parameters();
    for (const auto& item : ours) {
      if (!item.value().requires_grad()) continue;
      EXPECT_TRUE(at::equal(item.value().grad(), theirs[item.key()].grad()))
          << item.key() << " step " << step;
    }
  }
}

// Micro-batches accumulate inside a NoSyncGuard; the next synced backward reduces the sum.
TEST(GradReducer, NoSyncAccumulatesThenReducesTheSum) {
  const int rank = world().rank();
  ThreeDtypes model;
  GradReducer reducer(world_ptr(), *model, GradReducerOptions().bucket_numel(64));
  reducer.zero_grad();
  {
    GradReducer::NoSyncGuard no_sync(reducer);
    backward_weighted(model, rank);
    EXPECT_NE(error_of([&] { reducer.finish(); }).find("inside a NoSyncGuard"), std::string::npos);
  }
  backward_weighted(model, rank);
  reducer.finish();
  int salt = 0;
  for (auto& item : model->named_parameters()) {
    ++salt;
    // Σ 2w / N in FP32, rounded once (the doubled inputs are still exact in BF16/FP16).
    at::Tensor sum = at::zeros(item.value().sizes(), at::kFloat);
    for (int r = 0; r < world().size(); ++r)
      sum += weight_for(item.value(), r, salt).to(at::kFloat) * 2;
    if (world().size() > 1) sum.div_(world().size());
    EXPECT_TRUE(at::equal(item.value().grad(), sum.to(item.value().scalar_type()))) << item.key();
  }
}

// An optimizer's zero_grad() sets .grad to none: the hooks put the buffer's ranges back, and
// finish() still reduces everything (a parameter without a gradient contributes zeros). One
// that no rank has a gradient for is left without one, as in one process.
TEST(GradReducer, GradsSetToNoneAreAdoptedAgain) {
  const int rank = world().rank();
  ThreeDtypes model;
  GradReducer reducer(world_ptr(), *model, GradReducerOptions().bucket_numel(64));
  for (auto& p : model->parameters()) p.mutable_grad().reset();
  backward_weighted(model, rank, /*skip=*/"c");
  reducer.finish();
  int salt = 0;
  for (auto& item : model->named_parameters()) {
    ++salt;
    const at::Tensor& p = item.value();
    if (item.key() == "c") {
      EXPECT_FALSE(p.grad().defined());
      continue;
    }
    ASSERT_TRUE(p.grad().defined()) << item.key();
    EXPECT_TRUE(at::equal(p.grad(), expected_average(p, salt, true))) << item.key();
  }
  // .grad is the buffer's range again: zero_grad() reaches it.
  reducer.zero_grad();
  for (auto& p : model->parameters()) EXPECT_EQ(p.grad().abs().sum().item<double>(), 0.0);
}

// Skipped on some ranks only: every rank gets the average (zeros from the ranks that skipped).
TEST(GradReducer, AGradientOnOneRankIsAGradientOnEvery) {
  const int rank = world().rank();
  ThreeDtypes model;
  GradReducer reducer(world_ptr(), *model, GradReducerOptions().bucket_numel(64));
  reducer.zero_grad();
  backward_weighted(model, rank, /*skip=*/rank == 0 ? "" : "c");
  reducer.finish();
  const at::Tensor& c = model->c;
  ASSERT_TRUE(c.grad().defined());
  at::Tensor sum = weight_for(c, 0, /*salt=*/3).to(at::kFloat);
  if (world().size() > 1) sum.div_(world().size());
  EXPECT_TRUE(at::equal(c.grad(), sum.to(c.scalar_type())));
}

// Gradients cleared torch's way (set to none) and, on the last rank, no backward at all this
// step (an empty micro-batch): its finish() still reduces — with zeros — instead of taking the
// call for a repeat of the last step's and leaving the others' collectives to pair with its
// next step's. Then a normal step follows on every rank, unshifted.
TEST(GradReducer, ARankWithoutABackwardAfterGradsWereClearedStillReduces) {
  const int rank = world().rank(), n = world().size();
  if (n < 2) GTEST_SKIP() << "needs a rank with a backward beside the one without";
  const bool empty = rank == n - 1;
  for (const ReduceMode mode : {ReduceMode::kAllReduce, ReduceMode::kReduceScatter}) {
    for (const bool fp32 : {false, true}) {
      SCOPED_TRACE(std::string(mode == ReduceMode::kAllReduce ? "all-reduce" : "reduce-scatter") +
                   (fp32 ? ", accumulate_in_fp32" : ""));
      ThreeDtypes model;
      GradReducer reducer(
          world_ptr(), *model,
          GradReducerOptions().bucket_numel(64).mode(mode).accumulate_in_fp32(fp32));
      reducer.zero_grad();
      backward_weighted(model, rank);
      reducer.finish();
      for (int step = 0; step < 2; ++step) {
        for (auto& p : model->parameters()) p.mutable_grad().reset();  // torch's zero_grad()
        if (!(empty && step == 0)) backward_weighted(model, rank);
        reducer.finish();
        // Salt 2 is 'b' (FP32): the ranks that ran a backward, averaged over all n.
        const at::Tensor& b = model->b;
        at::Tensor sum = at::zeros(b.sizes(), at::kFloat);
        const int contributing = step == 0 ? n - 1 : n;
        for (int r = 0; r < contributing; ++r) sum += weight_for(b, r, /*salt=*/2);
        if (n > 1) sum.div_(n);
        ASSERT_TRUE(b.grad().defined()) << "step " << step;
        for (const auto& piece : reducer.layout().param_shards(rank)) {
          if (piece.fqn != "b") continue;
          EXPECT_TRUE(at::equal(b.grad().view({-1}).narrow(0, piece.begin, piece.numel()),
                                sum.view({-1}).narrow(0, piece.begin, piece.numel())))
              << "step " << step;
        }
      }
    }
  }
}

// Two more ways a step can begin with nothing a rank without a backward can see in its .grad
// tensors (kAllReduce, where .grad carries over): a step before in which no rank had a backward
// (finish() left every .grad none, and torch's zero_grad() has nothing to clear), and an
// optimizer step followed by gradients zeroed in place. The rank without a backward still
// reduces, and a repeated finish() still changes nothing.
TEST(GradReducer, ARankWithoutABackwardReducesAfterAnEmptyStepOrAnUpdate) {
  const int rank = world().rank(), n = world().size();
  if (n < 2) GTEST_SKIP() << "needs a rank with a backward beside the one without";
  const bool empty = rank == n - 1;
  // b's (salt 2) gradient averaged over n, from the first `contributing` ranks.
  const auto average_of = [n](const at::Tensor& b, int contributing) {
    at::Tensor sum = at::zeros(b.sizes(), at::kFloat);
    for (int r = 0; r < contributing; ++r) sum += weight_for(b, r, /*salt=*/2);
    return sum.div_(n);
  };
  for (const bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlap" : "no overlap");
    ThreeDtypes model;
    GradReducer reducer(
        world_ptr(), *model,
        GradReducerOptions().bucket_numel(64).mode(ReduceMode::kAllReduce).overlap(overlap));
    reducer.zero_grad();
    reducer.finish();  // no rank had a backward: every .grad is none
    ASSERT_FALSE(model->b.grad().defined());
    for (auto& p : model->parameters()) p.mutable_grad().reset();  // torch's zero_grad(): no-op
    if (!empty) backward_weighted(model, rank);
    reducer.finish();
    ASSERT_TRUE(model->b.grad().defined());
    EXPECT_TRUE(at::equal(model->b.grad(), average_of(model->b, n - 1)));

    // An optimizer step, then .grad zeroed in place (torch's zero_grad(set_to_none=false)).
    {
      at::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.sub_(p.grad());
      for (auto& p : model->parameters()) p.mutable_grad().zero_();
    }
    if (!empty) backward_weighted(model, rank);
    reducer.finish();
    EXPECT_TRUE(at::equal(model->b.grad(), average_of(model->b, n - 1)));
    reducer.finish();  // a repeat: nothing changed since
    EXPECT_TRUE(at::equal(model->b.grad(), average_of(model->b, n - 1)));

    // Every rank in step again.
    reducer.zero_grad();
    backward_weighted(model, rank);
    reducer.finish();
    EXPECT_TRUE(at::equal(model->b.grad(), average_of(model->b, n)));
  }
}

// Without overlap no bucket is in flight before finish(): the second backward's error leaves
// nothing half-reduced (with buckets in flight the group fails: reducer_misuse_mp.cpp).
TEST(GradReducer, SecondBackwardBeforeFinishIsAnErrorNamingTheParameter) {
  ThreeDtypes model;
  GradReducer reducer(world_ptr(), *model,
                      GradReducerOptions().bucket_numel(1 << 20).overlap(false));
  backward_weighted(model, world().rank());
  const std::string message = error_of([&] { backward_weighted(model, world().rank()); });
  EXPECT_NE(message.find("arrived twice before finish()"), std::string::npos) << message;
  reducer.finish();  // every rank is in the same state: the reduction completes
}

// Two BF16 parameters of ones: 'a', trainable, and 'b', registered frozen.
struct TrainableAndFrozen : torch::nn::Module {
  TrainableAndFrozen(int64_t trainable, int64_t frozen) {
    a = register_parameter("a", at::ones({trainable}, at::kBFloat16));
    b = register_parameter("b", at::ones({frozen}, at::kBFloat16), /*requires_grad=*/false);
  }
  at::Tensor a, b;
};

// A parameter registered frozen (register_parameter(..., requires_grad=false)) has no autograd
// metadata yet: the reducer still lays it out and hooks it, so unfreezing it later works.
TEST(GradReducer, AParameterRegisteredFrozenCanBeUnfrozenLater) {
  TrainableAndFrozen model(/*trainable=*/4, /*frozen=*/3);
  GradReducer reducer(world_ptr(), model, GradReducerOptions().bucket_numel(64));
  model.b.set_requires_grad(true);
  reducer.zero_grad();
  (model.a.to(at::kFloat).sum() + model.b.to(at::kFloat).sum() * 2).backward();
  reducer.finish();
  EXPECT_TRUE(at::equal(model.b.grad(), at::full({3}, 2.0, at::kBFloat16)));
}

TEST(GradReducer, OneReducerPerModel) {
  ThreeDtypes model;
  GradReducer reducer(world_ptr(), *model);
  const std::string message = error_of([&] { GradReducer second(world_ptr(), *model); });
  EXPECT_NE(message.find("'a' already has a post-accumulate-grad hook"), std::string::npos)
      << message;
}

TEST(GradReducer, DescribePrintsEveryRanksRanges) {
  MixedNet model;
  GradReducer reducer(world_ptr(), *model,
                      GradReducerOptions().mode(ReduceMode::kReduceScatter).bucket_numel(100));
  const std::string table = reducer.layout().describe();
  if (world().rank() == 0) std::cout << table;
  for (int r = 0; r < world().size(); ++r) {
    EXPECT_NE(table.find("rank " + std::to_string(r) + " ["), std::string::npos);
  }
  EXPECT_NE(table.find("param fc1.weight [16, 13]"), std::string::npos);
  // Frozen parameters have their ranges too: unfreezing one later needs no new layout.
  EXPECT_NE(table.find("param frozen.weight"), std::string::npos);
}

// by default (grad_reduce_in_fp32) FP16 buckets are summed in FP32: a gradient of
// 40000 on every rank sums past FP16's 65504 but averages back to 40000, not Inf.
struct OneHalfImpl : torch::nn::Module {
  OneHalfImpl() { w = register_parameter("w", at::zeros({37}, at::kHalf)); }
  at::Tensor w;
};
TORCH_MODULE(OneHalf);

TEST(GradReducer, DefaultSumsHalfBucketsInFp32PastFp16Range) {
  for (ReduceMode mode : {ReduceMode::kAllReduce, ReduceMode::kReduceScatter}) {
    OneHalf model;
    GradReducer reducer(world_ptr(), *model, GradReducerOptions().mode(mode));
    reducer.zero_grad();
    (model->w.to(at::kFloat) * 40000).sum().backward();
    reducer.finish();
    const at::Tensor grad = model->w.grad().view({-1});
    for (const auto& piece : reducer.layout().param_shards(world().rank())) {
      EXPECT_TRUE(at::equal(grad.narrow(0, piece.begin, piece.numel()),
                            at::full({piece.numel()}, 40000, at::kHalf)))
          << grad.narrow(0, piece.begin, piece.numel());
    }
  }
}

// accumulate_in_fp32 in kReduceScatter mode, gradients cleared torch's way (set to none, not
// reducer.zero_grad()) between steps: the FP32 main gradients start the next step from zero.
// Left holding the last step's values (its average in this rank's shard, its unreduced sum
// elsewhere), the next backward would be added to them and every BF16/FP16 parameter stepped
// with the sum of two steps' gradients. 'b' (FP32) has no main_grad: the FP16/BF16 ones do.
TEST(GradReducer, Fp32MainGradsStartAfreshWhenGradsAreClearedTorchsWay) {
  const int rank = world().rank(), n = world().size();
  ThreeDtypes model;
  GradReducer reducer(world_ptr(), *model,
                      GradReducerOptions()
                          .mode(ReduceMode::kReduceScatter)
                          .accumulate_in_fp32(true)
                          .bucket_numel(64));
  reducer.zero_grad();
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    if (step > 0) {
      for (auto& p : model->parameters()) p.mutable_grad().reset();  // torch's zero_grad()
    }
    backward_weighted(model, rank);
    reducer.finish();
    int salt = 0;
    for (auto& item : model->named_parameters()) {
      ++salt;
      const at::Tensor main = reducer.main_grad(reducer.index_of(item.value()));
      if (!main.defined()) continue;  // FP32 'b'
      at::Tensor sum = at::zeros(item.value().sizes(), at::kFloat);
      for (int r = 0; r < n; ++r) sum += weight_for(item.value(), r, salt).to(at::kFloat);
      if (n > 1) sum.div_(n);
      for (const auto& piece : reducer.layout().param_shards(rank)) {
        if (piece.fqn != item.key()) continue;
        EXPECT_TRUE(at::equal(main.reshape({-1}).narrow(0, piece.begin, piece.numel()),
                              sum.view({-1}).narrow(0, piece.begin, piece.numel())))
            << item.key() << "[" << piece.begin << ":" << piece.end << "]";
      }
    }
  }
}

// A .grad set from outside (no backward) on a parameter that finish() left without one is a
// gradient, and the next finish() reduces it: it is not a repeat of the last finish(). Taken
// for one, every rank would keep its own value and step with it, and the replicas drift apart.
TEST(GradReducer, AGradSetFromOutsideAfterFinishIsReduced) {
  const int rank = world().rank(), n = world().size();
  if (n < 2) GTEST_SKIP() << "one rank's average is its own gradient";
  ThreeDtypes model;
  GradReducer reducer(world_ptr(), *model,
                      GradReducerOptions().mode(ReduceMode::kAllReduce).bucket_numel(64));
  reducer.zero_grad();
  backward_weighted(model, rank, /*skip=*/"c");
  reducer.finish();
  ASSERT_FALSE(model->c.grad().defined());  // no rank had one
  model->c.mutable_grad() = weight_for(model->c, rank, /*salt=*/3);
  reducer.finish();
  ASSERT_TRUE(model->c.grad().defined());
  EXPECT_TRUE(at::equal(model->c.grad(), expected_average(model->c, /*salt=*/3, /*fp32=*/true)))
      << model->c.grad();
}

// kReduceScatter with a frozen parameter and torch's zero_grad(), which clears only the
// trainable parameters' .grad (the frozen one is in no optimizer): the frozen parameter's .grad
// is still its buffer range, holding nothing that is reduced, and must not be refused as "the
// last step's gradient" — the next step reduces as the first did.
TEST(GradReducer, AFrozenParameterIsNoStaleGradientInReduceScatterMode) {
  const int rank = world().rank(), n = world().size();
  TrainableAndFrozen model(/*trainable=*/6, /*frozen=*/5);
  GradReducer reducer(world_ptr(), model,
                      GradReducerOptions().mode(ReduceMode::kReduceScatter).bucket_numel(64));
  reducer.zero_grad();
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    model.a.mutable_grad().reset();  // torch's zero_grad() over the trainable parameters
    (model.a.to(at::kFloat) * (rank + 1)).sum().backward();
    EXPECT_NO_THROW(reducer.finish());
    const double average = (n + 1) / 2.0;  // Σ (r + 1) / n
    for (const auto& piece : reducer.layout().param_shards(rank)) {
      if (piece.fqn != "a") continue;
      EXPECT_TRUE(at::equal(model.a.grad().view({-1}).narrow(0, piece.begin, piece.numel()),
                            at::full({piece.numel()}, average, at::kBFloat16)));
    }
  }
}

// overlap_param_gather: a backward whose forward ran before wait_for_params() read parameters
// the all-gather was still writing. Its first gradient is an error naming the cause, on every
// rank; the gathers still complete (wait_param_gather), and a step that waits is fine.
TEST(GradReducer, ABackwardBeforeWaitingForTheParamGatherIsAnError) {
  const int rank = world().rank(), n = world().size();
  if (n < 2) GTEST_SKIP() << "one rank gathers nothing";
  ThreeDtypes model;
  GradReducer reducer(world_ptr(), *model,
                      GradReducerOptions()
                          .mode(ReduceMode::kReduceScatter)
                          .bucket_numel(64)
                          .overlap_param_gather(true));
  reducer.zero_grad();
  backward_weighted(model, rank);
  reducer.finish();
  reducer.start_param_gather();
  reducer.zero_grad();
  const std::string message = error_of([&] { backward_weighted(model, rank); });
  EXPECT_NE(message.find("all-gather was never waited for"), std::string::npos) << message;
  reducer.wait_param_gather();
  reducer.start_param_gather();
  reducer.zero_grad();
  reducer.wait_for_params(*model);
  EXPECT_EQ(error_of([&] { backward_weighted(model, rank); }), "");
  reducer.finish();
}

// The parameter gather writes every parameter through its buffer, behind the parameter's
// back: each one's version counter must move, as an in-place write's would, or whatever keys a
// cached value on it (quant::OperandCache's quantized weights, a state dict's unchanged check)
// goes on using the value from before the other ranks' updates arrived.
TEST(GradReducer, TheParamGatherMovesEveryParametersVersion) {
  const int n = world().size();
  if (n < 2) GTEST_SKIP() << "one rank gathers nothing";
  for (const bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "gather overlapped" : "gather waited");
    ThreeDtypes model;
    GradReducer reducer(world_ptr(), *model,
                        GradReducerOptions()
                            .mode(ReduceMode::kReduceScatter)
                            .bucket_numel(64)
                            .overlap_param_gather(overlap));
    std::vector<int64_t> before;
    for (const auto& p : model->parameters()) before.push_back(p._version());
    reducer.start_param_gather();
    reducer.wait_param_gather();
    size_t k = 0;
    for (const auto& item : model->named_parameters()) {
      EXPECT_GT(item.value()._version(), before[k++]) << item.key();
    }
  }
}

// accumulate_in_fp32: a .grad replaced from outside after micro-batches accumulated into the
// FP32 main gradient is the gradient, as in one process (assigning .grad discards what was
// accumulated). Added to the main gradient instead, the step would average the replacement
// plus the discarded micro-batches.
TEST(GradReducer, AGradReplacedAfterNoSyncMicroBatchesIsTheGradientWithFp32Accumulation) {
  const int rank = world().rank();
  for (const ReduceMode mode : {ReduceMode::kAllReduce, ReduceMode::kReduceScatter}) {
    SCOPED_TRACE(mode == ReduceMode::kAllReduce ? "all-reduce" : "reduce-scatter");
    ThreeDtypes model;
    GradReducer reducer(world_ptr(), *model,
                        GradReducerOptions().mode(mode).accumulate_in_fp32(true).bucket_numel(64));
    reducer.zero_grad();
    {
      GradReducer::NoSyncGuard no_sync(reducer);
      backward_weighted(model, rank);  // every parameter, 'a' included, into main_grad
    }
    model->a.mutable_grad() = weight_for(model->a, rank, /*salt=*/7);  // replaced
    backward_weighted(model, rank, /*skip=*/"a");
    reducer.finish();
    const at::Tensor main = reducer.main_grad(reducer.index_of(model->a)).reshape({-1});
    at::Tensor sum = at::zeros(model->a.sizes(), at::kFloat);
    for (int r = 0; r < world().size(); ++r) sum += weight_for(model->a, r, 7).to(at::kFloat);
    if (world().size() > 1) sum.div_(world().size());
    for (const auto& piece : reducer.layout().param_shards(rank)) {
      if (piece.fqn != "a") continue;
      EXPECT_TRUE(at::equal(main.narrow(0, piece.begin, piece.numel()),
                            sum.view({-1}).narrow(0, piece.begin, piece.numel())))
          << main.narrow(0, piece.begin, piece.numel());
    }
  }
}

// With overlap, a bucket whose parameters are all frozen has no gradient to wait for: it is
// complete at once and does not hold back the buckets after it in the launch order (it goes
// first once the order is agreed). Waited for, every reduction would start in finish(), after
// backward: overlap lost, without a word, for any model with a frozen layer.
TEST(GradReducer, AFrozenBucketDoesNotHoldBackOverlap) {
  struct Net : torch::nn::Module {
    Net() {
      a = register_parameter("a", at::ones({64}));
      b = register_parameter("b", at::ones({64}));
      f = register_parameter("f", at::ones({64}), /*requires_grad=*/false);
    }
    at::Tensor a, b, f;
  };
  Net model;
  GradReducer reducer(world_ptr(), model,
                      GradReducerOptions().bucket_numel(64).shard_alignment(1).overlap(true));
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    reducer.zero_grad();
    (model.a.sum() + model.b.sum() * 2).backward();
    reducer.finish();
    ASSERT_EQ(reducer.last_timing().buckets, 3);
    EXPECT_GT(reducer.last_timing().launched_during_backward, 0);
    EXPECT_TRUE(at::equal(model.b.grad(), at::full({64}, 2.0)));
  }
}

// broadcast_from_rank0 reaches tensors of any layout: a non-contiguous buffer (a transposed
// view) and a non-contiguous parameter of a dtype that is only broadcast get rank 0's values
// on every rank, as contiguous ones do. Sent from a contiguous copy that is never written
// back, they would keep each rank's own values: ranks apart from the first step.
TEST(GradReducer, BroadcastFromRankZeroReachesNonContiguousTensors) {
  const int rank = world().rank(), n = world().size();
  if (n < 2) GTEST_SKIP() << "one rank has rank 0's values";
  struct Net : torch::nn::Module {
    explicit Net(int rank) {
      w = register_parameter("w", at::full({4}, 1.0 + rank));
      stats = register_buffer("stats", at::arange(12, at::kFloat).add(100 * rank).view({3, 4}).t());
      codes = register_parameter("codes", at::arange(6, at::kInt).add(10 * rank).view({2, 3}).t(),
                                 /*requires_grad=*/false);
    }
    at::Tensor w, stats, codes;
  };
  Net model(rank), rank_zero(0);
  ASSERT_FALSE(model.stats.is_contiguous());
  ASSERT_FALSE(model.codes.is_contiguous());
  GradReducer reducer(world_ptr(), model, GradReducerOptions());
  EXPECT_TRUE(at::equal(model.w, rank_zero.w));
  EXPECT_TRUE(at::equal(model.stats, rank_zero.stats)) << model.stats;
  EXPECT_TRUE(at::equal(model.codes, rank_zero.codes)) << model.codes;
}

// With overlap, reductions start during backward: until finish(), zero_grad() would zero
// buffers a collective is reading (or, in kReduceScatter mode, writing) and a NoSyncGuard's
// backward would add into them. Both are errors that change nothing; finish() then completes
// the step on every rank with the right average.
TEST(GradReducer, ZeroGradAndNoSyncWhileReductionsAreInFlightAreErrors) {
  const int rank = world().rank();
  ThreeDtypes model;
  GradReducer reducer(world_ptr(), *model, GradReducerOptions().bucket_numel(64).overlap(true));
  reducer.zero_grad();
  backward_weighted(model, rank);
  ASSERT_GT(reducer.last_timing().buckets, 1);
  std::string message = error_of([&] { reducer.zero_grad(); });
  EXPECT_NE(message.find("in flight; call finish() first"), std::string::npos) << message;
  message = error_of([&] { GradReducer::NoSyncGuard no_sync(reducer); });
  EXPECT_NE(message.find("in flight; call finish() before accumulating"), std::string::npos)
      << message;
  reducer.finish();
  expect_every_grad_averaged(*model);
}

// accumulate_in_fp32 in kAllReduce mode, gradients cleared torch's way between steps, and a
// parameter only rank 0's backward reaches in the second step: the other ranks contribute
// zeros for it, not the FP32 average the last step left in their main gradients.
TEST(GradReducer, AClearedParameterNoBackwardReachedSendsZerosWithFp32Accumulation) {
  const int rank = world().rank(), n = world().size();
  if (n < 2) GTEST_SKIP() << "needs a rank whose backward skips the parameter";
  ThreeDtypes model;
  GradReducer reducer(
      world_ptr(), *model,
      GradReducerOptions().mode(ReduceMode::kAllReduce).accumulate_in_fp32(true).bucket_numel(64));
  reducer.zero_grad();
  backward_weighted(model, rank);
  reducer.finish();
  for (auto& p : model->parameters()) p.mutable_grad().reset();  // torch's zero_grad()
  backward_weighted(model, rank, /*skip=*/rank == 0 ? "" : "e");
  reducer.finish();
  const at::Tensor& e = model->e;  // salt 5
  ASSERT_TRUE(e.grad().defined());
  const at::Tensor expected =
      weight_for(e, 0, /*salt=*/5).to(at::kFloat).div(n).to(e.scalar_type());
  EXPECT_TRUE(at::equal(e.grad(), expected)) << e.grad();
}

// grad_reduce_in_fp32 off: FP16 buckets are summed in FP16, and the sum comes before the
// division (grad_reducer.h, Numerics): 40000 on every rank overflows the sum on two or more
// ranks, where the default FP32 sum averages back to 40000.
TEST(GradReducer, WithoutFp32ReductionHalfSumsOverflowBeforeTheDivision) {
  const int rank = world().rank();
  if (world().size() < 2) GTEST_SKIP() << "one rank sums nothing";
  for (ReduceMode mode : {ReduceMode::kAllReduce, ReduceMode::kReduceScatter}) {
    SCOPED_TRACE(mode == ReduceMode::kAllReduce ? "all-reduce" : "reduce-scatter");
    OneHalf model;
    GradReducer reducer(world_ptr(), *model,
                        GradReducerOptions().mode(mode).grad_reduce_in_fp32(false));
    reducer.zero_grad();
    (model->w.to(at::kFloat) * 40000).sum().backward();
    reducer.finish();
    const at::Tensor grad = model->w.grad().view({-1});
    for (const auto& piece : reducer.layout().param_shards(rank)) {
      EXPECT_TRUE(grad.narrow(0, piece.begin, piece.numel()).isinf().all().item<bool>())
          << grad.narrow(0, piece.begin, piece.numel());
    }
  }
}

// accumulate_in_fp32 implies grad_reduce_in_fp32, even when that is turned off: the FP32
// buffer is where the micro-batches accumulate, and the sum past FP16's range averages back.
TEST(GradReducer, AccumulatingInFp32ImpliesReducingInFp32) {
  const int rank = world().rank();
  OneHalf model;
  GradReducer reducer(world_ptr(), *model,
                      GradReducerOptions()
                          .mode(ReduceMode::kReduceScatter)
                          .accumulate_in_fp32(true)
                          .grad_reduce_in_fp32(false));
  EXPECT_TRUE(reducer.options().grad_reduce_in_fp32());
  const at::Tensor main = reducer.main_grad(reducer.index_of(model->w));
  ASSERT_TRUE(main.defined());
  EXPECT_EQ(main.scalar_type(), at::kFloat);
  reducer.zero_grad();
  (model->w.to(at::kFloat) * 40000).sum().backward();
  reducer.finish();
  for (const auto& piece : reducer.layout().param_shards(rank)) {
    EXPECT_TRUE(at::equal(main.view({-1}).narrow(0, piece.begin, piece.numel()),
                          at::full({piece.numel()}, 40000.0f)));
  }
}

// A parameter of a dtype whose gradients are not reduced (FP64, integers, FP8) must be frozen:
// a trainable one is an error naming it, on every rank, not a parameter silently left out.
TEST(GradReducer, RefusesATrainableParameterOfADtypeItDoesNotReduce) {
  struct Net : torch::nn::Module {
    Net() {
      w = register_parameter("w", at::ones({3}));
      table = register_parameter("table", at::ones({2}, at::kDouble));
    }
    at::Tensor w, table;
  };
  Net model;
  const std::string message = error_of([&] { GradReducer reducer(world_ptr(), model); });
  EXPECT_NE(message.find("'table' is a trainable Double parameter"), std::string::npos) << message;
}

// In kAllReduce mode every rank ends with every averaged gradient: a rank's piece of each
// parameter is all of it (the layout's shards are what kReduceScatter mode keeps).
TEST(GradReducer, EveryRankHoldsEveryElementInAllReduceMode) {
  const int rank = world().rank();
  ThreeDtypes model;
  GradReducer reducer(world_ptr(), *model, GradReducerOptions().bucket_numel(64));
  for (const auto& item : model->named_parameters()) {
    const size_t i = reducer.index_of(item.value());
    ASSERT_NE(i, GradReducer::kNoParam) << item.key();
    EXPECT_EQ(reducer.piece_of(i), (FlatRange{0, item.value().numel()})) << item.key();
  }
  ThreeDtypes sharded_model;
  GradReducer sharded(world_ptr(), *sharded_model,
                      GradReducerOptions().mode(ReduceMode::kReduceScatter).bucket_numel(64));
  std::map<size_t, FlatRange> owned;
  for (const auto& piece : sharded.layout().param_shards(rank)) {
    owned[piece.param] = FlatRange{piece.begin, piece.end};
  }
  for (size_t i = 0; i < sharded.layout().params.size(); ++i) {
    if (owned.count(i)) {
      EXPECT_EQ(sharded.piece_of(i), owned[i]) << sharded.layout().params[i].fqn;
    } else {
      EXPECT_EQ(sharded.piece_of(i).numel(), 0) << sharded.layout().params[i].fqn;
    }
  }
}

// A NoSyncGuard inside another leaves the outer one in force when it ends: finish() is still
// refused, and the next backward still only accumulates.
TEST(GradReducer, ANestedNoSyncGuardLeavesTheOuterOneInForce) {
  const int rank = world().rank();
  auto group = own_group("nested-no-sync", std::chrono::seconds(10));
  ThreeDtypes model;
  GradReducer reducer(group, *model, GradReducerOptions().bucket_numel(64));
  reducer.zero_grad();
  {
    GradReducer::NoSyncGuard outer(reducer);
    { GradReducer::NoSyncGuard inner(reducer); }
    EXPECT_NE(error_of([&] { reducer.finish(); }).find("inside a NoSyncGuard"), std::string::npos);
    backward_weighted(model, rank);
  }
  backward_weighted(model, rank);
  reducer.finish();
  int salt = 0;
  for (auto& item : model->named_parameters()) {
    ++salt;
    at::Tensor sum = at::zeros(item.value().sizes(), at::kFloat);
    for (int r = 0; r < world().size(); ++r)
      sum += weight_for(item.value(), r, salt).to(at::kFloat) * 2;
    if (world().size() > 1) sum.div_(world().size());
    EXPECT_TRUE(at::equal(item.value().grad(), sum.to(item.value().scalar_type()))) << item.key();
  }
  world().barrier();
}

// A destroyed reducer takes its hooks with it: another reducer can serve the same model.
TEST(GradReducer, ADestroyedReducerLeavesTheModelToTheNextOne) {
  const int rank = world().rank();
  ThreeDtypes model;
  { GradReducer first(world_ptr(), *model, GradReducerOptions().bucket_numel(64)); }
  std::unique_ptr<GradReducer> second;
  const std::string message = error_of([&] {
    second =
        std::make_unique<GradReducer>(world_ptr(), *model, GradReducerOptions().bucket_numel(64));
  });
  ASSERT_EQ(message, "");
  second->zero_grad();
  backward_weighted(model, rank);
  second->finish();
  expect_every_grad_averaged(*model);
}

// Only a kReduceScatter reducer's ranks hold parts of the parameters: gathering them from an
// all-reduce reducer is an error.
TEST(GradReducer, OnlyAReduceScatterReducerGathersParameters) {
  ThreeDtypes model;
  GradReducer reducer(world_ptr(), *model, GradReducerOptions().bucket_numel(64));
  const std::string message = error_of([&] { reducer.start_param_gather(); });
  EXPECT_NE(message.find("only a kReduceScatter reducer"), std::string::npos) << message;
}

// Two FP32 parameters of 64 elements, one bucket each (bucket_numel 64): buckets of one size,
// so collectives that paired one rank's `p` with another's `q` would go unnoticed by Gloo.
struct TwoBuckets : torch::nn::Module {
  TwoBuckets() {
    p = register_parameter("p", at::zeros({64}));
    q = register_parameter("q", at::zeros({64}));
  }
  at::Tensor p, q;
};

// Backward reaches the parameters in another order on odd ranks (two backwards, `q` first):
// buckets complete in another order there, yet every rank starts them in one agreed order
// (rank 0's from the second step), so each collective sums the same bucket on every rank.
TEST(GradReducer, RanksWhoseBackwardCompletesBucketsInAnotherOrderStillPairThem) {
  const int rank = world().rank(), n = world().size();
  auto group = own_group("buckets-in-another-order", std::chrono::seconds(10));
  TwoBuckets model;
  GradReducer reducer(group, model,
                      GradReducerOptions().bucket_numel(64).shard_alignment(1).overlap(true));
  ASSERT_EQ(reducer.last_timing().buckets, 2);
  double p_sum = 0, q_sum = 0;
  for (int r = 0; r < n; ++r) {
    p_sum += r + 1;
    q_sum += 100 * (r + 1);
  }
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    reducer.zero_grad();
    const auto backward_p = [&] { (model.p * (rank + 1)).sum().backward(); };
    const auto backward_q = [&] { (model.q * (100 * (rank + 1))).sum().backward(); };
    if (rank % 2 == 0) {
      backward_p();
      backward_q();
    } else {
      backward_q();
      backward_p();
    }
    reducer.finish();
    EXPECT_TRUE(at::equal(model.p.grad(), at::full({64}, p_sum / n))) << model.p.grad();
    EXPECT_TRUE(at::equal(model.q.grad(), at::full({64}, q_sum / n))) << model.q.grad();
  }
  world().barrier();
}

// A bucket none of whose parameters got a gradient in the first step (an unused expert) goes
// last in the order agreed after it: from the second step on, the buckets that do complete in
// backward are not held back behind it, and the first to complete starts during backward.
TEST(GradReducer, ABucketWithoutGradientsInTheFirstStepDoesNotHoldBackOverlap) {
  struct Net : torch::nn::Module {
    Net() {
      unused = register_parameter("unused", at::ones({64}));
      a = register_parameter("a", at::ones({64}));
      b = register_parameter("b", at::ones({64}));
    }
    at::Tensor unused, a, b;
  };
  Net model;
  GradReducer reducer(world_ptr(), model,
                      GradReducerOptions().bucket_numel(64).shard_alignment(1).overlap(true));
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    reducer.zero_grad();
    (model.a.sum() + model.b.sum() * 2).backward();
    reducer.finish();
    ASSERT_EQ(reducer.last_timing().buckets, 3);
    if (step > 0) EXPECT_GT(reducer.last_timing().launched_during_backward, 0);
    EXPECT_TRUE(at::equal(model.b.grad(), at::full({64}, 2.0)));
    EXPECT_FALSE(model.unused.grad().defined());
  }
}

// A floating parameter that is not contiguous (a transposed view, on every rank alike) cannot
// be laid out as a range of its buffer: it is an error naming it.
TEST(GradReducer, RefusesANonContiguousParameter) {
  struct Net : torch::nn::Module {
    Net() {
      w = register_parameter("w", at::ones({3}));
      t = register_parameter("t", at::ones({4, 2}).t());
    }
    at::Tensor w, t;
  };
  Net model;
  ASSERT_FALSE(model.t.is_contiguous());
  const std::string message = error_of([&] { GradReducer reducer(world_ptr(), model); });
  EXPECT_NE(message.find("'t' must be dense and contiguous"), std::string::npos) << message;
}

// A finish() repeated with nothing changed since returns at once, also when the last one left a
// parameter without a gradient (no rank had one: .grad none): no collective runs again.
TEST(GradReducer, ARepeatedFinishAfterAParameterWasLeftWithoutAGradientChangesNothing) {
  const int rank = world().rank();
  ThreeDtypes model;
  GradReducer reducer(world_ptr(), *model, GradReducerOptions().bucket_numel(64));
  const auto calls = [] {
    int64_t total = 0;
    for (auto kind : {distributed::Collective::kAllReduce, distributed::Collective::kReduceScatter,
                      distributed::Collective::kAllGather, distributed::Collective::kBroadcast}) {
      total += world().traffic(kind).calls;
    }
    return total;
  };
  reducer.zero_grad();
  backward_weighted(model, rank, /*skip=*/"c");
  reducer.finish();
  ASSERT_FALSE(model->c.grad().defined());
  const int64_t before = calls();
  reducer.finish();
  EXPECT_EQ(calls(), before);
  EXPECT_FALSE(model->c.grad().defined());
  EXPECT_TRUE(at::equal(model->a.grad(), expected_average(model->a, /*salt=*/1, true)));
}

TEST(GradReducer, RefusesANullCommunicator) {
  ThreeDtypes model;
  const std::string message = error_of([&] { GradReducer reducer(nullptr, *model); });
  EXPECT_NE(message.find("the communicator is null"), std::string::npos) << message;
}

// The reducer's zero_grad() begins a new step: a rank with no backward after it (an empty
// micro-batch) still reduces — zeros — in its finish(), which is no repeat of the last step's
// finish() although every .grad is still its buffer range and no parameter was written.
TEST(GradReducer, ARankWithoutABackwardAfterTheReducersZeroGradStillReduces) {
  const int rank = world().rank(), n = world().size();
  if (n < 2) GTEST_SKIP() << "needs a rank with a backward beside the one without";
  auto group = own_group("no-backward-after-zero-grad", std::chrono::seconds(10));
  ThreeDtypes model;
  GradReducer reducer(group, *model,
                      GradReducerOptions().mode(ReduceMode::kAllReduce).bucket_numel(64));
  reducer.zero_grad();
  backward_weighted(model, rank);
  reducer.finish();
  reducer.zero_grad();
  if (rank != n - 1) backward_weighted(model, rank);
  EXPECT_EQ(error_of([&] { reducer.finish(); }), "");
  at::Tensor sum = at::zeros(model->b.sizes(), at::kFloat);
  for (int r = 0; r < n - 1; ++r) sum += weight_for(model->b, r, /*salt=*/2);
  ASSERT_TRUE(model->b.grad().defined());
  EXPECT_TRUE(at::equal(model->b.grad(), sum.div_(n)));
  world().barrier();
}

// Rank 0 without a backward in the first step has seen no order to agree on: the ranks agree
// after a later step instead (rank 0's order then: `p` before `q`, against the layout's), and
// from then on the first bucket to complete starts during backward.
TEST(GradReducer, TheLaunchOrderIsAgreedAfterAStepInWhichRankZeroHadABackward) {
  const int rank = world().rank();
  TwoBuckets model;
  GradReducer reducer(world_ptr(), model,
                      GradReducerOptions().bucket_numel(64).shard_alignment(1).overlap(true));
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    reducer.zero_grad();
    if (step > 0 || rank != 0) {
      model.p.sum().backward();
      (model.q * 2).sum().backward();
    }
    reducer.finish();
    if (step == 2) EXPECT_GT(reducer.last_timing().launched_during_backward, 0);
    if (step > 0) EXPECT_TRUE(at::equal(model.q.grad(), at::full({64}, 2.0)));
  }
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::testing
