// DistributedOptimizer: ZeRO-1. optim::Float16Optimizer's algorithm with its state sharded
// across the data-parallel ranks.
//
// Each rank owns its shard of every gradient bucket (distributed/buffer_layout.h; GradReducer in
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
// step through the same per-algorithm table (state names, hyper-parameters, fused kernel),
// loss scaler, clipping (clip_grad), NonFiniteGrads policy. Every trainable parameter
// has a gradient (a buffer view; zeros if backward did not reach it), so every trainable
// parameter in the groups is stepped.
//
// Bitwise: the kernels are element-wise with no cross-element state, so a piece steps exactly
// as the same elements of the whole parameter would. Given the same averaged gradients, params
// after K steps are bitwise those of Float16Optimizer on one rank, and of plain data
// parallelism (GradReducer kAllReduce + a Float16Optimizer per rank) — tests/distributed check
// both. The global norm is summed in FP64 in another order than on one rank (per piece, then over
// ranks); it can differ in the last bits, which matters only when clipping.
//
// Per-rank optimizer memory is about 1/N of Float16Optimizer's (state_bytes()); the buffers of
// step 4 are transient (one bucket per bucket, in the parameter dtype).
//
// Checkpoints. sharded_state_dict() has exactly the keys, global shapes, dtypes and common
// state of Float16Optimizer::sharded_state_dict() for the same parameters, each tensor this
// rank's piece as a flat slice (ShardedTensor::flat_range = the piece's [begin, end)), so a
// checkpoint of either loads into the other, on any number of ranks.
// distributed/collective_checkpoint.h saves and loads whole training states collectively.
//
// Offloading (Float16OptimizerOptions::offload, optim/offload.h): each rank keeps the masters
// and moments of its own pieces on the host and steps them there, its pieces of parameters and
// gradients copied in overlapped chunks (distributed_optimizer_offload.cpp); results are
// bitwise those without offloading. master_remainders is not supported here (refused).
#pragma once

#include "mixprec/distributed/grad_reducer.h"
#include "mixprec/optim/float16_optimizer.h"

#include <torch/optim/optimizer.h>

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace mixprec::optim::detail {
class AlgorithmTraits;
class OffloadPipeline;
}  // namespace mixprec::optim::detail

namespace mixprec::distributed {

class DistributedOptimizer;

// A state checked against one DistributedOptimizer (check_sharded_state_dict); only its
// apply() takes it.
class CheckedShardedState {
 public:
  CheckedShardedState(CheckedShardedState&&) noexcept;
  CheckedShardedState& operator=(CheckedShardedState&&) noexcept;
  ~CheckedShardedState();
  // What apply() will report: keys missing or unexpected (non-strict), notes.
  const LoadReport& report() const;

 private:
  friend class DistributedOptimizer;
  struct Plan;
  explicit CheckedShardedState(std::unique_ptr<Plan> plan);
  std::unique_ptr<Plan> plan_;
};

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
  optim::Algorithm algorithm() const;
  // The per-parameter state tensors' kinds (checkpoint/format/state_keys.h), in the order
  // LocalShard::state holds them: exp_avg, exp_avg_sq, max_exp_avg_sq (Adam/AdamW);
  // momentum_buffer (SGD).
  std::span<const std::string_view> state_kinds() const;
  // The group this optimizer's collectives (and collective checkpoints) run on.
  Communicator& communicator() const { return reducer_.communicator(); }
  // Every parameter of the groups, as Float16Optimizer lists them (same ids, same roles).
  const std::vector<optim::ParamInfo>& params_info() const { return info_; }
  // Updates applied to params_info()[info] so far: the same on every rank.
  int64_t param_step(size_t info) const { return steps_.at(info); }

  // This rank's piece of one parameter and the optimizer state it owns for it.
  struct LocalShard {
    ParamShard shard;  // FQN, global shape, [begin, end) of the parameter's elements
    size_t info;       // index into params_info()
    optim::ParamRole role;
    at::Tensor param;   // view: elements [begin, end) of the model parameter (1-D)
    at::Tensor grad;    // view: the same elements of the gradient buffer (1-D)
    at::Tensor master;  // FP32 main copy of the piece (kMaster only; on the host if offloaded)
    // Parallel to state_kinds(): FP32, 1-D, defined once stepped with a kind the algorithm
    // holds under the group's options (max_exp_avg_sq with amsgrad, SGD's with momentum); on
    // the host if offloaded.
    std::vector<at::Tensor> state;
  };
  // In buffer order; only parameters of the groups that are trainable.
  const std::vector<LocalShard>& local_shards() const { return shards_; }
  // The state tensor of `kind` of `shard` (state_kinds()); undefined if not held. Throws
  // c10::Error naming the kind if the algorithm has no such state.
  const at::Tensor& state_of(const LocalShard& shard, std::string_view kind) const;
  // This rank's piece of parameter `fqn` ([begin, end) of its flat elements); an empty range
  // when it owns none of it or the parameter is not stepped by this optimizer.
  FlatRange piece_of(const std::string& fqn) const;
  // Bytes of this rank's optimizer-owned tensors (masters and moments) for `role`.
  int64_t state_bytes(optim::ParamRole role) const;
  // The reducer's layout table followed by this rank's pieces and their roles.
  std::string describe() const;
  // What the last update() that stepped did with offloading on (all zero without it).
  const optim::OffloadStats& offload_stats() const { return offload_stats_; }

  // FQN-keyed state, as Float16Optimizer::sharded_state_dict() keys it: for every parameter
  // with a piece here, "optimizer.state.fp32_param.<fqn>" (kMaster) and, once stepped,
  // "optimizer.state.<kind>.<fqn>" for each state it holds, each a flat ShardedTensor with
  // the parameter's global shape and this rank's [begin, end), aliasing the optimizer's own
  // tensors (no copy). Parameters with no piece here are absent: their owners hold them (a
  // zero-element parameter is rank 0's). common["optimizer"] = {algorithm, step, steps,
  // param_groups with FQN lists and hyper-parameters, frozen, without_state, scaler}: the
  // same on every rank, and what Float16Optimizer writes for the same parameters and state.
  // Not collective.
  ShardedStateDict sharded_state_dict() const;
  // Checks `state` against this optimizer and this rank's pieces; changes nothing; not
  // collective. `state` holds common["optimizer"] and the optimizer's keys as whole tensors (a
  // single-process state dict, or a checkpoint read whole) or as flat slices containing
  // this rank's pieces (collective loads read every optimizer key, with an empty range where
  // a rank owns nothing, so every rank judges key sets and shapes alike). Model keys may be
  // there too: a parameter saved as native FP32 that now has a main copy takes it from the
  // FP32 model tensor under its FQN. Same rules as Float16Optimizer::check_sharded_state_dict:
  // algorithm, groups (same FQNs in the same order), hyper-parameters (the step's ranges),
  // steps, scaler, every key's global shape equal to its parameter's and floating (FP32 for
  // fp32_param); strict: missing or unexpected keys are errors. Throws c10::Error
  // "[mixprec::distributed::DistributedOptimizer] cannot load the state" listing every problem.
  CheckedShardedState check_sharded_state_dict(const ShardedStateDict& state,
                                               const LoadOptions& options = {}) const;
  // Collective (every rank, with its own checked state): installs hyper-parameters, scaler,
  // steps, this rank's masters and moments; rewrites its pieces of BF16/FP16 parameters from
  // the masters (round-to-nearest-even) and all-gathers every parameter, so every rank holds
  // the same values. Throws c10::Error, changing nothing, if `checked` was made by another
  // optimizer or was applied already. Returns the check's report.
  LoadReport apply(CheckedShardedState&& checked);

  // LibTorch's archives key state by pointer and hold one rank's shard without its layout:
  // both throw c10::Error (use sharded_state_dict(), or distributed/collective_checkpoint.h).
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
  const optim::detail::AlgorithmTraits* traits_;
  optim::LossScaler scaler_;
  std::vector<optim::ParamInfo> info_;
  std::vector<std::vector<int64_t>> shapes_;  // parallel to info_: each parameter's shape
  std::vector<int64_t> steps_;                // parallel to info_: replicated on every rank
  std::vector<LocalShard> shards_;
  std::unordered_map<std::string, size_t> shard_of_;  // FQN → index into shards_
  // Views of every piece this rank owns in the layout (groups or not), for the all-gather.
  std::vector<std::pair<ParamShard, at::Tensor>> owned_pieces_;
  optim::StepResult last_result_;
  std::shared_ptr<optim::detail::OffloadPipeline> offload_;  // made on the first offloaded step
  optim::OffloadStats offload_stats_;
};

}  // namespace mixprec::distributed
