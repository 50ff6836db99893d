// DistributedOptimizer: ZeRO-1. optim::Float16Optimizer's rules applied to each rank's piece of
// every parameter, through Float16Optimizer's own code (it is one, with sharding).
//
// Each rank owns its shard of every bucket of the GradReducer's buffers (distributed/
// buffer_layout.h), so a piece of each parameter: one contiguous range [begin, end) of its
// row-major elements, possibly empty. It keeps optimizer state for those elements only: for a
// trainable BF16/FP16 parameter an FP32 main copy and the moments of its piece; for a trainable
// FP32 parameter the moments (the piece itself is stepped in place); nothing for a frozen one.
// A step (update()):
//   1. the reducer's finish(): each bucket's gradients summed (reduce-scatter, or on Gloo with
//      more than two ranks an in-place all-reduce), averaged;
//   2. per piece, its gradient's sum of squares and finiteness; one FP64 all-reduce carries
//      them and, per parameter, whether any rank received a gradient: every rank sees the same
//      global norm, the same overflow verdict, and the same set of parameters to step;
//   3. clipping by the global norm; the fused step of every owned piece whose parameter got a
//      gradient on some rank (masters → model params, round-to-nearest-even, in the same
//      pass). A parameter no rank produced a gradient for (an expert that got no tokens
//      anywhere) is not stepped and its step count does not advance, as in one process;
//   4. the reducer's start_param_gather(): every rank's updated shards reach every rank in
//      place in the parameter buffers (the parameters are views of them), overlapped with the
//      next forward if the reducer's overlap_param_gather is on.
//
// It follows its model as Float16Optimizer does, with the same code (float16_optimizer.h):
// a weight written from outside (copy_, a model-only load, torch::load, set_data) re-seeds
// its main copy, or is an error by `on_external_param_change`; a parameter frozen after
// construction keeps its state and is not stepped without a gradient; one unfrozen takes the
// role its dtype gives (the reducer lays out every floating parameter, frozen ones included);
// add_param_group adds parameters, and torch's base-class add_param_group is refused at the
// next use; tied weights are one parameter. A dtype changed after construction is an error
// naming the parameter (the reducer's buffers are per dtype). A replaced parameter tensor is
// re-pointed at the parameter buffer first (GradReducer::reseat_params).
//
// Bitwise: the kernels are element-wise, so a piece steps exactly as the same elements of the
// whole parameter. Given the same averaged gradients, params after K steps are bitwise those
// of Float16Optimizer in one process, and of plain data parallelism (GradReducer kAllReduce +
// a Float16Optimizer per rank); tests/distributed check both. The global norm is summed in
// FP64 per parameter piece, then over ranks: it can differ from one process in the last bits,
// which matters only when clipping.
//
// Checkpoints: sharded_state_dict() has exactly the keys, global shapes, dtypes and common
// state of Float16Optimizer's for the same parameters, each tensor this rank's piece as a flat
// slice (ShardedTensor::flat_range), so a checkpoint of either loads into the other, on any
// number of ranks; distributed/collective_checkpoint.h saves and loads whole training states
// collectively. apply() of a checked state is collective (it all-gathers the parameters).
// torch's positional state_dict() and archives are refused: they hold one rank's pieces without
// their layout.
//
// Offloading (Float16OptimizerOptions::offload, optim/offload.h) steps each rank's pieces on
// the host. master_remainders is refused here.
#pragma once

#include "mixprec/distributed/grad_reducer.h"
#include "mixprec/optim/float16_optimizer.h"

#include <torch/optim/optimizer.h>

#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mixprec::distributed {

class DistributedOptimizer : public optim::Float16Optimizer {
 public:
  // Collective in its checks only through the reducer's model check (already done). `reducer`
  // must use ReduceMode::kReduceScatter, serve `model` and outlive this optimizer. `groups`
  // hold parameters of `model` (by identity); their options must all have the type of
  // `defaults` (AdamWOptions, AdamOptions or SGDOptions). Throws c10::Error naming the
  // parameter if one is not in the model or appears twice, and as Float16Optimizer does.
  DistributedOptimizer(GradReducer& reducer, const torch::nn::Module& model,
                       std::vector<torch::optim::OptimizerParamGroup> groups,
                       std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                       optim::Float16OptimizerOptions options = {});
  // One group with every parameter of `model` (tied ones once), in named order.
  DistributedOptimizer(GradReducer& reducer, const torch::nn::Module& model,
                       const torch::optim::OptimizerOptions& defaults,
                       optim::Float16OptimizerOptions options = {});

  // The group this optimizer's collectives (and collective checkpoints) run on.
  Communicator& communicator() const { return reducer_.communicator(); }
  GradReducer& reducer() const { return reducer_; }
  // The per-parameter state tensors' kinds (checkpoint/format/state_keys.h), in the order
  // LocalShard::state holds them.
  std::span<const std::string_view> state_kinds() const;
  // Updates applied to params_info()[info] so far: the same on every rank. Throws c10::Error
  // naming the index if it is not below params_info().size().
  int64_t param_step(size_t info) const;

  // This rank's piece of one parameter and the optimizer state it owns for it.
  struct LocalShard {
    ParamShard shard;  // FQN, global shape, [begin, end) of the parameter's elements, buffer
    size_t info;       // index into params_info()
    optim::ParamRole role;
    at::Tensor param;   // view: those elements of the model parameter (1-D)
    at::Tensor master;  // FP32 main copy of the piece (kMaster only; on the host if offloaded)
    std::vector<at::Tensor> state;  // parallel to state_kinds(); undefined until stepped
  };
  // Every trainable parameter of the groups of which this rank holds a non-empty piece, in
  // params_info() order; the tensors are the optimizer's own.
  std::vector<LocalShard> local_shards() const;
  // The state tensor of `kind` of `shard` (state_kinds()); undefined if not held. Throws
  // c10::Error naming the kind if the algorithm has no such state.
  at::Tensor state_of(const LocalShard& shard, std::string_view kind) const;
  // This rank's piece of parameter `fqn`; an empty range if it owns none of it or the
  // optimizer does not hold the parameter.
  FlatRange piece_of(const std::string& fqn) const;
  // The reducer's layout table followed by this rank's pieces and their roles.
  std::string describe() const;

 protected:
  void before_update() override;
  void reduce_gradients() override;
  at::Tensor piece_gradient(size_t index, bool& arrived) const override;
  void agree(GradientAgreement& agreement) override;
  void publish_params() override;
  void agree_to_load(const std::exception_ptr& failed) override;

 private:
  static Sharding sharding_of(GradReducer& reducer);

  GradReducer& reducer_;
  at::Tensor agreement_buffer_;  // FP64: the step's one all-reduce
};

}  // namespace mixprec::distributed
