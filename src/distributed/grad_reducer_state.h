// Private: what a GradReducer holds (grad_reducer.cpp builds it and reduces gradients,
// param_gather.cpp gathers parameters). Every tensor is made at construction; a step only
// writes into them.
#pragma once

#include "mixprec/distributed/grad_reducer.h"

#include <torch/csrc/autograd/function_hook.h>

#include <mutex>
#include <unordered_map>
#include <vector>

namespace mixprec::distributed {

struct GradReducer::State {
  std::shared_ptr<Communicator> comm;
  GradReducerOptions options;
  GradLayout layout;

  // Per parameter, in layout.params order.
  std::vector<at::Tensor> params;       // the model's own tensors
  std::vector<at::Tensor> param_views;  // its range of the parameter buffer, in its shape
  // Its range of the gradient buffer, in its shape: an alias of the buffer's storage, not an
  // autograd view of it, so that torch::optim::Optimizer::zero_grad() (which detaches .grad in
  // place, refused for views) works on it.
  std::vector<at::Tensor> grad_views;
  std::vector<at::Tensor> fp32_views;  // its range of the FP32 buffer, flat; or undefined
  std::vector<FlatRange> pieces;       // this rank's part of its elements
  std::vector<size_t> bucket_id;       // the flat id of its bucket (below)
  std::unordered_map<const c10::TensorImpl*, size_t> index;
  std::vector<const torch::autograd::PostAccumulateGradHook*> hooks;  // ours

  // Per buffer (layout.buffers): parameters, gradients, and the FP32 copy BF16/FP16 gradients
  // are summed (and, with accumulate_in_fp32, accumulated) in; undefined for FP32 buffers.
  std::vector<at::Tensor> param_buffers, grad_buffers, fp32_buffers;
  // FP32, as large as the largest BF16/FP16 parameter: a gradient converted here before it is
  // added to its FP32 range (an add of mixed dtypes would allocate a converted copy).
  at::Tensor scratch;

  // Per bucket, by flat id (buffers in order, then their buckets): what its collective reads
  // and writes.
  struct Bucket {
    size_t buffer = 0, index = 0;  // in layout.buffers[buffer].buckets
    std::vector<size_t> params;    // layout.params indices in it
    at::Tensor grads;              // its range of the gradient buffer
    at::Tensor send;               // what is summed in place: `grads` or its FP32 copy
    at::Tensor reduced;            // what holds the sum: `send`, or this rank's shard of it
    at::Tensor round_to;           // where the FP32 average is rounded back, or undefined
    // The world size as a 0-dim tensor of `send`'s dtype: dividing by a scalar would wrap it
    // into a new tensor at every step.
    at::Tensor world_size;
    bool copy_in = false;            // copy `grads` into `send` before the collective
    at::Tensor params_range;         // its range of the parameter buffer
    std::vector<at::Tensor> shards;  // per rank: that rank's shard of `params_range`
  };
  std::vector<Bucket> buckets;

  std::mutex mutex;
  bool sync = true;
  bool finished = false;  // finish() ran and no gradient arrived since (nor zero_grad())
  // kReduceScatter, per parameter: finish() reduced its buffer range, and since then neither
  // zero_grad() ran nor was its .grad found cleared or replaced. Its .grad (its buffer range)
  // then holds the average only in this rank's shard (elsewhere, local or partial sums): it
  // cannot carry into the next step's sum.
  std::vector<char> stale;
  // Per parameter, as the last finish() left it: 1 if its .grad was its buffer range, 0 if none.
  // A .grad found otherwise at the next finish() (cleared to none, or replaced) starts a new step
  // on this rank even without a backward: finish() then reduces, as the ranks that had one do.
  std::vector<char> adopted_at_finish;
  // Per parameter, its version counter as the last finish() left it: an in-place write since
  // (an optimizer step) makes the next finish() a new step's, even with every .grad unchanged
  // (zeroed in place, or none since that finish()).
  std::vector<int64_t> versions_at_finish;
  // The last finish() left no parameter a gradient (kAllReduce, no rank had a backward): a
  // repeat of it changes nothing, so finish() runs again rather than guess whether a new step
  // began (every rank sees the same, after the flags' all-reduce).
  bool finished_without_gradients = false;
  // Per parameter: it has a gradient, as it would in one process: one arrived (or .grad was
  // set) since zero_grad(), and .grad was not cleared since.
  std::vector<char> got;
  // Per parameter: its .grad holds the FP32 average rounded back (kAllReduce with
  // accumulate_in_fp32) and no backward has accumulated on it since: the next one carries on
  // from that .grad, not from the FP32 average again.
  std::vector<char> rounded;
  // kAllReduce: per parameter, how many ranks have a gradient (all-reduced in finish()).
  at::Tensor any_rank_got;

  // One step's reduction.
  std::vector<size_t> order;  // launch order: flat bucket ids (agreed on every rank)
  bool order_agreed = false;
  bool counted = false;                    // `waiting` was counted for this step
  std::vector<char> ready;                 // per parameter: counted for this step
  std::vector<int64_t> arrival;            // per parameter: its arrival in this step, or -1
  int64_t arrivals = 0;                    // gradients arrived this step
  std::vector<int64_t> waiting;            // per bucket: trainable parameters not arrived
  size_t next = 0;                         // next entry of `order` to start
  std::vector<PendingCollective> flights;  // per bucket: its collective in flight
  std::vector<int64_t> launched_at;        // per bucket: arrivals when a hook started it, or -1
  ReductionTiming timing;

  // Parameter gathers (param_gather.cpp).
  std::vector<PendingCollective> gathers;  // per bucket
  std::vector<char> gather_waited;         // per bucket: waited since started
  std::unordered_map<const void*, std::vector<size_t>> module_buckets;  // cache by module

  void count_waiting();
  void reset_step();
  // After finish(): true while nothing marks a new step since — every .grad and parameter is as
  // finish() left it (adopted_at_finish, versions_at_finish), and it left some gradient.
  bool unchanged_since_finish() const;
  // A new step after finish() without zero_grad(): with accumulate_in_fp32 in kReduceScatter
  // mode the FP32 buffers hold the last step's reduced shards and, elsewhere, partial sums —
  // nothing to carry on from; they start again, as zero_grad() would make them.
  void restart_after_finish();
  // True if params[i].grad is its buffer range.
  bool grad_is_adopted(size_t i) const;
  void adopt_grad(size_t i);
  // accumulate_in_fp32: adds parameter i's .grad to its FP32 range (or, with `restart`, makes
  // the range that .grad) and zeroes the .grad.
  void accumulate_fp32(size_t i, bool restart);
  // A parameter no backward reached in this step, as its bucket starts: its .grad decides.
  void settle(size_t i);
  // kAllReduce, after the buckets: a parameter no rank has a gradient for gets none.
  void clear_unused_everywhere();
  void start(size_t position);
  bool bucket_complete(size_t position) const { return waiting[order[position]] == 0; }
  void on_grad_ready(size_t i);
  void agree_on_order();
  void wait_bucket_gather(size_t bucket);
  void wait_all_gathers();
};

}  // namespace mixprec::distributed
