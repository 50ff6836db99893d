// ZeRO-1 follows its model as Float16Optimizer does, in real processes: parameters frozen or
// unfrozen after construction, groups added, weights loaded after construction, ranks seeded
// differently, tied weights, an expert that gets no gradient, FP32 gradient accumulation, a
// failed collective, and a steady-state step that allocates nothing.
#include "distributed/mp/mp_support.h"
#include "mixprec/distributed/distributed_optimizer.h"
#include "mixprec/distributed/grad_reducer.h"
#include "optim/support_optim.h"
#include "support/counting_allocator.h"
#include "support/error_message.h"

#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>

#include <filesystem>

namespace mixprec::testing {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using distributed::DistributedOptimizer;
using distributed::GradReducer;
using distributed::GradReducerOptions;
using distributed::ReduceMode;
using optim::Float16Optimizer;

// A transformer-like toy: BF16 linears, an FP32 norm, a frozen linear, an expert the data can
// leave unused, an FP32 buffer, and an embedding tied to the output head.
struct ToyImpl : torch::nn::Module {
  explicit ToyImpl(uint64_t seed = 7) {
    at::manual_seed(seed);
    embed = register_parameter("embed", at::randn({11, 8}) * 0.3);
    up = register_module("up", torch::nn::Linear(8, 16));
    down = register_module("down", torch::nn::Linear(16, 8));
    expert = register_module("expert", torch::nn::Linear(8, 8));
    frozen = register_module("frozen", torch::nn::Linear(8, 8));
    frozen->weight.set_requires_grad(false);
    frozen->bias.set_requires_grad(false);
    norm = register_parameter("norm", keep_in_fp32(at::ones({8}) + at::randn({8}) * 0.1));
    register_parameter("head", embed);  // tied: one tensor under two names
    stat = register_buffer("stat", at::randn({3}));
    convert_module_to_dtype_except_fp32_marked(*this, at::kBFloat16);
  }
  at::Tensor loss(const at::Tensor& x, bool use_expert = true) {
    at::Tensor h = down(at::relu(up(x.to(at::kBFloat16))));
    h = (h.to(at::kFloat) * norm).to(at::kBFloat16);
    if (use_expert) h = h + expert(h);
    h = frozen(h);
    const at::Tensor logits = at::matmul(h, embed.t());
    return logits.to(at::kFloat).pow(2).mean();
  }
  torch::nn::Linear up{nullptr}, down{nullptr}, expert{nullptr}, frozen{nullptr};
  at::Tensor embed, norm, stat;
};
TORCH_MODULE(Toy);

at::Tensor toy_batch(int64_t step) {
  at::manual_seed(100 + step);  // the same on every rank: N ranks average N equal gradients
  return at::randn({6, 8});
}

torch::optim::AdamWOptions adamw() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.1); }

// ZeRO-1 on every rank beside a single-process Float16Optimizer on the same data: with equal
// gradients on every rank the average is each rank's gradient exactly (FP32 sums of N equal
// BF16 values, N <= 4), so the two step bitwise alike. With a kAllReduce reducer, plain data
// parallelism instead: a Float16Optimizer per rank on the reduced .grad.
struct Pair {
  Toy zero_model, single_model;
  std::unique_ptr<GradReducer> reducer;
  std::unique_ptr<Float16Optimizer> zero;
  std::unique_ptr<Float16Optimizer> single;
  // Clear gradients with the optimizers' own (torch's) zero_grad(), which sets .grad to none,
  // instead of GradReducer::zero_grad().
  bool torch_zero_grad = false;

  explicit Pair(
      GradReducerOptions options = GradReducerOptions().mode(ReduceMode::kReduceScatter)) {
    reducer = std::make_unique<GradReducer>(world_ptr(), *zero_model,
                                            options.bucket_numel(64).shard_alignment(4));
    if (options.mode() == ReduceMode::kReduceScatter) {
      zero = std::make_unique<DistributedOptimizer>(*reducer, *zero_model, adamw());
    } else {
      zero = std::make_unique<Float16Optimizer>(*zero_model, adamw());
    }
    single = std::make_unique<Float16Optimizer>(*single_model, adamw());
  }
  DistributedOptimizer& zero1() { return dynamic_cast<DistributedOptimizer&>(*zero); }
  void step(int64_t step, bool use_expert = true) {
    if (torch_zero_grad) {
      zero->zero_grad();
    } else {
      reducer->zero_grad();
    }
    zero_model->loss(toy_batch(step), use_expert).backward();
    if (!dynamic_cast<DistributedOptimizer*>(zero.get())) reducer->finish();
    zero->update();
    single->zero_grad();
    single_model->loss(toy_batch(step), use_expert).backward();
    single->update();
  }
  void expect_same(const std::string& what) {
    auto theirs = single_model->named_parameters();
    for (const auto& item : zero_model->named_parameters()) {
      EXPECT_TRUE(bitwise_equal(item.value(), theirs[item.key()])) << what << ": " << item.key();
      EXPECT_TRUE(same_on_all_ranks(item.value())) << what << ": " << item.key();
    }
  }
};

// Both data-parallel modes, each with both ways of clearing gradients.
struct FollowCase {
  ReduceMode mode;
  bool torch_zero_grad;
  std::string name() const {
    return std::string(mode == ReduceMode::kReduceScatter ? "ZeRO-1" : "plain data parallel") +
           (torch_zero_grad ? ", torch's zero_grad()" : ", the reducer's zero_grad()");
  }
};
const std::vector<FollowCase> kFollowCases = {{ReduceMode::kReduceScatter, false},
                                              {ReduceMode::kReduceScatter, true},
                                              {ReduceMode::kAllReduce, false},
                                              {ReduceMode::kAllReduce, true}};

TEST(ZeroFollowsModel, FrozenAfterConstructionIsNotStepped) {
  Pair pair;
  pair.step(0);
  for (Toy* model : {&pair.zero_model, &pair.single_model}) {
    (*model)->down->weight.set_requires_grad(false);
    (*model)->down->bias.set_requires_grad(false);
  }
  const at::Tensor before = pair.zero_model->down->weight.clone();
  for (int64_t s = 1; s < 4; ++s) pair.step(s);
  // Weight decay and momentum would have moved it at every step.
  EXPECT_TRUE(bitwise_equal(pair.zero_model->down->weight, before));
  pair.expect_same("frozen after construction");
}

TEST(ZeroFollowsModel, UnfrozenAfterConstructionIsStepped) {
  Pair pair;
  pair.step(0);
  const at::Tensor before = pair.zero_model->frozen->weight.clone();
  for (Toy* model : {&pair.zero_model, &pair.single_model}) {
    (*model)->frozen->weight.set_requires_grad(true);
  }
  for (int64_t s = 1; s < 4; ++s) pair.step(s);
  EXPECT_FALSE(bitwise_equal(pair.zero_model->frozen->weight, before));
  pair.expect_same("unfrozen after construction");
}

TEST(ZeroFollowsModel, AddedGroupIsSteppedAndTorchsAddParamGroupRefused) {
  Toy zero_model, single_model;
  GradReducer reducer(world_ptr(), *zero_model,
                      GradReducerOptions().mode(ReduceMode::kReduceScatter).bucket_numel(64));
  auto groups_without_up = [](Toy& m) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>{m->embed, m->down->weight, m->down->bias,
                                                m->expert->weight, m->expert->bias, m->norm});
    return groups;
  };
  DistributedOptimizer zero(reducer, *zero_model, groups_without_up(zero_model),
                            std::make_unique<torch::optim::AdamWOptions>(adamw()));
  Float16Optimizer single(*single_model, groups_without_up(single_model),
                          std::make_unique<torch::optim::AdamWOptions>(adamw()));
  auto step = [&](int64_t s) {
    reducer.zero_grad();
    zero_model->loss(toy_batch(s)).backward();
    zero.update();
    single.zero_grad();
    single_model->loss(toy_batch(s)).backward();
    single.update();
  };
  step(0);
  const at::Tensor before = zero_model->up->weight.clone();
  zero.add_param_group(
      torch::optim::OptimizerParamGroup({zero_model->up->weight, zero_model->up->bias},
                                        std::make_unique<torch::optim::AdamWOptions>(adamw())));
  single.add_param_group(
      torch::optim::OptimizerParamGroup({single_model->up->weight, single_model->up->bias},
                                        std::make_unique<torch::optim::AdamWOptions>(adamw())));
  for (int64_t s = 1; s < 3; ++s) step(s);
  EXPECT_FALSE(bitwise_equal(zero_model->up->weight, before));
  EXPECT_TRUE(bitwise_equal(zero_model->up->weight, single_model->up->weight));
  EXPECT_TRUE(same_on_all_ranks(zero_model->up->weight));

  // torch's add_param_group is not virtual: through the base class it bypasses the optimizer,
  // which refuses to go on rather than never stepping the group.
  static_cast<torch::optim::Optimizer&>(zero).add_param_group(torch::optim::OptimizerParamGroup(
      {zero_model->frozen->weight}, std::make_unique<torch::optim::AdamWOptions>(adamw())));
  reducer.zero_grad();
  zero_model->loss(toy_batch(3)).backward();
  const std::string message = error_of([&] { zero.update(); });
  EXPECT_NE(message.find("param groups changed outside the optimizer"), std::string::npos)
      << message;
  reducer.finish();  // every rank leaves the step in the same place
}

// Weights written after construction, three ways, are what the next step starts from (an
// lr = 0 step keeps them exactly), on every rank.
TEST(ZeroFollowsModel, WeightsLoadedAfterConstructionAreKept) {
  Toy model, other(/*seed=*/99);
  GradReducer reducer(world_ptr(), *model,
                      GradReducerOptions().mode(ReduceMode::kReduceScatter).bucket_numel(64));
  DistributedOptimizer zero(reducer, *model, adamw());
  auto step = [&](int64_t s, double lr) {
    for (auto& group : zero.param_groups()) group.options().set_lr(lr);
    reducer.zero_grad();
    model->loss(toy_batch(s)).backward();
    // finish() before update(), as mixprec-train does: the reseat update() makes of a loaded
    // parameter is no new step to the finish() inside it.
    reducer.finish();
    zero.update();
  };
  step(0, 1e-2);
  const auto expect_params_are = [&](const std::string& what) {
    auto loaded = other->named_parameters();
    for (const auto& item : model->named_parameters()) {
      EXPECT_TRUE(bitwise_equal(item.value(), loaded[item.key()])) << what << ": " << item.key();
      EXPECT_TRUE(same_on_all_ranks(item.value())) << what << ": " << item.key();
    }
  };
  {  // copy_, as a model-only checkpoint load does
    at::NoGradGuard no_grad;
    auto loaded = other->named_parameters();
    for (auto& item : model->named_parameters()) item.value().copy_(loaded[item.key()]);
  }
  step(1, 0.0);
  expect_params_are("copy_");

  Toy third(/*seed=*/5);  // set_data: the parameter's storage replaced
  {
    auto values = third->named_parameters();
    for (auto& item : model->named_parameters()) item.value().set_data(values[item.key()].clone());
    for (auto& item : other->named_parameters()) item.value().set_data(values[item.key()].clone());
  }
  step(2, 0.0);
  expect_params_are("set_data");

  // torch::load(model): InputArchive::read uses Tensor::set_.
  const std::string file = ::testing::TempDir() + "/toy-" + std::to_string(world().rank()) + ".pt";
  Toy fourth(/*seed=*/11);
  torch::save(fourth, file);
  torch::load(model, file);
  torch::load(other, file);
  step(3, 0.0);
  expect_params_are("torch::load");
  std::filesystem::remove(file);
  // And training goes on from them.
  const at::Tensor loaded = model->up->weight.clone();
  step(4, 1e-2);
  EXPECT_FALSE(bitwise_equal(model->up->weight, loaded));
  EXPECT_TRUE(same_on_all_ranks(model->up->weight));
}

TEST(ZeroFollowsModel, RanksSeededDifferentlyStartFromRankZerosWeights) {
  const int rank = world().rank();
  Toy mine(/*seed=*/1000 + rank), rank_zero(/*seed=*/1000);
  GradReducer reducer(world_ptr(), *mine, GradReducerOptions().mode(ReduceMode::kReduceScatter));
  auto expected = rank_zero->named_parameters();
  for (const auto& item : mine->named_parameters()) {
    EXPECT_TRUE(bitwise_equal(item.value(), expected[item.key()])) << item.key();
  }
  auto expected_buffers = rank_zero->named_buffers();
  for (const auto& item : mine->named_buffers()) {
    EXPECT_TRUE(bitwise_equal(item.value(), expected_buffers[item.key()])) << item.key();
  }

  // Without the broadcast, weights that differ are an error naming the first of them.
  Toy apart(/*seed=*/2000 + rank);
  const std::string message = error_of([&] {
    GradReducer unchecked(world_ptr(), *apart, GradReducerOptions().broadcast_from_rank0(false));
  });
  if (world().size() > 1) {
    EXPECT_NE(message.find("the ranks start from different weights: 'embed' holds other values "
                           "on rank 1 than on rank 0"),
              std::string::npos)
        << message;
  } else {
    EXPECT_EQ(message, "");
  }
}

TEST(ZeroFollowsModel, TiedWeightsThroughTheConvenienceConstructor) {
  Pair pair;  // the convenience constructor: one group with every parameter
  std::vector<std::string> names;
  for (const auto& info : pair.zero->params_info()) names.push_back(info.fqn);
  EXPECT_EQ(std::count(names.begin(), names.end(), "embed"), 1);
  EXPECT_EQ(std::count(names.begin(), names.end(), "head"), 0);  // the same tensor as embed
  for (int64_t s = 0; s < 3; ++s) pair.step(s);
  pair.expect_same("tied embedding and head");
}

// An expert no rank routes a token to has no gradient anywhere: not stepped, its step count
// stays, as in one process. One used on some rank only is stepped everywhere.
TEST(ZeroFollowsModel, ExpertWithoutGradientIsNotSteppedAsInOneProcess) {
  Pair pair;
  pair.step(0, /*use_expert=*/false);
  pair.step(1, /*use_expert=*/false);
  const auto& info = pair.zero->params_info();
  size_t expert_weight = info.size();
  for (size_t k = 0; k < info.size(); ++k) {
    if (info[k].fqn == "expert.weight") expert_weight = k;
  }
  ASSERT_LT(expert_weight, info.size());
  EXPECT_EQ(pair.zero1().param_step(expert_weight), 0);
  EXPECT_EQ(pair.zero1().param_step(0), 2);
  const int n = world().size();
  if ((n & (n - 1)) == 0) pair.expect_same("expert without gradient");

  // Used on rank 0 only: the average is rank 0's gradient / N, and every rank steps it.
  pair.reducer->zero_grad();
  pair.zero_model->loss(toy_batch(2), /*use_expert=*/world().rank() == 0).backward();
  const at::Tensor before = pair.zero_model->expert->weight.clone();
  pair.zero->update();
  EXPECT_EQ(pair.zero1().param_step(expert_weight), 1);
  EXPECT_FALSE(bitwise_equal(pair.zero_model->expert->weight, before));
  EXPECT_TRUE(same_on_all_ranks(pair.zero_model->expert->weight));
}

// Megatron's main_grad: four micro-batches accumulate in FP32, exactly the FP32 sum of their
// BF16 gradients, instead of rounding to BF16 after each one.
TEST(ZeroFollowsModel, Fp32MainGradAccumulatesMicroBatchesExactly) {
  // create_graph makes autograd replace .grad instead of adding in place: the same sums.
  for (const bool create_graph : {false, true}) {
    SCOPED_TRACE(create_graph ? "create_graph" : "in place");
    Toy model, reference;
    GradReducer reducer(
        world_ptr(), *model,
        GradReducerOptions().mode(ReduceMode::kReduceScatter).accumulate_in_fp32(true));
    std::map<std::string, at::Tensor> sums;
    reducer.zero_grad();
    {
      GradReducer::NoSyncGuard accumulate(reducer);
      for (int64_t m = 0; m < 4; ++m) {
        model->loss(toy_batch(m)).backward({}, /*retain_graph=*/create_graph, create_graph);
        for (auto& item : reference->named_parameters()) item.value().mutable_grad() = at::Tensor();
        reference->loss(toy_batch(m)).backward();
        for (const auto& item : reference->named_parameters()) {
          if (!item.value().grad().defined()) continue;
          const at::Tensor g = item.value().grad().to(at::kFloat);
          sums[item.key()] = sums.count(item.key()) ? sums[item.key()] + g : g;
        }
      }
    }
    int checked = 0;
    for (const auto& item : model->named_parameters()) {
      const size_t i = reducer.index_of(item.value());
      if (item.value().scalar_type() != at::kBFloat16 || !sums.count(item.key())) continue;
      const at::Tensor main_grad = reducer.main_grad(i);
      ASSERT_TRUE(main_grad.defined()) << item.key();
      EXPECT_TRUE(bitwise_equal(main_grad, sums[item.key()])) << item.key();
      // The BF16 sum the .grad would otherwise hold lost bits on the way.
      ++checked;
    }
    EXPECT_GT(checked, 3);
    reducer.finish();  // the average over ranks of those FP32 sums
  }
}

// A collective that fails leaves the group unusable: every later call says why, none hangs.
TEST(ZeroFollowsModel, FailedCollectiveMakesEveryLaterCallAnError) {
  const int n = world().size(), rank = world().rank();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  auto group = own_group("failed-collective", std::chrono::seconds(3));
  Toy model;
  GradReducer reducer(group, *model, GradReducerOptions().mode(ReduceMode::kReduceScatter));
  DistributedOptimizer zero(reducer, *model, adamw());
  reducer.zero_grad();
  model->loss(toy_batch(0)).backward();
  if (rank == 0) {
    // Rank 0 alone steps: its collectives find no peer and time out.
    const std::string first = error_of([&] { zero.update(); });
    EXPECT_NE(first.find("failed on rank 0"), std::string::npos) << first;
    for (const auto& [what, call] : std::vector<std::pair<std::string, std::function<void()>>>{
             {"zero_grad", [&] { reducer.zero_grad(); }},
             {"finish", [&] { reducer.finish(); }},
             {"update", [&] { zero.update(); }},
             {"start_param_gather", [&] { reducer.start_param_gather(); }},
             // A backward's hooks too, before touching buffers the backend may still write.
             {"backward", [&] { model->loss(toy_batch(1)).backward(); }},
             {"a new optimizer", [&] { DistributedOptimizer again(reducer, *model, adamw()); }},
             {"all_reduce", [&] { group->all_reduce_sum(at::zeros({1})).wait(); }}}) {
      const std::string message = error_of(call);
      EXPECT_NE(message.find("the process group is unusable: an earlier collective failed"),
                std::string::npos)
          << what << ": " << message;
    }
  }
  world().barrier();
}

// Which parameters have a gradient is what one process would say, in both modes and however
// gradients are cleared: an expert no rank uses and a parameter frozen after construction are
// not stepped (weight decay would move them), a .grad set without backward is stepped.
TEST(ZeroFollowsModel, GradientsOnlyWhereOneProcessHasThemInBothModes) {
  const int n = world().size();
  if (n & (n - 1)) GTEST_SKIP() << "N = " << n << " is not a power of two";
  for (const FollowCase& c : kFollowCases) {
    SCOPED_TRACE(c.name());
    Pair pair(GradReducerOptions().mode(c.mode));
    pair.torch_zero_grad = c.torch_zero_grad;
    pair.step(0);
    for (Toy* model : {&pair.zero_model, &pair.single_model}) {
      (*model)->down->weight.set_requires_grad(false);
      (*model)->down->bias.set_requires_grad(false);
    }
    const at::Tensor down = pair.zero_model->down->weight.clone();
    const at::Tensor expert = pair.zero_model->expert->weight.clone();
    pair.step(1, /*use_expert=*/false);
    pair.step(2, /*use_expert=*/false);
    EXPECT_TRUE(bitwise_equal(pair.zero_model->down->weight, down));
    EXPECT_TRUE(bitwise_equal(pair.zero_model->expert->weight, expert));
    pair.expect_same("unused and frozen");

    // The expert's .grad set from outside, no backward through it: stepped, as in one process.
    for (Float16Optimizer* o : {pair.zero.get(), pair.single.get()}) o->zero_grad();
    if (!c.torch_zero_grad) pair.reducer->zero_grad();
    for (Toy* model : {&pair.zero_model, &pair.single_model}) {
      (*model)->loss(toy_batch(3), /*use_expert=*/false).backward();
      (*model)->expert->weight.mutable_grad() = at::full_like((*model)->expert->weight, 0.5);
    }
    if (c.mode == ReduceMode::kAllReduce) pair.reducer->finish();
    pair.zero->update();
    pair.single->update();
    EXPECT_FALSE(bitwise_equal(pair.zero_model->expert->weight, expert));
    pair.expect_same(".grad set from outside");
  }
}

// Plain data parallelism with FP32 accumulation: the optimizer reads .grad, which holds the FP32
// average rounded once; a backward after finish() without zero_grad() carries on from it.
TEST(ZeroFollowsModel, PlainDataParallelWithFp32AccumulationStepsOnTheAverage) {
  const int n = world().size();
  if (n & (n - 1)) GTEST_SKIP() << "N = " << n << " is not a power of two";
  Pair pair(GradReducerOptions().mode(ReduceMode::kAllReduce).accumulate_in_fp32(true));
  for (int64_t s = 0; s < 3; ++s) pair.step(s);
  pair.expect_same("three steps");
  // Two backwards, finish() between them, no zero_grad(): both sides hold g3 + g4 in BF16.
  pair.zero->zero_grad();
  pair.reducer->zero_grad();
  pair.single->zero_grad();
  pair.zero_model->loss(toy_batch(3)).backward();
  pair.reducer->finish();
  pair.zero_model->loss(toy_batch(4)).backward();
  pair.reducer->finish();
  for (int64_t s : {3, 4}) pair.single_model->loss(toy_batch(s)).backward();
  auto theirs = pair.single_model->named_parameters();
  for (const auto& item : pair.zero_model->named_parameters()) {
    if (!item.value().requires_grad()) continue;
    EXPECT_TRUE(bitwise_equal(item.value().grad(), theirs[item.key()].grad())) << item.key();
  }
}

// A steady-state step of reducer and optimizer allocates no tensor memory: zero_grad() and
// update() (reduction, agreement, step, parameter gather) none at all, and backward with the
// reducer's hooks exactly what the same backward allocates without them.
TEST(ZeroFollowsModel, SteadyStateStepAllocatesNothing) {
  for (const bool fp32_accumulation : {false, true}) {
    for (const bool overlap_gather : {false, true}) {
      SCOPED_TRACE(std::string(fp32_accumulation ? "main_grad" : "bf16 grads") +
                   (overlap_gather ? ", gather overlapped" : ", gather waited"));
      Toy model, plain;
      GradReducer reducer(world_ptr(), *model,
                          GradReducerOptions()
                              .mode(ReduceMode::kReduceScatter)
                              .bucket_numel(64)
                              .accumulate_in_fp32(fp32_accumulation)
                              .overlap_param_gather(overlap_gather));
      DistributedOptimizer zero(reducer, *model, adamw());
      for (auto& p : plain->parameters()) {
        if (p.requires_grad()) p.mutable_grad() = at::zeros_like(p);
      }
      const at::Tensor x = toy_batch(0);
      CountingAllocatorGuard counting;
      int64_t ours = 0, backward_with = 0, backward_without = 0;
      for (int64_t s = 0; s < 5; ++s) {
        const bool measured = s >= 3;  // after the first steps made state and agreed orders
        int64_t mark = counting.allocations();
        reducer.zero_grad();
        if (measured) ours += counting.allocations() - mark;
        if (overlap_gather) reducer.wait_for_params(*model);
        mark = counting.allocations();
        model->loss(x).backward();
        if (measured) backward_with += counting.allocations() - mark;
        mark = counting.allocations();
        reducer.finish();
        const int64_t in_finish = counting.allocations() - mark;
        mark = counting.allocations();
        zero.update();
        if (measured) ours += counting.allocations() - mark + in_finish;
        for (auto& p : plain->parameters()) {
          if (p.grad().defined()) p.mutable_grad().zero_();
        }
        mark = counting.allocations();
        plain->loss(x).backward();
        if (measured) backward_without += counting.allocations() - mark;
      }
      reducer.wait_param_gather();
      EXPECT_EQ(ours, 0);
      EXPECT_EQ(backward_with, backward_without);
    }
  }
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::testing
