// ZeRO-1 with offloading (optim/offload.h): each rank steps its own pieces on the host through
// the chunked pipeline. Bitwise the same as ZeRO-1 without offloading (and, for power-of-two
// N, as the offloaded single-process Float16Optimizer), in real processes.
#include "distributed/mp/mp_support.h"
#include "distributed/mp/zero_support.h"
#include "mixprec/distributed/distributed_optimizer.h"
#include "optim/support_optim.h"
#include "support/error_message.h"

#include <gtest/gtest.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>

namespace mixprec::testing {
namespace MIXPREC_UNITY_ID {  // anonymous outside unity builds (tests/CMakeLists.txt)

using distributed::DistributedOptimizer;
using distributed::GradReducer;
using distributed::GradReducerOptions;
using distributed::ReduceMode;
using optim::Float16Optimizer;
using optim::Float16OptimizerOptions;
using optim::OffloadOptions;
using optim::ParamRole;

std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> offload_algorithms() {
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> out;
  out.push_back(std::make_unique<torch::optim::AdamWOptions>(
      torch::optim::AdamWOptions(2e-2).weight_decay(0.1)));
  out.push_back(std::make_unique<torch::optim::AdamOptions>(
      torch::optim::AdamOptions(1e-2).weight_decay(0.05).amsgrad(true)));
  out.push_back(std::make_unique<torch::optim::SGDOptions>(
      torch::optim::SGDOptions(5e-2).momentum(0.9).dampening(0.1).weight_decay(0.01)));
  return out;
}

// A model and ZeRO-1 (or, with `single`, one Float16Optimizer) over it.
struct OffloadTrainer {
  MixedNet model;
  std::unique_ptr<GradReducer> reducer;
  std::unique_ptr<torch::optim::Optimizer> optimizer;

  OffloadTrainer(bool single, const torch::optim::OptimizerOptions& algo,
                 Float16OptimizerOptions mixed, at::ScalarType half)
      : model(half) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(model->parameters());
    if (single) {
      optimizer =
          std::make_unique<Float16Optimizer>(*model, std::move(groups), algo.clone(), mixed);
      return;
    }
    reducer = std::make_unique<GradReducer>(
        world_ptr(), *model,
        GradReducerOptions().bucket_numel(64).shard_alignment(4).mode(ReduceMode::kReduceScatter));
    optimizer = std::make_unique<DistributedOptimizer>(*reducer, *model, std::move(groups),
                                                       algo.clone(), mixed);
  }
  double loss_scale() const {
    return reducer ? static_cast<DistributedOptimizer&>(*optimizer).loss_scale()
                   : static_cast<Float16Optimizer&>(*optimizer).loss_scale();
  }
  optim::StepResult step(const at::Tensor& x) {
    if (reducer) {
      reducer->zero_grad();
    } else {
      optimizer->zero_grad();
    }
    (model->loss(x) * loss_scale()).backward();
    if (reducer) return static_cast<DistributedOptimizer&>(*optimizer).update();
    return static_cast<Float16Optimizer&>(*optimizer).update();
  }
};

TEST(DistributedOptimizer, OffloadedShardsStepBitwiseAsWithoutOffloading) {
  const int n = world().size();
  // The offloaded step runs on the host. With the model there too, that is the arithmetic of
  // the plain step, bit for bit; with the model on a GPU (scripts/gpu-check.sh) the plain step
  // runs on the GPU, which rounds differently, so the two are only close, and the bitwise
  // reference is the offloaded single process (the same host arithmetic on the same gradients).
  const bool same_processor = test_device().is_cpu();
  for (at::ScalarType half : {at::kBFloat16, at::kHalf}) {
    for (const auto& algo : offload_algorithms()) {
      for (int64_t chunk_bytes : {int64_t{256}, int64_t{1} << 20}) {
        SCOPED_TRACE(std::string(c10::toString(half)) + " chunk " + std::to_string(chunk_bytes));
        Float16OptimizerOptions plain_options;
        plain_options.clip_grad(0.5);
        if (half == at::kHalf) {
          plain_options.loss_scaler(optim::LossScalerOptions::fp16_dynamic().initial_scale(512));
        }
        Float16OptimizerOptions offload_options = plain_options;
        offload_options.offload(OffloadOptions().chunk_bytes(chunk_bytes).chunks_in_flight(2));
        OffloadTrainer zero(false, *algo, plain_options, half),
            offloaded(false, *algo, offload_options, half),
            single(true, *algo, offload_options, half);
        for (int64_t step = 0; step < 4; ++step) {
          const at::Tensor x = batch(step);
          const optim::StepResult z = zero.step(x), o = offloaded.step(x);
          single.step(x);
          EXPECT_EQ(z.success, o.success);
          // (Equal also covers the infinite norm of a skipped FP16 step.)
          EXPECT_TRUE(z.grad_norm == o.grad_norm ||
                      (!same_processor &&
                       std::abs(z.grad_norm - o.grad_norm) <= 1e-6 * std::abs(z.grad_norm)))
              << z.grad_norm << " vs " << o.grad_norm;
        }
        expect_params_equal(*offloaded.model, *zero.model, "offloaded vs plain ZeRO-1",
                            same_processor);
        if ((n & (n - 1)) == 0) {
          expect_params_equal(*offloaded.model, *single.model, "vs offloaded single process");
        }
        auto& z = static_cast<DistributedOptimizer&>(*zero.optimizer);
        auto& o = static_cast<DistributedOptimizer&>(*offloaded.optimizer);
        EXPECT_EQ(o.state_bytes(ParamRole::kMaster), z.state_bytes(ParamRole::kMaster));
        EXPECT_EQ(o.state_bytes(ParamRole::kNativeFp32), z.state_bytes(ParamRole::kNativeFp32));
        const auto o_shards = o.local_shards(), z_shards = z.local_shards();
        ASSERT_EQ(o_shards.size(), z_shards.size());
        for (size_t i = 0; i < o_shards.size(); ++i) {
          const auto& a = o_shards[i];
          const auto& b = z_shards[i];
          EXPECT_TRUE(equal_or_close(a.master.defined() ? a.master : a.param,
                                     b.master.defined() ? b.master : b.param, same_processor))
              << a.shard.fqn;
          ASSERT_EQ(a.state.size(), b.state.size());
          for (size_t k = 0; k < a.state.size(); ++k) {
            EXPECT_EQ(a.state[k].defined(), b.state[k].defined()) << a.shard.fqn;
            if (a.state[k].defined()) {
              EXPECT_TRUE(equal_or_close(a.state[k], b.state[k], same_processor)) << a.shard.fqn;
            }
          }
        }
        if (chunk_bytes == 256 && !o.local_shards().empty()) {
          EXPECT_GT(o.offload_stats().chunks, 1);
        }
      }
    }
  }
}

TEST(DistributedOptimizer, RefusesMasterRemainders) {
  MixedNet model;
  GradReducer reducer(world_ptr(), *model, GradReducerOptions().mode(ReduceMode::kReduceScatter));
  const std::string message = error_of([&] {
    DistributedOptimizer opt(reducer, *model, torch::optim::AdamWOptions(1e-3),
                             Float16OptimizerOptions().master_remainders(true));
  });
  EXPECT_NE(message.find("master_remainders is not supported"), std::string::npos) << message;
}

}  // namespace MIXPREC_UNITY_ID
}  // namespace mixprec::testing
