// DistributedOptimizer: ZeRO-1. optim::Float16Optimizer's algorithm with its state sharded
// across the data-parallel ranks.
//
// Each rank owns its shard of every gradient bucket (dist/buffer_layout.h; GradReducer in
// ReduceMode::kReduceScatter delivers exactly those averaged gradients) and keeps optimizer
// state for those elements only: for a trainable BF16/FP16 parameter an FP32 main copy and the
// moments of the piece it owns; for a trainable FP32 parameter the moments only (the piece of
// the parameter itself is stepped in place); nothing for a frozen one. A piece is one
// contiguous range [begin, end) of the parameter's row-major elements, so the same fused
// kernels (optim/fused_kernels.h) step it as 1-D slices. A step:
//   1. GradReducer::finish(): reduce-scatter of every bucket, averaged;
//   2. per piece, grad_stats(); one FP64 all-reduce of (sum of squares, non-finite count) so
//      every rank sees the global norm and the same overflow verdict: all ranks step or all
//      skip (and back the loss scale off) together;
//   3. clip by the global norm, fused step of every owned piece (masters → model params with
//      round-to-nearest-even in the same pass);
//   4. all-gather of every bucket's updated parameter values (in the parameter dtype), copied
//      back into the model's parameters.
// Semantics are Float16Optimizer's: Adam/AdamW/SGD from torch's option types read at every
// step, loss scaler, clipping (clip_grad), NonFiniteGrads policy. Every trainable parameter
// has a gradient (a buffer view; zeros if backward did not reach it), so every trainable
// parameter in the groups is stepped.
//
// Bitwise: the kernels are element-wise with no cross-element state, so a piece steps exactly
// as the same elements of the whole parameter would. Given the same averaged gradients, params
// after K steps are bitwise those of Float16Optimizer on one rank, and of plain data
// parallelism (GradReducer kAllReduce + a Float16Optimizer per rank) — tests/dist check both.
// The global norm is summed in FP64 in another order than on one rank (per piece, then over
// ranks); it can differ in the last bits, which matters only when clipping.
//
// Per-rank optimizer memory is about 1/N of Float16Optimizer's (state_bytes()); the buffers of
// step 4 are transient (one bucket per bucket, in the parameter dtype).
//
// Offloading (Float16OptimizerOptions::offload, optim/offload.h): each rank keeps the masters
// and moments of its own pieces on the host and steps them there, its pieces of parameters and
// gradients copied in overlapped chunks (distributed_optimizer_offload.cpp); results are
// bitwise those without offloading. master_remainders is not supported here (refused).
#pragma once

#include "mixprec/dist/grad_reducer.h"
#include "mixprec/optim/float16_optimizer.h"

#include <torch/optim/optimizer.h>

#include <memory>
#include <string>
#include <vector>

namespace mixprec::optim::detail {
class OffloadPipeline;
}

namespace mixprec::dist {

class DistributedOptimizer : public torch::optim::Optimizer {
 public:
  // Collective. `reducer` must use ReduceMode::kReduceScatter, serve `model` and outlive this
  // optimizer. `groups` hold parameters of `model` (by identity); their options must all have
  // the type of `defaults` (AdamWOptions, AdamOptions or SGDOptions). Throws c10::Error naming
  // the parameter if one is not in the model, appears twice, or is trainable but has no
  // gradient buffer in `reducer` (made trainable after the reducer was built).
  DistributedOptimizer(GradReducer& reducer, const torch::nn::Module& model,
                       std::vector<torch::optim::OptimizerParamGroup> groups,
                       std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                       optim::Float16OptimizerOptions options = {});
  // One group with every parameter of `model`, in named order.
  DistributedOptimizer(GradReducer& reducer, const torch::nn::Module& model,
                       const torch::optim::OptimizerOptions& defaults,
                       optim::Float16OptimizerOptions options = {});

  // Evaluates `closure` (if any), then update().
  at::Tensor step(LossClosure closure = nullptr) override;
  // Collective: one optimizer step (see the header comment). Calls the reducer's finish().
  optim::StepResult update();
  const optim::StepResult& last_result() const { return last_result_; }

  double loss_scale() const { return scaler_.scale(); }
  const optim::LossScaler& loss_scaler() const { return scaler_; }
  optim::Algorithm algorithm() const { return algorithm_; }
  // Every parameter of the groups, as Float16Optimizer lists them (same ids, same roles).
  const std::vector<optim::ParamInfo>& params_info() const { return info_; }

  // This rank's piece of one parameter and the optimizer state it owns for it.
  struct LocalShard {
    ParamShard shard;  // FQN, global shape, [begin, end) of the parameter's elements
    size_t info;       // index into params_info()
    optim::ParamRole role;
    at::Tensor param;   // view: elements [begin, end) of the model parameter (1-D)
    at::Tensor grad;    // view: the same elements of the gradient buffer (1-D)
    at::Tensor master;  // FP32 main copy of the piece (kMaster only; on the host if offloaded)
    at::Tensor exp_avg, exp_avg_sq, max_exp_avg_sq, momentum_buffer;  // FP32, once stepped
    int64_t step = 0;
  };
  // In buffer order; only parameters of the groups that are trainable.
  const std::vector<LocalShard>& local_shards() const { return shards_; }
  // Bytes of this rank's optimizer-owned tensors (masters and moments) for `role`.
  int64_t state_bytes(optim::ParamRole role) const;
  // The reducer's layout table followed by this rank's pieces and their roles.
  std::string describe() const;
  // What the last update() that stepped did with offloading on (all zero without it).
  const optim::OffloadStats& offload_stats() const { return offload_stats_; }

  // LibTorch's archives key state by pointer; mixprec keeps state by name, and collective
  // checkpoints of the sharded state are not part of this class yet. Both throw c10::Error.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  void build(const torch::nn::Module& model);
  void step_shard(LocalShard& shard, double grad_multiplier);
  // Steps every owned piece through the offloading pipeline (distributed_optimizer_offload.cpp).
  void step_offloaded(double grad_multiplier);
  void gather_params();

  GradReducer& reducer_;
  optim::Float16OptimizerOptions options_;
  optim::Algorithm algorithm_;
  optim::LossScaler scaler_;
  std::vector<optim::ParamInfo> info_;
  std::vector<LocalShard> shards_;
  // Views of every piece this rank owns in the layout (groups or not), for the all-gather.
  std::vector<std::pair<ParamShard, at::Tensor>> owned_pieces_;
  optim::StepResult last_result_;
  std::shared_ptr<optim::detail::OffloadPipeline> offload_;  // made on the first offloaded step
  optim::OffloadStats offload_stats_;
};

}  // namespace mixprec::dist
