#include "data_parallel.h"

#include "optimizer.h"

#include "mixprec/distributed/collective_checkpoint.h"
#include "mixprec/distributed/distributed_optimizer.h"
#include "mixprec/distributed/grad_reducer.h"
#include "mixprec/distributed/init.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <csignal>

namespace train {
namespace {

using mixprec::optim::ParamRole;

class DataParallelOptimizer final : public TrainingOptimizer {
 public:
  DataParallelOptimizer(MixedModel& mixed, const TrainConfig& config, const Precision& precision,
                        std::shared_ptr<mixprec::distributed::Communicator> ranks)
      : model_(*mixed.module),
        reducer_(std::move(ranks), *mixed.module,
                 mixprec::distributed::GradReducerOptions()
                     .mode(mixprec::distributed::ReduceMode::kReduceScatter)
                     .overlap_param_gather(true)),
        optimizer_(reducer_, *mixed.module, adamw_groups(*mixed.module, config),
                   std::make_unique<torch::optim::AdamWOptions>(adamw_options(config)),
                   float16_options(config, precision)),
        gpt_(mixed.gpt),
        weight_decay_(config.weight_decay) {
    gpt_->before_use = [this](const torch::nn::Module& part) { reducer_.wait_for_params(part); };
  }
  ~DataParallelOptimizer() override { gpt_->before_use = nullptr; }

  double loss_scale() const override { return optimizer_.loss_scale(); }
  void zero_grad() override { reducer_.zero_grad(); }
  std::shared_ptr<void> accumulate_only() override {
    return std::make_shared<mixprec::distributed::GradReducer::NoSyncGuard>(reducer_);
  }
  void set_lr(double lr) override {
    for (auto& group : optimizer_.param_groups()) group.options().set_lr(lr);
  }
  mixprec::optim::StepResult step() override { return optimizer_.update(); }
  void finish_reduction() override { reducer_.finish(); }

  mixprec::ShardedStateDict training_state(const nlohmann::json& user) const override {
    return mixprec::distributed::training_state_dict(model_, optimizer_, user);
  }
  nlohmann::json load(const std::filesystem::path& dir) override {
    nlohmann::json user = mixprec::distributed::load_training_state(dir, model_, optimizer_).user;
    apply_weight_decay(optimizer_.param_groups(), weight_decay_);
    return user;
  }

  std::size_t checkpoint_bytes() const override {
    return mixprec::distributed::staging_bytes_when_stepped(model_, optimizer_);
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
  Gpt gpt_;
  double weight_decay_;
};

}  // namespace

std::unique_ptr<TrainingOptimizer> make_data_parallel_optimizer(
    MixedModel& model, const TrainConfig& config, const Precision& precision,
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

StepAgreement agree_on_step(mixprec::distributed::Communicator* ranks, StepAgreement mine,
                            const std::vector<at::Tensor>& expert_loads) {
  if (ranks == nullptr) return mine;
  // FP64 holds the token counts exactly (far below 2^53).
  int64_t counts = 0;
  for (const at::Tensor& t : expert_loads) counts += t.numel();
  constexpr int64_t kScalars = 4;
  at::Tensor sums = at::empty({kScalars + counts}, at::kDouble);
  double* values = sums.mutable_data_ptr<double>();
  values[0] = mine.loss;
  values[1] = mine.aux_loss;
  // Ranks that got each signal (a sum, not a maximum: one all-reduce for everything).
  values[2] = mine.stop_signal == SIGTERM ? 1.0 : 0.0;
  values[3] = mine.stop_signal != 0 && mine.stop_signal != SIGTERM ? 1.0 : 0.0;
  int64_t at = kScalars;
  for (const at::Tensor& t : expert_loads) {
    sums.narrow(0, at, t.numel()).copy_(t.reshape({-1}));
    at += t.numel();
  }
  ranks->all_reduce_sum(sums).wait();
  at = kScalars;
  for (const at::Tensor& t : expert_loads) {
    t.copy_(sums.narrow(0, at, t.numel()).view(t.sizes()));
    at += t.numel();
  }
  const double n = ranks->size();
  const int stop_signal = values[2] > 0 ? SIGTERM : (values[3] > 0 ? SIGINT : 0);
  return {values[0] / n, values[1] / n, stop_signal};
}

}  // namespace train
