// The CUDA engine: pinned staging buffers, one side stream per direction, events as tickets.
// Compiled only against a CUDA LibTorch (optim.cmake); device_copier_no_cuda.cpp otherwise.
//
// Ordering on the device:
//   * begin() records an event on the current stream (where backward wrote the gradients and
//     forward/backward may still read the parameters) and makes both side streams wait for
//     it: downloads see finished gradients, uploads never overwrite a parameter still in use;
//   * a download into a staging buffer waits for the upload that last read that buffer
//     (`after`); the host waits for a download before stepping the chunk it brought;
//   * end() makes the current stream wait for the last upload, so later kernels see the new
//     parameters without a host round trip (the pipeline has waited for them anyway).
// Device-side temporaries a copy reads are held by the pipeline until their ticket is waited
// for, so the caching allocator cannot hand their memory out while a copy still reads it.
#include "optim/offload/device_copier.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <cuda_runtime_api.h>

#include <map>
#include <memory>

namespace mixprec::optim::detail {
namespace {

class CudaCopier final : public DeviceCopier {
 public:
  explicit CudaCopier(c10::Device device)
      : device_(device),
        down_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())),
        up_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {}

  c10::Device device() const override { return device_; }

  at::Tensor staging(int64_t bytes) override {
    return at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  }

  void begin() override {
    c10::cuda::CUDAGuard guard(device_);
    c10::cuda::CUDAEvent ready;
    ready.record(c10::cuda::getCurrentCUDAStream(device_.index()));
    ready.block(down_);
    ready.block(up_);
  }

  Ticket download(std::vector<CopySpan> copies, Ticket after) override {
    if (after != kNone) batches_.at(after).end.block(down_);
    return enqueue(down_, std::move(copies));
  }

  Ticket upload(std::vector<CopySpan> copies) override { return enqueue(up_, std::move(copies)); }

  void wait(Ticket ticket) override { batches_.at(ticket).end.synchronize(); }

  void end() override {
    c10::cuda::CUDAGuard guard(device_);
    c10::cuda::CUDAEvent uploaded;
    uploaded.record(up_);
    uploaded.block(c10::cuda::getCurrentCUDAStream(device_.index()));
  }

  double take_busy_seconds() override {
    double ms = 0.0;
    for (auto& [ticket, batch] : batches_) {
      batch.end.synchronize();
      ms += batch.start.elapsed_time(batch.end);
    }
    batches_.clear();  // every batch is done: its tensors may go
    return ms * 1e-3;
  }

 private:
  struct Batch {
    c10::cuda::CUDAEvent start{cudaEventDefault};  // timing enabled
    c10::cuda::CUDAEvent end{cudaEventDefault};
    std::vector<CopySpan> copies;  // kept alive until the batch is known to be done
  };

  Ticket enqueue(const c10::cuda::CUDAStream& stream, std::vector<CopySpan> copies) {
    c10::cuda::CUDAGuard guard(device_);
    c10::cuda::CUDAStreamGuard on_stream(stream);
    const Ticket ticket = next_++;
    Batch& batch = batches_[ticket];
    batch.start.record(stream);
    for (const CopySpan& c : copies) c.dst.copy_(c.src, /*non_blocking=*/true);
    batch.end.record(stream);
    batch.copies = std::move(copies);
    return ticket;
  }

  const c10::Device device_;
  c10::cuda::CUDAStream down_, up_;
  std::map<Ticket, Batch> batches_;
  Ticket next_ = 0;
};

}  // namespace

std::unique_ptr<DeviceCopier> make_cuda_copier(c10::Device device) {
  TORCH_CHECK(device.is_cuda() && device.has_index(),
              "[mixprec::optim offload] expected a CUDA device with an index, got ", device);
  return std::make_unique<CudaCopier>(device);
}

}  // namespace mixprec::optim::detail
