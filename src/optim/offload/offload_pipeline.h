// Private: the chunked, overlapped host step behind OffloadOptions (optim/offload.h), shared by
// Float16Optimizer and distributed::DistributedOptimizer. They decide what is stepped (roles, the
// gradient multiplier, state allocation and commit); this runs it: device → staging → host
// kernel → staging → device, in chunks, with the copies on a DeviceCopier.
#pragma once

#include "mixprec/optim/offload.h"
#include "optim/algorithm_traits.h"
#include "optim/offload/device_copier.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <memory>
#include <vector>

namespace mixprec::optim::detail {

// One parameter (or one rank's piece of one) to step. Device tensors are 1-D, contiguous and on
// the pipeline's device; host tensors 1-D, contiguous, on the CPU, of the same numel.
struct OffloadItem {
  at::Tensor grad;   // device, FP32/BF16/FP16: read
  at::Tensor param;  // device, the model parameter (a view of it): written
  // The step reads the parameter too (native FP32: it is the target; BF16 with a remainder).
  bool param_down = false;
  at::Tensor master;     // host FP32 main copy, or undefined (native FP32, or `remainder`)
  at::Tensor remainder;  // host int16 low half of the master (the parameter is the high half)
  std::vector<at::Tensor> state;  // host FP32, parallel to state_kinds(), complete for this step
  std::vector<bool> fresh;        // which of `state` allocate_state() created for this step
  const torch::optim::OptimizerOptions* options = nullptr;  // the parameter's group
  int64_t steps_before = 0;
};

class OffloadPipeline {
 public:
  // Throws c10::Error naming `who` and the option if `options` are out of range.
  static void check_options(const OffloadOptions& options, const char* who);
  // Checks `options` as check_options() does.
  OffloadPipeline(const OffloadOptions& options, c10::Device device, const char* who);
  ~OffloadPipeline();

  c10::Device device() const { return device_; }

  // Steps every item once (in place: parameters, masters, remainders, state), in chunks (see
  // offload.h), and bumps each parameter's version counter as an in-place write would.
  // Returns when every parameter has been written. Items must have been checked by the
  // caller (the kernels' own checks are internal errors here).
  OffloadStats run(const AlgorithmTraits& traits, const std::vector<OffloadItem>& items,
                   double grad_multiplier);
  // Allocates the staging buffers run(items) needs (run() does it too): called for every
  // device before any runs, running out of memory for them changes nothing.
  void prepare(const std::vector<OffloadItem>& items);

 private:
  struct Piece {
    size_t item;
    int64_t begin, end;                 // elements of the item
    int64_t grad_offset, param_offset;  // bytes into the staging buffer
  };
  using Chunk = std::vector<Piece>;
  std::vector<Chunk> plan(const std::vector<OffloadItem>& items) const;
  // Grows the staging buffers to what `chunks` chunks keep in flight; returns that depth.
  size_t reserve_staging(size_t chunks);
  void step_chunk(const AlgorithmTraits& traits, const std::vector<OffloadItem>& items,
                  const Chunk& chunk, const at::Tensor& staging, double grad_multiplier) const;

  OffloadOptions options_;
  c10::Device device_;
  std::unique_ptr<DeviceCopier> copier_;
  std::vector<at::Tensor> staging_;  // chunks_in_flight buffers of chunk_bytes, on first use
};

}  // namespace mixprec::optim::detail
