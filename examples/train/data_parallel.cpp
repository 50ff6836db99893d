#include "data_parallel.h"

#include "optimizer.h"

#include "mixprec/distributed/collective_checkpoint.h"
#include "mixprec/distributed/distributed_optimizer.h"
#include "mixprec/distributed/grad_reducer.h"
#include "mixprec/distributed/init.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

namespace train {
namespace {

using mixprec::optim::ParamRole;

class DataParallelOptimizer final : public TrainingOptimizer {
 public:
  DataParallelOptimizer(torch::nn::Module& model, const TrainConfig& config,
                        const Precision& precision,
                        std::shared_ptr<mixprec::distributed::Communicator> ranks)
      : model_(model),
        reducer_(std::move(ranks), model,
                 mixprec::distributed::GradReducerOptions().mode(
                     mixprec::distributed::ReduceMode::kReduceScatter)),
        optimizer_(reducer_, model, adamw_groups(model, config),
                   std::make_unique<torch::optim::AdamWOptions>(adamw_options(config)),
                   float16_options(config, precision)) {}

  double loss_scale() const override { return optimizer_.loss_scale(); }
  void zero_grad() override { reducer_.zero_grad(); }
  std::shared_ptr<void> accumulate_only() override {
    return std::make_shared<mixprec::distributed::GradReducer::NoSyncGuard>(reducer_);
  }
  void set_lr(double lr) override {
    for (auto& group : optimizer_.param_groups()) group.options().set_lr(lr);
  }
  mixprec::optim::StepResult step() override { return optimizer_.update(); }

  mixprec::ShardedStateDict training_state(const nlohmann::json& user) const override {
    return mixprec::distributed::training_state_dict(model_, optimizer_, user);
  }
  nlohmann::json load(const std::filesystem::path& dir) override {
    return mixprec::distributed::load_training_state(dir, model_, optimizer_).user;
  }

  OptimizerMemory memory() const override {
    return optimizer_memory(model_, optimizer_.params_info(),
                            optimizer_.state_bytes(ParamRole::kMaster) +
                                optimizer_.state_bytes(ParamRole::kNativeFp32));
  }

 private:
  torch::nn::Module& model_;
  mixprec::distributed::GradReducer reducer_;
  mixprec::distributed::DistributedOptimizer optimizer_;
};

}  // namespace

std::unique_ptr<TrainingOptimizer> make_data_parallel_optimizer(
    torch::nn::Module& model, const TrainConfig& config, const Precision& precision,
    std::shared_ptr<mixprec::distributed::Communicator> ranks) {
  return std::make_unique<DataParallelOptimizer>(model, config, precision, std::move(ranks));
}

std::shared_ptr<mixprec::distributed::Communicator> join_ranks() {
  if (!mixprec::distributed::read_launcher_env().launched) return nullptr;
  return mixprec::distributed::init_from_env();
}

double mean_over_ranks(mixprec::distributed::Communicator* ranks, double value) {
  if (ranks == nullptr) return value;
  at::Tensor t = at::full({1}, value, at::kDouble);
  ranks->all_reduce_sum(t).wait();
  return t.item<double>() / ranks->size();
}

bool any_rank(mixprec::distributed::Communicator* ranks, bool mine) {
  if (ranks == nullptr) return mine;
  at::Tensor t = at::full({1}, mine ? 1 : 0, at::kLong);
  ranks->all_reduce_max(t).wait();
  return t.item<int64_t>() != 0;
}

void sum_over_ranks(mixprec::distributed::Communicator* ranks,
                    const std::vector<at::Tensor>& tensors) {
  if (ranks == nullptr) return;
  for (const at::Tensor& t : tensors) ranks->all_reduce_sum(t).wait();
}

}  // namespace train
