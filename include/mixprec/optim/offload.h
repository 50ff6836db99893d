// CPU offloading of the optimizer (Megatron's HybridDeviceOptimizer): FP32 masters and moments
// live on the host and are stepped there by the fused CPU kernels (optim/fused_kernels.h),
// while parameters and gradients stay on their device. An option of Float16Optimizer and of
// distributed::DistributedOptimizer (each rank offloads its own shard): everything else — roles,
// both state-dict forms, loss scaler, clipping, following the model, checkpoints — is theirs.
//
// A step, after the gradient norm and overflow check (on the device, as without offloading):
// the stepped parameters, in optimizer order, are cut into chunks whose gradient and
// parameter bytes fit one staging buffer of chunk_bytes (a parameter larger than what is left
// of a chunk is split across chunks). A copy engine runs beside the host:
//   while chunk k is stepped on the host, chunk k+1's gradients copy down into a free staging
//   buffer and chunk k−1's updated parameters copy up from theirs;
// chunks_in_flight staging buffers bound how far the copies run ahead. Staging buffers are
// page-locked (pinned) host memory where the device is CUDA, and the engine is a pair of CUDA
// streams there (downloads wait for work already queued on the current stream, such as the
// backward that wrote the gradients; later work on it waits for the uploads); elsewhere it is
// one copy thread. On a CPU-only build the "device" is the host and the same chunked path runs.
// update() returns when every parameter has been written.
//
// Per element copied: the gradient down and the parameter up; the parameter down too where the
// step reads it: native FP32 parameters (stepped in place: their value stays on the device and
// no host copy can go stale when the model is written from outside) and BF16 parameters held
// with master remainders (the parameter is the master's high half).
//
// Bitwise: the kernels are elementwise with no dependence on an element's position, so results
// are those of the optimizer on the CPU without offloading, for every chunk size and depth.
// Against the same optimizer without offloading on a CUDA device they are not: there the step
// runs ATen's ops (fused_kernels.h), which round Adam's update differently in a few elements
// per 10^5 (SGD's agree).
#pragma once

#include <torch/arg.h>

#include <algorithm>
#include <cstdint>

namespace mixprec::optim {

struct OffloadOptions {
  // Bytes of one staging buffer (one chunk's gradient and parameter bytes, 64-byte aligned
  // per piece). At least 256; checked by the optimizer that uses it.
  TORCH_ARG(int64_t, chunk_bytes) = int64_t{16} << 20;
  // Staging buffers, at least 1. 1: copies and host steps take turns (no overlap); 2: chunk
  // k+1's download and chunk k−1's upload run while chunk k is stepped; more give the copy
  // engine slack when chunks differ in size.
  TORCH_ARG(int64_t, chunks_in_flight) = 2;
};

// What the last offloaded step did, for benchmarks and logs.
struct OffloadStats {
  int64_t chunks = 0;
  int64_t bytes_down = 0;     // gradients (and parameters the step reads) to the host
  int64_t bytes_up = 0;       // updated parameters to the device
  double wall_seconds = 0.0;  // the whole pipeline: first download issued to last upload done
  double step_seconds = 0.0;  // host time in the fused kernels
  double copy_seconds = 0.0;  // time the copy engine was busy (downloads and uploads)
  // Copy time that ran while the host was stepping: copy + step − wall, within [0, copy].
  double hidden_copy_seconds() const {
    return std::clamp(copy_seconds + step_seconds - wall_seconds, 0.0, copy_seconds);
  }
};

}  // namespace mixprec::optim
