// Where a step's memory goes, counted rather than estimated: a CPU allocator over LibTorch's
// that tracks the bytes of every tensor allocation alive and their peak, so that the summary
// can split the peak into what lives between steps (parameters, gradients, optimizer state:
// summed from the tensors themselves) and what a step adds on top (activations kept for
// backward, temporaries, GEMM workspaces: the allocator's peak during a step over its level
// when the step starts).
#pragma once

#include <c10/core/Allocator.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace train {

class LiveBytesAllocator final : public c10::Allocator {
 public:
  // Installs itself as the CPU allocator (over the current one) for the rest of the process;
  // memory allocated before keeps its own deleter and is not counted. One per process.
  static LiveBytesAllocator& install();
  // The installed one, or nullptr.
  static LiveBytesAllocator* installed();

  c10::DataPtr allocate(size_t bytes) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  int64_t live_bytes() const { return live_.load(std::memory_order_relaxed); }
  int64_t peak_bytes() const { return peak_.load(std::memory_order_relaxed); }
  // Starts a new peak from the current level (at the start of a step).
  void reset_peak() { peak_.store(live_.load(std::memory_order_relaxed)); }

 private:
  explicit LiveBytesAllocator(c10::Allocator* inner);
  static void free_counted(void* data);

  c10::Allocator* inner_;
  c10::DeleterFnPtr inner_deleter_;
  std::mutex mutex_;
  std::unordered_map<void*, size_t> sizes_;  // of the live allocations made here
  std::atomic<int64_t> live_{0};
  std::atomic<int64_t> peak_{0};
};

}  // namespace train
