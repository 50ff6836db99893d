// What the training loop needs from an optimizer: the single-process one and the data-parallel
// one.
//
// The loop sees only TrainingOptimizer: scale the loss, step, set the learning rate, and hand
// the training state to a checkpoint or take it back. The single-process implementation wraps
// mixprec::optim::Float16Optimizer (AdamW with FP32 masters for BF16/FP16 parameters, FP32
// parameters stepped in place). The data-parallel one (data_parallel.cpp) is ZeRO-1:
// mixprec::distributed::GradReducer reduce-scatters gradients in buckets during backward,
// mixprec::distributed::DistributedOptimizer steps this rank's shard of masters and moments and
// all-gathers the parameters; training_state() is this rank's shard of a collective
// checkpoint, and load() reads one written by any number of ranks.
#pragma once

#include "config.h"
#include "plan.h"

#include "mixprec/optim/float16_optimizer.h"
#include "mixprec/sharded_state_dict.h"

#include <filesystem>
#include <memory>
#include <vector>

#include <torch/optim/adamw.h>

namespace torch::nn {
class Module;
}
namespace mixprec::distributed {
class Communicator;
}

namespace train {

// Optimizer memory, for the summary.
struct OptimizerMemory {
  int64_t state_bytes = 0;         // masters and moments held by this rank
  int64_t master_params = 0;       // parameters with an FP32 master (BF16/FP16 ones)
  int64_t native_fp32_params = 0;  // FP32 parameters stepped in place, no copy
  int64_t trainable_params = 0;    // all trainable parameters (of the whole model)
};

class TrainingOptimizer {
 public:
  virtual ~TrainingOptimizer() = default;

  // Multiply the loss by this before backward (1 unless FP16's dynamic scaler is active).
  virtual double loss_scale() const = 0;
  virtual void zero_grad() = 0;
  // While the returned guard lives, backward only accumulates gradients: the micro-batches
  // before the last of a step need no reduction across ranks. Null for one process.
  virtual std::shared_ptr<void> accumulate_only() { return nullptr; }
  // Sets the learning rate of every parameter group (the schedule calls it each step).
  virtual void set_lr(double lr) = 0;
  // One step over the accumulated gradients: unscale, skip on Inf/NaN (FP16), clip, AdamW.
  virtual mixprec::optim::StepResult step() = 0;
  // Waits for the gradient reduction still in flight after backward (several ranks; step()
  // would wait for it otherwise): timed apart, it is the reduction's exposed part.
  virtual void finish_reduction() {}

  // This rank's part of the training state: model, optimizer, RNG and `user` metadata.
  virtual mixprec::ShardedStateDict training_state(const nlohmann::json& user) const = 0;
  // Loads a checkpoint directory into model and optimizer (validated completely first) and
  // returns its user metadata. Throws naming the file and key if it does not fit.
  virtual nlohmann::json load(const std::filesystem::path& dir) = 0;

  virtual OptimizerMemory memory() const = 0;
  // Host memory an asynchronous save of this rank's training state will copy into, once every
  // parameter holds its moments: known before the first step (checkpointing.h reserves it).
  virtual std::size_t checkpoint_bytes() const = 0;
};

// AdamW over `model`'s parameters in two groups — matrices and embeddings with weight decay;
// norms, biases and the router without — with Float16Optimizer's FP32 masters, global-norm
// clipping (--clip-grad) and the loss scaler of `precision`.
std::unique_ptr<TrainingOptimizer> make_single_process_optimizer(torch::nn::Module& model,
                                                                 const TrainConfig& config,
                                                                 const Precision& precision);

// The same AdamW, clipping and loss scaler, data parallel over `ranks` (ZeRO-1). Collective:
// every rank calls it at the same point with the same model (checked: an error names the first
// parameter that differs); rank 0's weights become every rank's. The parameter gather after a
// step overlaps the next forward: the model waits for each part's parameters just before it
// reads them (GptImpl::before_use).
std::unique_ptr<TrainingOptimizer> make_data_parallel_optimizer(
    MixedModel& model, const TrainConfig& config, const Precision& precision,
    std::shared_ptr<mixprec::distributed::Communicator> ranks);

// What both share: the summary's memory figures (state_bytes: this rank's), the two parameter
// groups (decay / no decay) and AdamW's options.
std::vector<torch::optim::OptimizerParamGroup> adamw_groups(torch::nn::Module& model,
                                                            const TrainConfig& config);
torch::optim::AdamWOptions adamw_options(const TrainConfig& config);
// After a load: the groups' options come back as they were saved, but --weight-decay is a
// setting of the run, which a resumed run may change (config.h, kCarried); the lr is set by
// the schedule every step.
void apply_weight_decay(std::vector<torch::optim::OptimizerParamGroup>& groups,
                        double weight_decay);
OptimizerMemory optimizer_memory(const torch::nn::Module& model,
                                 const std::vector<mixprec::optim::ParamInfo>& params_info,
                                 int64_t state_bytes);
mixprec::optim::Float16OptimizerOptions float16_options(const TrainConfig& config,
                                                        const Precision& precision);

}  // namespace train
