// Private: the copy engine of the offloading pipeline (optim/offload.h), one per device.
//
// Copies run asynchronously to the caller, in the order they were issued within a direction;
// a ticket names one batch of copies. Two implementations:
//   * a copy thread (device_copier.cpp): any device whose tensors the host can copy_, and the
//     CPU itself (plain memcpy), where the offloading path is tested without a GPU;
//   * CUDA streams (device_copier_cuda.cpp, compiled only against a CUDA LibTorch): pinned
//     staging memory, one stream per direction, events as tickets.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace mixprec::optim::detail {

// One copy between the device and host staging memory: same dtype and numel, both contiguous.
struct CopySpan {
  at::Tensor dst;
  at::Tensor src;
};

class DeviceCopier {
 public:
  using Ticket = int64_t;
  static constexpr Ticket kNone = -1;

  virtual ~DeviceCopier() = default;
  DeviceCopier() = default;
  DeviceCopier(const DeviceCopier&) = delete;
  DeviceCopier& operator=(const DeviceCopier&) = delete;

  virtual c10::Device device() const = 0;
  // Host memory for staging, `bytes` bytes (kByte), page-locked where the device has such a
  // notion.
  virtual at::Tensor staging(int64_t bytes) = 0;
  // Start of a step: later downloads see every write already queued on the device.
  virtual void begin() = 0;
  // Enqueues device→host copies, started only after the copies of `after` (kNone: no wait)
  // have finished: the staging buffer they fill is free then. Returns their ticket.
  virtual Ticket download(std::vector<CopySpan> copies, Ticket after) = 0;
  // Enqueues host→device copies. Returns their ticket.
  virtual Ticket upload(std::vector<CopySpan> copies) = 0;
  // Blocks until the ticket's copies are done; rethrows what a copy threw.
  virtual void wait(Ticket ticket) = 0;
  // End of a step, once every ticket was waited for: later device work sees the uploads.
  virtual void end() = 0;
  // Seconds the engine spent copying since the last call.
  virtual double take_busy_seconds() = 0;
};

// The engine for tensors on `device`: CUDA streams for a CUDA device, a copy thread otherwise.
std::unique_ptr<DeviceCopier> make_device_copier(c10::Device device);

// The CUDA engine: device_copier_cuda.cpp in a build against a CUDA LibTorch; otherwise
// device_copier_no_cuda.cpp, which throws (no CUDA tensor can exist there).
std::unique_ptr<DeviceCopier> make_cuda_copier(c10::Device device);

}  // namespace mixprec::optim::detail
