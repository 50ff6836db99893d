// GradReducer: data parallelism's parameters and gradients in contiguous buffers, and gradient
// reduction in buckets overlapped with backward (PyTorch DDP's reducer and Megatron's
// param_and_grad_buffer in one).
//
// Construction (collective: every rank constructs its reducer at the same point):
//   1. every rank checks that all hold the same model (distributed/model_check.h: names,
//      dtypes, shapes, trainability, tying, buffers); an error names the parameter that
//      differs, on every rank, before anything else is sent;
//   2. every floating parameter, trainable or frozen (tied ones once, under their first name),
//      gets a range of its dtype's contiguous buffers (distributed/buffer_layout.h): freezing or
//      unfreezing a parameter later needs no new layout. Parameters become views into a
//      parameter buffer (set_data: the module keeps its tensors and their identities) and
//      their .grad aliases of ranges of a gradient buffer, keeping any gradient they had;
//   3. with broadcast_from_rank0 (the default, as DDP does), rank 0's parameters and buffers
//      are sent to every rank, so that every rank starts from the same weights whatever it
//      was initialised or loaded with. Once: buffers that forward updates (BatchNorm's running
//      statistics) then drift apart by rank, where DDP's broadcast_buffers re-sends them
//      before every forward; broadcast them yourself where that matters.
//
// A step. A post-accumulate-grad hook per parameter notes that its gradient arrived (this
// rank's `got_gradient`) and counts what its bucket still waits for;
// a bucket whose trainable parameters have all arrived starts its collective at once, while
// backward goes on. Every rank starts buckets in one agreed order, so collectives match even
// when backward visits parameters differently: at first the layout's (reverse model order),
// from the second step the order in which rank 0 saw buckets complete in the first (DDP's
// rebuilt order): a bucket waits only for the buckets that complete before it, and one whose
// parameters did not all arrive in the first step goes last. finish() starts what is left (a
// parameter without a gradient contributes zeros), waits, and averages by the world size.
//
// Which parameters have a gradient: the same as in one process, whatever clears or sets .grad.
// A parameter has one if a backward reached it, or .grad was set from outside, since it was
// last cleared — by zero_grad() here, or by setting .grad to none (torch's
// Optimizer::zero_grad(), which works on these .grad tensors). A parameter that no backward
// reached keeps the .grad it had: cleared, it has none; not cleared (no zero_grad between
// steps), it keeps the last one, as in one process — in kAllReduce mode. In kReduceScatter mode
// a .grad holds the average only in this rank's shard after finish() (elsewhere local or
// partial sums), so it cannot carry into the next step: a gradient added to it, or a finish()
// that would reduce it again, is an error naming the parameter (clear gradients every step).
// Not seen: a backward with create_graph, which makes a new .grad from the old one (it looks
// like a .grad replaced from outside). Frozen parameters are treated alike (a parameter frozen
// after construction keeps its optimizer role). In kAllReduce mode finish() agrees on it over
// ranks (one small all-reduce, as DDP's find_unused_parameters does): a parameter that has a
// gradient on no rank gets .grad none, so any optimizer skips it as in one process (its
// momentum and weight decay do not move it). DistributedOptimizer agrees on got_gradient() in
// its own collective.
//
// Modes:
//   kAllReduce     every rank ends with every averaged gradient (plain data parallelism: then
//                  any optimizer, e.g. one optim::Float16Optimizer per rank);
//   kReduceScatter a rank ends with the averaged gradients of its own shard of each bucket
//                  (GradLayout::param_shards(rank)); for DistributedOptimizer (ZeRO-1), which
//                  then all-gathers the updated parameters through start_param_gather().
// The collective is the cheapest correct one the backend offers: a native in-place
// reduce-scatter (NCCL; on Gloo with two ranks an exchange of halves, half the bytes of an
// all-reduce); on Gloo with more ranks, whose reduce-scatter clones its input and all-reduces
// it whole, an in-place all-reduce of the bucket (the same bytes on the wire, no copy).
//
// Memory. Everything is laid out once; a steady-state step (zero_grad, backward's hooks,
// finish, and the optimizer's step and parameter gather) allocates no tensor.
//   * grad_reduce_in_fp32 (default): BF16/FP16 buckets are summed in a persistent FP32 copy of
//     the buffer, then rounded back once (why: see Numerics);
//   * accumulate_in_fp32 (Megatron's main_grad): each backward's BF16/FP16 gradient is added to
//     that FP32 buffer at once (main_grad()) and .grad is zeroed, so micro-batches accumulate in
//     FP32 instead of rounding to 8 bits at every one. DistributedOptimizer steps on the FP32
//     averages; in kAllReduce mode finish() also rounds them back into .grad, once, for an
//     optimizer that reads .grad. A backward after finish() without zero_grad() carries on
//     from that rounded .grad (the FP32 average is not counted twice).
//   * on two Gloo ranks, kReduceScatter's exchange receives the other rank's half of each
//     bucket into a buffer of its own (the communicator keeps one per bucket for the next
//     step): half the size of the buckets, 2 bytes per parameter for BF16 summed in FP32.
//
// Numerics. The average of a bucket is (sum over ranks) / world_size, summed by the backend in
// its own order, then rounded once to the gradient dtype. Summed in FP32, identical BF16/FP16
// gradients on a power-of-two number of ranks N give partial sums j*g (j <= N) that FP32 holds
// exactly for N up to 2^13, so the average is bitwise the single-process gradient whatever
// order the backend sums in; summed in BF16 it is exact only for some orders. FP32 gradients
// are summed in FP32: for identical gradients a sequential or pairwise sum is exact for N <= 4,
// which tests/distributed check on Gloo for N = 1, 2, 4. Both modes reduce the same padded
// buckets. The sum comes before the division: with grad_reduce_in_fp32 off, FP16 gradients
// overflow at 1/N of FP16's range (a dynamic loss scaler then backs off sooner than in one
// process), where DDP, which divides first, would not.
//
// A bucket's gradients are read when its collective starts, during backward: changing .grad
// between backward and finish() does not reach the reduction (nor whether it has a gradient). Do it
// in backward, or after finish(). A second backward before finish() would add into buckets in
// flight: it is an error, and where a bucket was in flight the group is failed (the ranks'
// gradients can no longer agree); a NoSyncGuard cannot begin while buckets are in flight.
//
// Failures. A collective that fails makes the group unusable (distributed/communicator.h): the
// backend may still write into the buffers, and ranks may hold partial sums. Every later call
// of this reducer, and of the optimizer using it, throws c10::Error saying why.
//
// Threading: hooks run on autograd's thread for the device. The reducer is not otherwise
// thread-safe: call zero_grad(), finish() and the optimizer from one thread.
#pragma once

#include "mixprec/distributed/buffer_layout.h"
#include "mixprec/distributed/communicator.h"
#include "mixprec/sharded_state_dict.h"

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstddef>
#include <limits>
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
  // Sum BF16/FP16 gradients in a persistent FP32 buffer (see the header comment); no effect on
  // FP32 gradients.
  TORCH_ARG(bool, grad_reduce_in_fp32) = true;
  // Accumulate BF16/FP16 gradients in that FP32 buffer across backwards (main_grad); implies
  // grad_reduce_in_fp32.
  TORCH_ARG(bool, accumulate_in_fp32) = false;
  // Send rank 0's parameters and buffers to every rank at construction.
  TORCH_ARG(bool, broadcast_from_rank0) = true;
  // kReduceScatter: start_param_gather() returns without waiting; each bucket's gather is
  // waited for by wait_for_params() before the forward that uses it (Megatron's
  // overlap_param_gather), and everything at the next finish(). Off: the gather completes
  // inside start_param_gather(), and forward needs no call. On, a write into the parameters
  // from outside after an update (copy_, set_data, torch::load) must come after
  // wait_param_gather(): the gathers in flight would overwrite part of it. mixprec's own
  // checkpoint loads and saves wait for them.
  TORCH_ARG(bool, overlap_param_gather) = false;
  TORCH_ARG(int64_t, bucket_numel) = int64_t{1} << 22;
  TORCH_ARG(int64_t, shard_alignment) = 16;
};

struct ReductionTiming {
  int64_t buckets = 0;  // collectives per step
  // Of those, started from a hook while later gradients of the step were still to come: the
  // ones whose communication could overlap backward.
  int64_t launched_during_backward = 0;
  double finish_seconds = 0.0;  // wall time of the last finish(): the exposed reduction
  // Wall time spent waiting for parameter gathers since the last finish() (overlap on: the
  // part the next forward did not hide).
  double param_gather_wait_seconds = 0.0;
};

class GradReducer {
 public:
  static constexpr size_t kNoParam = std::numeric_limits<size_t>::max();
  // Whether gradients of `dtype` are reduced: Float, BFloat16 and Half. A parameter of another
  // dtype (FP8, FP64, integer) must be frozen; it is only broadcast from rank 0.
  static bool reduces(c10::ScalarType dtype);

  // Collective (see the header comment). Throws c10::Error, on every rank where it applies:
  // naming the parameter for ranks holding different models, for a floating parameter that is
  // sparse or not contiguous, on another device than the first, or already hooked by another
  // reducer; for non-positive bucket or alignment options.
  GradReducer(std::shared_ptr<Communicator> comm, torch::nn::Module& model,
              GradReducerOptions options = {});
  ~GradReducer();  // removes its hooks; parameters and .grad stay views of the buffers
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // Zeroes the gradient buffers (and FP32 buffers) and makes every .grad its buffer range
  // again; no parameter has a gradient until the next backward. Throws c10::Error if a reduction is
  // in flight (call finish() first) or the group failed.
  void zero_grad();
  // Collective. Starts every bucket not started yet, waits (at most the communicator's timeout
  // each) for them and for any parameter gather still in flight, averages. A .grad that is not
  // the buffer's range any more (set to none, or replaced) is copied into its range first, or
  // its range zeroed when none (see "Which parameters have a gradient"). In kAllReduce mode a
  // parameter with a gradient on no rank gets .grad none. Idempotent: a second call with no
  // backward, no zero_grad(), no .grad cleared or replaced and no parameter written in place (an
  // optimizer step) in between returns at once (every rank must then skip it alike) — unless the
  // last call left no parameter a gradient, when running again changes nothing. So a rank with
  // no backward in a step (an empty micro-batch) still reduces — zeros — when its gradients were
  // cleared by zero_grad() or set to none (torch's Optimizer::zero_grad()), or zeroed in place
  // after an optimizer step that wrote the parameters; a .grad zeroed in place with no such
  // write in between (no step, or one skipped on overflow) is not a new step.
  // Throws c10::Error inside a NoSyncGuard, and if the group failed; a throw before any
  // collective (the last step's gradient in reduce-scatter mode) changes nothing.
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
  // Buffer `index` of layout().buffers: every .grad of its dtype is a view into the gradient
  // buffer, every parameter into the parameter buffer.
  const at::Tensor& grad_buffer(size_t index) const;
  const at::Tensor& param_buffer(size_t index) const;
  // Parameter `index` of layout().params (the model's own tensor).
  const at::Tensor& param(size_t index) const;
  // The index in layout().params of a parameter of the model (by identity), or kNoParam.
  size_t index_of(const at::Tensor& param) const;
  // This rank's part [begin, end) of parameter `index`'s elements (kReduceScatter; all of
  // them in kAllReduce mode).
  FlatRange piece_of(size_t index) const;
  // True if parameter `index` has a gradient on this rank (see "Which parameters have a
  // gradient"); final after finish().
  bool got_gradient(size_t index) const;
  // Parameter `index`'s reduced gradient after finish(), flat: its FP32 main_grad range with
  // accumulate_in_fp32 (BF16/FP16 parameters), else its gradient buffer range. In
  // kReduceScatter mode only this rank's piece of it holds the average.
  at::Tensor reduced_gradient(size_t index) const;
  // Parameter `index`'s FP32 accumulation buffer in its shape (accumulate_in_fp32 and a
  // BF16/FP16 parameter); undefined otherwise.
  at::Tensor main_grad(size_t index) const;

  // Re-points every parameter whose tensor was replaced from outside since construction
  // (set_data, torch::load's set_) at its buffer range again, copying the value it holds now.
  // Parameters whose dtype or shape changed are left for the optimizer to refuse. Local.
  void reseat_params();

  // kReduceScatter (DistributedOptimizer): every rank sends its updated shard of each bucket of
  // parameters to every rank, in place in the parameter buffers, buckets in forward order. With
  // overlap_param_gather the call returns at once; otherwise when every parameter is current.
  void start_param_gather();
  // Waits for the gathers of the buckets holding parameters of `module` (recursively). A
  // parameter whose gradient arrives before its bucket's gather was waited for is an error
  // naming it (its forward read values being written). No-op when nothing is in flight.
  void wait_for_params(const torch::nn::Module& module);
  // Waits for every gather in flight.
  void wait_param_gather();

  const ReductionTiming& last_timing() const;

  struct State;  // shared with the hooks, which hold it weakly

 private:
  std::shared_ptr<State> state_;
};

}  // namespace mixprec::distributed
