#include "memory.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace train {
namespace {

LiveBytesAllocator* g_installed = nullptr;
constexpr uint8_t kPriority = 254;  // above LibTorch's own registrations

}  // namespace

LiveBytesAllocator::LiveBytesAllocator(c10::Allocator* inner)
    : inner_(inner), inner_deleter_(inner->raw_deleter()) {
  // LibTorch's CPU allocator hands out memory whose context is the pointer itself, freed by
  // one function: the counting wrapper relies on both.
  TORCH_INTERNAL_ASSERT(inner_deleter_ != nullptr, "the CPU allocator has no raw deleter");
}

LiveBytesAllocator& LiveBytesAllocator::install() {
  TORCH_INTERNAL_ASSERT(g_installed == nullptr, "LiveBytesAllocator installed twice");
  static LiveBytesAllocator allocator(c10::GetCPUAllocator());  // lives to the process's end
  c10::SetCPUAllocator(&allocator, kPriority);
  g_installed = &allocator;
  return allocator;
}

LiveBytesAllocator* LiveBytesAllocator::installed() { return g_installed; }

c10::DataPtr LiveBytesAllocator::allocate(size_t bytes) {
  c10::DataPtr inner = inner_->allocate(bytes);
  if (inner.get() == nullptr || inner.get() != inner.get_context() ||
      inner.get_deleter() != inner_deleter_) {
    return inner;  // not the plain kind (an empty tensor): not counted
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    sizes_[inner.get()] = bytes;
  }
  const int64_t live = live_.fetch_add(static_cast<int64_t>(bytes)) + static_cast<int64_t>(bytes);
  int64_t peak = peak_.load(std::memory_order_relaxed);
  while (live > peak && !peak_.compare_exchange_weak(peak, live)) {
  }
  void* data = inner.release_context();
  return {data, data, &free_counted, inner.device()};
}

void LiveBytesAllocator::free_counted(void* data) {
  LiveBytesAllocator& self = *g_installed;
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(self.mutex_);
    const auto it = self.sizes_.find(data);
    if (it != self.sizes_.end()) {
      bytes = it->second;
      self.sizes_.erase(it);
    }
  }
  self.live_.fetch_sub(static_cast<int64_t>(bytes));
  self.inner_deleter_(data);
}

c10::DeleterFnPtr LiveBytesAllocator::raw_deleter() const { return &free_counted; }

void LiveBytesAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  inner_->copy_data(dest, src, count);
}

}  // namespace train
