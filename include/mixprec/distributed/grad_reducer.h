// GradReducer: data-parallel gradient reduction in buckets, overlapped with backward.
//
// Every trainable parameter's .grad is a view into a contiguous gradient buffer (one per grad
// dtype; layout and shards in distributed/buffer_layout.h). A post-accumulate-grad hook on each
// parameter counts the gradients a bucket still waits for; when a bucket is complete its
// collective starts at once, while backward goes on computing earlier layers. Buckets start
// strictly in GradLayout::bucket_order on every rank (a bucket that is complete early waits
// for the ones before it), so every rank issues the same collectives in the same order even
// when backward visits parameters in another order. finish() starts whatever is left (a
// parameter that got no gradient this step contributes its buffer range: zeros after
// zero_grad()), waits, and averages by the world size.
//
// Modes:
//   kAllReduce     every rank ends with every averaged gradient (plain data parallelism:
//                  then any optimizer, e.g. one optim::Float16Optimizer per rank);
//   kReduceScatter a rank ends with the averaged gradients of its own shard of each bucket
//                  (GradLayout::param_shards(rank)); elsewhere its buffer keeps its local,
//                  unreduced gradients. For distributed::DistributedOptimizer (ZeRO-1).
// overlap = false starts every collective in finish() instead (debugging; and the baseline
// the benchmark measures overlap against).
//
// Numerics. The average of a bucket is (sum over ranks) / world_size, summed by the backend in
// its own order, then rounded once to the gradient dtype. With grad_reduce_in_fp32 (default)
// BF16/FP16 gradients are summed in an FP32 copy of the bucket. Why: with identical gradients
// on every rank and a power-of-two world size N, every partial sum, in any order, is j*g for
// some j <= N; that needs at most 8 (BF16) or 11 (FP16) significand bits plus log2(N), which
// FP32's 24 hold for N up to 2^13, so the sum is exact, division by N is exact, and the average
// rounds back to g itself: bitwise the single-process gradient, whatever algorithm the backend
// runs. Summed in BF16 it is exact only for some orders (a sequential or pairwise sum of 4
// equal values is; longer chains are not), and sums of different values round at every
// partial sum to 8 bits. FP32 gradients are summed in FP32: for identical gradients a
// sequential or pairwise sum is exact for N <= 4 (3g rounds by at most half an ulp of 4g, and
// its tie case rounds back to even), which tests/distributed check on Gloo for N = 1, 2, 4.
// Both modes reduce the same padded buckets; on Gloo, whose reduce-scatter is an all-reduce
// of the bucket followed by a copy of the rank's chunk, the two modes' sums are therefore
// bitwise identical for any data (tests/distributed check ZeRO-1 against plain DP for N = 1..4).
//
// A bucket's gradients are read when its collective starts, during backward: changing .grad
// between backward and finish() (clipping by hand, injecting values) does not reach the
// reduction. Do it in backward, or after finish().
//
// Threading: hooks run on autograd's thread for the device. The reducer is not otherwise
// thread-safe: call zero_grad(), finish() and the optimizer from one thread.
#pragma once

#include "mixprec/distributed/buffer_layout.h"
#include "mixprec/distributed/communicator.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <memory>

namespace torch::nn {
class Module;
}

namespace mixprec::distributed {

enum class ReduceMode { kAllReduce, kReduceScatter };

struct GradReducerOptions {
  TORCH_ARG(ReduceMode, mode) = ReduceMode::kAllReduce;
  // Start a bucket's collective from backward as soon as it is complete.
  TORCH_ARG(bool, overlap) = true;
  // Sum BF16/FP16 gradients in FP32 (see the header comment); no effect on FP32 gradients.
  TORCH_ARG(bool, grad_reduce_in_fp32) = true;
  TORCH_ARG(int64_t, bucket_numel) = int64_t{1} << 22;
  TORCH_ARG(int64_t, shard_alignment) = 16;
};

struct ReductionTiming {
  int64_t buckets = 0;                   // collectives per step
  int64_t launched_during_backward = 0;  // of those, started from a hook in the last step
  double finish_seconds = 0.0;           // wall time of the last finish()
};

class GradReducer {
 public:
  // Collective (every rank constructs its reducer at the same point). First checks that every
  // rank holds the same model (distributed/model_check.h: an error naming the first differing
  // parameter, on every rank); then lays out every trainable parameter of `model` (tied
  // parameters once, under their first name) and makes its .grad a view into the buffers,
  // keeping any gradient it already had. Throws c10::Error naming the parameter for a
  // trainable dtype other than Float/BFloat16/Half, a sparse or non-contiguous parameter,
  // parameters on different devices, or a parameter that already has a post-accumulate-grad
  // hook (another reducer).
  GradReducer(std::shared_ptr<Communicator> comm, torch::nn::Module& model,
              GradReducerOptions options = {});
  ~GradReducer();  // removes its hooks; .grad tensors stay (views keep the buffers alive)
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // Zeroes the buffers and makes every .grad its buffer view again. Throws c10::Error if a
  // reduction is in flight (call finish() first).
  void zero_grad();
  // Collective. Starts every bucket not started yet, waits (at most the communicator's
  // timeout each), averages. A .grad that is not the buffer view any more (set to none by
  // an optimizer's zero_grad(), or replaced) is copied into its view first, or its range
  // zeroed when it is undefined. Idempotent: a second call with no backward and no
  // zero_grad() in between returns at once (every rank must then skip it alike). Throws
  // c10::Error inside a NoSyncGuard.
  void finish();

  // While alive, backward only accumulates into the buffers (gradient accumulation over
  // micro-batches); the next backward outside it reduces the sum.
  class [[nodiscard]] NoSyncGuard {
   public:
    explicit NoSyncGuard(GradReducer& reducer);
    ~NoSyncGuard();
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;
    NoSyncGuard(NoSyncGuard&&) = delete;
    NoSyncGuard& operator=(NoSyncGuard&&) = delete;

   private:
    GradReducer& reducer_;
    bool previous_;
  };

  const GradLayout& layout() const;
  const GradReducerOptions& options() const;
  Communicator& communicator() const;
  // Buffer `index` of layout().buffers; every .grad of its dtype is a view into it.
  const at::Tensor& grad_buffer(size_t index) const;
  // Trainable parameter `index` of layout().params (the model's own tensor).
  const at::Tensor& param(size_t index) const;
  const ReductionTiming& last_timing() const;

  struct State;  // shared with the hooks, which hold it weakly

 private:
  std::shared_ptr<State> state_;
};

}  // namespace mixprec::distributed
