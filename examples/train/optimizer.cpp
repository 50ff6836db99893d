#include "optimizer.h"

#include "mixprec/checkpoint/training_state.h"

#include <torch/nn/module.h>
#include <torch/optim/adamw.h>

namespace train {
namespace {

using mixprec::optim::Float16Optimizer;
using mixprec::optim::ParamRole;

// Decay shrinks weights towards zero; that helps matrices generalize but would pull norm
// scales and the router (whose logits set routing) away from where they must be.
bool decays(const std::string& name, const at::Tensor& p) {
  return p.dim() >= 2 && name.find("router") == std::string::npos;
}

class SingleProcessOptimizer final : public TrainingOptimizer {
 public:
  SingleProcessOptimizer(torch::nn::Module& model, const TrainConfig& config,
                         const Precision& precision)
      : model_(model),
        optimizer_(model, adamw_groups(model, config),
                   std::make_unique<torch::optim::AdamWOptions>(adamw_options(config)),
                   float16_options(config, precision)),
        weight_decay_(config.weight_decay) {}

  double loss_scale() const override { return optimizer_.loss_scale(); }
  void zero_grad() override { optimizer_.zero_grad(); }
  void set_lr(double lr) override {
    for (auto& group : optimizer_.param_groups()) group.options().set_lr(lr);
  }
  mixprec::optim::StepResult step() override { return optimizer_.update(); }

  mixprec::ShardedStateDict training_state(const nlohmann::json& user) const override {
    return mixprec::checkpoint::training_state_dict(model_, optimizer_, user);
  }
  nlohmann::json load(const std::filesystem::path& dir) override {
    nlohmann::json user = mixprec::checkpoint::load_training_state(dir, model_, optimizer_).user;
    apply_weight_decay(optimizer_.param_groups(), weight_decay_);
    return user;
  }

  OptimizerMemory memory() const override {
    return optimizer_memory(model_, optimizer_.params_info(),
                            optimizer_.state_bytes(ParamRole::kMaster) +
                                optimizer_.state_bytes(ParamRole::kNativeFp32));
  }
  std::size_t checkpoint_bytes() const override {
    return mixprec::checkpoint::staging_bytes_when_stepped(model_, optimizer_);
  }

 private:
  torch::nn::Module& model_;
  Float16Optimizer optimizer_;
  double weight_decay_;
};

}  // namespace

std::vector<torch::optim::OptimizerParamGroup> adamw_groups(torch::nn::Module& model,
                                                            const TrainConfig& config) {
  std::vector<at::Tensor> with_decay, without_decay;
  for (const auto& item : model.named_parameters()) {
    (decays(item.key(), item.value()) ? with_decay : without_decay).push_back(item.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> out;
  out.emplace_back(with_decay, std::make_unique<torch::optim::AdamWOptions>(
                                   adamw_options(config).weight_decay(config.weight_decay)));
  out.emplace_back(without_decay, std::make_unique<torch::optim::AdamWOptions>(
                                      adamw_options(config).weight_decay(0)));
  return out;
}

OptimizerMemory optimizer_memory(const torch::nn::Module& model,
                                 const std::vector<mixprec::optim::ParamInfo>& params_info,
                                 int64_t state_bytes) {
  OptimizerMemory m;
  m.state_bytes = state_bytes;
  const auto params = model.named_parameters();
  for (const auto& info : params_info) {
    const int64_t n = params[info.fqn].numel();
    if (info.role == ParamRole::kMaster) m.master_params += n;
    if (info.role == ParamRole::kNativeFp32) m.native_fp32_params += n;
    if (info.role != ParamRole::kFrozen) m.trainable_params += n;
  }
  return m;
}

void apply_weight_decay(std::vector<torch::optim::OptimizerParamGroup>& groups,
                        double weight_decay) {
  // adamw_groups' order: the decayed group first.
  TORCH_INTERNAL_ASSERT(groups.size() == 2, "mixprec-train's AdamW has two parameter groups");
  static_cast<torch::optim::AdamWOptions&>(groups.front().options()).weight_decay(weight_decay);
}

torch::optim::AdamWOptions adamw_options(const TrainConfig& config) {
  return torch::optim::AdamWOptions(config.lr).betas({0.9, 0.95}).eps(1e-8);
}

mixprec::optim::Float16OptimizerOptions float16_options(const TrainConfig& config,
                                                        const Precision& precision) {
  return mixprec::optim::Float16OptimizerOptions()
      .clip_grad(config.clip_grad)
      .loss_scaler(precision.scaler);
}

std::unique_ptr<TrainingOptimizer> make_single_process_optimizer(torch::nn::Module& model,
                                                                 const TrainConfig& config,
                                                                 const Precision& precision) {
  return std::make_unique<SingleProcessOptimizer>(model, config, precision);
}

}  // namespace train
