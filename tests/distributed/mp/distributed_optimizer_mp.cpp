// ZeRO-1 against the single-process Float16Optimizer and against plain data parallelism
// (GradReducer all-reduce + a Float16Optimizer per rank), in real processes.
#include "distributed/mp/mp_support.h"
#include "mixprec/checkpoint/format/state_keys.h"
#include "mixprec/distributed/distributed_optimizer.h"
#include "optim/support_optim.h"
#include "support/error_message.h"

#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <set>

namespace mixprec::testing {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using distributed::DistributedOptimizer;
using distributed::GradReducer;
using distributed::GradReducerOptions;
using distributed::ReduceMode;
using optim::Float16Optimizer;
using optim::Float16OptimizerOptions;
using optim::ParamRole;

using MakeOptions = std::function<std::unique_ptr<torch::optim::OptimizerOptions>()>;

struct Algo {
  std::string name;
  MakeOptions make;
};

std::vector<Algo> algorithms() {
  return {
      {"adamw",
       [] {
         return std::make_unique<torch::optim::AdamWOptions>(
             torch::optim::AdamWOptions(2e-2).weight_decay(0.1));
       }},
      {"adam-amsgrad-l2",
       [] {
         return std::make_unique<torch::optim::AdamOptions>(
             torch::optim::AdamOptions(1e-2).weight_decay(0.05).amsgrad(true));
       }},
      {"sgd-nesterov",
       [] {
         return std::make_unique<torch::optim::SGDOptions>(
             torch::optim::SGDOptions(5e-2).momentum(0.9).nesterov(true).weight_decay(0.01));
       }},
  };
}

std::vector<torch::optim::OptimizerParamGroup> one_group(torch::nn::Module& model) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(model.parameters());
  return groups;
}

// One training setup: a model and how it steps.
struct Trainer {
  enum Kind { kSingle, kPlainDp, kZero } kind;
  MixedNet model;
  std::unique_ptr<GradReducer> reducer;
  std::unique_ptr<torch::optim::Optimizer> optimizer;

  Trainer(Kind kind, const MakeOptions& make, Float16OptimizerOptions mixed = {},
          at::ScalarType half = at::kBFloat16,
          GradReducerOptions reduce = GradReducerOptions().bucket_numel(64).shard_alignment(4))
      : kind(kind), model(half) {
    if (kind == kPlainDp) reducer = std::make_unique<GradReducer>(world_ptr(), *model, reduce);
    if (kind == kZero) {
      reducer = std::make_unique<GradReducer>(world_ptr(), *model,
                                              reduce.mode(ReduceMode::kReduceScatter));
      optimizer = std::make_unique<DistributedOptimizer>(*reducer, *model, one_group(*model),
                                                         make(), mixed);
    } else {
      optimizer = std::make_unique<Float16Optimizer>(*model, one_group(*model), make(), mixed);
    }
  }
  double loss_scale() const {
    return kind == kZero ? static_cast<DistributedOptimizer&>(*optimizer).loss_scale()
                         : static_cast<Float16Optimizer&>(*optimizer).loss_scale();
  }
  // Backward of the (scaled) loss. `poison` (optional, 5x7): added to head.weight's gradient
  // (Inf/NaN entries force an overflow in that one element only).
  void backward(const at::Tensor& x, const at::Tensor& poison = {}) {
    if (reducer) {
      reducer->zero_grad();
    } else {
      optimizer->zero_grad();
    }
    at::Tensor loss = model->loss(x);
    if (poison.defined()) {
      const at::Tensor& w = model->head->weight;
      loss = loss + (w.to(at::kFloat) * poison.to(w.device())).sum();
    }
    (loss * loss_scale()).backward();
  }
  optim::StepResult update() {
    if (kind == kZero) return static_cast<DistributedOptimizer&>(*optimizer).update();
    if (reducer) reducer->finish();
    return static_cast<Float16Optimizer&>(*optimizer).update();
  }
  void set_lr(double lr) {
    for (auto& group : optimizer->param_groups()) group.options().set_lr(lr);
  }
};

void expect_same_params(MixedNet& a, MixedNet& b, const std::string& what) {
  auto theirs = b->named_parameters();
  for (const auto& item : a->named_parameters()) {
    EXPECT_TRUE(bitwise_equal(item.value(), theirs[item.key()])) << what << ": " << item.key();
  }
}

bool power_of_two(int n) { return (n & (n - 1)) == 0; }

TEST(DistributedOptimizer, SameGradsEveryRankMatchSingleProcessAndPlainDp) {
  const int n = world().size();
  for (const Algo& algo : algorithms()) {
    SCOPED_TRACE(algo.name);
    Trainer single(Trainer::kSingle, algo.make), dp(Trainer::kPlainDp, algo.make),
        zero(Trainer::kZero, algo.make);
    for (int64_t step = 0; step < 4; ++step) {
      if (step == 2) {
        for (Trainer* t : {&single, &dp, &zero}) t->set_lr(3e-3);  // schedulers keep working
      }
      const at::Tensor x = batch(step);
      for (Trainer* t : {&single, &dp, &zero}) t->backward(x);
      const optim::StepResult s = single.update(), d = dp.update(), z = zero.update();
      EXPECT_TRUE(s.success && d.success && z.success);
      EXPECT_EQ(z.params_stepped, d.params_stepped);
      EXPECT_NEAR(z.grad_norm, d.grad_norm, 1e-12 * d.grad_norm);
    }
    expect_same_params(zero.model, dp.model, "ZeRO-1 vs plain DP");
    if (power_of_two(n)) expect_same_params(zero.model, single.model, "ZeRO-1 vs one process");
    for (const auto& p : zero.model->parameters()) EXPECT_TRUE(same_on_all_ranks(p));
  }
}

TEST(DistributedOptimizer, DifferentDataPerRankMatchesPlainDp) {
  for (const Algo& algo : algorithms()) {
    SCOPED_TRACE(algo.name);
    Trainer dp(Trainer::kPlainDp, algo.make), zero(Trainer::kZero, algo.make);
    for (int64_t step = 0; step < 4; ++step) {
      const at::Tensor x = batch(step, world().rank());
      dp.backward(x);
      zero.backward(x);
      EXPECT_TRUE(dp.update().success);
      EXPECT_TRUE(zero.update().success);
    }
    expect_same_params(zero.model, dp.model, "ZeRO-1 vs plain DP");
    for (const auto& p : zero.model->parameters()) EXPECT_TRUE(same_on_all_ranks(p));
  }
}

// FP16 with a dynamic scaler; at step 1 one gradient element overflows on the last rank only,
// so after the reduce-scatter only the rank that owns that element sees it.
TEST(DistributedOptimizer, OverflowOnOneRankSkipsEveryRankAndBacksOffTogether) {
  const int n = world().size(), rank = world().rank();
  optim::LossScalerOptions scaling = optim::LossScalerOptions::fp16_dynamic();
  scaling.initial_scale(1024);
  scaling.hysteresis(1);
  const Float16OptimizerOptions mixed = Float16OptimizerOptions().loss_scaler(scaling);
  const MakeOptions adamw = algorithms()[0].make;
  Trainer dp(Trainer::kPlainDp, adamw, mixed, at::kHalf),
      zero(Trainer::kZero, adamw, mixed, at::kHalf);
  optim::LossScaler expected_scaler(scaling);
  for (int64_t step = 0; step < 3; ++step) {
    at::Tensor poison = at::zeros({5, 7});
    if (step == 1 && rank == n - 1) poison[4][6] = INFINITY;
    std::vector<at::Tensor> before;
    for (const auto& p : zero.model->parameters()) before.push_back(p.clone());
    const at::Tensor x = batch(step, rank);
    dp.backward(x, poison);
    zero.backward(x, poison);
    const optim::StepResult d = dp.update(), z = zero.update();
    EXPECT_EQ(z.success, step != 1) << "step " << step;
    EXPECT_EQ(d.success, step != 1) << "step " << step;
    EXPECT_EQ(z.loss_scale, expected_scaler.scale());
    expected_scaler.update(/*found_inf=*/step == 1);
    EXPECT_EQ(zero.loss_scale(), expected_scaler.scale()) << "step " << step;
    EXPECT_EQ(dp.loss_scale(), expected_scaler.scale()) << "step " << step;
    if (step == 1) {
      EXPECT_TRUE(std::isinf(z.grad_norm));
      size_t i = 0;
      for (const auto& p : zero.model->parameters()) {
        EXPECT_TRUE(bitwise_equal(p, before[i++])) << "a skipped step changed a parameter";
      }
    }
  }
  EXPECT_EQ(zero.loss_scale(), 512.0);
  EXPECT_TRUE(same_on_all_ranks(at::tensor({zero.loss_scale()}, at::kDouble)));
  expect_same_params(zero.model, dp.model, "ZeRO-1 vs plain DP");
}

// BF16 without a dynamic scaler and NonFiniteGrads::kError: every rank raises the same error,
// naming the parameter, though only the rank(s) owning the bad piece see it locally.
TEST(DistributedOptimizer, NonFiniteGradientErrorNamesTheParameterOnEveryRank) {
  const int n = world().size();
  Trainer zero(Trainer::kZero, algorithms()[0].make,
               Float16OptimizerOptions().non_finite_grads(optim::NonFiniteGrads::kError));
  // The NaN comes through backward: a bucket's gradients are taken when it starts, during
  // backward, so writing into .grad afterwards would not reach the reduction.
  at::Tensor poison = at::zeros({5, 7});
  if (world().rank() == n - 1) poison[2][3] = NAN;
  zero.backward(batch(0), poison);
  const std::string message = error_of([&] { zero.update(); });
  EXPECT_NE(message.find("non-finite gradient in parameter 'head.weight'"), std::string::npos)
      << message;
}

// Global-norm clipping: the norm every rank uses is the norm of the concatenated averaged
// gradients. Squares of FP32/BF16 values are exact in FP64; only the order of the FP64 sums
// differs (per piece, then over ranks, against per parameter on one rank), so the relative
// difference is bounded by about (number of terms) x 2^-53 < 1e-12 for these ~400 terms.
TEST(DistributedOptimizer, ClippingUsesTheGlobalNormOfTheConcatenatedGradients) {
  const MakeOptions sgd = algorithms()[2].make;
  const Float16OptimizerOptions mixed = Float16OptimizerOptions().clip_grad(0.05);
  Trainer dp(Trainer::kPlainDp, sgd, mixed), zero(Trainer::kZero, sgd, mixed);
  for (int64_t step = 0; step < 3; ++step) {
    const at::Tensor x = batch(step, world().rank());
    dp.backward(x);
    zero.backward(x);
    dp.reducer->finish();  // the averaged gradients, whole, to compute the reference norm
    std::vector<at::Tensor> flat;
    for (const auto& p : dp.model->parameters()) {
      if (p.requires_grad()) flat.push_back(p.grad().to(at::kDouble).view({-1}));
    }
    const double reference = at::cat(flat).norm().item<double>();
    const optim::StepResult d = dp.update(), z = zero.update();
    EXPECT_GT(reference, 0.05) << "the test needs clipping to be active";
    EXPECT_NEAR(z.grad_norm, reference, 1e-12 * reference) << "step " << step;
    EXPECT_NEAR(d.grad_norm, reference, 1e-12 * reference) << "step " << step;
  }
  // The clip multiplier is rounded to FP32 inside the kernels: the norms' last-bit difference
  // reaches the parameters only if it straddles an FP32 rounding boundary (~1e-8 odds a step).
  expect_same_params(zero.model, dp.model, "ZeRO-1 vs plain DP with clipping");
}

// The upstream interleaved model (BF16 pre, frozen BF16, FP32 gate, BF16 post), shard
// boundaries inside parameters: the state gathered from the shards is, key by key and value by
// value, the state of a Float16Optimizer fed the same averaged gradients (plain DP's), and its
// parameters equal. With power-of-two N that is also the single-process optimizer's.
TEST(DistributedOptimizer, InterleavedModelStateMatchesKeyByKeyAndValueByValue) {
  const int n = world().size();
  at::manual_seed(7);
  Interleaved zero_model;
  at::manual_seed(7);
  Interleaved dp_model;
  const auto reduce = GradReducerOptions().bucket_numel(40).shard_alignment(1);
  GradReducer zero_reducer(world_ptr(), *zero_model,
                           GradReducerOptions(reduce).mode(ReduceMode::kReduceScatter));
  GradReducer dp_reducer(world_ptr(), *dp_model, reduce);
  const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(zero_model->optimizer_order());
  DistributedOptimizer zero(zero_reducer, *zero_model, std::move(groups),
                            std::make_unique<torch::optim::AdamWOptions>(adamw));
  auto reference = make_optimizer(dp_model, adamw);
  if (world().rank() == 0) std::cout << zero.describe();
  bool split_inside_a_param = false;
  for (const auto& s : zero.local_shards()) {
    int64_t numel = 1;
    for (int64_t d : s.shard.global_shape) numel *= d;
    split_inside_a_param |= s.shard.begin > 0 || s.shard.end < numel;
  }
  if (n == 3) EXPECT_TRUE(split_inside_a_param);

  for (int64_t step = 0; step < 3; ++step) {
    at::manual_seed(50 + step);
    const at::Tensor x = at::randn({4, 8});
    zero_reducer.zero_grad();
    dp_reducer.zero_grad();
    zero_model->loss(x).backward();
    dp_model->loss(x).backward();
    zero.update();
    dp_reducer.finish();
    reference->update();
  }

  // Keys: what the sharded state holds for every parameter, from the roles every rank knows.
  const ShardedStateDict expected = reference->sharded_state_dict();
  std::set<std::string> expected_keys, keys;
  for (const auto& [key, tensor] : expected.tensors) {
    if (checkpoint::keys::is_optimizer_key(key)) expected_keys.insert(key);
  }
  namespace keys_ns = checkpoint::keys;
  for (const auto& info : zero.params_info()) {
    if (info.role == ParamRole::kFrozen) continue;
    if (info.role == ParamRole::kMaster)
      keys.insert(keys_ns::optimizer_state_key(keys_ns::kFp32Param, info.fqn));
    keys.insert(keys_ns::optimizer_state_key(keys_ns::kExpAvg, info.fqn));
    keys.insert(keys_ns::optimizer_state_key(keys_ns::kExpAvgSq, info.fqn));
  }
  EXPECT_EQ(keys, expected_keys);

  // Values: each key's tensor assembled from the pieces every rank owns.
  for (const auto& info : zero.params_info()) {
    if (info.role == ParamRole::kFrozen) continue;
    for (std::string_view kind : {keys_ns::kFp32Param, keys_ns::kExpAvg, keys_ns::kExpAvgSq}) {
      if (kind == keys_ns::kFp32Param && info.role != ParamRole::kMaster) continue;
      const std::string key = keys_ns::optimizer_state_key(kind, info.fqn);
      const at::Tensor& whole = expected.at(key).local;
      at::Tensor local = at::zeros({whole.numel()}, at::kFloat);
      int64_t begin = 0, end = 0;
      for (const auto& s : zero.local_shards()) {
        if (s.shard.fqn != info.fqn) continue;
        const at::Tensor& piece = kind == keys_ns::kFp32Param ? s.master : zero.state_of(s, kind);
        local.narrow(0, s.shard.begin, s.shard.numel()).copy_(piece);
        begin = s.shard.begin;
        end = s.shard.end;
      }
      const at::Tensor gathered = gather_pieces(local, begin, end).view(whole.sizes());
      EXPECT_TRUE(bitwise_equal(gathered, whole)) << key;
    }
  }
  auto dp_params = dp_model->named_parameters();
  for (const auto& item : zero_model->named_parameters()) {
    EXPECT_TRUE(bitwise_equal(item.value(), dp_params[item.key()])) << item.key();
  }
}

// Per-rank optimizer state is about 1/N of the single-process state: over all ranks the
// owned bytes add up to exactly the single-process bytes, and no rank holds more than its
// share plus the padding of one alignment granule per bucket.
TEST(DistributedOptimizer, StateBytesPerRankAreAboutOneOverN) {
  const int n = world().size();
  const MakeOptions adamw = algorithms()[0].make;
  const auto reduce = GradReducerOptions().bucket_numel(128).shard_alignment(16);
  Trainer dp(Trainer::kPlainDp, adamw, {}, at::kBFloat16, reduce),
      zero(Trainer::kZero, adamw, {}, at::kBFloat16, reduce);
  dp.backward(batch(0));
  zero.backward(batch(0));
  dp.update();
  zero.update();
  auto& f16 = static_cast<Float16Optimizer&>(*dp.optimizer);
  auto& z = static_cast<DistributedOptimizer&>(*zero.optimizer);
  const int64_t single =
      f16.state_bytes(ParamRole::kMaster) + f16.state_bytes(ParamRole::kNativeFp32);
  const int64_t mine = z.state_bytes(ParamRole::kMaster) + z.state_bytes(ParamRole::kNativeFp32);
  at::Tensor total = at::tensor({mine}, at::kLong);
  world().all_reduce_sum(total).wait();
  EXPECT_EQ(total.item<int64_t>(), single);
  const int64_t buckets = static_cast<int64_t>(zero.reducer->layout().bucket_order.size());
  // A rank's shard of a bucket exceeds 1/N of the bucket's data by at most the alignment.
  const int64_t bound = single / n + buckets * 16 * 12;  // 12 bytes: master + 2 moments
  EXPECT_LE(mine, bound) << "rank " << world().rank() << " holds " << mine << " of " << single;
  EXPECT_EQ(z.state_bytes(ParamRole::kFrozen), 0);
}

TEST(DistributedOptimizer, RefusesAnAllReduceReducer) {
  MixedNet model;
  GradReducer reducer(world_ptr(), *model);
  const std::string message = error_of(
      [&] { DistributedOptimizer opt(reducer, *model, torch::optim::AdamWOptions(1e-3)); });
  EXPECT_NE(message.find("ReduceMode::kReduceScatter"), std::string::npos) << message;
}

// The reducer must serve the optimizer's model: another model's parameters would have no piece
// on any rank and never be stepped.
TEST(DistributedOptimizer, RefusesAModelItsReducerDoesNotServe) {
  MixedNet model, other;
  GradReducer reducer(world_ptr(), *model, GradReducerOptions().mode(ReduceMode::kReduceScatter));
  const std::string message = error_of(
      [&] { DistributedOptimizer opt(reducer, *other, torch::optim::AdamWOptions(1e-3)); });
  EXPECT_NE(message.find("is not a parameter of the GradReducer's model"), std::string::npos)
      << message;
}

// Frozen parameters of a dtype the reducer does not reduce (an FP8 primary weight, an FP64
// table) are only broadcast: they belong to the model it serves, as they do to a
// Float16Optimizer, which leaves them alone; so does the distributed one.
TEST(DistributedOptimizer, TakesFrozenParametersOfDtypesTheReducerOnlyBroadcasts) {
  MixedNet model;
  const at::Tensor fp64 =
      model->register_parameter("table", at::linspace(0, 1, 3, at::kDouble), false);
  const at::Tensor fp8 = model->register_parameter(
      "fp8_weight", at::linspace(-1, 1, 4, at::kFloat).to(at::kFloat8_e4m3fn), false);
  const at::Tensor fp64_before = fp64.clone(), fp8_before = fp8.to(at::kFloat);
  GradReducer reducer(world_ptr(), *model, GradReducerOptions().mode(ReduceMode::kReduceScatter));
  DistributedOptimizer opt(reducer, *model, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  const at::Tensor fc1_before = model->fc1->weight.clone();
  opt.zero_grad();
  model->loss(batch(0)).backward();
  opt.step();
  EXPECT_FALSE(at::equal(model->fc1->weight, fc1_before)) << "the trainable ones are stepped";
  EXPECT_TRUE(at::equal(fp64, fp64_before));
  EXPECT_TRUE(at::equal(fp8.to(at::kFloat), fp8_before));
}

// local_shards() lists the trainable parameters' pieces only (a frozen one has no optimizer
// state), and piece_of(fqn) is this rank's piece of each, empty for a name it does not hold.
TEST(DistributedOptimizer, LocalShardsAndPiecesAreThisRanksTrainablePieces) {
  Trainer zero(Trainer::kZero, algorithms()[0].make);
  auto& z = static_cast<DistributedOptimizer&>(*zero.optimizer);
  zero.backward(batch(0));
  zero.update();
  for (const auto& s : z.local_shards()) {
    EXPECT_NE(s.role, ParamRole::kFrozen) << s.shard.fqn;
    EXPECT_EQ(s.shard.fqn.rfind("frozen.", 0), std::string::npos) << s.shard.fqn;
    EXPECT_EQ(z.piece_of(s.shard.fqn), (FlatRange{s.shard.begin, s.shard.end})) << s.shard.fqn;
  }
  for (const auto& piece : zero.reducer->layout().param_shards(world().rank())) {
    EXPECT_EQ(z.piece_of(piece.fqn), (FlatRange{piece.begin, piece.end})) << piece.fqn;
  }
  EXPECT_EQ(z.piece_of("no.such.parameter").numel(), 0);
  const size_t held = z.params_info().size();
  const std::string message = error_of([&] { z.param_step(held); });
  EXPECT_NE(message.find("::param_step] index " + std::to_string(held) +
                         " is not a parameter: the optimizer holds " + std::to_string(held)),
            std::string::npos)
      << message;
}

// A parameter given another dtype after construction (set_data) is an error naming it, on every
// rank, before anything changes: the reducer's buffers are per dtype, and it is not cast back.
TEST(DistributedOptimizer, ADtypeChangedAfterConstructionIsAnErrorNamingTheParameter) {
  Trainer zero(Trainer::kZero, algorithms()[0].make);
  at::Tensor& w = zero.model->fc2->weight;
  w.set_data(w.detach().to(at::kFloat));
  const std::string message = error_of([&] { zero.update(); });
  EXPECT_NE(message.find("'fc2.weight' changed dtype from BFloat16 to Float"), std::string::npos)
      << message;
  EXPECT_EQ(w.scalar_type(), at::kFloat);
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::testing
