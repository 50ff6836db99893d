// Counts the tensor allocations of a process: a CPU allocator that forwards to LibTorch's and
// counts each allocation of memory for a tensor (any thread, the backend's included). Used by
// the tests and the distributed benchmark to show that a steady-state step allocates nothing.
//
//   CountingAllocatorGuard counting;   // installed until the guard is destroyed
//   ... warm up ...
//   const int64_t before = counting.allocations();
//   step();
//   EXPECT_EQ(counting.allocations() - before, 0);
//
// fail_after(n) makes it refuse allocations from the n+1-th on, as running out of memory would.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <limits>

namespace mixprec::testing {

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}
  c10::DataPtr allocate(size_t n) override {
    if (n > 0) {
      // Out of memory on demand: the allocation that would take the count past the limit.
      TORCH_CHECK_WITH(OutOfMemoryError, allocations_.load() < fail_after_.load(),
                       "CountingAllocator: allocation ", allocations_.load() + 1,
                       " refused (a test's simulated out-of-memory)");
      allocations_.fetch_add(1, std::memory_order_relaxed);
      bytes_.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed);
    }
    return inner_->allocate(n);
  }
  c10::DeleterFnPtr raw_deleter() const override { return inner_->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    inner_->copy_data(dest, src, count);
  }
  int64_t allocations() const { return allocations_.load(); }
  int64_t bytes() const { return bytes_.load(); }
  // Refuses every allocation once `count` more have been made (c10::OutOfMemoryError).
  void fail_after(int64_t count) { fail_after_ = allocations_.load() + count; }
  void never_fail() { fail_after_ = std::numeric_limits<int64_t>::max(); }

 private:
  c10::Allocator* inner_;
  std::atomic<int64_t> allocations_{0}, bytes_{0};
  std::atomic<int64_t> fail_after_{std::numeric_limits<int64_t>::max()};
};

// Installs a CountingAllocator over the current CPU allocator; restores it on destruction.
class [[nodiscard]] CountingAllocatorGuard {
 public:
  CountingAllocatorGuard() : previous_(c10::GetCPUAllocator()), counting_(previous_) {
    c10::SetCPUAllocator(&counting_, /*priority=*/kPriority);
  }
  ~CountingAllocatorGuard() { c10::SetCPUAllocator(previous_, kPriority); }
  CountingAllocatorGuard(const CountingAllocatorGuard&) = delete;
  CountingAllocatorGuard& operator=(const CountingAllocatorGuard&) = delete;

  int64_t allocations() const { return counting_.allocations(); }
  int64_t bytes() const { return counting_.bytes(); }
  void fail_after(int64_t count) { counting_.fail_after(count); }
  void never_fail() { counting_.never_fail(); }

 private:
  static constexpr uint8_t kPriority = 255;  // above LibTorch's own registrations
  c10::Allocator* previous_;
  CountingAllocator counting_;
};

}  // namespace mixprec::testing
